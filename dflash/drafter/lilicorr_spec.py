"""LiLiCorr's torch-free rules: its geometry checks, parameter and FLOP counts, and its export format (the
config.json keys and tensor names vLLM's `LiLiCorrForCausalLM` loads). The module and the walk live in
dflash/drafter/lilicorr.py; geometry.py and export.py call the functions here for drafter.kind lilicorr.

Export (vLLM 0.31-0.33, model_executor/models/lilicorr.py): architectures ["LiLiCorrDraftModel"], served with
method "dflash"; dflash_config holds the DFlash keys plus lilicorr_enabled, lilicorr_candidate_topk,
lilicorr_hidden_size (0 = the target's), lilicorr_num_layers, lilicorr_num_heads, lilicorr_mlp_ratio,
lilicorr_factor_dim, lilicorr_logit_scale, lilicorr_vector_eps and conv_kernel_size / conv_group_size (0 / 0: a
plain DFlash body; else DFlash2's grouped convs in every layer). Tensors: the DFlash body (+ the convs) and
`lilicorr.*` (weight_names below).

Imports: dflash.core only (geometry imports this module; `cfg` below is its DrafterConfig).
"""

from __future__ import annotations

from typing import Any

from dflash.core.params import LiLiCorrParams

DrafterConfig = Any  # dflash.drafter.geometry.DrafterConfig (not imported: geometry imports this module)

LILICORR = "lilicorr"
ARCHITECTURE = "LiLiCorrDraftModel"
NUM_FEATURES = 5  # per candidate: log p, p, log p - max log p, rank / (K - 1), is-top-1
MAX_TOP_K = 16  # vLLM refuses a larger candidate_topk (and any that is not a power of two)
# our params field -> its dflash_config key
JSON_KEYS = {
    "candidate_top_k": "lilicorr_candidate_topk",
    "hidden_size": "lilicorr_hidden_size",
    "num_layers": "lilicorr_num_layers",
    "num_heads": "lilicorr_num_heads",
    "mlp_ratio": "lilicorr_mlp_ratio",
    "factor_dim": "lilicorr_factor_dim",
    "logit_scale": "lilicorr_logit_scale",
    "vector_eps": "lilicorr_vector_eps",
}
CONV_KEYS = ("conv_kernel_size", "conv_group_size")


def width(cfg: DrafterConfig) -> int:
    """The correlator's hidden width: lilicorr.hidden_size, 0 meaning the target's."""
    return cfg.lilicorr.hidden_size or cfg.hidden_size


def mlp_width(cfg: DrafterConfig) -> int:
    return int(width(cfg) * cfg.lilicorr.mlp_ratio)  # vLLM truncates the same way


def check(cfg: DrafterConfig, fail: Any) -> None:
    """fail(field, message) for anything vLLM's LiLiCorr would refuse or that cannot be trained."""
    p = cfg.lilicorr
    if p is None:
        fail("lilicorr", "missing: drafter.kind lilicorr needs its section")
    k = p.candidate_top_k
    if not 1 <= k <= MAX_TOP_K or k & (k - 1):
        fail("lilicorr.candidate_top_k", f"must be a power of two <= {MAX_TOP_K} (vLLM's rule), got {k}")
    if k > cfg.vocab_size:
        fail("lilicorr.candidate_top_k", f"{k} exceeds the {cfg.vocab_size} vocabulary rows")
    if p.hidden_size < 0:
        fail("lilicorr.hidden_size", f"must be >= 0 (0 = the target's), got {p.hidden_size}")
    if p.num_layers < 0:
        fail("lilicorr.num_layers", f"must be >= 0, got {p.num_layers}")
    if p.num_heads < 1 or width(cfg) % p.num_heads:
        fail("lilicorr.num_heads", f"{p.num_heads} does not divide the correlator width {width(cfg)}")
    if mlp_width(cfg) < 1:
        fail("lilicorr.mlp_ratio", f"{p.mlp_ratio} gives an MLP of width {mlp_width(cfg)}")
    if p.factor_dim < 1:
        fail("lilicorr.factor_dim", f"must be >= 1, got {p.factor_dim}")
    if p.logit_scale <= 0 or p.vector_eps <= 0:
        fail("lilicorr.logit_scale" if p.logit_scale <= 0 else "lilicorr.vector_eps", "must be > 0")
    taps, group = cfg.conv_kernel_size, cfg.conv_group_size
    if taps < 0 or group < 0 or bool(taps) != bool(group):
        fail("lilicorr.conv_kernel_size", f"{taps} taps with group size {group}: both 0 (no convs) or both >= 1")
    if taps > cfg.block_size:
        fail("lilicorr.conv_kernel_size", f"{taps} taps reach past a block of {cfg.block_size} slots")
    if group and cfg.hidden_size % group:
        fail("lilicorr.conv_group_size", f"{group} does not divide the hidden size {cfg.hidden_size}")


def config_fields(p: LiLiCorrParams) -> dict[str, Any]:
    """DrafterConfig fields of drafter.kind lilicorr from its params section."""
    return {"lilicorr": p, "conv_kernel_size": p.conv_kernel_size, "conv_group_size": p.conv_group_size}


def export_config(cfg: DrafterConfig) -> dict[str, Any]:
    """The dflash_config keys the export adds (module docstring)."""
    out: dict[str, Any] = {"lilicorr_enabled": True, "block_size": cfg.block_size}
    out.update({key: getattr(cfg.lilicorr, field) for field, key in JSON_KEYS.items()})
    out.update({key: getattr(cfg, key) for key in CONV_KEYS})
    return out


