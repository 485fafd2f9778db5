"""What the plan reads: GPU profiles, the target's config.json, dataset metrics and the generate pilot.

Each value carries where it came from (a file and key, or the param that stood in for it), so the
report can say it. Files that do not exist yet fall back to `plan.dataset` params; a needed value
that neither gives is a UserError naming the param. No torch (stdlib + dflash.core's YAML reading; `tokenizers` for the tokenizer
beside the target's config, when there is one).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.core.errors import ParamsError, UserError
from dflash.core.loader import read_yaml
from dflash.core.target_config import TARGET_JSON, TargetArch, load_target_arch, read_config

# --------------------------------------------------------------------------------------------
# Hardware profiles
# --------------------------------------------------------------------------------------------

_PROFILE_KEYS = {
    "name": str,
    "memory_gb": float,
    "bandwidth_tbps": float,
    "bf16_tflops": float,
    "interconnect": str,
    "interconnect_gbps": float,
    "price_per_gpu_hour": float,
    "source": str,
}


@dataclass(frozen=True)
class GpuProfile:
    key: str  # the profile's name in the hardware file
    name: str  # marketing name
    memory_gb: float  # device memory (GB = 1e9 bytes)
    bandwidth_tbps: float  # peak memory bandwidth (TB/s)
    bf16_tflops: float  # dense BF16 tensor peak (TFLOP/s)
    interconnect: str  # GPU-to-GPU link
    interconnect_gbps: float  # GB/s per direction between two GPUs
    price_per_gpu_hour: float  # USD; 0 = unknown
    source: str  # where these numbers come from


def load_hardware(path: str | Path) -> dict[str, GpuProfile]:
    """Read the profiles file strictly: every key present, numbers positive, nothing unknown."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"plan.hardware_file: {path} does not exist")
    data = read_yaml(path, "GPU profiles file (plan.hardware_file)")  # DVC's YAML reading; ParamsError naming the file
    profiles = data.get("profiles")
    if not isinstance(profiles, dict) or not profiles:
        raise UserError(f"{path}: expected a top-level `profiles:` mapping of name -> profile")
    out = {}
    for key, prof in profiles.items():
        where = f"{path}: profiles.{key}"
        if not isinstance(prof, dict):
            raise UserError(f"{where}: expected a mapping")
        unknown = sorted(set(prof) - set(_PROFILE_KEYS), key=str)
        if unknown:
            raise UserError(f"{where}.{unknown[0]}: unknown key (known: {', '.join(_PROFILE_KEYS)})")
        values = {}
        for name, tp in _PROFILE_KEYS.items():
            if name not in prof:
                raise UserError(f"{where}.{name}: missing key")
            value = prof[name]
            if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, tp):
                raise UserError(f"{where}.{name}: expected {tp.__name__}, got {value!r}")
            values[name] = value
        for name in ("memory_gb", "bandwidth_tbps", "bf16_tflops"):
            if not values[name] > 0:
                raise UserError(f"{where}.{name}: must be > 0, got {values[name]}")
        for name in ("interconnect_gbps", "price_per_gpu_hour"):
            if not values[name] >= 0:
                raise UserError(f"{where}.{name}: must be >= 0, got {values[name]}")
        out[key] = GpuProfile(key=key, **values)
    return out


def select_gpu(profiles: dict[str, GpuProfile], name: str, file: str) -> GpuProfile:
    if name not in profiles:
        raise UserError(f"plan.hardware: no profile {name!r} in {file} (have: {', '.join(profiles)})")
    return profiles[name]


# --------------------------------------------------------------------------------------------
# Inputs: params + optional measurement files
# --------------------------------------------------------------------------------------------


def _read_optional(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object")
    return data


def lookup(data: dict | None, keys: tuple[str, ...]) -> tuple[float | None, str]:
    """First positive number among `keys` and the key that held it (dotted keys reach into nested objects)."""
    for key in keys:
        node: Any = data
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, (int, float)) and not isinstance(node, bool) and node > 0:
            return float(node), key
    return None, ""


def number(data: dict | None, keys: tuple[str, ...]) -> float | None:
    return lookup(data, keys)[0]


def resolve_paths(plan: Any, base: Any) -> dict[str, Path]:
    reports = Path(base.reports_dir)
    return {
        "target_config": Path(plan.target_config or Path(base.target_dir) / "config.json"),
        "audit": Path(plan.audit_json or reports / "audit.json"),
        "tokenize": Path(plan.tokenize_json or reports / "tokenize.json"),
        "pilot": Path(plan.pilot_json or reports / "pilot.json"),
    }


def load_target(path: Path) -> TargetArch:
    """The planned target's architecture (plan.target_config), refusing what the planner cannot price."""
    if not path.exists():
        raise UserError(
            f"plan.target_config: {path} does not exist (run the target stage, or point plan.target_config "
            "at a config.json, e.g. params/targets/qwen3.6-27b.config.json)"
        )
    return load_target_arch(path)


