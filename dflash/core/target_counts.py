"""Parameter and FLOP counts of a target's text decoder: pure arithmetic on its config (no model is loaded).

Shared by the plan stage (dflash/plan/: memory, decode bytes, training time) and the training pilot
(dflash/train/pilot.py: the FLOPs behind its measured MFU), so both count a step the same way. The target is
a `TargetArch` read from its `config.json` (dflash/core/target_config.py); the drafter's own counts live with
its geometry (dflash/drafter/geometry.py, dflash/drafter/flops.py). Stdlib only.

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
nk/nv linear-attention key/value heads, dk/dv their widths.
"""

from __future__ import annotations

from dflash.core.target_config import ATTENTION_TYPES, TargetArch

GDN_CHUNK = 64  # chunk length of the chunked delta-rule kernels (fla); only shapes the prefill / training FLOPs


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


def prefill_flops(t: TargetArch, tokens: float, layers: int | None = None, with_head: bool = True) -> float:
    """Forward FLOPs of a causal pass over `tokens` tokens through the first `layers` decoder layers."""
    p = target_params(t)
    kinds = t.layer_types[: layers if layers is not None else t.num_layers]
    matmul = sum(layer_params(t, i, active=True)["linear"] for i in range(len(kinds)))
    flops = 2.0 * tokens * matmul
    for kind in kinds:
        if kind in ATTENTION_TYPES:
            # causal: each query sees on average half the (possibly windowed) sequence; QK^T + AV = 4 flops/MAC pair
            flops += 4.0 * tokens * (kept_tokens(t, kind, tokens) / 2.0) * t.num_heads * t.head_dim
        else:
            flops += (
                tokens
                * t.lin_value_heads
                * (6.0 * t.lin_key_dim * t.lin_value_dim + 2.0 * GDN_CHUNK * (t.lin_key_dim + t.lin_value_dim))
            )
    if with_head:
        flops += 2.0 * tokens * (p["lm_head"] or p["embed_tokens"])
    return flops


def kept_tokens(t: TargetArch, kind: str, tokens: float) -> float:
    """Keys a query of a `kind` layer sees at `tokens` context: sliding layers stop at their window."""
    if kind == "sliding_attention" and t.sliding_window:
        return min(tokens, float(t.sliding_window))
    return tokens
