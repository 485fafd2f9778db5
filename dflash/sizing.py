"""Parameter, byte and FLOP counts of the target and the drafter: pure arithmetic on configs.

The plan stage (dflash/plan.py) prices generation and training with these counts. Nothing here
loads a model: the target is described by its `config.json` (a dict), the drafter by the
`drafter` params plus the target's hidden size and vocabulary. No torch import (DESIGN.md section 9).

Supported targets:
- dense Qwen3-style decoders (`Qwen3ForCausalLM`...): every layer full attention (or sliding);
- hybrid Qwen3.5 / 3.6 (`Qwen3_5ForConditionalGeneration`, text fields under `text_config`):
  `layer_types` mixes "linear_attention" (Gated DeltaNet) and "full_attention" (gated: q_proj is
  doubled to carry the output gate). Their MTP layers (`mtp_num_hidden_layers`) and the vision
  tower are counted but NOT loaded for generation or training (vLLM skips `mtp.*` and runs
  `--language-model-only`; online training needs only the text decoder).

Dimension letters: H hidden, F FFN width, V vocab, nq/nkv query/KV heads, hd head width,
nk/nv linear-attention key/value heads, dk/dv their widths, K target feature layers, B block size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1}
ATTENTION_TYPES = ("full_attention", "sliding_attention")
LINEAR_TYPES = ("linear_attention",)
GDN_CHUNK = 64  # chunk length of the chunked delta-rule kernels (fla); only shapes the training FLOPs estimate
HYBRID_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text")


def dtype_bytes(name: str, where: str) -> int:
    if name not in DTYPE_BYTES:
        raise ValueError(f"{where}: unknown dtype {name!r} (known: {', '.join(sorted(DTYPE_BYTES))})")
    return DTYPE_BYTES[name]


@dataclass(frozen=True)
class TargetArch:
    """The text decoder of a target, as read from its config.json."""

    architecture: str
    model_type: str
    hidden_size: int
    vocab_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]  # one per decoder layer
    num_heads: int
    num_kv_heads: int
    head_dim: int
    attn_output_gate: bool  # q_proj also produces a per-channel output gate (Qwen3-Next / 3.5 / 3.6)
    attention_bias: bool
    sliding_window: int  # tokens kept by sliding_attention layers (0 = none)
    lin_key_heads: int
    lin_value_heads: int
    lin_key_dim: int
    lin_value_dim: int
    lin_conv_kernel: int
    tie_word_embeddings: bool
    mtp_layers: int
    ssm_dtype: str  # the config's recurrent-state dtype (mamba_ssm_dtype), "" when absent
    vision: dict  # vision_config ({} when none)

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def n_attention(self) -> int:
        return sum(t in ATTENTION_TYPES for t in self.layer_types)

    @property
    def n_linear(self) -> int:
        return sum(t in LINEAR_TYPES for t in self.layer_types)


def _need(cfg: dict, key: str, source: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ValueError(f"{source}: missing key {key!r} in the target config")
    return cfg[key]


def target_signature(config_path: str | Path) -> str:
    """A short name for the target a measurement was taken on (architecture, layers, hidden, vocab), written
    into pilot / tokenize metrics so that the plan never calibrates one model with another's numbers."""
    path = Path(config_path)
    if not path.exists():
        return ""
    t = parse_target_config(json.loads(path.read_text(encoding="utf-8")), str(path))
    return f"{t.architecture}/layers={t.num_layers}/hidden={t.hidden_size}/vocab={t.vocab_size}"


