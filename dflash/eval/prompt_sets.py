"""Eval prompt sets: named sets of prompts measured beside the held-out split, each with its own thinking mode, so
drafters compare per benchmark as the papers report them (one table: rows = sets, columns = engines).

`eval.prompt_sets` maps a name to {source, split, column, num_prompts, enable_thinking}. Sources:
  a local file   .jsonl / .json (an array) / .parquet; each row holds a conversation (`messages`: a list of
                 {role, content}; the prompt is every message before the first assistant turn) or a prompt text
                 (`prompt`: one user message). `column` names another field; "" = `messages` when present, else
                 `prompt`.
  hf:DATASET_ID  a hub dataset (machines with a network; the `datasets` package): `split` ("" = train) and
                 `column` (required) as above.
The held-out split (tokenize's eval shards, rendered with the training template) is always the set named
`heldout`, sized by `eval.num_prompts`; the top-level tau of reports/eval.json stays its figure.
Prompts are rendered with the target's chat template and generation prompt, thinking mode per set. Errors name
the set, the file and the row. Local set files are DVC deps of the eval stage when they live under data/eval/.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash.core.chat import render_ids, template_kwargs
from dflash.core.errors import UserError
from dflash.core.params import PromptSet

HELDOUT = "heldout"
SUFFIXES = (".jsonl", ".json", ".parquet")


def _rows(name: str, spec: PromptSet) -> list[tuple[str, dict]]:
    """[(row reference, row dict)] of a set's source."""
    where = f"eval.prompt_sets.{name}.source"
    if spec.source.startswith("hf:"):
        if not spec.column:
            raise UserError(f"{where}: {spec.source}: a hub dataset needs eval.prompt_sets.{name}.column")
        try:
            import datasets
        except ImportError as exc:
            raise UserError(f"{where}: {spec.source}: the `datasets` package is not installed") from exc
        try:
            table = datasets.load_dataset(spec.source[3:], split=spec.split or "train")
        except Exception as exc:  # network, unknown id or split: say which
            raise UserError(f"{where}: cannot load {spec.source} split {spec.split or 'train'!r}: {exc}") from exc
        return [(f"{spec.source} row {i}", dict(r)) for i, r in enumerate(table)]
    path = Path(spec.source)
    if path.suffix.lower() not in SUFFIXES or not path.is_file():
        raise UserError(f"{where}: {path}: not a {'/'.join(SUFFIXES)} file (or `hf:DATASET_ID`)")
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        return [(f"{path} row {i}", r) for i, r in enumerate(pq.read_table(path).to_pylist())]
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix.lower() == ".json":
            rows = json.loads(text)
            if not isinstance(rows, list):
                raise UserError(f"{path}: expected a JSON array of rows")
            return [(f"{path} element {i}", r) for i, r in enumerate(rows)]
        out = []
        for line_no, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                out.append((f"{path}:line {line_no}", json.loads(line)))
        return out
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON ({exc})") from exc


def _messages(ref: str, row: Any, column: str) -> list[dict]:
    """A row -> the messages of its prompt (before the first assistant turn)."""
    if not isinstance(row, dict):
        raise UserError(f"{ref}: expected an object, got {type(row).__name__}")
    key = column or ("messages" if "messages" in row else "prompt")
    if key not in row:
        raise UserError(f"{ref}: no {key!r} field (fields: {sorted(row)[:8]}); set eval.prompt_sets.*.column")
    value = row[key]
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not all(isinstance(m, dict) and "role" in m for m in value):
        raise UserError(f"{ref}: {key!r} must be a prompt text or a list of {{role, content}} messages")
    prompt = []
    for m in value:
        if m["role"] == "assistant":
            break
        prompt.append({"role": m["role"], "content": m.get("content", "")})
    if not prompt or prompt[-1]["role"] != "user":
        raise UserError(f"{ref}: {key!r} has no user message before its first assistant turn")
    return prompt


def load_prompt_set(name: str, spec: PromptSet, tokenizer: Any, chat_kwargs: dict) -> list[dict]:
    """The first `num_prompts` (0 = all) prompts of a set, rendered: [{"sample_id", "prompt_ids"}]."""
    out = []
    kwargs = template_kwargs(spec.enable_thinking, chat_kwargs)
    for ref, row in _rows(name, spec):
        msgs = _messages(ref, row, spec.column)
        try:
            ids = render_ids(tokenizer, msgs, True, kwargs)
        except Exception as exc:  # the template refused the conversation
            raise UserError(f"{ref}: the chat template cannot render this prompt ({exc})") from exc
        out.append({"sample_id": f"{name}:{len(out)}", "prompt_ids": ids})
        if spec.num_prompts and len(out) == spec.num_prompts:
            break
    if not out:
        raise UserError(f"eval.prompt_sets.{name}: {spec.source} holds no prompts")
    return out


