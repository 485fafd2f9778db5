"""DSpark (arXiv 2607.05147): the DFlash backbone drafting from the anchor, plus a sequential Markov head and a
confidence head. What vLLM 0.32 serves as `method: "dspark"` (`Qwen3DSparkModel`); docs/design/successors.md.

Block layout (our block_size B = vLLM's num_speculative_tokens + 1, as for every kind): B-1 query slots
[anchor, mask x (B-2)] at positions a .. a+B-2; slot j drafts the token at a + j + 1 (the anchor predicts the
first draft). The backbone is DFlashDrafter's, run with `config.query_slots` = B-1 slots.

Markov head (the sequential stage): W1 (V x r) embeds the previous token, W2 (V x r) maps it to a vocabulary
bias: the logits of slot j are lm_head(h_j) + W2 W1[prev_j], prev_0 = the anchor, prev_j = the draft of slot
j-1 (in training the true token there: teacher forcing). Confidence head: sigmoid(w . [h_j ; W1[prev_j]] + b),
the predicted probability that slot j's draft is accepted (vLLM reads it only with adaptive verification).

Init: the backbone exactly as DFlashDrafter's under the same seed, then W1 and the confidence projection
normal(0, 0.02) and W2 zero, so an untrained DSpark drafts with its backbone alone. W2 = 0 also keeps the W2 rows
of tokens whose lm_head row is zero identical through training (they get identical gradients), which the chunked
loss relies on (dflash/train/loss_dspark.py).

Legend: n tokens, H hidden, V vocabulary, r markov_rank, N = B-1 query slots.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash.drafter.geometry import DrafterConfig
from dflash.drafter.model import DFlashDrafter


class MarkovHead(nn.Module):
    """markov_w1 (V x r): embedding of the previous token; markov_w2 (V x r): its vocabulary bias (vLLM's names)."""

    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Module()  # vLLM's ParallelLMHead holds `weight` [V, r]
        self.markov_w2.weight = nn.Parameter(torch.zeros(vocab, rank))

    def reset_parameters(self, std: float) -> None:
        nn.init.normal_(self.markov_w1.weight, std=std)
        nn.init.zeros_(self.markov_w2.weight)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """(n,) previous tokens -> (n, r)."""
        return self.markov_w1(token_ids)

    def bias(self, markov_embed: torch.Tensor) -> torch.Tensor:
        """(n, r) -> (n, V): the transition bias added to the lm_head logits."""
        return F.linear(markov_embed, self.markov_w2.weight)


class ConfidenceHead(nn.Module):
    """proj: [h ; W1[prev]] (H + r) -> one acceptance logit, with bias (vLLM's confidence_head.proj)."""

    def __init__(self, hidden: int, rank: int):
        super().__init__()
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(1, hidden + rank))
        self.proj.bias = nn.Parameter(torch.zeros(1))

    def reset_parameters(self, std: float) -> None:
        nn.init.normal_(self.proj.weight, std=std)
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        """(n, H), (n, r) -> (n,) logits (fp32, as vLLM computes them)."""
        x = torch.cat([hidden, markov_embed.to(hidden.dtype)], dim=-1).float()
        return F.linear(x, self.proj.weight.float(), self.proj.bias.float()).squeeze(-1)


class DSparkDrafter(DFlashDrafter):
    """DFlash body (`layers`, `fc`, `hidden_norm`, `norm`) + `markov_head` + `confidence_head` (when configured)."""

    def __init__(self, config: DrafterConfig):
        if config.kind != "dspark":
            raise ValueError(f"DSparkDrafter needs drafter.kind dspark, got {config.kind!r}")
        super().__init__(config)  # the body, initialised as DFlash's (same seed, same weights)
        self.markov_head = MarkovHead(config.vocab_size, config.markov_rank)
        self.confidence_head = (
            ConfidenceHead(config.hidden_size, config.markov_rank) if config.confidence_head else None
        )
        self._reset_heads(0.02)

    def reset_parameters(self, std: float = 0.02) -> None:
        super().reset_parameters(std)
        if hasattr(self, "markov_head"):  # absent while the body's constructor initialises the body
            self._reset_heads(std)

    def _reset_heads(self, std: float) -> None:
        self.markov_head.reset_parameters(std)
        if self.confidence_head is not None:
            self.confidence_head.reset_parameters(std)

    def label_row_weight(self) -> torch.Tensor:
        """markov_w2: the W2 rows of labels whose lm_head rows are zero are their own (dflash/train/loss_dspark.py)."""
        return self.markov_head.markov_w2.weight

    def confidence(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """(n, H) slot hidden states, (n,) previous tokens -> (n,) acceptance probabilities."""
        if self.confidence_head is None:
            raise ValueError("this DSpark drafter has no confidence head (drafter.dspark.confidence_head: false)")
        return torch.sigmoid(self.confidence_head(hidden, self.markov_head.embed(prev_ids)))


@torch.no_grad()
def markov_walk(
    drafter: DSparkDrafter,
    base_logits: torch.Tensor,
    anchor_id: int,
    choose: Callable[[torch.Tensor, int], int],
) -> tuple[list[int], torch.Tensor]:
    """The sequential stage at inference: base_logits (N, V) = lm_head(h) of the N slots. For j = 0..N-1:
    logits_j = base_j + W2 W1[prev], draft_j = choose(logits_j, j), prev = draft_j (prev starts at the anchor).
    `choose` is argmax at temperature 0, a seeded draw above it. Returns the drafts and the (N, V) logits along
    the drafted path (the draft distribution rejection sampling needs)."""
    head = drafter.markov_head
    prev = torch.tensor([anchor_id], device=base_logits.device)
    drafts, rows = [], []
    for j in range(base_logits.shape[0]):
        logits = base_logits[j].float() + head.bias(head.embed(prev))[0].float()
        token = choose(logits, j)
        drafts.append(token)
        rows.append(logits)
        prev = torch.tensor([token], device=base_logits.device)
    return drafts, torch.stack(rows)


def draft_step(
    session: Any, hidden: torch.Tensor, lm_head: Callable[[torch.Tensor], torch.Tensor], bonus: int, pick: Any
) -> tuple[list[int], torch.Tensor]:
    """DSpark's decode step (the reference evaluator's): its B-1 slots, each drafting the next token, the Markov bias
    fed the previous draft (markov_walk)."""
    return markov_walk(session.drafter, lm_head(hidden).float(), bonus, pick)


__all__ = ["ConfidenceHead", "DSparkDrafter", "MarkovHead", "draft_step", "markov_walk"]
