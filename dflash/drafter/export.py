"""Save / load a drafter in the z-lab native format that vLLM and SGLang serve (docs/design/checkpoint-serving.md).

Folder layout:
  config.json        the drafter's Qwen3 config fields + architectures ["DFlashDraftModel"], model_type
                     "qwen3", block_size, num_target_layers, layer_types, sliding_window,
                     use_sliding_window, dflash_config {mask_token_id, target_layer_ids}
  model.safetensors  the body only: layers.{i}.self_attn.{q,k,v,o}_proj / {q,k}_norm, layers.{i}.mlp.
                     {gate,up,down}_proj, layers.{i}.{input,post_attention}_layernorm, fc ([H, K*H]),
                     hidden_norm, norm. No embed_tokens and no lm_head: engines share the target's.

target_layer_ids are in the z-lab convention (output of decoder layer L = HF hidden_states[L + 1]);
vLLM adds 1 itself. Serve: speculative_config={"method": "dflash", "model": DIR,
"num_speculative_tokens": block_size - 1}. vLLM treats sliding_attention layers as causal inside the
block and full_attention layers as bidirectional, which is what we train; mixed layer types need
VLLM_USE_V2_MODEL_RUNNER=1 there.

The successor kinds (docs/design/successors.md "Export") keep that body and add their own tensors:
  dflash2  architectures ["DFlash2DraftModel"] (served as method "dflash"); dflash_config adds conv_kernel_size,
           conv_group_size, selector_rank, selector_top_k; tensors layers.{i}.{attention,mlp}_conv.{base_kernel,
           kernel_projection.weight}, candidate_selector.{predecessor,successor}_codebook, .hidden_projection.weight
  dspark   architectures ["Qwen3DSparkModel"] (method "dspark"); vLLM reads its keys at the top level: block_size
           (its slots: our block_size - 1), mask_token_id, target_layer_ids, markov_rank, enable_confidence_head,
           confidence_head_with_markov (always written: vLLM's default differs from the trainers'),
           sample_from_anchor; tensors markov_head.markov_w{1,2}.weight, confidence_head.proj.{weight,bias}
  lilicorr architectures ["LiLiCorrDraftModel"] (method "dflash"); dflash_config adds the lilicorr_* keys and
           conv_kernel_size / conv_group_size; tensors lilicorr.* (+ the convs): dflash/drafter/lilicorr_spec.py
Serve every kind with num_speculative_tokens = block_size - 1 (speculative_config()).

A pruned draft vocabulary (drafter.draft_vocab_size D > 0, dflash/drafter/vocab.py) adds `draft_vocab_size` to
config.json and three tensors: lm_head.weight (D, H: the target's rows of the vocabulary's tokens), d2t (D,) int64
and t2d (V,) bool. vLLM then builds a D-row lm_head of its own, loads d2t as draft_id_to_target_id, skips t2d,
and scatters the D logits back to the target vocabulary (-inf elsewhere).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dflash.core.errors import UserError
from dflash.core.io import atomic_path, read_json, write_json
from dflash.drafter.build import build_drafter
from dflash.drafter.draft_head import DraftHead
from dflash.drafter.geometry import FULL, SLIDING, DrafterConfig, validate_config
from dflash.drafter.kinds import KINDS, spec_for
from dflash.drafter.model import DFlashDrafter

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
ARCHITECTURES = {name: spec.architecture for name, spec in KINDS.items()}
VOCAB_KEYS = ("lm_head.weight", "d2t", "t2d")  # the pruned vocabulary's tensors (not the drafter module's)


def body_keys(config: DrafterConfig) -> list[str]:
    """Every tensor name the checkpoint holds, in the spelling of docs/design/checkpoint-serving.md (and, for the
    successor kinds, of vLLM's qwen3_dspark.py / qwen3_dflash2.py)."""
    keys, spec = [], spec_for(config.kind)
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        keys += [f"{p}self_attn.{n}_proj.weight" for n in ("q", "k", "v", "o")]
        keys += [f"{p}self_attn.{n}_norm.weight" for n in ("q", "k")]
        keys += [f"{p}mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
        keys += [f"{p}{n}_layernorm.weight" for n in ("input", "post_attention")]
        keys += [f"{p}{n}" for n in spec.layer_weights]
    keys += ["fc.weight", "hidden_norm.weight", "norm.weight"]
    return keys + spec.weights(config)


def hf_config(config: DrafterConfig, dtype: torch.dtype) -> dict[str, Any]:
    """config.json contents."""
    out = {
        "architectures": [spec_for(config.kind).architecture],
        "model_type": "qwen3",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "layer_types": list(config.layer_types),
        "sliding_window": config.sliding_window,
        # transformers drops sliding_window (-> None) unless this is true, and vLLM then refuses sliding layers.
        "use_sliding_window": SLIDING in config.layer_types,
        "block_size": config.block_size,
        "num_target_layers": config.num_target_layers,
        "dflash_config": {"mask_token_id": config.mask_token_id, "target_layer_ids": list(config.target_layer_ids)},
    }
    if config.draft_vocab_size:
        out["draft_vocab_size"] = config.draft_vocab_size
    spec_for(config.kind).write_config(config, out)
    return out


def save_drafter(
    model: DFlashDrafter, config: DrafterConfig, out_dir: str | Path, head: DraftHead | None = None
) -> Path:
    """Write config.json + model.safetensors (body only, plus the pruned vocabulary's lm_head / d2t / t2d when
    config.draft_vocab_size is set: `head` required then) into out_dir; return the folder."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    assert sorted(state) == sorted(body_keys(config)), "drafter state_dict drifted from the exported key set"
    if bool(config.draft_vocab_size) != (head is not None):
        raise ValueError(f"draft_vocab_size {config.draft_vocab_size}: a DraftHead is needed exactly when it is > 0")
    if head is not None:
        if tuple(head.weight.shape) != (config.draft_vocab_size, config.hidden_size):
            raise ValueError(
                f"draft head {tuple(head.weight.shape)} != ({config.draft_vocab_size}, {config.hidden_size})"
            )
        state.update(
            {k: v.to(model.fc.weight.dtype) if v.is_floating_point() else v for k, v in head.tensors().items()}
        )
    with atomic_path(out / WEIGHTS) as tmp:
        save_file(state, str(tmp), metadata={"format": "pt"})
    write_json(out / CONFIG, hf_config(config, model.fc.weight.dtype))
    return out


def read_config(folder: str | Path) -> DrafterConfig:
    """Parse an exported config.json (also z-lab's own checkpoints) into a DrafterConfig, unvalidated."""
    path = Path(folder) / CONFIG
    raw = read_json(path)
    kinds = [k for k, arch in ARCHITECTURES.items() if arch in (raw.get("architectures") or [])]
    if len(kinds) != 1:
        names = ", ".join(repr(a) for a in ARCHITECTURES.values())
        raise UserError(f"{path}: architectures {raw.get('architectures')} is not one of [{names}]")
    kind = kinds[0]
    spec = spec_for(kind)
    block = spec.read_block(raw, path)

    def need(key: str, value: Any) -> Any:
        if value is None:
            raise UserError(f"{path}: {key}: missing key")
        return value

    n_layers = int(need("num_hidden_layers", raw.get("num_hidden_layers")))
    layer_types = tuple(raw.get("layer_types") or (FULL,) * n_layers)
    window = raw.get("sliding_window")
    if window is None:  # irrelevant without sliding layers; validation refuses it otherwise
        window = need("sliding_window", None) if SLIDING in layer_types else raw.get("max_position_embeddings", 1)
    rope_theta = raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta"))
    return DrafterConfig(
        hidden_size=int(need("hidden_size", raw.get("hidden_size"))),
        vocab_size=int(need("vocab_size", raw.get("vocab_size"))),
        num_hidden_layers=n_layers,
        num_attention_heads=int(need("num_attention_heads", raw.get("num_attention_heads"))),
        num_key_value_heads=int(need("num_key_value_heads", raw.get("num_key_value_heads"))),
        head_dim=int(need("head_dim", raw.get("head_dim"))),
        intermediate_size=int(need("intermediate_size", raw.get("intermediate_size"))),
        layer_types=layer_types,
        sliding_window=int(window),
        rope_theta=float(need("rope_theta", rope_theta)),
        rms_norm_eps=float(need("rms_norm_eps", raw.get("rms_norm_eps"))),
        max_position_embeddings=int(need("max_position_embeddings", raw.get("max_position_embeddings"))),
        block_size=int(need("block_size", block["block_size"])),
        mask_token_id=int(need(spec.config_keys["mask_token_id"], block["mask_token_id"])),
        target_layer_ids=tuple(need(spec.config_keys["target_layer_ids"], block["target_layer_ids"])),
        num_target_layers=int(need("num_target_layers", raw.get("num_target_layers"))),
        kind=kind,
        draft_vocab_size=_draft_vocab_size(raw),
        **spec.read_fields(raw, need, path),
    )


def _draft_vocab_size(raw: dict) -> int:
    """config.json's draft_vocab_size; absent or the whole vocabulary = 0 (as vLLM reads it)."""
    size = raw.get("draft_vocab_size")
    return 0 if size is None or int(size) == int(raw.get("vocab_size", -1)) else int(size)


def load_drafter(
    folder: str | Path,
    target_config: Any = None,
    tokenizer: Any = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
) -> tuple[DFlashDrafter, DrafterConfig]:
    """Load an exported drafter. With target_config, refuse a drafter built for another target (hidden
    size, vocab, layer count); with tokenizer, refuse a mask token the data uses. dtype defaults to the file's."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config = read_config(folder)
    keys = spec_for(config.kind).config_keys
    validate_config(config, target_config, tokenizer, prefix=f"{folder / CONFIG}: ", keys=keys)
    state = load_file(str(folder / WEIGHTS), device=str(device))
    vocab = {k: state.pop(k) for k in VOCAB_KEYS if k in state}
    if config.draft_vocab_size and sorted(vocab) != sorted(VOCAB_KEYS):
        missing = sorted(set(VOCAB_KEYS) - set(vocab))
        raise UserError(f"{folder / WEIGHTS}: draft_vocab_size {config.draft_vocab_size} without tensors {missing}")
    expected = set(body_keys(config))
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise UserError(f"{folder / WEIGHTS}: missing tensors {missing[:5]}, unexpected tensors {unexpected[:5]}")
    model = build_drafter(config, device="meta")
    for name, p in model.state_dict().items():
        if tuple(state[name].shape) != tuple(p.shape):
            raise UserError(
                f"{folder / WEIGHTS}: {name} has shape {tuple(state[name].shape)}, config implies {tuple(p.shape)}"
            )
    model = model.to_empty(device=device).to(dtype or state["fc.weight"].dtype)
    model.load_state_dict(state, strict=True)
    return model, config


def load_draft_head(
    folder: str | Path, config: DrafterConfig, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> DraftHead | None:
    """The pruned vocabulary's head of an exported drafter (None: it drafts over the target's whole vocabulary)."""
    from safetensors import safe_open

    if not config.draft_vocab_size:
        return None
    with safe_open(str(Path(folder) / WEIGHTS), framework="pt", device=str(device)) as f:
        names = set(f.keys())  # noqa: SIM118 (a safetensors handle, not a dict)
        state = {k: f.get_tensor(k) for k in VOCAB_KEYS if k in names}
    try:
        head = DraftHead.from_tensors(state, config.vocab_size)
    except (KeyError, ValueError) as exc:
        raise UserError(f"{Path(folder) / WEIGHTS}: draft vocabulary tables: {exc}") from exc
    if tuple(head.weight.shape) != (config.draft_vocab_size, config.hidden_size):
        raise UserError(f"{Path(folder) / WEIGHTS}: lm_head.weight {tuple(head.weight.shape)} != draft_vocab_size x H")
    return head.to(device, dtype)


__all__ = ["VOCAB_KEYS", "body_keys", "hf_config", "load_draft_head", "load_drafter", "read_config", "save_drafter"]