class TokenizerFacts:
    """What `dflash.drafter.geometry.check_mask_token` asks of a tokenizer (its length, added tokens, named special
    ids, chat template), read from `tokenizer.json` + `tokenizer_config.json` with the `tokenizers` library: the
    same verdict train reaches with transformers' tokenizer (tests/unit/core/test_validate.py compares the two)."""

    def __init__(self, folder: Path):
        from tokenizers import Tokenizer

        from dflash.core.chat import read_chat_template

        self.folder = folder
        self._tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.added_tokens_decoder = self._tok.get_added_tokens_decoder()
        try:
            self.chat_template, config = read_chat_template(folder)
        except UserError:  # no template: nothing to compare the mask token's spelling with
            config_path = folder / "tokenizer_config.json"
            config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.exists() else {}
            self.chat_template = ""
        for name in ("eos", "bos", "pad", "unk"):
            value = config.get(f"{name}_token")
            value = value.get("content") if isinstance(value, dict) else value
            setattr(self, f"{name}_token_id", self._tok.token_to_id(value) if isinstance(value, str) else None)

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def convert_ids_to_tokens(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)


def load_tokenizer_facts(target_config: Path) -> TokenizerFacts | None:
    """The tokenizer train would use: beside the planned config.json (the tiny target's folder, a local model
    folder), or in the local folder its target.json names (a real target the target stage referenced). None
    for a config alone, such as params/targets/*.config.json or a hub id: the mask token is then checked
    against the embedding rows only."""
    folder = Path(target_config).parent
    if not (folder / "tokenizer.json").exists() and (folder / TARGET_JSON).exists():
        model = read_config(folder / TARGET_JSON).get("model")
        folder = Path(model) if isinstance(model, str) and model else folder
    return TokenizerFacts(folder) if (folder / "tokenizer.json").exists() else None


def _same_target(data: dict | None, signature: str, path: Path, ignored: dict[str, str]) -> dict | None:
    """Measurements taken on another target (e.g. the tiny demo's audit or pilot beside a 27B plan) are set aside."""
    if data is None or not signature or not data.get("target_signature") or data["target_signature"] == signature:
        return data
    ignored[str(path)] = f"measured on {data['target_signature']}, not on the planned {signature}"
    return None


def dataset_inputs(plan: Any, paths: dict[str, Path], signature: str = "") -> dict[str, Any]:
    """Dataset size and lengths, each with the file or param it came from. `signature` names the planned
    target (TargetArch.signature); audit, pilot and tokenize metrics of another target are ignored, and said so."""
    ds = plan.dataset
    ignored: dict[str, str] = {}
    audit = _same_target(_read_optional(paths["audit"]), signature, paths["audit"], ignored)
    tok = _same_target(_read_optional(paths["tokenize"]), signature, paths["tokenize"], ignored)
    pilot = _same_target(_read_optional(paths["pilot"]), signature, paths["pilot"], ignored)
    out: dict[str, Any] = {"audit": audit is not None, "tokenize": tok is not None, "pilot": pilot, "ignored": ignored}
    src: dict[str, str] = {}

    # each value: (measured value or None, the file and key it came from, the param standing in for it)
    found = {
        "num_prompts": (lookup(audit, ("num_conversations",)), paths["audit"], ds.num_prompts),
        "mean_prompt_tokens": (
            lookup(audit, ("mean_prompt_tokens", "prompt_tokens_mean", "prompt_tokens.mean")),
            paths["audit"],
            ds.mean_prompt_tokens,
        ),
        "mean_output_tokens": (lookup(pilot, ("mean_output_tokens",)), paths["pilot"], ds.mean_output_tokens),
    }
    if pilot is not None and found["mean_output_tokens"][0][0] is None:
        raise UserError(f"{paths['pilot']}: missing mean_output_tokens (needed when a pilot file exists)")
    for key, ((value, used), file, fallback) in found.items():
        if value is not None:
            out[key], src[key] = value, f"{file} {used}"
        elif fallback > 0:
            out[key], src[key] = fallback, f"param plan.dataset.{key}"
        else:
            raise UserError(f"plan.dataset.{key}: must be > 0 while {file} does not provide it (got {fallback})")
    if not (0 < ds.output_tokens_low <= ds.mean_output_tokens <= ds.output_tokens_high):
        raise ParamsError(
            "plan.dataset.output_tokens_low / output_tokens_high: need 0 < low <= mean_output_tokens <= high, got "
            f"{ds.output_tokens_low} / {ds.mean_output_tokens} / {ds.output_tokens_high}"
        )

    # Training data: measured token totals when tokenize ran, else prompt + output per prompt.
    # The training split only (tokenize.json also counts the held-out eval split in num_samples).
    samples = number(tok, ("train_samples", "num_samples")) if tok else None
    total = number(tok, ("train_tokens", "total_tokens")) if tok else None
    loss = number(tok, ("train_loss_tokens", "loss_tokens")) if tok else None
    if samples and total and loss:
        out.update(train_samples=samples, seq_tokens=total / samples, loss_tokens=loss / samples)
        src.update({k: f"{paths['tokenize']}" for k in ("train_samples", "seq_tokens", "loss_tokens")})
    else:
        out.update(
            train_samples=out["num_prompts"],
            seq_tokens=out["mean_prompt_tokens"] + out["mean_output_tokens"],
            loss_tokens=out["mean_output_tokens"],
        )
        src.update(
            train_samples=src["num_prompts"],
            seq_tokens="mean_prompt_tokens + mean_output_tokens",
            loss_tokens="mean_output_tokens",
        )
    out["sources"] = src
    return out
