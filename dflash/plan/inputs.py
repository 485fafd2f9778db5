"""What the plan reads: the hardware profile (dflash/core/hardware.py), the target's config.json, the dataset's
metrics and the generate pilot, each value with where it came from.

Each value carries where it came from (a file and key, or the param that stood in for it), so the
report can say it. Files that do not exist yet fall back to `plan.dataset` params; a needed value
that neither gives is a UserError naming the param. Measurements of another target are set aside, and said so.
The training pilot and the stages' own reports (what calibration compares with) are read in
dflash/plan/measured.py. No torch (stdlib + dflash.core's YAML reading; `tokenizers` for the tokenizer beside the
target's config, when there is one).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash.core.errors import ParamsError, UserError
from dflash.core.hardware import GpuProfile, load_hardware, select_gpu
from dflash.core.params import BaseParams, PlanParams
from dflash.core.target_config import TARGET_JSON, TargetArch, load_target_arch, read_config


def planned_hardware(plan: PlanParams) -> GpuProfile:
    """The profile `plan.hardware` names in `plan.hardware_file`."""
    return select_gpu(load_hardware(plan.hardware_file), plan.hardware, plan.hardware_file)


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


@dataclass(frozen=True)
class PlanPaths:
    """Every file the plan reads (params `plan.*_json`; "" = the file in `base.reports_dir`)."""

    target_config: Path  # plan.target_config, "" = ${base.target_dir}/config.json
    audit: Path  # audit.json: prompts, prompt tokens
    tokenize: Path  # tokenize.json: training samples and tokens
    pilot: Path  # pilot.json: the generate pilot's measured rate and output lengths
    train_pilot: Path  # train_pilot.json: the training pilot's step time, memory, MFU
    generate: Path  # generate.json: the generate stage's own figures (calibration)
    train: Path  # train.json: the train stage's own figures (calibration)

    @property
    def pilot_details(self) -> Path:
        """The generate pilot's details beside its headline (full-run prompt count, p99, concurrency, backend)."""
        return self.pilot.with_name(self.pilot.stem + "_details.json")


def resolve_paths(plan: PlanParams, base: BaseParams) -> PlanPaths:
    """Every file the plan reads, resolved once (estimate.py passes them down)."""
    reports = Path(base.reports_dir)
    return PlanPaths(
        target_config=Path(plan.target_config or Path(base.target_dir) / "config.json"),
        audit=Path(plan.audit_json or reports / "audit.json"),
        tokenize=Path(plan.tokenize_json or reports / "tokenize.json"),
        pilot=Path(plan.pilot_json or reports / "pilot.json"),
        train_pilot=Path(plan.train_pilot_json or reports / "train_pilot.json"),
        generate=Path(plan.generate_json or reports / "generate.json"),
        train=Path(plan.train_json or reports / "train.json"),
    )


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


def same_target(data: dict | None, signature: str, path: Path, *, ignored: dict[str, str]) -> dict | None:
    """Measurements taken on another target (e.g. the tiny demo's audit or pilot beside a 27B plan) are set aside."""
    if data is None or not signature or not data.get("target_signature") or data["target_signature"] == signature:
        return data
    ignored[str(path)] = f"measured on {data['target_signature']}, not on the planned {signature}"
    return None


@dataclass(frozen=True)
class GeneratePilot:
    """The generate pilot (reports/pilot.json, + pilot_details.json when present) as the plan reads it."""

    output_tokens_per_s: float  # the pilot run's aggregate rate (its prompts, its engines, its drain included)
    num_engines: float | None  # engines the pilot ran (None: the plan's own count)
    mean_output_tokens: float
    p10_output_tokens: float | None
    p90_output_tokens: float | None
    p99_output_tokens: float | None  # details: the long tail that drains at the end of a run
    estimated_total_hours: float | None  # the pilot's own extrapolation
    chosen_max_num_seqs: int | None  # the sweep's knee
    sweep: list[dict]  # [{"max_num_seqs", "output_tokens_per_s", ...}] one engine each
    prompts: float | None  # prompts the pilot ran
    max_num_seqs: int | None  # details: the concurrency the pilot run itself used
    backend: str | None  # details: engines | servers
    full_run_prompts: float | None  # details: the prompts (turns) the full run will regenerate

    @classmethod
    def read(cls, data: dict, details: dict | None, path: Path) -> GeneratePilot:
        rate, mean = number(data, ("output_tokens_per_s",)), number(data, ("mean_output_tokens",))
        if not rate:
            raise UserError(f"{path}: missing output_tokens_per_s (needed when a pilot file exists)")
        if not mean:
            raise UserError(f"{path}: missing mean_output_tokens (needed when a pilot file exists)")
        extra = details or {}
        sweep = [r for r in data.get("sweep") or [] if isinstance(r, dict) and r.get("output_tokens_per_s")]
        seqs = extra.get("max_num_seqs")
        return cls(
            output_tokens_per_s=rate,
            num_engines=number(data, ("num_engines",)),
            mean_output_tokens=mean,
            p10_output_tokens=number(data, ("p10_output_tokens",)),
            p90_output_tokens=number(data, ("p90_output_tokens",)),
            p99_output_tokens=number(extra, ("p99_output_tokens",)),
            estimated_total_hours=number(data, ("estimated_total_hours",)),
            chosen_max_num_seqs=data.get("chosen_max_num_seqs"),
            sweep=sweep,
            prompts=number(data, ("pilot_prompts",)),
            max_num_seqs=seqs if isinstance(seqs, int) and not isinstance(seqs, bool) else None,
            backend=extra.get("backend") if isinstance(extra.get("backend"), str) else None,
            full_run_prompts=number(extra, ("full_run_prompts",)),
        )


