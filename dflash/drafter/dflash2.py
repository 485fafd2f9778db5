"""DFlash2: DFlash with grouped causal convolutions around each sublayer and a candidate selector that walks the
lm_head's top-K candidates slot by slot. What vLLM 0.32 serves as `method: "dflash"` with architectures
["DFlash2DraftModel"] (qwen3_dflash2.py, the V2 runner's DFlash2 speculator); docs/design/successors.md.

Block layout: DFlash's (B slots [anchor, mask x (B-1)], slot k drafts the token at anchor + k).

Grouped causal conv (one before and one after each attention and MLP sublayer, per layer). The projection of
the sublayer's normed input x gives, per row, 2 x taps x G coefficients (G = H / conv_group_size groups):
side 0 convolves that input before the sublayer, side 1 the sublayer's output after it,
    out[i] = sum_{t < taps} (base[side, t] + delta[i, side, t, group(c)]) * x[i - t]     (channel c)
where the term t is dropped when row i is fewer than t slots into its block (taps never cross a block start). The
context K/V path (fc -> hidden_norm -> k/v projections) has no conv. Init: base[:, 0] = 1, every other tap and the
projection 0, so each conv is the identity and an untrained DFlash2 computes exactly its DFlash body.

Candidate selector. For drafted slot k (query slot k >= 1) with hidden h_k: the lm_head's top-K tokens c and
their logits u_c (the unary scores); the edge score of candidate c after predecessor p is
    s(p, c) = u_c + < P[p] * (W h_k), S[c] >      P, S: predecessor / successor codebooks (V x r), W: r x H.
The walk starts at the anchor: slot 1 scores its candidates after the anchor token, slot k after the candidate
chosen at slot k-1; at temperature 0 it takes the argmax (a greedy walk, not a beam search). S starts at zero,
so untrained the walk picks each slot's top-1: DFlash's draft.

Legend: Q query rows (N*B in training, B at inference), H hidden, G groups, V vocabulary, r selector_rank, K top-K.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash.drafter.geometry import DrafterConfig
from dflash.drafter.layers import DecoderLayer
from dflash.drafter.model import DFlashDrafter


def grouped_causal_conv(
    x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int, group_size: int
) -> torch.Tensor:
    """x (Q, H) rows in blocks of block_size; delta (Q, taps, G) predicted coefficients; base (taps, H) -> (Q, H)
    (module docstring). The row's slot in its block is row % block_size."""
    taps = base.shape[0]
    coef = base.unsqueeze(0) + delta.repeat_interleave(group_size, dim=-1)  # (Q, taps, H)
    out = coef[:, 0] * x
    slot = torch.arange(x.shape[0], device=x.device) % block_size
    for t in range(1, taps):
        earlier = torch.cat([x.new_zeros(t, x.shape[1]), x[:-t]])  # x[i - t], zero before the first row
        out = out + coef[:, t] * earlier * (slot >= t).to(x.dtype)[:, None]
    return out


class GroupedCausalConv(nn.Module):
    """base_kernel (2, taps, H) and kernel_projection (H -> 2 x taps x G), vLLM's DFlashGroupedConv weights."""

    def __init__(self, hidden: int, taps: int, group_size: int, block_size: int):
        super().__init__()
        self.taps, self.group_size, self.block_size = taps, group_size, block_size
        self.groups = hidden // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, taps, hidden))
        self.kernel_projection = nn.Module()  # not an nn.Linear: the body's normal init must not reach it
        self.kernel_projection.weight = nn.Parameter(torch.empty(2 * taps * self.groups, hidden))
        self.reset_identity()

    def reset_identity(self) -> None:
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def _conv(self, x: torch.Tensor, delta: torch.Tensor, side: int) -> torch.Tensor:
        return grouped_causal_conv(x, delta, self.base_kernel[side].to(x.dtype), self.block_size, self.group_size)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normed sublayer input (Q, H) -> (its side-0 convolution, the side-1 coefficients (Q, taps, G))."""
        coef = F.linear(x, self.kernel_projection.weight.to(x.dtype)).view(x.shape[0], 2, self.taps, self.groups)
        return self._conv(x, coef[:, 0], 0), coef[:, 1]

    def finish(self, y: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
        """Sublayer output (Q, H) -> its side-1 convolution with the coefficients from prepare."""
        return self._conv(y, coef.to(y.dtype), 1)


class DFlash2DecoderLayer(DecoderLayer):
    """DFlash's pre-norm layer with a grouped causal conv around the attention and around the MLP."""

    def __init__(self, c: DrafterConfig):
        super().__init__(
            c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size, c.rms_norm_eps
        )
        self.attention_conv = GroupedCausalConv(c.hidden_size, c.conv_kernel_size, c.conv_group_size, c.block_size)
        self.mlp_conv = GroupedCausalConv(c.hidden_size, c.conv_kernel_size, c.conv_group_size, c.block_size)

    def forward(self, x, ctx_k, ctx_v, cos, sin, mask, backend: str) -> torch.Tensor:
        y, coef = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(y, ctx_k, ctx_v, cos, sin, mask, backend), coef)
        y, coef = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(y), coef)


