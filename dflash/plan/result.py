"""The plan as a typed result: every section the report shows, and its JSON (plan_details.json)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from dflash.plan.calibration import Calibration
from dflash.plan.deadline import Deadline
from dflash.plan.generation import GenerationEstimate
from dflash.plan.inputs import Dataset
from dflash.plan.published import PublishedCheck
from dflash.plan.serving import ServingEstimate
from dflash.plan.training import TrainingEstimate


@dataclass(frozen=True)
class ScalingRow:
    """Hours of generation and training on `gpus` GPUs (the time-vs-GPUs table and plots)."""

    gpus: int
    generation_hours: float | None
    train_hours: float
    train_layout: str
    train_fits: bool


@dataclass
class Plan:
    """Everything the report shows. `to_json` is plan_details.json; `summary` is plan.json (the DVC metrics)."""

    summary: dict
    inputs: dict
    hardware: dict
    target: dict
    drafter: dict
    dataset: Dataset
    generation: GenerationEstimate
    training: TrainingEstimate
    scaling: list[ScalingRow]
    deadline: Deadline | None
    calibration: list[Calibration]
    published: list[PublishedCheck]
    serving: ServingEstimate | None = None
    assumptions: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["dataset"] = self.dataset.as_json()
        for key in ("generation", "training", "deadline", "serving"):
            out[key] = dataclasses.asdict(out[key]) if out[key] is not None else None
        for key in ("scaling", "calibration", "published"):
            out[key] = [dataclasses.asdict(x) for x in out[key]]
        return out
