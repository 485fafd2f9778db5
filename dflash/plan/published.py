"""The pre-pilot generation model held against published measured runs (params/published/runs.yaml).

Each run: its setup as a self-contained params overlay over params.yaml, the figure it measured (the generation
wall time, or the output tokens/s per GPU) and its source. `check_runs` plans each setup with the model alone (no
audit, tokenize or pilot file is read: what the plan would have said before any measurement) and gives the model's
figure beside the measured one and the error (model / measured - 1). The plan states these errors in its
assumptions; benchmarks/published_runs.py prints them with the model at every concurrency level.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dflash.core.errors import UserError
from dflash.core.loader import load_params, read_yaml
from dflash.plan.generation import generation_estimate
from dflash.plan.inputs import dataset_inputs, load_target, planned_hardware, resolve_paths
from dflash.plan.settings import generation_settings

RUNS_FILE = Path("params/published/runs.yaml")
MEASURES = {  # what a run measured -> its unit
    "generation_hours": "h",
    "tokens_per_s_per_gpu": "output tok/s per GPU",
}


@dataclass(frozen=True)
class PublishedCheck:
    """One published run beside the model."""

    key: str
    what: str
    overlay: str
    measured: str  # generation_hours | tokens_per_s_per_gpu
    unit: str
    value: float  # the measured figure
    model: float  # the model's figure for the same setup
    error: float  # model / measured - 1 (-: the model is optimistic about time / ...)
    optimistic: bool  # the model promised less time or more tokens/s than the run delivered
    batch: int  # sequences per engine the model ran at
    bound: str  # what bounds the model's decode step there
    source: str


def _model_figure(params, measured: str) -> tuple[float, int, str]:
    plan = params.plan
    paths = resolve_paths(plan, params.base)
    target = load_target(paths.target_config)
    hw = planned_hardware(plan)
    gs = generation_settings(params, paths.target_config)
    data = dataset_inputs(plan, paths, target.signature, measured=False)
    est = generation_estimate(target, hw, gs, plan.weight_dtype, plan.num_gpus, data, 0.0, params.generate.backend)
    step = est.step
    value = est.model_wall_hours.mid if measured == "generation_hours" else est.model_tokens_per_s / plan.num_gpus
    if value is None:
        raise UserError(f"{plan.target_config} on {hw.key}: the model does not fit, nothing to compare")
    return value, step.batch if step else 0, step.bound if step else "-"


def check_runs(params_file: str | Path = "params.yaml", runs_file: str | Path = RUNS_FILE) -> list[PublishedCheck]:
    """Every published run of `runs_file` planned by the model alone over `params_file` (module docstring)."""
    runs = read_yaml(runs_file, "published runs file").get("runs")
    if not isinstance(runs, dict) or not runs:
        raise UserError(f"{runs_file}: expected a top-level `runs:` mapping of name -> run")
    out = []
    for key, run in runs.items():
        where = f"{runs_file}: runs.{key}"
        missing = [k for k in ("what", "overlay", "measured", "value", "source") if k not in run]
        if missing:
            raise UserError(f"{where}.{missing[0]}: missing key")
        if run["measured"] not in MEASURES:
            raise UserError(f"{where}.measured: expected one of {', '.join(MEASURES)}, got {run['measured']!r}")
        params = load_params(params_file, overlays=[run["overlay"]])
        model, batch, bound = _model_figure(params, run["measured"])
        value = float(run["value"])
        time_like = run["measured"] == "generation_hours"
        out.append(
            PublishedCheck(
                key=key,
                what=run["what"],
                overlay=run["overlay"],
                measured=run["measured"],
                unit=MEASURES[run["measured"]],
                value=value,
                model=model,
                error=model / value - 1,
                optimistic=model < value if time_like else model > value,
                batch=batch,
                bound=bound,
                source=" ".join(str(run["source"]).split()),
            )
        )
    return out
