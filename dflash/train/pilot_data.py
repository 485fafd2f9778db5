"""The training pilot's data: the rows of its three phases and the data plan that feeds them to the real trainer.

  longest   the longest documents packed best-fit into rows of train.max_tokens_per_row (the first row holds the
            longest document): the target forward and the drafter's context at their largest;
  anchors   the documents with the most anchors per token packed the same way: the most blocks a row can carry;
  ordinary  a seeded sample of epoch 0's packed rows: the step time the run will see.
`PilotData` replaces the trainer's data plan (dflash/train/data_plan.py): step s of the pilot takes the pilot's step
s (anchors drawn as in epoch 0), and the data wait of each step is timed. `anchor_mix` and `epoch_step_seconds` scale
the ordinary step time to the epoch's mix of rows (dflash/train/pilot.py says why).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from dflash.train.data import Batch, DocIndex, pack_best_fit
from dflash.train.data_plan import DataPlan

PHASES = ("longest", "anchors", "ordinary")
_PILOT_STREAM = 3  # the ordinary sample's own seeded stream (data.py uses 1 and 2)


def _fill(order: np.ndarray, index: DocIndex, capacity: int, rows: int) -> list[np.ndarray]:
    """Pack the documents of `order` (taken in that order until they fill `rows` rows) best-fit decreasing."""
    lengths = index.length[order]
    take = int(np.searchsorted(np.cumsum(lengths), rows * capacity) + 1)
    chosen = order[:take]
    return [chosen[r] for r in pack_best_fit(index.length[chosen], capacity)]


def longest_rows(index: DocIndex, capacity: int, rows: int) -> list[np.ndarray]:
    """`rows` rows built from the longest documents (packed best-fit decreasing), the longest document first."""
    usable = index.usable
    order = usable[np.argsort(-index.length[usable].astype(np.int64), kind="stable")]
    packed = _fill(order, index, capacity, rows)
    packed.sort(key=lambda r: (-int(index.length[r].max()), -int(index.length[r].sum())))
    return packed[:rows]


def row_anchors(index: DocIndex, row: np.ndarray, num_anchors: int) -> int:
    """Blocks a packed row carries: each document draws min(num_anchors, its anchor candidates)."""
    return int(np.minimum(index.candidates[row], num_anchors).sum())


def most_anchor_rows(index: DocIndex, capacity: int, num_anchors: int, rows: int) -> list[np.ndarray]:
    """`rows` rows built from the documents with the most anchors per token (ties: the most anchors), most first."""
    usable = index.usable
    anchors = np.minimum(index.candidates[usable], num_anchors).astype(np.float64)
    order = usable[np.lexsort((-anchors, -anchors / index.length[usable]))]
    packed = _fill(order, index, capacity, rows)
    packed.sort(key=lambda r: -row_anchors(index, r, num_anchors))
    return packed[:rows]


def _cycle(rows: list[np.ndarray], n: int) -> list[np.ndarray]:
    return [rows[i % len(rows)] for i in range(n)]


def phase_steps(plan: DataPlan, steps: int) -> dict[str, list[list[np.ndarray]]]:
    """Each phase's steps (module docstring), each step a global batch of the run's own size."""
    k, index = plan.rows_per_step, plan.index
    worst_longest = longest_rows(index, plan.capacity, k)
    worst_anchors = most_anchor_rows(index, plan.capacity, plan.num_anchors, k)
    epoch = plan.rows(0)
    rng = np.random.default_rng([plan.seed, _PILOT_STREAM])
    picks = rng.choice(len(epoch), size=steps * k, replace=steps * k > len(epoch))
    ordinary = [epoch[int(i)] for i in picks]
    return {
        "longest": [_cycle(worst_longest, k)] * steps,
        "anchors": [_cycle(worst_anchors, k)] * steps,
        "ordinary": [ordinary[s * k : (s + 1) * k] for s in range(steps)],
    }


@dataclasses.dataclass(frozen=True)
class AnchorMix:
    """Blocks per packed row: in the ordinary steps the pilot measured, and over epoch 0's rows."""

    sample_per_row: float
    epoch_per_row: float


def anchor_mix(plan: DataPlan, measured_steps: list[list[np.ndarray]]) -> AnchorMix:
    """The measured ordinary rows' anchors per row beside the epoch's (module docstring: the epoch step time)."""
    n = plan.num_anchors
    sample = [row_anchors(plan.index, r, n) for step in measured_steps for r in step]
    epoch = [row_anchors(plan.index, r, n) for r in plan.rows(0)]
    return AnchorMix(sample_per_row=float(np.mean(sample)), epoch_per_row=float(np.mean(epoch)))


def epoch_step_seconds(ordinary: dict, mix: AnchorMix) -> float | None:
    """The ordinary step time for the epoch's mix of rows: the drafter's part (forward + backward, which grows with
    the blocks a row carries) scaled by the epoch's anchors per row over the measured rows'; the target forward,
    optimizer and data wait as measured."""
    step = ordinary.get("step_seconds")
    if not step or mix.sample_per_row <= 0:
        return step
    drafter = step * ordinary["share"]["drafter"]
    return step + drafter * (mix.epoch_per_row / mix.sample_per_row - 1)


@dataclasses.dataclass
class PilotData(DataPlan):
    """The trainer's data plan, fed the pilot's steps (module docstring)."""

    steps: list[list[np.ndarray]] = dataclasses.field(default_factory=list)  # each a global batch of rows
    data_seconds: float = 0.0  # the data wait of the steps since it was last reset
    last_batches: list[Batch] = dataclasses.field(default_factory=list)  # this process's batches of the last step

    @classmethod
    def replacing(cls, plan: DataPlan, steps: list[list[np.ndarray]]) -> PilotData:
        """`plan` (its index, sizes and this process's place) feeding `steps` instead of its epochs."""
        return cls(**{f.name: getattr(plan, f.name) for f in dataclasses.fields(DataPlan)}, steps=steps)

    def locate(self, step: int) -> tuple[int, int]:
        return 0, step  # every pilot step draws epoch 0's anchors

    def step_rows(self, step: int) -> list[np.ndarray]:
        return self.steps[step]

    def micro_batches(self, step: int) -> list[tuple[int, Batch]]:
        t0 = time.perf_counter()
        out = super().micro_batches(step)
        self.data_seconds += time.perf_counter() - t0
        self.last_batches = [b for _, b in out]
        return out


__all__ = [
    "PHASES",
    "AnchorMix",
    "PilotData",
    "anchor_mix",
    "epoch_step_seconds",
    "longest_rows",
    "most_anchor_rows",
    "phase_steps",
    "row_anchors",
]
