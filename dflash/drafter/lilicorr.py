"""LiLiCorr: a DFlash body (optionally with DFlash2's grouped causal convs) plus a candidate-lattice correlator that
re-scores the lm_head's top-K candidates of every drafted slot jointly. What vLLM 0.31-0.33 serves as method "dflash"
with architectures ["LiLiCorrDraftModel"] (model_executor/models/lilicorr.py; the V2 runner's LiLiCorr speculator,
v1/worker/gpu/spec_decode/lilicorr/speculator.py, walks its scores like DFlash2's). Geometry and export format:
dflash/drafter/lilicorr_spec.py; loss: dflash/train/loss_lilicorr.py.

Block layout: DFlash's (B slots [anchor, mask x (B-1)], slot k drafts the token at anchor + k). Drafted slot s
(0-based over slots 1..B-1, n = B-1 of them) has the drafter hidden h_s and candidates c_{s,j} (j < K, the lm_head's
top-K, best first) with full-vocabulary log-probabilities l_{s,j}.

The lattice: n K tokens, one per (slot, candidate), each starting as
    x_{s,j} = T e(c_{s,j}) + P h_s + MLP(LN(f_{s,j})) + slot_s + rank_j
with e the target's input embedding (T: a projection when the correlator is narrower than the target, else none),
f the 5 candidate features [l, exp l, l - max_j l, j / (K-1), j == 0], then L pre-norm layers of attention over the
whole lattice (no mask: an additive per-head bias rel[slot(q) - slot(k)] + same * [slot(q) == slot(k)]) and an
MLP (up, SiLU, down, with biases). The anchor a = C g, g the drafter's fused context feature (fc -> hidden_norm) of
the last verified position (the one before the block's anchor token; zero when there is none). After the output
norms x~ and a~ (RMSNorm), each candidate's factor state is u = SiLU(W [x~ ; a~ ; x~ * a~] + b), and
    out_{s,j} = normalize(O u),  in_{s,j} = normalize(I u),  start = normalize(A a~)
    score(anchor -> c_{0,j})    = scale <start, in_{0,j}>
    score(c_{s,i} -> c_{s+1,j}) = scale <out_{s,i}, in_{s+1,j}>
The walk (vLLM's candidate sampler): slot 0 takes the best start score, slot s the best score after the candidate
picked at slot s-1 (temperature 0), or draws from softmax(scores / T). The scores replace the lm_head logits: the
draft distribution is the K scores, -inf elsewhere.

Init: the body as DFlash's under the same seed (the convs identity), then the correlator's linears (and the lattice
QKV) uniform within 1 / sqrt(fan-in) (torch's default: at std 0.02 the candidate features fade through the five maps
between them and the scores, and the scores barely learn) with zero biases, the slot / rank embeddings normal(0,
std), the attention biases zero, norms one.

Legend: H hidden (target), W correlator width, K candidate_top_k, n = B-1 drafted slots, F factor_dim, b blocks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash.drafter import lilicorr_spec
from dflash.drafter.dflash2 import DFlash2DecoderLayer
from dflash.drafter.geometry import DrafterConfig
from dflash.drafter.model import DFlashDrafter


class _UpDown(nn.Module):
    """up_proj -> SiLU -> down_proj, both with bias (vLLM's NemotronHMLP with hidden_act silu)."""

    def __init__(self, d_in: int, d_mid: int, d_out: int):
        super().__init__()
        self.up_proj = nn.Linear(d_in, d_mid)
        self.down_proj = nn.Linear(d_mid, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.up_proj(x)))


