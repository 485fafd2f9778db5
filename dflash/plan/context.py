"""What every estimate of the plan prices with, read and resolved once by dflash/plan/estimate.py and passed down:
the params, the files the plan reads (their paths resolved once), the target, the drafter, the hardware profile, the
two stages' settings, the dataset and the training pilot."""

from __future__ import annotations

from dataclasses import dataclass

from dflash.core.hardware import GpuProfile
from dflash.core.params import Params, PlanParams
from dflash.core.target_config import TargetArch
from dflash.drafter.geometry import DrafterConfig
from dflash.plan.inputs import Dataset, PlanPaths, TokenizerFacts
from dflash.plan.measured import TrainPilot
from dflash.plan.settings import GenerationSettings, TrainSettings


@dataclass(frozen=True)
class PlanContext:
    """The plan's inputs (module docstring)."""

    params: Params
    paths: PlanPaths
    target: TargetArch
    tokenizer: TokenizerFacts | None  # the tokenizer beside the target's config (train's mask-token check); None: none
    drafter: DrafterConfig
    hw: GpuProfile
    gs: GenerationSettings
    ta: TrainSettings
    data: Dataset
    pilot: TrainPilot | None  # the training pilot, when it ran on this target (its hardware: pilot.ran_on)
    price: float  # USD per GPU-hour: plan.price_per_gpu_hour, else the profile's; 0 = unknown

    @property
    def plan(self) -> PlanParams:
        return self.params.plan

    @property
    def weight_dtype(self) -> str:
        return self.params.plan.weight_dtype

    @property
    def backend(self) -> str:
        """generate.backend: engines | servers (which pilot measurement stands for the planned run)."""
        return self.params.generate.backend
