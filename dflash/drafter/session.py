"""Drafting at inference: one request's cached context K/V and one drafter pass per block (docs/design/
inference.md). The PyTorch reference evaluator (dflash/eval/reference.py) drives it; vLLM has its own."""

from __future__ import annotations

from collections.abc import Callable

import torch

from dflash.drafter.geometry import SLIDING
from dflash.drafter.layers import rope_cos_sin
from dflash.drafter.model import DFlashDrafter


class DraftSession:
    """One request's drafter state: per-layer context K/V of positions 0..length-1 (k_norm + RoPE applied).

    Use: extend(prompt features); then per cycle draft(bonus, start=length) -> B-1 greedy ids; the target
    verifies; extend(features of the accepted positions, which are start..start+accepted). `embed` maps
    ids (n,) -> (n, H) and `lm_head` (n, H) -> (n, V): the target's own frozen modules.
    """

    def __init__(self, drafter: DFlashDrafter, embed: Callable, lm_head: Callable):
        self.drafter, self.embed, self.lm_head = drafter, embed, lm_head
        c = drafter.config
        w = drafter.fc.weight
        empty = torch.empty(0, c.num_key_value_heads, c.head_dim, dtype=w.dtype, device=w.device)
        self.k = [empty] * c.num_hidden_layers
        self.v = [empty] * c.num_hidden_layers
        self.length = 0
        self.anchor: torch.Tensor | None = None  # (H,) fused context feature of the last cached position (lilicorr)

    @torch.no_grad()
    def extend(self, features: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        """Append context features (T, K*H) for positions length..length+T-1 (the only positions accepted)."""
        c, T = self.drafter.config, features.shape[0]
        expected = torch.arange(self.length, self.length + T, device=features.device)
        if positions is not None and not torch.equal(positions.to(expected.device), expected):
            raise ValueError(f"positions must continue the cached context at {self.length}, got {positions.tolist()}")
        ctx = self.drafter.context(features)  # (T, H)
        cos, sin = rope_cos_sin(expected, c.head_dim, c.rope_theta, ctx.dtype)
        for i, layer in enumerate(self.drafter.layers):
            k, v = layer.self_attn.project_kv(ctx, cos, sin)  # (T, nkv, hd)
            self.k[i] = torch.cat([self.k[i], k])
            self.v[i] = torch.cat([self.v[i], v])
        self.length += T
        self.anchor = ctx[-1] if T else self.anchor

    def _mask(self, kind: str, device: torch.device) -> torch.Tensor:
        """(B, length + B): all cached context (sliding: within the window); the block per layer type. B: the
        kind's query slots (block_size; DSpark: block_size - 1)."""
        c, T, B = self.drafter.config, self.length, self.drafter.config.query_slots
        o = torch.arange(B, device=device)[:, None]  # query offset
        p = torch.arange(T, device=device)[None, :]
        o2 = torch.arange(B, device=device)[None, :]
        ctx = torch.ones(B, T, dtype=torch.bool, device=device)
        blk = torch.ones(B, B, dtype=torch.bool, device=device)
        if kind == SLIDING:
            ctx = (T + o) - p <= c.sliding_window - 1
            blk = (o2 <= o) & (o - o2 <= c.sliding_window - 1)
        return torch.cat([ctx, blk], dim=1)

    @torch.no_grad()
    def draft_hidden(self, bonus_token_id: int, start_position: int) -> torch.Tensor:
        """(B, H) hidden after `norm` for the block [bonus, mask x (B-1)] at positions start..start+B-1 (B: the
        kind's query slots)."""
        c = self.drafter.config
        if start_position != self.length:
            raise ValueError(f"start_position {start_position} != cached context length {self.length}")
        dev = self.drafter.fc.weight.device
        ids = torch.full((c.query_slots,), c.mask_token_id, dtype=torch.long, device=dev)
        ids[0] = bonus_token_id
        h = self.embed(ids).to(self.drafter.fc.weight.dtype)  # (B, H)
        pos = torch.arange(start_position, start_position + c.query_slots, device=dev)
        cos, sin = rope_cos_sin(pos, c.head_dim, c.rope_theta, h.dtype)
        masks = {kind: self._mask(kind, dev) for kind in dict.fromkeys(c.layer_types)}
        for i, (layer, kind) in enumerate(zip(self.drafter.layers, c.layer_types, strict=True)):
            h = layer(h, self.k[i], self.v[i], cos, sin, masks[kind], "sdpa")
        return self.drafter.norm(h)

    @torch.no_grad()
    def draft(self, bonus_token_id: int, start_position: int) -> list[int]:
        """B-1 greedy draft tokens for slots 1..B-1 (one drafter pass)."""
        h = self.draft_hidden(bonus_token_id, start_position)
        return self.lm_head(h[1:]).argmax(dim=-1).tolist()
