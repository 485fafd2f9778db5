"""What every estimate of the plan prices with, read and resolved once by dflash/plan/estimate.py and passed down:
the params, the files the plan reads (their paths resolved once), the target, the drafter, the hardware profile, the
two stages' settings, the dataset and the training pilot; and the two estimates on a GPU count, as the headline, the
scaling table, the deadline search and the calibration ask for them."""

from __future__ import annotations

from dataclasses import dataclass

from dflash.core.hardware import GpuProfile
from dflash.core.params import Params, PlanParams
from dflash.core.target_config import TargetArch
from dflash.drafter.geometry import DrafterConfig
from dflash.plan.generation import GenerationEstimate, generation_estimate
from dflash.plan.inputs import Dataset, PlanPaths, TokenizerFacts
from dflash.plan.measured import TrainPilot
from dflash.plan.settings import GenerationSettings, TrainSettings
from dflash.plan.training import TrainingEstimate, training_at


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

    def generation_on(self, num_gpus: int, price: float = 0.0) -> GenerationEstimate:
        """The generation estimate on `num_gpus` GPUs (dflash/plan/generation.py); `price` USD per GPU-hour."""
        return generation_estimate(
            self.target,
            self.hw,
            self.gs,
            weight_dtype=self.weight_dtype,
            num_gpus=num_gpus,
            data=self.data,
            price=price,
            backend=self.backend,
        )

    def training_on(self, num_gpus: int) -> TrainingEstimate:
        """Training on `num_gpus` GPUs in the planned layout scaled to them (dflash/plan/training.py `training_at`)."""
        return training_at(
            self.target,
            self.drafter,
            self.hw,
            ta=self.ta,
            weight_dtype=self.weight_dtype,
            num_gpus=num_gpus,
            data=self.data,
            planned_gpus=self.ta.num_gpus,
            pilot=self.pilot,
        )
