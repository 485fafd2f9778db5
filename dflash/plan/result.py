"""The plan as a typed result: every section the report shows (dflash/plan/report.py renders it from these types), and
its JSON (plan_details.json; `summary` is plan.json)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from dflash.core.hardware import GpuProfile
from dflash.drafter.geometry import DrafterConfig, config_dict
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


@dataclass(frozen=True)
class PlanInputs:
    """What the plan read, and what it set aside."""

    target_config: str  # plan.target_config as resolved
    mask_token_checked_against: str  # the tokenizer.json train's mask-token check would read, or what stood in
    audit_json: str | None  # None: absent, params used
    tokenize_json: str | None
    pilot_json: str | None  # the generate pilot
    train_pilot_json: str | None  # set only when its times replaced the model's
    sources: dict[str, str]  # dataset value -> the file and key or the param it came from
    ignored: dict[str, str]  # measurement file -> why it was set aside


@dataclass(frozen=True)
class PlannedHardware:
    """The GPU profile priced, how many, and the price used."""

    profile: GpuProfile
    count: int  # plan.num_gpus
    price_used: float | None  # USD per GPU-hour (None: unknown)

    def as_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self.profile), "count": self.count, "price_used": self.price_used}


@dataclass(frozen=True)
class TargetFacts:
    """The planned target's shape and parameter counts (dflash/core/target_counts.py)."""

    architecture: str
    layers: int
    full_attention_layers: int
    linear_attention_layers: int
    hidden_size: int
    vocab_size: int
    params: dict[str, int]  # part -> parameters (decoder, embed_tokens, lm_head, text_total, mtp / vision skipped)
    weight_dtype: str


@dataclass(frozen=True)
class DrafterFacts:
    """The drafter the plan prices: its config and parameter counts (dflash/drafter/geometry.py)."""

    config: DrafterConfig
    params: dict[str, int]  # part -> parameters (attn_q_o, attn_kv, mlp, fc, norms, total)
    deepest_target_layer: int

    def as_json(self) -> dict[str, Any]:
        return {"params": self.params, **config_dict(self.config), "deepest_target_layer": self.deepest_target_layer}


@dataclass
class Plan:
    """Everything the report shows. `to_json` is plan_details.json; `summary` is plan.json (the DVC metrics)."""

    summary: dict[str, Any]
    inputs: PlanInputs
    hardware: PlannedHardware
    target: TargetFacts
    drafter: DrafterFacts
    dataset: Dataset
    generation: GenerationEstimate
    training: TrainingEstimate
    scaling: list[ScalingRow]
    deadline: Deadline | None
    calibration: list[Calibration]
    published: list[PublishedCheck]
    serving: ServingEstimate | None = None
    assumptions: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        def section(x: Any) -> Any:
            return dataclasses.asdict(x) if x is not None else None

        return {
            "summary": self.summary,
            "inputs": dataclasses.asdict(self.inputs),
            "hardware": self.hardware.as_json(),
            "target": dataclasses.asdict(self.target),
            "drafter": self.drafter.as_json(),
            "dataset": self.dataset.as_json(),
            "generation": section(self.generation),
            "training": section(self.training),
            "scaling": [dataclasses.asdict(x) for x in self.scaling],
            "deadline": section(self.deadline),
            "calibration": [dataclasses.asdict(x) for x in self.calibration],
            "published": [dataclasses.asdict(x) for x in self.published],
            "serving": section(self.serving),
            "assumptions": self.assumptions,
        }
