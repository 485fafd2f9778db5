"""The run's data plan: which packed rows every optimizer step takes, and this process's micro-batches of them.

Inputs: the data's DocIndex (data.py `scan_shards`), the train params that shape the plan (`max_tokens_per_row`,
`pack_window`, `num_anchors`, `batch_size`, `grad_accum_steps`, `global_batch`), `base.seed` and this process's place
(distributed.py `Dist`). Output: a `DataPlan`, the one object a training step asks for its rows (loop.py `Trainer`);
the training pilot (pilot.py `PilotData`) replaces it with one that feeds its chosen rows.

    epoch e      data.epoch_rows (seed, e): the epoch's packed rows, one epoch cached (plans are metadata only)
    step s       global optimizer step -> (epoch, step in the epoch): steps_per_epoch[e] = rows // rows_per_step
    step rows    rows [i * rows_per_step, (i + 1) * rows_per_step) of the epoch: the global batch, any world size
    micro-steps  data.shard_step: this process's slots of the step, each made a Batch (anchors drawn for the epoch)

Each optimizer step takes the global batch: `train.global_batch` packed rows, or when 0 `batch_size x
grad_accum_steps x world_size` (dropped at an epoch's end when incomplete); slot s of batch_size rows goes to global
rank s % world as its micro-step s // world (data.shard_step), so one process with more micro-steps sees the same rows
as several processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dflash.core.errors import UserError
from dflash.core.params import TrainParams
from dflash.train import distributed as dist
from dflash.train.data import Batch, DocIndex, ShardReader, epoch_rows, make_batch, packing_efficiency, shard_step


@dataclass
class DataPlan:
    """The packed rows of every optimizer step and this process's micro-batches (module docstring)."""

    index: DocIndex
    seed: int  # base.seed: the epoch plans and the anchor draws
    capacity: int  # train.max_tokens_per_row
    window: int  # train.pack_window
    num_anchors: int
    batch_size: int  # rows per micro-step
    accum: int  # micro-steps per process per optimizer step
    world: int
    rank: int  # global rank: which slots of a step are this process's
    rows_per_step: int  # the global batch
    steps_per_epoch: list[int]
    reader: ShardReader
    _cached: tuple[int, list[np.ndarray]] = field(default_factory=lambda: (-1, []), repr=False)  # (epoch, its rows)

    @classmethod
    def build(cls, index: DocIndex, tp: TrainParams, seed: int, place: dist.Dist) -> DataPlan:
        """The plan of `tp.epochs` epochs for this process; a UserError when an epoch cannot fill one step."""
        accum, rows_per_step = dist.accumulation(tp.batch_size, tp.grad_accum_steps, tp.global_batch, place.world)
        plan = cls(
            index=index,
            seed=seed,
            capacity=tp.max_tokens_per_row,
            window=tp.pack_window,
            num_anchors=tp.num_anchors,
            batch_size=tp.batch_size,
            accum=accum,
            world=place.world,
            rank=place.rank,
            rows_per_step=rows_per_step,
            steps_per_epoch=[],
            reader=ShardReader(index),
        )
        rows_per_epoch = [len(plan.rows(e)) for e in range(tp.epochs)]  # plans are cheap: metadata only
        plan.steps_per_epoch = [n // rows_per_step for n in rows_per_epoch]
        if plan.steps_per_epoch[0] == 0:
            raise UserError(
                f"train.batch_size: an epoch packs {rows_per_epoch[0]} rows, fewer than one optimizer step takes "
                f"({rows_per_step} = batch_size x {accum} micro-steps x {place.world} processes)"
            )
        return plan

    @property
    def total_steps(self) -> int:
        return sum(self.steps_per_epoch)

    def packing_efficiency(self) -> float:
        """Real tokens / row capacity of epoch 0's rows."""
        return packing_efficiency(self.index, self.rows(0), self.capacity)

    def rows(self, epoch: int) -> list[np.ndarray]:
        """The epoch's packed rows (data.epoch_rows), one epoch cached."""
        if self._cached[0] != epoch:
            self._cached = (epoch, epoch_rows(self.index, self.seed, epoch, self.capacity, self.window))
        return self._cached[1]

    def locate(self, step: int) -> tuple[int, int]:
        """Global optimizer step -> (epoch, step inside the epoch)."""
        for epoch, n in enumerate(self.steps_per_epoch):
            if step < n:
                return epoch, step
            step -= n
        raise IndexError("step past the last epoch")

    def step_rows(self, step: int) -> list[np.ndarray]:
        """The global batch of an optimizer step: its packed rows (arrays of document numbers), any world size."""
        epoch, i = self.locate(step)
        return self.rows(epoch)[i * self.rows_per_step : (i + 1) * self.rows_per_step]

    def micro_batches(self, step: int) -> list[tuple[int, Batch]]:
        """This process's micro-steps of a global step: [(slot, Batch)] (data.shard_step)."""
        epoch, _ = self.locate(step)
        slots = shard_step(self.step_rows(step), self.batch_size, self.accum, self.world, self.rank)
        return [(s, make_batch(r, self.reader, self.num_anchors, self.seed, epoch)) for s, r in slots]


__all__ = ["DataPlan"]
