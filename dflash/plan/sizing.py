"""Parameter, byte and FLOP counts of a target: pure arithmetic on its config (no model is loaded).

The plan stage (dflash/plan/estimate.py) prices generation and training with these counts. The target is
a `TargetArch` read from its `config.json` (dflash/core/target_config.py); the drafter's own counts live
with its geometry (dflash/drafter/geometry.py). No torch here.

Supported targets:
- dense Qwen3-style decoders (`Qwen3ForCausalLM`...): every layer full attention (or sliding);
- hybrid Qwen3.5 / 3.6 (`Qwen3_5ForConditionalGeneration`, text fields under `text_config`):
  `layer_types` mixes "linear_attention" (Gated DeltaNet) and "full_attention" (gated: q_proj is
  doubled to carry the output gate). Their MTP layers (`mtp_num_hidden_layers`) and the vision
  tower are counted but NOT loaded for generation or training (vLLM skips `mtp.*` and runs
  `--language-model-only`; online training needs only the text decoder);
- mixture-of-experts MLPs (`num_experts`, the Qwen3-MoE / Qwen3-Next layer rule with `mlp_only_layers` and
  `decoder_sparse_step`): every expert, the shared expert and the router are loaded (memory, bytes read per
  decode step at the batch sizes a generation job runs); FLOPs count the top-k experts a token runs.

Dimension letters: H hidden, F FFN width, V vocab, nq/nkv query/KV heads, hd head width,
nk/nv linear-attention key/value heads, dk/dv their widths, K target feature layers, B block size.
"""

from __future__ import annotations

from dflash.core.errors import UserError
from dflash.core.target_config import ATTENTION_TYPES, TargetArch

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1}
GDN_CHUNK = 64  # chunk length of the chunked delta-rule kernels (fla); only shapes the training FLOPs estimate


def dtype_bytes(name: str, where: str) -> int:
    if name not in DTYPE_BYTES:
        raise UserError(f"{where}: unknown dtype {name!r} (known: {', '.join(sorted(DTYPE_BYTES))})")
    return DTYPE_BYTES[name]


# --------------------------------------------------------------------------------------------
# Target parameter counts
# --------------------------------------------------------------------------------------------


def attention_params(t: TargetArch) -> dict[str, int]:
    """One (gated) full-attention block: projections + per-head q/k norms."""
    q_out = t.num_heads * t.head_dim * (2 if t.attn_output_gate else 1)
    kv_out = t.num_kv_heads * t.head_dim
    proj = t.hidden_size * (q_out + 2 * kv_out) + t.num_heads * t.head_dim * t.hidden_size
    bias = (q_out + 2 * kv_out) if t.attention_bias else 0
    return {"linear": proj, "other": bias + 2 * t.head_dim}


def linear_attention_params(t: TargetArch) -> dict[str, int]:
    """One Gated DeltaNet block: in_proj_qkv / z / b / a, depthwise conv, dt_bias, A_log, gated norm, out_proj."""
    key_dim = t.lin_key_heads * t.lin_key_dim
    value_dim = t.lin_value_heads * t.lin_value_dim
    conv_dim = 2 * key_dim + value_dim
    proj = t.hidden_size * (conv_dim + value_dim + 2 * t.lin_value_heads) + value_dim * t.hidden_size
    other = conv_dim * t.lin_conv_kernel + 2 * t.lin_value_heads + t.lin_value_dim
    return {"linear": proj, "other": other}


def mlp_params(t: TargetArch, layer: int = 0, active: bool = False) -> dict[str, int]:
    """The MLP of decoder layer `layer`: SwiGLU gate / up / down ("linear"), or for a mixture-of-experts layer
    every expert + the shared expert ("linear", or only the top-k experts a token runs with `active`) and the
    router + shared-expert gate ("other": small matmuls kept in bf16 by fp8 checkpoints)."""
    h = t.hidden_size
    if layer not in t.moe_layers:
        return {"linear": 3 * h * t.intermediate_size, "other": 0}
    experts = t.num_experts_per_tok if active else t.num_experts
    shared = 3 * h * t.shared_expert_intermediate_size
    router = h * t.num_experts + (h if t.shared_expert_intermediate_size else 0)
    return {"linear": experts * 3 * h * t.moe_intermediate_size + shared, "other": router}


def vision_params(vision: dict) -> int:
    """Approximate ViT tower + patch merger size (reported only; never loaded by this pipeline)."""
    if not vision:
        return 0
    h = int(vision.get("hidden_size", 0))
    f = int(vision.get("intermediate_size", 0))
    depth = int(vision.get("depth", 0))
    merge = int(vision.get("spatial_merge_size", 2))
    patch = int(vision.get("patch_size", 14))
    out = int(vision.get("out_hidden_size", h))
    patch_in = int(vision.get("in_channels", 3)) * int(vision.get("temporal_patch_size", 2)) * patch * patch
    block = 4 * h * h + 2 * h * f + 4 * h  # qkv + proj, MLP, norms (biases ignored)
    merged = h * merge * merge
    return depth * block + patch_in * h + merged * merged + merged * out


