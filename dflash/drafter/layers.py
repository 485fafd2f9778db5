"""DFlash drafter building blocks: RMSNorm, full-head RoPE, KV-injection attention, SwiGLU, decoder layer.

Parameter names are the upstream Qwen3 / z-lab ones (`self_attn.q_proj`, `mlp.gate_proj`,
`input_layernorm`, ...) so that a plain `state_dict()` is the exported checkpoint.

Legend (no batch dimension; see dflash/drafter/model.py for the full contract):
  S  context positions       Q  query slots (N*B in training, B at inference)
  H  hidden size             nh / nkv  query / KV heads     hd  head_dim
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_compiled_flex = None


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: statistics in fp32, scale in the weight's dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """(P,) absolute positions -> cos, sin of shape (P, hd); NeoX layout (halves), full head rotated."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # (P, hd/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (P, hd)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (P, heads, hd); cos/sin (P, hd)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, backend: str) -> torch.Tensor:
    """q (Q, nh, hd), k/v (KV, nkv, hd), mask = dense bool (Q, KV) or BlockMask -> (Q, nh*hd)."""
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # (1, heads, len, hd)
    if backend == "sdpa":
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    elif backend == "flex":
        from torch.nn.attention.flex_attention import flex_attention

        global _compiled_flex
        if torch.is_autocast_enabled(q.device.type):  # flex is no autocast op: q/k (fp32 norms) and v must agree
            dt = torch.get_autocast_dtype(q.device.type)
            q, k, v = q.to(dt), k.to(dt), v.to(dt)
        fn = flex_attention
        if q.is_cuda:  # eager flex materialises the scores; the compiled kernel is the point on GPU
            if _compiled_flex is None:
                _compiled_flex = torch.compile(flex_attention)
            fn = _compiled_flex
        # Under autograd force the main kernel: for < 128 queries inductor picks flex *decoding*, which had
        # no valid kernel config for a backward pass on an H200 (torch 2.11).
        options = {"FORCE_USE_FLEX_ATTENTION": True} if torch.is_grad_enabled() else None
        out = fn(q, k, v, block_mask=mask, enable_gqa=True, kernel_options=options)
    else:
        raise ValueError(f"attention backend {backend!r}: expected 'sdpa' or 'flex'")
    return out.squeeze(0).transpose(0, 1).flatten(1)  # (Q, nh*hd)


class DFlashAttention(nn.Module):
    """Queries from the block only; keys/values = [context feature ; block], same k_proj/v_proj/k_norm/RoPE."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x (P, H) -> k (P, nkv, hd) after k_norm + RoPE, v (P, nkv, hd). Used for context and block alike."""
        k = self.k_norm(self.k_proj(x).view(x.shape[0], self.kv_heads, self.head_dim))
        v = self.v_proj(x).view(x.shape[0], self.kv_heads, self.head_dim)
        return apply_rope(k, cos, sin), v

    def forward(self, x, ctx_k, ctx_v, cos, sin, mask, backend: str) -> torch.Tensor:
        """x (Q, H) block hidden; ctx_k/ctx_v (S, nkv, hd) already projected; cos/sin (Q, hd) block positions."""
        q = self.q_norm(self.q_proj(x).view(x.shape[0], self.heads, self.head_dim))
        q = apply_rope(q, cos, sin)  # (Q, nh, hd)
        blk_k, blk_v = self.project_kv(x, cos, sin)  # (Q, nkv, hd)
        k = torch.cat([ctx_k, blk_k], dim=0)  # (S + Q, nkv, hd): context first, as the mask expects
        v = torch.cat([ctx_v, blk_v], dim=0)
        return self.o_proj(attend(q, k, v, mask, backend))  # (Q, H)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm Qwen3 layer. The context feature only feeds K/V: it never enters the residual stream."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, eps: float):
        super().__init__()
        self.self_attn = DFlashAttention(hidden, heads, kv_heads, head_dim, eps)
        self.mlp = SwiGLU(hidden, intermediate)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(self, x, ctx_k, ctx_v, cos, sin, mask, backend: str) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx_k, ctx_v, cos, sin, mask, backend)
        return x + self.mlp(self.post_attention_layernorm(x))
