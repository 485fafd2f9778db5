"""How good was this plan: once the stages have run, the plan's time and rate for each (from the pilots, and from
the model alone) beside what the stage measured, and the error.

    generate   the plan's generation time for the engines the generate stage ran (its reports/generate.json:
               engines, output tokens, the generation window generation_wall_s) vs that window
    train      the plan's training time for the run's processes and layout (reports/train.json, its details: world
               size, devices) vs the summed seconds of its optimizer steps (steps_seconds: every step of the run,
               a resumed run's earlier invocations included; not wall_seconds, the last invocation's loop only)
Error = planned / measured - 1 (+ the plan was slow to promise, - it promised too fast). The pilots' figures are the
plan's headline when they exist; the model's are shown beside them, so the report says what each would have
promised. Engine start-up (generate) and target loading (train) are outside both windows; the stage's whole wall
time is shown beside them.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash.plan.context import PlanContext
from dflash.plan.measured import StageRun, TrainPilot
from dflash.plan.training import TrainingEstimate, training_estimate


@dataclass(frozen=True)
class Calibration:
    """One stage: planned vs measured."""

    stage: str  # generate | train
    measured_from: str  # the stage's report
    measured_s: float
    measured_rate: float  # output tokens/s (generate), tokens/s (train)
    planned_from: str  # pilot | model: what the plan's headline used
    planned_s: float
    planned_rate: float
    error: float  # planned / measured - 1
    model_s: float | None  # the model alone (no pilot)
    model_error: float | None
    pilot_s: float | None  # the pilot-based figure (None: no pilot)
    pilot_error: float | None
    planned_work: float  # output tokens (generate) / tokens all epochs (train) the plan assumed
    measured_work: float  # output tokens (generate) / steps (train) the stage did
    stage_seconds: float | None  # the whole stage, start-up included (generate)
    setup: str  # what was compared, in words


def _err(planned: float | None, measured: float) -> float | None:
    return planned / measured - 1 if planned is not None and measured > 0 else None


def generate_calibration(ctx: PlanContext, run: StageRun) -> Calibration:
    """The generate stage's run vs the plan for its engines (module docstring)."""
    gs = ctx.gs
    gpus = run.engines_or_world * gs.tensor_parallel_size
    est = ctx.generation_on(gpus)
    model_h, pilot_h = est.model_wall_hours.mid, est.pilot.calibrated_wall_hours if est.pilot else None
    model_s = model_h * 3600 if model_h is not None else None
    pilot_s = pilot_h * 3600 if pilot_h is not None else None
    planned_s = pilot_s if pilot_s is not None else model_s
    return Calibration(
        stage="generate",
        measured_from=run.path,
        measured_s=run.seconds,
        measured_rate=run.rate,
        planned_from="pilot" if pilot_s is not None else "model",
        planned_s=planned_s if planned_s is not None else float("nan"),
        planned_rate=est.output_tokens / planned_s if planned_s else 0.0,
        error=_err(planned_s, run.seconds) if planned_s is not None else float("nan"),
        model_s=model_s,
        model_error=_err(model_s, run.seconds),
        pilot_s=pilot_s,
        pilot_error=_err(pilot_s, run.seconds),
        planned_work=est.output_tokens,
        measured_work=run.work,
        stage_seconds=run.stage_seconds,
        setup=f"{run.engines_or_world} engine(s) x TP {gs.tensor_parallel_size}, max_num_seqs {gs.max_num_seqs}",
    )


def train_calibration(ctx: PlanContext, run: StageRun, layout: str) -> Calibration:
    """The train stage's run vs the plan for its processes and layout (module docstring)."""
    ta, data = ctx.ta, ctx.data
    gpus = run.engines_or_world * (2 if layout == "split" else 1)

    def estimate(pilot: TrainPilot | None) -> TrainingEstimate:
        return training_estimate(
            ctx.target,
            ctx.drafter,
            ctx.hw,
            ta=ta,
            weight_dtype=ctx.weight_dtype,
            num_gpus=gpus,
            data=data,
            split_target_gpus=run.engines_or_world if layout == "split" else None,
            layout=layout if gpus > 1 else "single",
            pilot=pilot,
        )

    model = estimate(None).headline.total_hours * 3600
    with_pilot = estimate(ctx.pilot) if ctx.pilot is not None else None
    pilot_s = with_pilot.headline.total_hours * 3600 if with_pilot and with_pilot.source == "pilot" else None
    planned_s = pilot_s if pilot_s is not None else model
    tokens = data.train_samples * min(data.seq_tokens, ta.max_length) * ta.epochs
    return Calibration(
        stage="train",
        measured_from=run.path,
        measured_s=run.seconds,
        measured_rate=run.rate,
        planned_from="pilot" if pilot_s is not None else "model",
        planned_s=planned_s,
        planned_rate=tokens / planned_s if planned_s else 0.0,
        error=_err(planned_s, run.seconds),
        model_s=model,
        model_error=_err(model, run.seconds),
        pilot_s=pilot_s,
        pilot_error=_err(pilot_s, run.seconds),
        planned_work=tokens,
        measured_work=run.work,
        stage_seconds=run.stage_seconds,
        setup=f"{run.engines_or_world} process(es), layout {layout if gpus > 1 else 'single'}, {ta.epochs} epochs",
    )


def calibration_summary(rows: list[Calibration]) -> dict[str, dict[str, float]]:
    """The plan.json part: per stage the planned and measured seconds and the error."""
    out = {}
    for c in rows:
        out[c.stage] = {"planned_s": c.planned_s, "measured_s": c.measured_s, "error": c.error}
    return out