class CandidateSelector(nn.Module):
    """predecessor_codebook, successor_codebook (V x r), hidden_projection (H -> r): vLLM's weight names."""

    def __init__(self, hidden: int, vocab: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab, rank))
        self.hidden_projection = nn.Module()
        self.hidden_projection.weight = nn.Parameter(torch.empty(rank, hidden))

    def reset_parameters(self, std: float) -> None:
        nn.init.normal_(self.predecessor_codebook, std=std)
        nn.init.zeros_(self.successor_codebook)  # the edge term starts at 0: the walk starts as DFlash's argmax
        nn.init.normal_(self.hidden_projection.weight, std=std)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """(n, H) -> (n, r)."""
        return F.linear(hidden, self.hidden_projection.weight.to(hidden.dtype))

    def scores(
        self, candidate_ids: torch.Tensor, unary: torch.Tensor, hidden: torch.Tensor, predecessor_ids: torch.Tensor
    ) -> torch.Tensor:
        """Edge scores of every candidate after every predecessor of the same slot.
        candidate_ids / unary (n, K), hidden (n, H), predecessor_ids (n, P) -> (n, P, K)."""
        h = self.project(hidden)  # (n, r)
        pred = self.predecessor_codebook[predecessor_ids] * h[:, None, :]  # (n, P, r)
        succ = self.successor_codebook[candidate_ids]  # (n, K, r)
        return unary[:, None, :] + torch.einsum("npr,nkr->npk", pred, succ.to(pred.dtype))


class DFlash2Drafter(DFlashDrafter):
    """DFlash body with DFlash2DecoderLayers (`layers.{i}.{attention,mlp}_conv`) + `candidate_selector`."""

    def __init__(self, config: DrafterConfig):
        if config.kind != "dflash2":
            raise ValueError(f"DFlash2Drafter needs drafter.kind dflash2, got {config.kind!r}")
        super().__init__(
            config
        )  # body initialised as DFlash's (the convs are not nn.Linear: untouched), convs identity
        c = config
        self.candidate_selector = CandidateSelector(c.hidden_size, c.vocab_size, c.selector_rank, c.selector_top_k)
        self.candidate_selector.reset_parameters(0.02)

    def make_layer(self, c: DrafterConfig) -> nn.Module:
        return DFlash2DecoderLayer(c)

    def reset_parameters(self, std: float = 0.02) -> None:
        super().reset_parameters(std)
        for layer in self.layers:
            layer.attention_conv.reset_identity()
            layer.mlp_conv.reset_identity()
        if hasattr(self, "candidate_selector"):  # absent while the body's constructor initialises the body
            self.candidate_selector.reset_parameters(std)


@torch.no_grad()
def selector_walk(
    drafter: DFlash2Drafter,
    hidden: torch.Tensor,
    base_logits: torch.Tensor,
    anchor_id: int,
    choose: Callable[[torch.Tensor, int], int],
) -> tuple[list[int], torch.Tensor]:
    """The walk at inference over the drafted slots: hidden (N, H) and base_logits (N, V) = lm_head(hidden) of
    slots 1..B-1. Candidates: each slot's top-K logits (torch.topk, as vLLM's logits processor on CPU). Step j
    picks index choose(scores (K,), j) among slot j's candidates after the previous pick (the anchor at j = 0).
    Returns the drafts and the (N, V) draft logits along the path: the K scores, -inf elsewhere."""
    sel = drafter.candidate_selector
    unary, cand = torch.topk(base_logits.float(), sel.top_k, dim=-1)  # (N, K) each, descending
    n = cand.shape[0]
    # predecessors of slot j: the anchor for j = 0, else every candidate of slot j-1 (vLLM scores all K x K edges)
    anchor = torch.full((1, sel.top_k), anchor_id, dtype=cand.dtype, device=cand.device)
    preds = torch.cat([anchor, cand[:-1]])  # (N, K)
    scores = sel.scores(cand, unary, hidden.to(sel.predecessor_codebook.dtype), preds).float()  # (N, K, K)
    drafts, rows, previous = [], [], 0
    for j in range(n):
        row = scores[j, previous]  # (K,): the candidates of slot j after the pick of slot j-1
        index = choose(row, j)
        drafts.append(int(cand[j, index]))
        full = torch.full_like(base_logits[j], float("-inf"), dtype=torch.float32)
        rows.append(full.scatter(0, cand[j], row))
        previous = index
    return drafts, torch.stack(rows)


def draft_step(
    session: Any,
    hidden: torch.Tensor,
    lm_head: Callable[[torch.Tensor], torch.Tensor],
    bonus: int,
    pick: Any,
) -> tuple[list[int], torch.Tensor]:
    """DFlash2's decode step (the reference evaluator's): slots 1..B-1, walked over their top-K candidates."""
    return selector_walk(session.drafter, hidden[1:], lm_head(hidden[1:]).float(), bonus, pick)


__all__ = [
    "CandidateSelector",
    "draft_step",
    "DFlash2DecoderLayer",
    "DFlash2Drafter",
    "GroupedCausalConv",
    "grouped_causal_conv",
    "selector_walk",
]
