"""Bytes and decode FLOPs of a target for the generation estimate: pure arithmetic on its config.

The parameter and prefill FLOP counts live in dflash/core/target_counts.py (shared with the training pilot);
this module turns them into what a vLLM engine loads and reads per decode step, its KV cache and Gated DeltaNet
state per sequence, and the FLOPs of one decoded token. The plan stage (dflash/plan/generation.py,
dflash/plan/training.py) prices generation and training memory with them. No torch here.

Dimension letters: H hidden, V vocab, nkv KV heads, hd head width, nk/nv linear-attention key/value heads,
dk/dv their widths.
"""

from __future__ import annotations

from dflash.core.errors import UserError
from dflash.core.target_config import ATTENTION_TYPES, TargetArch
from dflash.core.target_counts import kept_tokens, target_params

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1}


def dtype_bytes(name: str, where: str) -> int:
    if name not in DTYPE_BYTES:
        raise UserError(f"{where}: unknown dtype {name!r} (known: {', '.join(sorted(DTYPE_BYTES))})")
    return DTYPE_BYTES[name]


def target_weight_bytes(t: TargetArch, weight_dtype: str) -> dict[str, float]:
    """Bytes the text model occupies. fp8 checkpoints quantize the decoder's matmul weights only;
    embeddings, lm_head and norms stay bf16 (the layout of the official FP8 Qwen checkpoints); fp32 is all fp32."""
    p = target_params(t)
    wb = dtype_bytes(weight_dtype, "plan.weight_dtype")
    rest = 4 if wb == 4 else 2  # fp32 engines keep everything fp32; fp8 / bf16 checkpoints keep the rest bf16
    decoder = p["decoder_linear"] * wb + (p["decoder"] - p["decoder_linear"]) * rest
    embed = p["embed_tokens"] * rest
    head = p["lm_head"] * rest
    return {
        "loaded": decoder + embed + head,
        # a decode step reads every weight once, except the embedding table (only b rows are gathered)
        "read_per_step": decoder + (head if head else embed),
    }


def decode_flops_per_token(t: TargetArch, context: float) -> float:
    """Forward FLOPs of one new token at `context` cached tokens (2 x matmul weights + attention + GDN)."""
    p = target_params(t)
    head = p["lm_head"] or p["embed_tokens"]
    attn_ctx = sum(kept_tokens(t, kind, context) for kind in t.layer_types if kind in ATTENTION_TYPES)
    attn = 4.0 * attn_ctx * t.num_heads * t.head_dim  # QK^T and AV
    gdn = t.n_linear * t.lin_value_heads * 6.0 * t.lin_key_dim * t.lin_value_dim  # state read, decay+update, output
    return 2.0 * (p["decoder_linear_active"] + head) + attn + gdn


def kv_bytes_per_token(t: TargetArch, kv_dtype: str, context: float = 0.0) -> float:
    """Cache bytes one token adds to a sequence (all attention layers; sliding layers stop growing at the window)."""
    per_layer = 2 * t.num_kv_heads * t.head_dim * dtype_bytes(kv_dtype, "plan.generation.kv_cache_dtype")
    full = sum(k == "full_attention" for k in t.layer_types)
    sliding = sum(k == "sliding_attention" for k in t.layer_types)
    if sliding and context and t.sliding_window:
        sliding_share = min(1.0, t.sliding_window / context)
    else:
        sliding_share = 1.0
    return per_layer * (full + sliding * sliding_share)


def linear_state_bytes(t: TargetArch, state_dtype: str, conv_dtype: str = "bf16") -> float:
    """Constant per-sequence state of all Gated DeltaNet layers: recurrent (nv x dk x dv) + conv window."""
    if not t.n_linear:
        return 0.0
    recurrent = t.lin_value_heads * t.lin_key_dim * t.lin_value_dim * dtype_bytes(state_dtype, "ssm_state_dtype")
    conv_dim = 2 * t.lin_key_heads * t.lin_key_dim + t.lin_value_heads * t.lin_value_dim
    conv = (t.lin_conv_kernel - 1) * conv_dim * dtype_bytes(conv_dtype, "conv dtype")
    return t.n_linear * float(recurrent + conv)