@dataclass
class Dataset:
    """The dataset the plan prices, each value with its source."""

    num_prompts: float  # prompts (turns) to regenerate
    mean_prompt_tokens: float
    mean_output_tokens: float
    low: float  # low end of the mean output length (the estimate's range)
    high: float
    train_samples: float  # training documents
    seq_tokens: float  # tokens per training document
    loss_tokens: float  # supervised tokens per training document
    sources: dict[str, str] = field(default_factory=dict)  # value -> the file and key or the param it came from
    ignored: dict[str, str] = field(default_factory=dict)  # measurement file -> why it was set aside
    audit_found: bool = False
    tokenize_found: bool = False
    pilot: GeneratePilot | None = None

    def as_json(self) -> dict:
        keys = ("num_prompts", "mean_prompt_tokens", "mean_output_tokens", "low", "high", "train_samples")
        return {k: getattr(self, k) for k in (*keys, "seq_tokens", "loss_tokens")}


def dataset_inputs(plan: PlanParams, paths: PlanPaths, *, signature: str = "", measured: bool = True) -> Dataset:
    """Dataset size and lengths, each with the file or param it came from. `signature` names the planned
    target (TargetArch.signature); audit, pilot and tokenize metrics of another target are ignored, and said so.
    measured=False reads no file: the params alone (what a plan says before any measurement)."""
    ds = plan.dataset
    ignored: dict[str, str] = {}

    def read(path: Path) -> dict | None:
        return same_target(_read_optional(path), signature, path, ignored=ignored) if measured else None

    audit, tok, raw_pilot = read(paths.audit), read(paths.tokenize), read(paths.pilot)
    pilot = None
    if raw_pilot is not None:
        details = same_target(_read_optional(paths.pilot_details), signature, paths.pilot_details, ignored={})
        pilot = GeneratePilot.read(raw_pilot, details, paths.pilot)
    src: dict[str, str] = {}
    values: dict[str, float] = {}

    # each value: (measured value and the key that held it, the file, the param standing in for it)
    turns = (pilot.full_run_prompts, "full_run_prompts (turns to regenerate)") if pilot else (None, "")
    found = {
        "num_prompts": (
            turns if turns[0] else lookup(audit, ("num_conversations",)),
            paths.pilot_details if turns[0] else paths.audit,
            ds.num_prompts,
        ),
        "mean_prompt_tokens": (
            lookup(audit, ("mean_prompt_tokens", "prompt_tokens_mean", "prompt_tokens.mean")),
            paths.audit,
            ds.mean_prompt_tokens,
        ),
        "mean_output_tokens": (
            (pilot.mean_output_tokens if pilot else None, "mean_output_tokens"),
            paths.pilot,
            ds.mean_output_tokens,
        ),
    }
    for key, ((value, used), file, fallback) in found.items():
        if value is not None:
            values[key], src[key] = value, f"{file} {used}"
        elif fallback > 0:
            values[key], src[key] = fallback, f"param plan.dataset.{key}"
        else:
            raise UserError(f"plan.dataset.{key}: must be > 0 while {file} does not provide it (got {fallback})")
    if not (0 < ds.output_tokens_low <= ds.mean_output_tokens <= ds.output_tokens_high):
        raise ParamsError(
            "plan.dataset.output_tokens_low / output_tokens_high: need 0 < low <= mean_output_tokens <= high, got "
            f"{ds.output_tokens_low} / {ds.mean_output_tokens} / {ds.output_tokens_high}"
        )
    low, high = ds.output_tokens_low, ds.output_tokens_high
    if pilot:  # the measured mean replaces the assumed one; keep the range around it
        low, high = min(low, pilot.mean_output_tokens), max(high, pilot.mean_output_tokens)

    # Training data: measured token totals when tokenize ran, else prompt + output per prompt.
    # The training split only (tokenize.json also counts the held-out eval split in num_samples).
    samples = number(tok, ("train_samples", "num_samples")) if tok else None
    total = number(tok, ("train_tokens", "total_tokens")) if tok else None
    loss = number(tok, ("train_loss_tokens", "loss_tokens")) if tok else None
    if samples and total and loss:
        train = {"train_samples": samples, "seq_tokens": total / samples, "loss_tokens": loss / samples}
        src.update({k: f"{paths.tokenize}" for k in train})
    else:
        train = {
            "train_samples": values["num_prompts"],
            "seq_tokens": values["mean_prompt_tokens"] + values["mean_output_tokens"],
            "loss_tokens": values["mean_output_tokens"],
        }
        src.update(
            train_samples=src["num_prompts"],
            seq_tokens="mean_prompt_tokens + mean_output_tokens",
            loss_tokens="mean_output_tokens",
        )
    return Dataset(
        **values,
        low=low,
        high=high,
        **train,
        sources=src,
        ignored=ignored,
        audit_found=audit is not None,
        tokenize_found=tok is not None,
        pilot=pilot,
    )
