"""One micro-step of an optimizer step as the training loop and the losses see it (dflash/train/loop.py).

MicroBatch: the micro-step's packed rows (dflash/train/data.py `Batch`, on the CPU) and what every loss needs of
them, moved to the drafter's device: tokens, documents, anchors, and the block labels with their valid flags
(dflash/drafter/model.py `block_labels`: slot k of the block at anchor a is the token at a + k; every kind uses
these labels, DSpark drafting position k from its query slot k - 1).
micro_loss: the drafter.kind's loss of one micro-step: loss.py (dflash), loss_dspark.py, loss_dflash2.py,
loss_lilicorr.py.
feature_noise: train.feature_noise on a micro-step's target features, seeded by (seed, step, row of the step) so that
it does not depend on how the step is split over processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dflash.core.params import TrainParams
from dflash.drafter.geometry import DrafterConfig
from dflash.drafter.kinds import resolve, spec_for
from dflash.drafter.masks import build_masks
from dflash.drafter.model import block_labels
from dflash.train import loss_dflash2, loss_dspark, loss_lilicorr  # noqa: F401  (with loss.py: every KindSpec.loss, by name)
from dflash.train.data import Batch
from dflash.train.loss import LMHead, LossOut


@dataclass
class MicroBatch:
    """One micro-step of an optimizer step: the packed rows and what the loss needs of them, on the drafter's
    device (labels and valid from dflash.drafter.model.block_labels)."""

    slot: int  # the micro-step's slot in the global batch (data.shard_step); seeds its feature noise
    batch: Batch  # the packed rows: token spans for the target forward, row lengths, document numbers
    input_ids: torch.Tensor  # (S,) long
    doc_ids: torch.Tensor  # (S,) long
    anchors: torch.Tensor  # (N,) long
    labels: torch.Tensor  # (N*B,) long
    valid: torch.Tensor  # (N*B,) bool
    outside: int = (
        0  # valid slots whose label is outside the draft vocabulary, masked from valid (dflash/drafter/vocab.py)
    )

    @classmethod
    def on_device(
        cls, slot: int, batch: Batch, block_size: int, device: torch.device, inside: torch.Tensor | None = None
    ) -> MicroBatch:
        """`inside`: the draft vocabulary's t2d mask (V,) bool: valid slots with a label outside it are masked."""
        ids, mask, docs = batch.input_ids.to(device), batch.loss_mask.to(device), batch.doc_ids.to(device)
        anchors = batch.anchors.to(device)
        labels, valid = block_labels(ids, mask, anchors, block_size, docs)
        if inside is None:
            return cls(slot, batch, ids, docs, anchors, labels, valid)
        out = valid & ~inside[labels]
        return cls(slot, batch, ids, docs, anchors, labels, valid & ~out, int(out.sum()))

    def masks(self, cfg: DrafterConfig, backend: str) -> Any:
        """The drafter's attention masks for this micro-step (dflash/drafter/masks.py), built outside the (optionally
        compiled) drafter: one compiled BlockMask builder."""
        return build_masks(
            cfg.layer_types,
            self.anchors,
            self.input_ids.numel(),
            cfg.query_slots,
            cfg.sliding_window,
            self.doc_ids,
            backend,
        )


def feature_noise(
    feats: torch.Tensor, scale: float, *, seed: int, step: int, first_row: int, rows: list[int]
) -> torch.Tensor:
    """`feats` (S, K*H) of packed rows of `rows` tokens each, the first being row `first_row` of global step `step`,
    plus uniform noise in [-scale, scale] (module docstring)."""
    parts = []
    for j, n in enumerate(rows):
        rng = torch.Generator(feats.device).manual_seed(_mix(seed, step, first_row + j))
        parts.append(torch.rand((n, feats.shape[1]), generator=rng, device=feats.device, dtype=torch.float32))
    noise = torch.cat(parts)
    return feats + ((noise * 2 - 1) * scale).to(feats.dtype)


def _mix(*parts: int) -> int:
    """A 63-bit seed from integers (stable across runs and processes)."""
    h = 0
    for p in parts:
        h = (h * 1_000_003 + int(p) + 1) % (1 << 63)
    return h


def micro_loss(
    drafter: torch.nn.Module,
    hidden: torch.Tensor,
    m: MicroBatch,
    *,
    head: LMHead,
    slot_w: torch.Tensor,
    normaliser: float,
    chunk_rows: int,
    tp: TrainParams,
    final: torch.Tensor | None,
    embed: torch.nn.Module | None = None,
    features: torch.Tensor | None = None,
) -> LossOut:
    """The loss of the drafter's kind over the drafter's output `hidden` of micro-step m (the caller backpropagates
    it); `final`: the target's final hidden states (S, H) when the loss needs the target's own predictions; `embed`
    and `features` (S, K*H): the target's input embedding and the drafter's input features (lilicorr)."""
    common = {
        "slot_w": slot_w,
        "normaliser": normaliser,
        "chunk_rows": chunk_rows,
        "loss_target": tp.loss_target,
        "target_hidden": final,
        "anchors": m.anchors,
    }
    spec = spec_for(drafter.config.kind)
    if spec.loss_params:  # a kind's own loss: its weights, and what it reads of the micro-step (spec.loss_inputs)
        inputs = {
            "drafter": drafter,
            "input_ids": m.input_ids,
            "embed": embed,
            "features": features,
            "doc_ids": m.doc_ids,
        }
        extra = {k: inputs[k] for k in spec.loss_inputs} | {"weights": getattr(tp, spec.loss_params)}
    else:  # the block loss, weighted by train.position_weighting
        extra = {"weighting": tp.position_weighting}
    return resolve(spec.loss)(hidden, m.labels, m.valid, head, **common, **extra)


__all__ = ["MicroBatch", "feature_noise", "micro_loss"]
