"""The pre-pilot generation model held against published measured runs (params/published/runs.yaml).

Each run: its setup as a self-contained params overlay over the params file (a path relative to that file's folder,
the repository root), the figure it measured (the generation wall time, or the output tokens/s per GPU) and its
source. Both files are arguments (`PublishedRuns`): the stage passes the params file it read and the runs file
beside it. `check_runs` plans each setup with the model alone (no
audit, tokenize or pilot file is read: what the plan would have said before any measurement) and gives the model's
figure beside the measured one and the error (model / measured - 1). The plan states these errors in its
assumptions; benchmarks/published_runs.py prints them with the model at every concurrency level.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dflash.core.errors import UserError
from dflash.core.loader import load_params, read_yaml
from dflash.core.params import Params
from dflash.plan.generation import generation_estimate
from dflash.plan.inputs import dataset_inputs, load_target, planned_hardware, resolve_paths
from dflash.plan.settings import generation_settings

RUNS_FILE = "params/published/runs.yaml"  # beside the params file: relative to its folder (the repository root)


@dataclass(frozen=True)
class PublishedRuns:
    """Where the published runs are listed and the params file their overlays are planned over."""

    params_file: Path
    runs_file: Path

    @classmethod
    def beside(cls, params_file: str | Path) -> PublishedRuns | None:
        """The runs file of the repository `params_file` belongs to (RUNS_FILE in its folder); None when that folder
        has none (a params file outside a checkout)."""
        runs_file = Path(params_file).parent / RUNS_FILE
        return cls(params_file=Path(params_file), runs_file=runs_file) if runs_file.is_file() else None


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


@dataclass(frozen=True)
class ModelFigure:
    """The model's figure for a published run's setup."""

    value: float
    batch: int  # sequences per engine the model ran at
    bound: str  # what bounds its decode step there


def _model_figure(params: Params, measured: str) -> ModelFigure:
    plan = params.plan
    paths = resolve_paths(plan, params.base)
    target = load_target(paths.target_config)
    hw = planned_hardware(plan)
    gs = generation_settings(params, paths)
    data = dataset_inputs(plan, paths, signature=target.signature, measured=False)
    est = generation_estimate(
        target,
        hw,
        gs,
        weight_dtype=plan.weight_dtype,
        num_gpus=plan.num_gpus,
        data=data,
        price=0.0,
        backend=params.generate.backend,
    )
    step = est.step
    value = est.model_wall_hours.mid if measured == "generation_hours" else est.model_tokens_per_s / plan.num_gpus
    if value is None:
        raise UserError(f"{plan.target_config} on {hw.key}: the model does not fit, nothing to compare")
    return ModelFigure(value=value, batch=step.batch if step else 0, bound=step.bound if step else "-")


def check_runs(published: PublishedRuns) -> list[PublishedCheck]:
    """Every published run of the runs file planned by the model alone over the params file (module docstring)."""
    runs_file = published.runs_file
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
        params = load_params(published.params_file, overlays=[published.params_file.parent / run["overlay"]])
        figure = _model_figure(params, run["measured"])
        model = figure.value
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
                batch=figure.batch,
                bound=figure.bound,
                source=" ".join(str(run["source"]).split()),
            )
        )
    return out