def layer_params(t: TargetArch, layer: int, active: bool = False) -> dict[str, int]:
    """Decoder layer `layer`: its mixer (full attention or Gated DeltaNet) + its MLP + 2 norms. `active`: only
    what one token runs (a mixture-of-experts layer's top-k experts; the same as all for dense layers)."""
    mixer = attention_params(t) if t.layer_types[layer] in ATTENTION_TYPES else linear_attention_params(t)
    mlp = mlp_params(t, layer, active)
    linear = mixer["linear"] + mlp["linear"]
    return {"linear": linear, "total": linear + mixer["other"] + mlp["other"] + 2 * t.hidden_size}


def target_params(t: TargetArch) -> dict[str, int]:
    """Counts of the target's parts. `decoder` = everything the text model loads except embed/lm_head;
    `decoder_linear_active` = the matmul weights one token runs through (< decoder_linear for MoE targets)."""
    layers = [layer_params(t, i) for i in range(t.num_layers)]
    decoder = sum(x["total"] for x in layers) + t.hidden_size  # + final norm
    attn = attention_params(t)  # an MTP layer: full attention + a dense SwiGLU MLP + 2 norms
    per_attn = attn["linear"] + attn["other"] + 3 * t.hidden_size * t.intermediate_size + 2 * t.hidden_size
    embed = t.vocab_size * t.hidden_size
    lm_head = 0 if t.tie_word_embeddings else embed
    # MTP module: fc over [embedding ; hidden] (2H -> H), one full-attention decoder layer per MTP layer, norms.
    mtp = (2 * t.hidden_size * t.hidden_size + 3 * t.hidden_size + t.mtp_layers * per_attn) if t.mtp_layers else 0
    return {
        "decoder": decoder,
        "decoder_linear": sum(x["linear"] for x in layers),  # the matmul weights (what fp8 checkpoints quantize)
        "decoder_linear_active": sum(layer_params(t, i, active=True)["linear"] for i in range(t.num_layers)),
        "embed_tokens": embed,
        "lm_head": lm_head,
        "text_total": decoder + embed + lm_head,
        "mtp_skipped": mtp,
        "vision_skipped": vision_params(t.vision),
    }


def target_weight_bytes(t: TargetArch, weight_dtype: str) -> dict[str, float]:
    """Bytes the text model occupies. fp8 checkpoints quantize the decoder's matmul weights only;
    embeddings, lm_head and norms stay bf16 (the layout of the official FP8 Qwen checkpoints)."""
    p = target_params(t)
    wb = dtype_bytes(weight_dtype, "plan.weight_dtype")
    decoder = p["decoder_linear"] * wb + (p["decoder"] - p["decoder_linear"]) * 2
    embed = p["embed_tokens"] * 2
    head = p["lm_head"] * 2
    return {
        "loaded": decoder + embed + head,
        # a decode step reads every weight once, except the embedding table (only b rows are gathered)
        "read_per_step": decoder + (head if head else embed),
    }


def decode_flops_per_token(t: TargetArch, context: float) -> float:
    """Forward FLOPs of one new token at `context` cached tokens (2 x matmul weights + attention + GDN)."""
    p = target_params(t)
    head = p["lm_head"] or p["embed_tokens"]
    attn_ctx = sum(_kept(t, kind, context) for kind in t.layer_types if kind in ATTENTION_TYPES)
    attn = 4.0 * attn_ctx * t.num_heads * t.head_dim  # QK^T and AV
    gdn = t.n_linear * t.lin_value_heads * 6.0 * t.lin_key_dim * t.lin_value_dim  # state read, decay+update, output
    return 2.0 * (p["decoder_linear_active"] + head) + attn + gdn


def prefill_flops(t: TargetArch, tokens: float, layers: int | None = None, with_head: bool = True) -> float:
    """Forward FLOPs of a causal pass over `tokens` tokens through the first `layers` decoder layers."""
    p = target_params(t)
    kinds = t.layer_types[: layers if layers is not None else t.num_layers]
    matmul = sum(layer_params(t, i, active=True)["linear"] for i in range(len(kinds)))
    flops = 2.0 * tokens * matmul
    for kind in kinds:
        if kind in ATTENTION_TYPES:
            # causal: each query sees on average half the (possibly windowed) sequence; QK^T + AV = 4 flops/MAC pair
            flops += 4.0 * tokens * (_kept(t, kind, tokens) / 2.0) * t.num_heads * t.head_dim
        else:
            flops += (
                tokens
                * t.lin_value_heads
                * (6.0 * t.lin_key_dim * t.lin_value_dim + 2.0 * GDN_CHUNK * (t.lin_key_dim + t.lin_value_dim))
            )
    if with_head:
        flops += 2.0 * tokens * (p["lm_head"] or p["embed_tokens"])
    return flops


def _kept(t: TargetArch, kind: str, tokens: float) -> float:
    if kind == "sliding_attention" and t.sliding_window:
        return min(tokens, float(t.sliding_window))
    return tokens


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