def read_export_config(dflash: dict, need: Any) -> dict[str, Any]:
    """The DrafterConfig fields from an export's dflash_config (need(key, value) refuses a missing key)."""
    if dflash.get("lilicorr_enabled", True) is not True:
        raise ValueError("dflash_config.lilicorr_enabled: only true is served")
    raw = {field: need(f"dflash_config.{key}", dflash.get(key)) for field, key in JSON_KEYS.items()}
    convs = {key: int(dflash.get(key, 0)) for key in CONV_KEYS}
    ints = ("candidate_top_k", "hidden_size", "num_layers", "num_heads", "factor_dim")
    typed = {f: int(v) if f in ints else float(v) for f, v in raw.items()}
    return config_fields(LiLiCorrParams(**typed, **convs))


def validation_keys() -> dict[str, str]:
    """Our field names -> the export's keys, for errors about an exported config.json."""
    out = {f"lilicorr.{field}": f"dflash_config.{key}" for field, key in JSON_KEYS.items()}
    return out | {f"lilicorr.{key}": f"dflash_config.{key}" for key in CONV_KEYS}


def weight_names(cfg: DrafterConfig) -> list[str]:
    """The correlator's tensors in vLLM's spelling (`lilicorr.` + the LiLiCorrHead parameter names)."""
    linears = ["pass_hidden_proj", "context_proj", "factor_input_proj", "out_head", "in_head", "anchor_out_head"]
    linears += ["feature_mlp.up_proj", "feature_mlp.down_proj"]
    if width(cfg) != cfg.hidden_size:
        linears.append("token_proj")
    names = [f"{m}.{t}" for m in linears for t in ("weight", "bias")]
    names += ["feature_norm.weight", "feature_norm.bias", "output_norm.weight", "anchor_norm.weight"]
    names += ["slot_embedding", "rank_embedding", "relative_slot_bias", "same_slot_bias"]
    for i in range(cfg.lilicorr.num_layers):
        p = f"layers.{i}."
        names += [f"{p}attn_norm.weight", f"{p}mlp_norm.weight", f"{p}attn.in_proj_weight", f"{p}attn.in_proj_bias"]
        names += [f"{p}{m}.{t}" for m in ("attn.out_proj", "mlp.up_proj", "mlp.down_proj") for t in ("weight", "bias")]
    return [f"lilicorr.{n}" for n in names]


def tensor_names(cfg: DrafterConfig) -> list[str]:
    """Every tensor it adds to the DFlash body: the optional grouped convs of each layer (DFlash2's names), then the
    correlator's (weight_names)."""
    convs = [f"{c}_conv.{n}" for c in ("attention", "mlp") for n in ("base_kernel", "kernel_projection.weight")]
    per_layer = [f"layers.{i}.{n}" for i in range(cfg.num_hidden_layers) for n in convs] if cfg.conv_kernel_size else []
    return per_layer + weight_names(cfg)


def parts(d: DrafterConfig) -> dict[str, int]:
    """Parameters of the correlator and the optional body convs, by part (geometry.kind_cost's `parts`)."""
    h, w, k, f, n = d.hidden_size, width(d), d.lilicorr.candidate_top_k, d.lilicorr.factor_dim, d.block_size - 1
    m = mlp_width(d)
    layer = 2 * w + (3 * w * w + 3 * w) + (w * w + w) + (w * m + m) + (m * w + w)
    parts = {
        "projections": (h * w + w) * (3 if w != h else 2) + (NUM_FEATURES * w + w) + (w * w + w) + 2 * NUM_FEATURES,
        "embeddings": n * w + k * w + d.lilicorr.num_heads * (2 * d.block_size - 1) + d.lilicorr.num_heads,
        "layers": d.lilicorr.num_layers * layer,
        "factors": (3 * w * w + w) + 3 * (w * f + f) + 2 * w,
    }
    parts["convs"] = 0
    if d.conv_kernel_size:
        taps, groups = d.conv_kernel_size, h // d.conv_group_size
        parts["convs"] = d.num_hidden_layers * 2 * (2 * taps * h + 2 * taps * groups * h)
    return parts


def flops_per_slot(d: DrafterConfig) -> float:
    """Forward FLOPs per query slot (2 per multiply-add): the body convs, and per drafted slot K lattice
    candidates, each costing the token / feature projections, every layer's QKV, output and MLP (attention over
    the (B-1) K lattice), the factor projection and its two heads."""
    h, w, k, f, n = d.hidden_size, width(d), d.lilicorr.candidate_top_k, d.lilicorr.factor_dim, d.block_size - 1
    m = mlp_width(d)
    conv_flops = 0.0
    if d.conv_kernel_size:
        taps, groups = d.conv_kernel_size, h // d.conv_group_size
        conv_flops = d.num_hidden_layers * 2 * (2.0 * h * 2 * taps * groups + 2 * 2.0 * taps * h)
    per_candidate = 2.0 * (
        (h * w if w != h else 0)
        + NUM_FEATURES * w
        + w * w
        + d.lilicorr.num_layers * (4 * w * w + 2 * w * m + 2 * n * k * w)
        + 3 * w * w
        + 2 * w * f
        + n * f
    )
    return conv_flops + k * per_candidate + 2.0 * h * w


__all__ = [
    "ARCHITECTURE",
    "LILICORR",
    "check",
    "config_fields",
    "flops_per_slot",
    "export_config",
    "parts",
    "read_export_config",
    "validation_keys",
    "weight_names",
    "width",
]
