"""The drafter's own lm_head over a pruned draft vocabulary (drafter.draft_vocab_size; the vocabulary, its
tables and the build rule: dflash/drafter/vocab.py): training builds it from the target's lm_head, the export
writes it (lm_head.weight, d2t, t2d), the reference evaluator drafts through it as vLLM does.

May import: dflash.core, dflash.drafter.vocab, torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from dflash.drafter.vocab import d2t_table, ids_from_d2t, t2d_table


class DraftHead:
    """The drafter's own lm_head over the draft vocabulary: the target's lm_head rows of its tokens (frozen,
    copied), called like the target's lm_head: (n, H) -> (n, V) logits, -inf outside the vocabulary (what vLLM's
    compute_logits scatters)."""

    def __init__(self, weight: Any, token_ids: Any, vocab_size: int):
        self.weight, self.token_ids, self.vocab_size = weight, token_ids, vocab_size  # (D, H), (D,) long, V

    @classmethod
    def from_target(cls, lm_head: Any, ids: np.ndarray) -> DraftHead:
        w = lm_head.weight.detach()
        index = torch.as_tensor(ids, dtype=torch.long, device=w.device)
        return cls(w[index].clone(), index, w.shape[0])

    def tensors(self) -> dict[str, Any]:
        """What the export writes beside the body: lm_head.weight, d2t, t2d (module docstring)."""
        ids = self.token_ids.cpu().numpy()
        return {
            "lm_head.weight": self.weight.detach().contiguous().cpu(),
            "d2t": torch.from_numpy(d2t_table(ids)),
            "t2d": torch.from_numpy(t2d_table(ids, self.vocab_size)),
        }

    @classmethod
    def from_tensors(cls, state: Mapping[str, Any], vocab_size: int) -> DraftHead:
        ids = torch.from_numpy(ids_from_d2t(state["d2t"].cpu().numpy())).to(state["lm_head.weight"].device)
        t2d = state.get("t2d")
        if t2d is not None and not torch.equal(torch.nonzero(t2d.cpu()).squeeze(1), ids.cpu()):
            raise ValueError("d2t and t2d name different vocabularies")
        return cls(state["lm_head.weight"], ids, vocab_size)

    def to(self, device: Any = None, dtype: Any = None) -> DraftHead:
        return DraftHead(self.weight.to(device=device, dtype=dtype), self.token_ids.to(device), self.vocab_size)

    def __call__(self, h: Any) -> Any:
        kept = torch.nn.functional.linear(h.to(self.weight.dtype), self.weight)
        out = kept.new_full((h.shape[0], self.vocab_size), float("-inf"))
        out[:, self.token_ids] = kept
        return out


__all__ = ["DraftHead"]
