"""One micro-step of an optimizer step as the training loop and the losses see it (dflash/train/loop.py).

The micro-step's packed rows (dflash/train/data.py `Batch`, on the CPU) and what every loss needs of them, moved to
the drafter's device: tokens, documents, anchors, and the block labels with their valid flags
(dflash/drafter/model.py `block_labels`: slot k of the block at anchor a is the token at a + k).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash.drafter.model import block_labels
from dflash.train.data import Batch


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

    @classmethod
    def on_device(cls, slot: int, batch: Batch, block_size: int, device: torch.device) -> MicroBatch:
        ids, mask, docs = batch.input_ids.to(device), batch.loss_mask.to(device), batch.doc_ids.to(device)
        anchors = batch.anchors.to(device)
        labels, valid = block_labels(ids, mask, anchors, block_size, docs)
        return cls(slot, batch, ids, docs, anchors, labels, valid)


__all__ = ["MicroBatch"]