def parse_target_config(raw: dict, source: str) -> TargetArch:
    """Read a HF config.json dict (dense Qwen3 or hybrid Qwen3.5/3.6) into a TargetArch."""
    text = raw.get("text_config") or raw  # multimodal wrappers keep the decoder under text_config
    if "num_experts" in text and text.get("num_experts"):
        raise ValueError(f"{source}: num_experts: mixture-of-experts targets are not supported by the planner")
    model_type = str(text.get("model_type") or raw.get("model_type") or "")
    hidden = int(_need(text, "hidden_size", source))
    n_layers = int(_need(text, "num_hidden_layers", source))
    heads = int(_need(text, "num_attention_heads", source))
    layer_types = text.get("layer_types")
    if layer_types is None:
        if "full_attention_interval" in text or model_type in HYBRID_MODEL_TYPES:
            every = int(text.get("full_attention_interval", 4))
            layer_types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n_layers)]
        else:
            layer_types = ["full_attention"] * n_layers
    if len(layer_types) != n_layers:
        raise ValueError(f"{source}: layer_types has {len(layer_types)} entries, num_hidden_layers is {n_layers}")
    for i, kind in enumerate(layer_types):
        if kind not in ATTENTION_TYPES + LINEAR_TYPES:
            raise ValueError(f"{source}: layer_types[{i}]: unknown layer type {kind!r}")
    hybrid = any(t in LINEAR_TYPES for t in layer_types)
    lin = {k: int(_need(text, k, source)) if hybrid else int(text.get(k, 0) or 0) for k in _LINEAR_KEYS}
    return TargetArch(
        architecture=str((raw.get("architectures") or text.get("architectures") or ["?"])[0]),
        model_type=model_type,
        hidden_size=hidden,
        vocab_size=int(_need(text, "vocab_size", source)),
        intermediate_size=int(_need(text, "intermediate_size", source)),
        layer_types=tuple(layer_types),
        num_heads=heads,
        num_kv_heads=int(text.get("num_key_value_heads") or heads),
        head_dim=int(text.get("head_dim") or hidden // heads),
        attn_output_gate=bool(text.get("attn_output_gate", model_type in HYBRID_MODEL_TYPES)),
        attention_bias=bool(text.get("attention_bias", False)),
        sliding_window=int(text.get("sliding_window") or 0),
        lin_key_heads=lin["linear_num_key_heads"],
        lin_value_heads=lin["linear_num_value_heads"],
        lin_key_dim=lin["linear_key_head_dim"],
        lin_value_dim=lin["linear_value_head_dim"],
        lin_conv_kernel=lin["linear_conv_kernel_dim"],
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        mtp_layers=int(text.get("mtp_num_hidden_layers", raw.get("mtp_num_hidden_layers", 0)) or 0),
        ssm_dtype=str(text.get("mamba_ssm_dtype") or ""),
        vision=dict(raw.get("vision_config") or {}),
    )


_LINEAR_KEYS = (
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)


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


def mlp_params(t: TargetArch) -> int:
    return 3 * t.hidden_size * t.intermediate_size  # SwiGLU gate / up / down


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


def target_params(t: TargetArch) -> dict[str, int]:
    """Counts of the target's parts. `decoder` = everything the text model loads except embed/lm_head."""
    attn = attention_params(t)
    lin = linear_attention_params(t)
    per_attn = attn["linear"] + attn["other"] + mlp_params(t) + 2 * t.hidden_size
    per_lin = lin["linear"] + lin["other"] + mlp_params(t) + 2 * t.hidden_size
    decoder = t.n_attention * per_attn + t.n_linear * per_lin + t.hidden_size  # + final norm
    embed = t.vocab_size * t.hidden_size
    lm_head = 0 if t.tie_word_embeddings else embed
    # MTP module: fc over [embedding ; hidden] (2H -> H), one full-attention decoder layer per MTP layer, norms.
    mtp = (2 * t.hidden_size * t.hidden_size + 3 * t.hidden_size + t.mtp_layers * per_attn) if t.mtp_layers else 0
    decoder_linear = t.n_attention * (attn["linear"] + mlp_params(t)) + t.n_linear * (lin["linear"] + mlp_params(t))
    return {
        "decoder": decoder,
        "decoder_linear": decoder_linear,  # the matmul weights (what fp8 checkpoints quantize)
        "embed_tokens": embed,
        "lm_head": lm_head,
        "text_total": decoder + embed + lm_head,
        "per_attention_layer": per_attn,
        "per_linear_layer": per_lin,
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
    return 2.0 * (p["decoder_linear"] + head) + attn + gdn


def prefill_flops(t: TargetArch, tokens: float, layers: int | None = None, with_head: bool = True) -> float:
    """Forward FLOPs of a causal pass over `tokens` tokens through the first `layers` decoder layers."""
    p = target_params(t)
    kinds = t.layer_types[: layers if layers is not None else t.num_layers]
    attn = attention_params(t)["linear"] + mlp_params(t)
    lin = linear_attention_params(t)["linear"] + mlp_params(t)
    matmul = sum(attn if k in ATTENTION_TYPES else lin for k in kinds)
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


# --------------------------------------------------------------------------------------------
# Drafter
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DrafterArch:
    hidden_size: int
    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    sliding_window: int
    block_size: int
    num_features: int  # K target layers concatenated into fc
    last_feature_layer: int  # highest target layer id read (the target forward can stop after it)


def drafter_arch(dp: Any, target: TargetArch) -> DrafterArch:
    """DrafterArch from the `drafter` params section + the target's hidden size and vocabulary."""
    ids = list(dp.target_layer_ids)
    k = len(ids) if ids else dp.num_target_features
    if k <= 0:
        raise ValueError("drafter.num_target_features: must be > 0 when drafter.target_layer_ids is []")
    last = max(ids) if ids else target.num_layers - 3  # the default rule ends at layer n-3
    if last >= target.num_layers or (ids and min(ids) < 0):
        raise ValueError(f"drafter.target_layer_ids: {ids} out of range for a {target.num_layers}-layer target")
    types = tuple(dp.layer_types) or ("full_attention",) * dp.num_hidden_layers
    if len(types) != dp.num_hidden_layers:
        raise ValueError(
            f"drafter.layer_types: {len(types)} entries for drafter.num_hidden_layers={dp.num_hidden_layers}"
        )
    return DrafterArch(
        hidden_size=target.hidden_size,
        vocab_size=target.vocab_size,
        num_layers=dp.num_hidden_layers,
        num_heads=dp.num_attention_heads,
        num_kv_heads=dp.num_key_value_heads,
        head_dim=dp.head_dim,
        intermediate_size=dp.intermediate_size,
        layer_types=types,
        sliding_window=dp.sliding_window,
        block_size=dp.block_size,
        num_features=k,
        last_feature_layer=last,
    )


def drafter_params(d: DrafterArch) -> dict[str, int]:
    """Trainable parameters: per layer q/k/v/o + q_norm/k_norm + SwiGLU + 2 norms; fc (K*H -> H); hidden_norm; norm.
    No embedding and no lm_head: the drafter borrows the target's (frozen)."""
    h = d.hidden_size
    q = d.num_heads * d.head_dim
    kv = d.num_kv_heads * d.head_dim
    attn_q_o = 2 * h * q
    attn_kv = 2 * h * kv
    mlp = 3 * h * d.intermediate_size
    small = 2 * d.head_dim + 2 * h  # q_norm, k_norm, input / post-attention norms
    per_layer = attn_q_o + attn_kv + mlp + small
    fc = d.num_features * h * h
    total = d.num_layers * per_layer + fc + 2 * h
    return {
        "per_layer": per_layer,
        "layers": d.num_layers * per_layer,
        "attn_q_o": d.num_layers * attn_q_o,  # applied to block tokens only
        "attn_kv": d.num_layers * attn_kv,  # applied to context features AND block tokens (KV injection)
        "mlp": d.num_layers * mlp,
        "fc": fc,
        "norms": d.num_layers * small + 2 * h,
        "total": total,
    }
