"""Measurements the plan holds its model against: the training pilot, and what the stages measured when they ran.

    TrainPilot   reports/train_pilot.json (dflash/train/pilot.py): the step time of ordinary rows, per-sample
                 target and drafter seconds, the peak memory at the worst rows, the MFU it reached, on which
                 device, layout and world size; whether it may stand in for the model here
    StageRun     reports/generate.json / train.json: the time and rate the stage itself measured (calibration)

Files that do not exist are None; files of another target are set aside (dflash/plan/inputs.py `same_target`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dflash.core.errors import UserError
from dflash.core.hardware import GpuProfile
from dflash.plan.inputs import _read_optional, number, same_target


@dataclass(frozen=True)
class TrainPilot:
    """The training pilot's headline, as the plan uses it."""

    path: str
    verdict: str  # ok | out_of_memory | bad_features
    device: str  # what it ran on (a GPU's name, or the CPU model and threads)
    device_type: str  # cuda | cpu
    world_size: int  # processes
    layout: str  # single | data_parallel | split
    step_seconds: float  # ordinary rows, time-weighted, for the epoch's mix of rows (epoch_step_seconds) when given
    tokens_per_s: float
    samples_per_s: float  # documents per second over all processes
    target_share: float  # of the ordinary step: the target forward (the rest: drafter, optimizer, data wait)
    worst_step_seconds: float | None
    peak_memory_gb: float  # the largest peak of any phase and device (CUDA reserved / CPU resident set)
    device_memory_gb: float | None
    peak_phase: str | None
    achieved_tflops: float | None
    mfu: float | None
    rows_per_step: int
    rows_per_epoch: int
    lm_head_rows: int | None  # rows the loss computes (a target's exactly-zero rows fold into one term)
    steps_per_epoch: int
    epochs: int

    def ran_on(self, hw: GpuProfile) -> bool:
        """Whether the pilot ran on the planned hardware (then its times stand in for the model's)."""
        return hw.matches("cpu" if self.device_type == "cpu" else "cuda", self.device)

    def epoch_seconds_one_process(self) -> float:
        """An epoch of the measured data's packed rows on one process at the ordinary step time."""
        return self.rows_per_epoch / (self.rows_per_step / self.world_size) * self.step_seconds


def read_train_pilot(path: Path, signature: str, ignored: dict[str, str]) -> TrainPilot | None:
    data = same_target(_read_optional(path), signature, path, ignored=ignored)
    if data is None:
        return None
    if data.get("verdict") != "ok":
        ignored[str(path)] = f"verdict {data.get('verdict')!r}: {data.get('problem') or 'no measurement'}"
        return None
    need = ("step_seconds", "tokens_per_s", "samples_per_s", "target_share")
    missing = [k for k in (*need, "peak_memory_gb") if number(data, (k,)) is None]
    if missing:
        raise UserError(f"{path}: missing {', '.join(missing)} (rerun the training pilot: dvc repro train_pilot)")
    details = _read_optional(path.with_name(path.stem + "_details.json")) or {}
    if not details.get("rows_per_epoch") or not details.get("rows_per_step"):
        raise UserError(f"{path}: its details lack rows_per_epoch / rows_per_step (rerun: dvc repro train_pilot)")
    step = number(data, ("epoch_step_seconds",)) or data["step_seconds"]  # the epoch's mix of rows, when measured
    return TrainPilot(
        path=str(path),
        verdict="ok",
        device=str(data.get("device", "")),
        device_type=str(details.get("device_type") or ("cpu" if "thread" in str(data.get("device")) else "cuda")),
        world_size=int(data.get("world_size") or 1),
        layout=str(data.get("layout") or "single"),
        step_seconds=step,
        tokens_per_s=data["tokens_per_s"],
        samples_per_s=data["samples_per_s"],
        target_share=data["target_share"] * data["step_seconds"] / step,  # the target forward's time, as measured
        worst_step_seconds=number(data, ("worst_step_seconds",)),
        peak_memory_gb=data["peak_memory_gb"],
        device_memory_gb=number(data, ("device_memory_gb",)),
        peak_phase=data.get("peak_phase"),
        achieved_tflops=number(data, ("achieved_tflops",)),
        mfu=number(data, ("mfu",)),
        rows_per_step=int(details["rows_per_step"]),
        lm_head_rows=int(data["lm_head_rows"]) if number(data, ("lm_head_rows",)) else None,
        rows_per_epoch=int(details["rows_per_epoch"]),
        steps_per_epoch=int(data.get("steps_per_epoch") or 0),
        epochs=int(data.get("epochs") or 0),
    )


@dataclass(frozen=True)
class StageRun:
    """What a stage measured about itself (its reports/NAME.json)."""

    path: str
    seconds: float  # the stage's own time for its work (generation window / training loop)
    rate: float  # output tokens/s (generate), tokens/s (train)
    work: float  # output tokens (generate), training steps (train)
    engines_or_world: int  # generate: engines; train: processes
    stage_seconds: float | None  # the whole stage (generate: with engine start-up)


def read_generate_run(path: Path, signature: str, ignored: dict[str, str]) -> StageRun | None:
    data = same_target(_read_optional(path), signature, path, ignored=ignored)
    details = _read_optional(path.with_name(path.stem + "_details.json")) or {}
    if data is None or not number(data, ("output_tokens_per_s",)):
        return None
    tokens = number(data, ("output_tokens",)) or 0.0
    rate = data["output_tokens_per_s"]
    return StageRun(
        path=str(path),
        seconds=number(details, ("generation_wall_s",)) or (tokens / rate if rate else 0.0),
        rate=rate,
        work=tokens,
        engines_or_world=int(details.get("num_engines") or 1),
        stage_seconds=number(details, ("stage_wall_s",)),
    )


def read_train_run(path: Path, drafter_params: int, hw: GpuProfile, *, ignored: dict[str, str]) -> StageRun | None:
    """train.json carries no target signature: it is this plan's run when it trained a drafter of the planned size
    on the planned kind of device (its details name the device)."""
    data = _read_optional(path)
    if data is None:
        return None
    details = _read_optional(path.with_name(path.stem + "_details.json")) or {}
    device = str(details.get("device", ""))
    kind = "cpu" if device.startswith("cpu") else "gpu"
    why = None
    # the run's own steps, whichever invocation ran them (a resumed run's wall_seconds holds only the last one's)
    seconds = number(data, ("steps_seconds",)) or (None if details.get("resumed") else number(data, ("wall_seconds",)))
    if not data.get("completed"):
        why = "an incomplete run (train.max_steps): nothing to compare with"
    elif not seconds:
        why = "a resumed run that does not say how long its steps took (rerun: dvc repro train)"
    elif data.get("drafter_params") != drafter_params:
        why = f"a drafter of {data.get('drafter_params')} parameters, not the planned {drafter_params}"
    elif device and kind != hw.kind:
        why = f"trained on {device}, not on a {hw.kind} like the planned {hw.key}"
    if why:
        ignored[str(path)] = why
        return None
    return StageRun(
        path=str(path),
        seconds=seconds,
        rate=number(data, ("tokens_per_s",)) or 0.0,
        work=number(data, ("steps",)) or 0.0,
        engines_or_world=int(details.get("world_size") or 1),
        stage_seconds=None,
    )
