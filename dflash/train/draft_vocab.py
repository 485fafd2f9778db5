"""Training over a pruned draft vocabulary (drafter.draft_vocab_size > 0; the rule: dflash/drafter/vocab.py).

The vocabulary is built from the tokenize stage's loss-token counts (`${tokenize.out}/token_counts.json`, beside
the `train/` shards); the drafter's lm_head is the target's rows of its tokens, frozen like the target's whole
lm_head is without a pruned vocabulary, and the loss runs over those rows only (LMHead.draft_vocab). `tokens`
labels outside the vocabulary are masked from the loss and counted (MicroBatch.outside); the run reports the
vocabulary's coverage of the training loss tokens and the share of valid slots masked.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash.core.errors import UserError
from dflash.drafter.draft_head import DraftHead
from dflash.drafter.geometry import DrafterConfig
from dflash.drafter.vocab import COUNTS_FILE, TokenCounts, coverage, select
from dflash.train.loss import LMHead

log = logging.getLogger(__name__)


@dataclass
class DraftVocabRun:
    """The run's draft vocabulary (head None: the target's whole vocabulary, nothing masked)."""

    loss_head: LMHead  # the head the loss runs over: the pruned one, else the target's whole lm_head
    head: DraftHead | None  # the drafter's own lm_head (exported beside the body)
    inside: torch.Tensor | None  # (V,) bool t2d on the drafter's device; given to MicroBatch for `tokens` labels
    coverage: float | None  # share of the training loss tokens inside the vocabulary

    def summary(self, history: Sequence[dict]) -> dict[str, Any]:
        """train.json's draft-vocabulary lines: size, coverage, and the valid slots masked (labels outside)."""
        outside = sum(h.get("outside", 0) for h in history)
        counted = sum(sum(h["counted"]) for h in history)
        size = 0 if self.head is None else int(self.head.weight.shape[0])
        return {
            "draft_vocab_size": size,
            "draft_vocab_coverage": 1.0 if self.coverage is None else round(self.coverage, 6),
            "draft_vocab_outside_slots": int(outside),
            "draft_vocab_outside_frac": round(outside / (outside + counted), 6) if outside + counted else 0.0,
        }


def setup(
    cfg: DrafterConfig, lm_head: torch.nn.Module, data_dir: str | Path, device: torch.device, loss_target: str
) -> DraftVocabRun:
    """Build the run's draft vocabulary from the counts beside `data_dir` (module docstring); without one, the
    target's lm_head reduced to its non-zero rows (loss.py)."""
    if not cfg.draft_vocab_size:
        full = LMHead.from_linear(lm_head, device)
        if full.num_zero:
            log.info("lm_head: %d of %d rows are exactly zero; exact reduced softmax", full.num_zero, full.vocab_size)
        return DraftVocabRun(full, None, None, None)
    path = Path(data_dir).parent / COUNTS_FILE
    if not path.exists():
        raise UserError(f"drafter.draft_vocab_size: {path} not found (written by the tokenize stage: rerun it)")
    counts = TokenCounts.read(path)
    try:
        ids = select(counts.counts, counts.always_in, cfg.draft_vocab_size, cfg.vocab_size)
    except ValueError as exc:
        raise UserError(f"drafter.draft_vocab_size: {exc}") from exc
    head = DraftHead.from_target(lm_head, ids).to(device)
    inside = torch.zeros(cfg.vocab_size, dtype=torch.bool, device=device)
    inside[head.token_ids] = True
    cover = coverage(counts.counts, ids)
    log.info(
        "draft vocabulary: %d of %d tokens, covering %.4f of the training loss tokens", len(ids), cfg.vocab_size, cover
    )
    loss_head = LMHead.draft_vocab(head.weight, head.token_ids, head.vocab_size)
    return DraftVocabRun(loss_head, head, inside if loss_target == "tokens" else None, cover)


__all__ = ["DraftVocabRun", "setup"]