class LatticeAttention(nn.Module):
    """Multi-head attention over the lattice with an additive bias: in_proj_weight / in_proj_bias (3W x W), out_proj."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * width, width))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * width))
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """x (b, L, W), bias (heads, L, L) -> (b, L, W)."""
        b, length, w = x.shape
        q, k, v = F.linear(x, self.in_proj_weight, self.in_proj_bias).split(w, dim=-1)

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(b, length, self.heads, w // self.heads).transpose(1, 2)

        y = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), attn_mask=bias[None].to(x.dtype))
        return self.out_proj(y.transpose(1, 2).reshape(b, length, w))


class LatticeLayer(nn.Module):
    """attn_norm -> attn (residual), mlp_norm -> mlp (residual)."""

    def __init__(self, width: int, heads: int, mlp: int, eps: float):
        super().__init__()
        self.attn_norm = nn.RMSNorm(width, eps=eps)
        self.attn = LatticeAttention(width, heads)
        self.mlp_norm = nn.RMSNorm(width, eps=eps)
        self.mlp = _UpDown(width, mlp, width)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), bias)
        return x + self.mlp(self.mlp_norm(x))


def candidate_features(log_probs: torch.Tensor) -> torch.Tensor:
    """(..., K) full-vocabulary log-probabilities of the ranked candidates -> (..., K, 5) (module docstring)."""
    k = log_probs.shape[-1]
    rank = torch.arange(k, device=log_probs.device, dtype=log_probs.dtype) / max(k - 1, 1)
    top1 = (torch.arange(k, device=log_probs.device) == 0).to(log_probs.dtype)
    best = log_probs.max(dim=-1, keepdim=True).values
    parts = [log_probs, log_probs.exp(), log_probs - best, rank.expand_as(log_probs), top1.expand_as(log_probs)]
    return torch.stack(parts, dim=-1)


class LatticeCorrelator(nn.Module):
    """The correlator (module docstring), with vLLM's LiLiCorrHead parameter names."""

    def __init__(self, c: DrafterConfig):
        super().__init__()
        p, h, w = c.lilicorr, c.hidden_size, lilicorr_spec.width(c)
        self.top_k, self.slots, self.block_size = p.candidate_top_k, c.block_size - 1, c.block_size
        self.logit_scale, self.vector_eps = p.logit_scale, p.vector_eps
        if w != h:
            self.token_proj = nn.Linear(h, w)
        self.pass_hidden_proj = nn.Linear(h, w)
        self.context_proj = nn.Linear(h, w)
        self.feature_norm = nn.LayerNorm(lilicorr_spec.NUM_FEATURES)
        self.feature_mlp = _UpDown(lilicorr_spec.NUM_FEATURES, w, w)
        self.slot_embedding = nn.Parameter(torch.empty(1, 1, self.slots, 1, w))
        self.rank_embedding = nn.Parameter(torch.empty(1, 1, 1, self.top_k, w))
        self.relative_slot_bias = nn.Parameter(torch.empty(p.num_heads, 2 * c.block_size - 1))
        self.same_slot_bias = nn.Parameter(torch.empty(p.num_heads))
        mlp = lilicorr_spec.mlp_width(c)
        self.layers = nn.ModuleList(LatticeLayer(w, p.num_heads, mlp, c.rms_norm_eps) for _ in range(p.num_layers))
        self.output_norm = nn.RMSNorm(w, eps=c.rms_norm_eps)
        self.anchor_norm = nn.RMSNorm(w, eps=c.rms_norm_eps)
        self.factor_input_proj = nn.Linear(3 * w, w)
        self.out_head = nn.Linear(w, p.factor_dim)
        self.in_head = nn.Linear(w, p.factor_dim)
        self.anchor_out_head = nn.Linear(w, p.factor_dim)

    def reset_parameters(self, std: float) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):  # torch's fan-in scaled default: the candidate signal survives the depth
                m.reset_parameters()
                nn.init.zeros_(m.bias)
            elif isinstance(m, LatticeAttention):
                bound = 1 / math.sqrt(m.in_proj_weight.shape[1])
                nn.init.uniform_(m.in_proj_weight, -bound, bound)
                nn.init.zeros_(m.in_proj_bias)
            elif isinstance(m, nn.RMSNorm | nn.LayerNorm):
                m.reset_parameters()
        nn.init.normal_(self.slot_embedding, std=std)
        nn.init.normal_(self.rank_embedding, std=std)
        nn.init.zeros_(self.relative_slot_bias)
        nn.init.zeros_(self.same_slot_bias)

    def attention_bias(self, n: int) -> torch.Tensor:
        """(heads, n K, n K): rel[slot(q) - slot(k) + B - 1] + same [slot(q) == slot(k)] over the first n slots."""
        slot = torch.arange(n, device=self.same_slot_bias.device).repeat_interleave(self.top_k)
        gap = slot[:, None] - slot[None, :]
        bias = self.relative_slot_bias[:, gap + self.block_size - 1]
        return bias + (gap == 0).to(bias.dtype)[None] * self.same_slot_bias[:, None, None]

    def forward(
        self,
        token_embeds: torch.Tensor,
        log_probs: torch.Tensor,
        hidden: torch.Tensor,
        anchor: torch.Tensor,
        anchor_valid: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """token_embeds (b, n, K, H) of the candidates, log_probs (b, n, K), hidden (b, n, H) the drafted slots,
        anchor (b, H) the context feature, anchor_valid (b,) -> (start (b, K), pairs (b, n-1, K, K)) transition
        logits, scaled by logit_scale, float32 or wider."""
        b, n, k = log_probs.shape
        if not 1 <= n <= self.slots or k != self.top_k:
            raise ValueError(f"lattice of {n} slots x {k} candidates; expected 1..{self.slots} x {self.top_k}")
        dtype = self.slot_embedding.dtype
        tokens = token_embeds.to(dtype)
        tokens = self.token_proj(tokens) if hasattr(self, "token_proj") else tokens
        x = tokens + self.pass_hidden_proj(hidden.to(dtype))[:, :, None]
        x = x + self.feature_mlp(self.feature_norm(candidate_features(log_probs.to(dtype))))
        x = (x + self.slot_embedding[:, 0, :n] + self.rank_embedding[:, 0]).reshape(b, n * k, -1)
        bias = self.attention_bias(n)
        for layer in self.layers:
            x = layer(x, bias)
        x = self.output_norm(x).reshape(b, n, k, -1)
        a = self.anchor_norm(self.context_proj(anchor.to(dtype)) * anchor_valid[:, None].to(dtype))
        a_row = a[:, None, None].expand_as(x)
        u = F.silu(self.factor_input_proj(torch.cat([x, a_row, x * a_row], dim=-1)))
        out_vec = F.normalize(self.out_head(u), dim=-1, eps=self.vector_eps)
        in_vec = F.normalize(self.in_head(u), dim=-1, eps=self.vector_eps)
        start_vec = F.normalize(self.anchor_out_head(a), dim=-1, eps=self.vector_eps)
        start = torch.einsum("bf,bkf->bk", start_vec, in_vec[:, 0])
        pairs = torch.einsum("bsif,bsjf->bsij", out_vec[:, :-1], in_vec[:, 1:])
        if dtype != torch.float64:  # float32 logits from a half-precision correlator (vLLM's .float())
            start, pairs = start.float(), pairs.float()
        return self.logit_scale * start, self.logit_scale * pairs


class LiLiCorrDrafter(DFlashDrafter):
    """DFlash body (`layers.{i}.{attention,mlp}_conv` with convs) + `lilicorr` (LatticeCorrelator)."""

    def __init__(self, config: DrafterConfig):
        if config.kind != lilicorr_spec.LILICORR:
            raise ValueError(f"LiLiCorrDrafter needs drafter.kind lilicorr, got {config.kind!r}")
        super().__init__(config)
        self.lilicorr = LatticeCorrelator(config)
        self.lilicorr.reset_parameters(0.02)

    def make_layer(self, c: DrafterConfig) -> nn.Module:
        return DFlash2DecoderLayer(c) if c.conv_kernel_size else super().make_layer(c)

    def reset_parameters(self, std: float = 0.02) -> None:
        super().reset_parameters(std)
        for layer in self.layers:
            if isinstance(layer, DFlash2DecoderLayer):
                layer.attention_conv.reset_identity()
                layer.mlp_conv.reset_identity()
        if hasattr(self, "lilicorr"):  # absent while the body's constructor initialises the body
            self.lilicorr.reset_parameters(std)


def ranked_candidates(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., V) logits -> the top-K ids (..., K), best first, and their full-vocabulary log-probabilities (float32)."""
    logits = logits.float()
    values, ids = torch.topk(logits, k, dim=-1)
    return ids, values - torch.logsumexp(logits, dim=-1, keepdim=True)


def walk_scores(start: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """(K,) and (n-1, K, K) -> (n, K, K): step s, row p = the scores of slot s's candidates after pick p of slot
    s-1 (every row of step 0 is the start scores), the layout vLLM's walk reads."""
    k = start.shape[-1]
    return torch.cat([start.expand(1, k, k), pairs])


@torch.no_grad()
def lattice_walk(
    drafter: LiLiCorrDrafter,
    hidden: torch.Tensor,
    base_logits: torch.Tensor,
    embed: Callable[[torch.Tensor], torch.Tensor],
    anchor: torch.Tensor | None,
    choose: Callable[[torch.Tensor, int], int],
) -> tuple[list[int], torch.Tensor]:
    """The walk at inference over the drafted slots: hidden (n, H), base_logits (n, V) = lm_head(hidden) of slots
    1..B-1, `embed` the target's input embedding, `anchor` (H,) the fused context feature of the last verified
    position (None: no context). Step j picks index choose(scores (K,), j) among slot j's candidates after the
    previous pick. Returns the drafts and the (n, V) draft logits along the path: the K scores, -inf elsewhere."""
    cor = drafter.lilicorr
    cand, log_probs = ranked_candidates(base_logits, cor.top_k)  # (n, K) each
    valid = torch.tensor([anchor is not None], device=hidden.device)
    anchor = torch.zeros_like(hidden[0]) if anchor is None else anchor
    start, pairs = cor(embed(cand)[None], log_probs[None], hidden[None], anchor[None], valid)
    scores = walk_scores(start[0], pairs[0]).float()
    drafts, rows, previous = [], [], 0
    for j in range(cand.shape[0]):
        row = scores[j, previous]
        index = choose(row, j)
        drafts.append(int(cand[j, index]))
        rows.append(torch.full_like(base_logits[j], float("-inf"), dtype=torch.float32).scatter(0, cand[j], row))
        previous = index
    return drafts, torch.stack(rows)


def propose_step(
    session: Any, hidden: torch.Tensor, lm_head: Callable, choose: Callable[[torch.Tensor, int], int]
) -> tuple[list[int], torch.Tensor]:
    """The reference evaluator's LiLiCorr proposal: hidden (B, H) of the block from session.draft_hidden (a
    dflash.drafter.session.DraftSession, whose `anchor` is the last verified position's fused context feature, as
    vLLM's prepare_context_anchor publishes it) -> lattice_walk over slots 1..B-1."""
    drafted = hidden[1:]
    return lattice_walk(session.drafter, drafted, lm_head(drafted).float(), session.embed, session.anchor, choose)


def draft_step(
    session: Any, hidden: torch.Tensor, lm_head: Callable, _bonus: int, pick: Callable[[torch.Tensor, int], int]
) -> tuple[list[int], torch.Tensor]:
    """LiLiCorr's decode step as the registry calls it (dflash/drafter/kinds.py `KindSpec.decode_step`)."""
    return propose_step(session, hidden, lm_head, pick)


__all__ = [
    "LatticeCorrelator",
    "LiLiCorrDrafter",
    "candidate_features",
    "draft_step",
    "lattice_walk",
    "propose_step",
    "ranked_candidates",
    "walk_scores",
]