def set_rows(sets: dict[str, dict], engines: dict[str, dict], reference: dict | None, greedy: bool) -> dict:
    """Per set (eval_details.json "prompt_set_details"): source, sizes, thinking mode, the trained drafter's tau,
    acceptance per position and counts (its per-set counters), every engine's tau, counts and acceptance per
    position, the reference's,
    and (greedy) whether each speculative engine's outputs equal plain greedy decoding."""
    out = {}
    for name, meta in sets.items():
        none = engines["none"]["sets"][name] if "none" in engines else None
        per_engine: dict[str, dict] = {}
        for engine, r in engines.items():
            s = r["sets"][name]
            c = s["counters"]
            d = {"tau": c["tau"], "num_drafts": c["num_drafts"], "num_accepted_tokens": c["num_accepted_tokens"]}
            d["acceptance_per_position"] = c["acceptance_per_position"]  # the report's figure: a line per engine
            d["output_tokens"] = s["output_tokens"]
            if greedy and none is not None and engine != "none":
                same = sum(a == b for a, b in zip(s["tokens"], none["tokens"], strict=True))
                d["greedy_identical_frac"] = same / max(1, len(s["tokens"]))
            per_engine[engine] = d
        # the trained drafter's vLLM counters (none when this host cannot serve its kind: dflash/eval/engines.py)
        main = engines["dflash"]["sets"][name]["counters"] if "dflash" in engines else {}
        ref = reference["sets"][name] if reference else None
        out[name] = {
            **meta,
            "tau": main.get("tau"),
            "tau_reference": ref["tau"] if ref else None,
            "tau_reference_by_temperature": by_temperature(reference, name),
            "acceptance_per_position": main.get("acceptance_per_position", []),
            "num_drafts": main.get("num_drafts"),
            "num_accepted_tokens_per_pos": main.get("num_accepted_tokens_per_pos", []),
            "engines": per_engine,
            "reference": None
            if ref is None
            else {k: ref[k] for k in ("tau", "num_drafts", "num_accepted_tokens", "acceptance_per_position")},
        }
    return out


def by_temperature(reference: dict | None, name: str) -> dict:
    """{temperature: {"tau", "expected_tau"}} of the reference on set `name` (expected_tau: T > 0 only)."""
    runs = (reference or {}).get("by_temperature", {})
    return {t: {k: r[name].get(k) for k in ("tau", "expected_tau")} for t, r in runs.items()}


HEADLINE_KEYS = (
    "tau",
    "tau_reference",
    "tau_reference_by_temperature",
    "num_drafts",
    "acceptance_per_position",
    "num_accepted_tokens_per_pos",
)


def headline_rows(details: dict) -> dict:
    """reports/eval.json["prompt_sets"]: per set the drafter's tau, the reference's, drafts, and (lists, which
    `dvc metrics show` does not print) acceptance and accepted counts per position."""
    return {name: {k: row[k] for k in HEADLINE_KEYS} for name, row in details.items()}


def table(prompt_sets: dict[str, dict]) -> list[str]:
    """Markdown lines: one row per set, one tau column per engine plus the reference (the papers' table)."""
    first = next(iter(prompt_sets.values()))
    engines = list(first["engines"])
    temps = list(first.get("tau_reference_by_temperature") or {})
    if not temps and any(s["tau_reference"] is not None for s in prompt_sets.values()):
        temps = [None]  # a reference without per-temperature runs: one column
    ref_head = [f"tau reference T={t}" if t is not None else "tau reference" for t in temps]
    ref_head += [f"expected tau reference T={t}" for t in temps if t not in (None, "0")]
    head = ["prompt set", "prompts", "thinking", *[f"tau {e}" for e in engines], *ref_head]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, s in prompt_sets.items():
        cells = [name, str(s["num_prompts"]), "on" if s["enable_thinking"] else "off"]
        cells += [_tau(s["engines"][e]["tau"]) for e in engines]
        runs = s.get("tau_reference_by_temperature") or {}
        cells += [_tau(runs[t]["tau"] if t is not None else s["tau_reference"]) for t in temps]
        cells += [_tau(runs[t]["expected_tau"]) for t in temps if t not in (None, "0")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _tau(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


__all__ = ["HELDOUT", "by_temperature", "headline_rows", "load_prompt_set", "set_rows", "table"]
