"""Audit raw conversations before any GPU time: catch placeholder responses, broken rows, shape errors,
duplicates and over-long prompts in seconds, and write the normalized prompts generation completes.

Inputs: `audit.input` (file, folder or glob of ShareGPT json/jsonl, OpenAI `messages` jsonl, parquet;
see dflash.conversations), optionally the target's tokenizer. Outputs under `audit.out`:
- `conversations.arrow`: one row per KEPT conversation (OUT_SCHEMA below; zstd Arrow IPC file).
- `rejected.jsonl`: one object per rejected input row: source_file, source_row, reasons, detail,
  conversation_id (when the row could be read) and an excerpt. kept + rejected == input rows.
- `audit.json` (metrics), `report.md` (findings and what to do), `plots/*.csv` (DVC plots).

Speed: each chunk of input is parsed by pyarrow and checked with pyarrow.compute / numpy over all
its turns at once; Python touches each row only to hash it. Memory is bounded by the chunk size
plus ~24 bytes a row for the duplicate / repetition keys, whatever the size of the text.

The tokenize stage reuses `loss_mask_spike`, `evaluate_gates` and `gate_failure_message`.

    python -m stages.audit --params params.yaml -S audit.input=FILE -S audit.out=DIR
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc

from dflash.audit_report import write_outputs
from dflash.audit_state import AuditState, segment_max, segment_min, segment_sum
from dflash.chat import load_fast_chat, template_kwargs
from dflash.config import AuditParams, BaseParams, GateParams
from dflash.conversations import iter_chunks, prefetch
from dflash.io import atomic_path, canonical_json
from dflash.sizing import target_signature
from dflash.turns import ROLES, Turns, flatten_turns, join_rows, turn_json

log = logging.getLogger(__name__)

# One row per kept conversation. `messages` / `prompt_messages` / `tools` are canonical JSON text
# (sorted keys, no spaces, UTF-8 kept), so `conversation_id` can be recomputed from them (see
# `conversation_id`). `prompt_messages` = `messages` minus the trailing assistant turn(s): what the
# generate stage completes. prompt_tokens = -1 without a tokenizer.
OUT_SCHEMA = pa.schema(
    [
        ("conversation_id", pa.string()),  # first 16 hex of sha256(canonical {"messages", "tools"})
        ("source_file", pa.string()),  # path as given
        ("source_row", pa.int64()),  # JSONL: 1-based line; JSON array: 0-based index; parquet: row index
        ("messages", pa.string()),  # JSON list of normalized OpenAI messages
        ("prompt_messages", pa.string()),  # JSON list: messages without the trailing assistant turn(s)
        ("tools", pa.string()),  # JSON list of tool definitions, or ""
        ("num_user_turns", pa.int32()),
        ("num_assistant_turns", pa.int32()),
        ("has_system", pa.bool_()),
        ("has_tool_calls", pa.bool_()),  # an assistant tool call or a tool turn
        ("prompt_chars", pa.int64()),  # characters of content in prompt_messages
        ("prompt_tokens", pa.int64()),  # tokens of the prompt rendered with the generation prompt; -1: no tokenizer
        ("placeholder_turns", pa.int32()),  # assistant turns that are placeholders or empty
        ("response_chars", pa.int64()),  # characters of the recorded trailing assistant turn(s)
    ]
)
REASONS = (
    "malformed",  # bad JSON / UTF-8, missing fields, wrong types
    "unknown_role",  # a role outside system/user/assistant/tool (after ShareGPT mapping)
    "first_turn_not_user",  # the first turn after optional system prompts is not from the user
    "no_user_turn",  # the prompt has no user turn (nothing to answer)
    "empty_prompt",  # the last user turn of the prompt is empty or whitespace
    "template_error",  # the target's chat template refused the conversation
    "prompt_too_long",  # prompt tokens > audit.max_prompt_tokens
    "duplicate_prompt",  # same prompt (messages + tools) as an earlier kept row
    "near_duplicate_prompt",  # same prompt up to case and whitespace as an earlier kept row
)
REPEAT_MAX_CHARS = 1024  # responses longer than this are not counted for repetition (mass-repeated texts are short)
GATE_FIXES = {
    "placeholder_response_frac": "regenerate every response with the generate stage (it completes `prompt_messages` "
    "with the target); once that is the plan, set this gate's action to report",
    "response_length_spike_frac": "most responses have the same length: they are templated or placeholders; regenerate "
    "them with the generate stage (see the most common responses in report.md)",
    "repeated_response_frac": "a few response texts repeat across many conversations; regenerate them with the "
    "generate stage or drop those rows",
    "malformed_frac": "fix or drop the rows listed in rejected.jsonl (each names file and line and what is wrong)",
    "duplicate_prompt_frac": "deduplicate the source data (duplicates are already left out of conversations.arrow); "
    "raise the gate if repeats are intended",
    "rejected_frac": "read the reasons in rejected.jsonl and report.md, and fix the source data",
}


# ---------------------------------------------------------------------------- public helpers


def conversation_id(messages: list[dict], tools: list[dict] | None = None) -> str:
    """The stable id: first 16 hex chars of sha256 of canonical JSON {"messages": ..., "tools": [...]}."""
    return hashlib.sha256(canonical_json({"messages": messages, "tools": tools or []}).encode()).hexdigest()[:16]


def loss_mask_spike(loss_mask_sums: Any) -> tuple[int, float]:
    """(most common value, share of samples at it) of per-sample loss-mask sums (or any lengths).
    The seeds' data: (6, 0.87). Empty input -> (0, 0.0)."""
    values = np.asarray(loss_mask_sums, dtype=np.int64)
    if values.size == 0:
        return 0, 0.0
    uniq, counts = np.unique(values, return_counts=True)
    k = int(np.argmax(counts))
    return int(uniq[k]), float(counts[k] / values.size)


def evaluate_gates(
    values: Mapping[str, float | None], gates: Any, fixes: Mapping[str, str] | None = None
) -> list[dict]:
    """Compare measured shares with gates (a dataclass whose fields are GateParams, or a mapping
    name -> GateParams). A gate is crossed when value > max. Returns one dict per gate."""
    items = (
        {f.name: getattr(gates, f.name) for f in dataclasses.fields(gates)}
        if dataclasses.is_dataclass(gates)
        else dict(gates)
    )
    results = []
    for name, gate in items.items():
        assert isinstance(gate, GateParams), f"gate {name} is not GateParams"
        if name not in values:
            raise ValueError(f"gate {name!r}: no measured value of that name (have: {', '.join(sorted(values))})")
        value = values[name]
        crossed = value is not None and value > gate.max
        results.append(
            {
                "name": name,
                "value": value,
                "max": gate.max,
                "action": gate.action,
                "crossed": crossed,
                "fix": (fixes or {}).get(name, ""),
            }
        )
    return results


def failed_gates(results: list[dict]) -> list[str]:
    return [r["name"] for r in results if r["crossed"] and r["action"] == "fail"]


def gate_failure_message(results: list[dict], section: str) -> str | None:
    """One message naming every failed gate, its measured value, the threshold and the fix; None if none."""
    lines = [
        f"gate {section}.{r['name']} failed: measured {r['value']:.4f} > max {r['max']:.4f}. Fix: {r['fix']}"
        for r in results
        if r["crossed"] and r["action"] == "fail"
    ]
    return "\n".join(lines) if lines else None


def _buffers(arr: pa.Array) -> tuple[memoryview, list[int]]:
    """(data, offsets) of a string array, for hashing row bytes without making Python strings."""
    arr = pc.fill_null(arr, "").cast(pa.large_string())
    offsets = np.frombuffer(arr.buffers()[1], dtype=np.int64)[arr.offset : arr.offset + len(arr) + 1]
    return memoryview(arr.buffers()[2] or b""), offsets.tolist()


def _ids(arr: pa.Array) -> list[str]:
    """conversation_id of each row of `{"messages":...,"tools":...}` texts: 16 hex chars of sha256."""
    data, off = _buffers(arr)
    sha = hashlib.sha256
    return [sha(data[off[i] : off[i + 1]]).hexdigest()[:16] for i in range(len(off) - 1)]


def _keys(*arrays: pa.Array) -> list[np.ndarray]:
    """64-bit keys (blake2b-8) of each row of each array (dedup / counting; collisions ~ n^2 / 2^65)."""
    blake = hashlib.blake2b
    out = []
    for arr in arrays:
        data, off = _buffers(arr)
        digests = b"".join([blake(data[off[i] : off[i + 1]], digest_size=8).digest() for i in range(len(off) - 1)])
        out.append(np.frombuffer(digests, dtype=np.uint64))
    return out


def _normalized(arr: pa.Array) -> pa.Array:
    """Text compared case- and whitespace-insensitively (near-duplicate prompts, repeated responses):
    lowercased, every space / tab / newline removed (plain substring kernels: regexes are 3x slower)."""
    arr = pc.utf8_lower(arr)
    for ch in (" ", "\n", "\t", "\r"):
        arr = pc.replace_substring(arr, ch, "")
    return arr


# ---------------------------------------------------------------------------- one chunk


def _chunk_features(t: Turns, n: int, placeholder_texts: pa.Array, max_placeholder_len: int) -> dict[str, Any]:
    """Per-conversation numpy features of one chunk (all rows; malformed rows are masked later)."""
    off, parent, pos = t.offsets, t.parent, t.pos
    code = pc.fill_null(pc.index_in(t.role, value_set=pa.array(ROLES)), -1).to_numpy(zero_copy_only=False)
    content_len = pc.fill_null(pc.utf8_length(t.content), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    reasoning_len = pc.fill_null(pc.utf8_length(t.reasoning), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    calls_len = pc.fill_null(pc.utf8_length(t.tool_calls), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    has_call = pc.is_valid(t.tool_calls).to_numpy(zero_copy_only=False)
    blank = pc.fill_null(pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(t.content)), 0), True).to_numpy(
        zero_copy_only=False
    )
    user, asst = code == 1, code == 2

    # Placeholder / empty assistant turns (only short texts can match the placeholder list).
    empty = asst & blank & ~has_call & (reasoning_len == 0)
    short = np.flatnonzero(asst & ~has_call & (content_len <= max_placeholder_len) & ~blank)
    listed = np.zeros(len(code), dtype=bool)
    if len(short):
        norm = pc.replace_substring_regex(pc.utf8_lower(t.content.take(pa.array(short))), r"[^\p{L}\p{N}]+", "")
        listed[short] = pc.is_in(norm, value_set=placeholder_texts).to_numpy(zero_copy_only=False)
    placeholder = empty | listed

    # Prompt = everything before the trailing run of assistant turns.
    length = np.diff(off)
    prompt_len = segment_max(np.where(~asst, pos + 1, 0), off)
    in_prompt = pos < prompt_len[parent]
    last_user = segment_max(np.where(user & in_prompt, pos + 1, 0), off) - 1
    first_other = segment_min(np.where(code != 0, pos, np.iinfo(np.int64).max), off)
    has_other = first_other < np.iinfo(np.int64).max
    first_role = np.full(n, -2)
    first_role[has_other] = code[off[:-1][has_other] + first_other[has_other]]
    last_user_blank = np.zeros(n, dtype=bool)
    has_user = last_user >= 0
    last_user_blank[has_user] = blank[off[:-1][has_user] + last_user[has_user]]

    # Role order (reported, not rejected): user after user, assistant after an assistant without
    # calls, a tool turn not answering a call, a system turn after the start.
    prev = np.roll(code, 1)
    prev_call = np.roll(has_call, 1)
    has_prev = pos > 0
    odd = has_prev & (
        (user & (prev == 1))
        | (asst & (prev == 2) & ~prev_call)
        | ((code == 3) & ~(((prev == 2) & prev_call) | (prev == 3)))
        | (code == 0)
    )
    response = ~in_prompt
    return {
        "length": length,
        "prompt_len": prompt_len,
        "in_prompt": in_prompt,
        "num_user": segment_sum(user, off),
        "num_assistant": segment_sum(asst, off),
        "has_system": segment_sum(code == 0, off) > 0,
        "has_tool_calls": segment_sum(has_call | (code == 3), off) > 0,
        "unknown_role": segment_sum(code == -1, off) > 0,
        "first_turn_not_user": has_other & (first_role != 1),
        "no_user_turn": segment_sum(user & in_prompt, off) == 0,
        "empty_prompt": has_user & last_user_blank,
        "role_order": segment_sum(odd, off) > 0,
        "prompt_chars": segment_sum(np.where(in_prompt, content_len, 0), off),
        "response_chars": segment_sum(np.where(response, content_len + reasoning_len + calls_len, 0), off),
        "has_response": prompt_len < length,
        "placeholder_turns": segment_sum(placeholder, off),
        "empty_turns": segment_sum(empty, off),
        "placeholder_in_prompt": segment_sum(placeholder & in_prompt, off),
        "assistant_turns": int(asst.sum()),
        "placeholder_turn_total": int(placeholder.sum()),
    }


def _tokenize(
    chat, messages_json, prompt_len, has_response, tools_json, rows, kwargs
) -> tuple[np.ndarray, np.ndarray, dict]:
    """Prompt tokens (with the generation prompt) and loss-mask sums (tokens of the recorded trailing
    assistant turns after that prompt: think block, answer, end of turn) for `rows`."""
    prompt_texts, full_texts, which, errors = [], [], [], {}
    for r in rows:
        messages = json.loads(messages_json[r])
        tools = json.loads(tools_json[r]) if tools_json[r] else None
        try:
            prompt_texts.append(chat.render(messages[: prompt_len[r]], True, kwargs, tools))
            full_texts.append(chat.render(messages, False, kwargs, tools) if has_response[r] else "")
            which.append(r)
        except Exception as exc:  # jinja raise_exception / undefined: the template refuses this shape
            errors[r] = f"chat template error: {exc}"
    prompt_tokens = np.full(len(messages_json), -1, dtype=np.int64)
    mask_sums = np.full(len(messages_json), -1, dtype=np.int64)
    if which:
        p_ids = chat.encode_batch(prompt_texts)
        f_ids = chat.encode_batch(full_texts)
        for r, p, f, pt, ft in zip(which, p_ids, f_ids, prompt_texts, full_texts, strict=True):
            prompt_tokens[r] = len(p)
            if has_response[r]:
                if ft.startswith(pt):
                    mask_sums[r] = len(f) - len(p)
                else:  # the template renders history differently once answered: count after the common prefix
                    k = next((i for i, (a, b) in enumerate(zip(p, f, strict=False)) if a != b), min(len(p), len(f)))
                    mask_sums[r] = len(f) - k
    return prompt_tokens, mask_sums, errors


def audit_chunk(chunk, state: AuditState, chat, kwargs: dict) -> pa.Table:
    """Check one chunk, update `state` (counts, keys, histograms, rejected rows) and return its kept rows."""
    p = state.params
    table, file = chunk.table, chunk.file
    n = table.num_rows
    rows = table.column("source_row").to_numpy()
    pending = [(m.row, ["malformed"], m.detail, None, m.excerpt) for m in chunk.malformed]
    state.num_rows += n + len(chunk.malformed)
    t = flatten_turns(table)
    f = _chunk_features(t, n, state.placeholder_set, state.max_placeholder_len)
    ok = np.ones(n, dtype=bool)
    ok[list(t.errors)] = False

    pieces = turn_json(t)
    messages = join_rows(pieces, t.offsets)
    prompt_offsets = np.concatenate(([0], np.cumsum(f["prompt_len"]))).astype(np.int64)
    prompt = join_rows(pieces.filter(pa.array(f["in_prompt"])), prompt_offsets)
    tools = pc.fill_null(table.column("tools").combine_chunks(), "")
    tools_key = pc.if_else(pc.equal(tools, ""), "[]", tools)
    ids = _ids(pc.binary_join_element_wise('{"messages":', messages, ',"tools":', tools_key, "}", ""))

    # Rejection reasons as one bit per REASONS entry (vectorised; names are spelled out per rejected row).
    bits = np.zeros(n, dtype=np.int32)
    for key in ("unknown_role", "first_turn_not_user", "no_user_turn", "empty_prompt"):
        bits |= (f[key] & ok).astype(np.int32) << REASONS.index(key)
    candidate = ok & (bits == 0)

    prompt_tokens = np.full(n, -1, dtype=np.int64)
    mask_sums = np.full(n, -1, dtype=np.int64)
    details: dict[int, str] = {}
    if chat is not None:
        prompt_tokens, mask_sums, errs = _tokenize(
            chat,
            messages.to_pylist(),
            f["prompt_len"],
            f["has_response"],
            tools.to_pylist(),
            np.flatnonzero(candidate),
            kwargs,
        )
        for r, msg in errs.items():
            bits[r] |= 1 << REASONS.index("template_error")
            details[r] = msg
        too_long = np.flatnonzero(candidate & (prompt_tokens > p.max_prompt_tokens))
        bits[too_long] |= 1 << REASONS.index("prompt_too_long")
        for r in too_long:
            details[r] = f"prompt is {prompt_tokens[r]} tokens > audit.max_prompt_tokens={p.max_prompt_tokens}"
        candidate &= bits == 0

    # Duplicates among rows that pass every other check; the first occurrence is kept.
    idx = np.flatnonzero(candidate)
    take = pa.array(idx)
    in_prompt = pa.array(f["in_prompt"])
    norm_turns = pc.binary_join_element_wise(
        pc.fill_null(t.role.filter(in_prompt), ""), _normalized(pc.fill_null(t.content.filter(in_prompt), "")), "\x1f"
    )
    norm_prompt = join_rows(norm_turns, prompt_offsets)
    exact_key, norm_key = _keys(
        pc.binary_join_element_wise(prompt.take(take), tools.take(take), "\x00"),
        pc.binary_join_element_wise(norm_prompt.take(take), tools.take(take), "\x00"),
    )
    exact_dup = state.seen_exact.first_occurrence_mask(exact_key)
    norm_dup = state.seen_norm.first_occurrence_mask(norm_key) & ~exact_dup
    bits[idx[exact_dup]] |= 1 << REASONS.index("duplicate_prompt")
    bits[idx[norm_dup]] |= 1 << REASONS.index("near_duplicate_prompt")
    fresh = ~(exact_dup | norm_dup)
    candidate[idx[~fresh]] = False
    state.seen_exact.add(exact_key[fresh])
    state.seen_norm.add(norm_key[fresh])

    # Final responses (the last turn when it is an assistant turn) for the repetition check: only
    # short ones are counted, after Arrow's own (C++) grouping, so Python hashes one text per group.
    last = t.offsets[1:] - 1
    with_resp = np.flatnonzero(ok & f["has_response"])
    texts = pc.fill_null(t.content.take(pa.array(last[with_resp], pa.int64())), "")
    short = pc.less_equal(pc.utf8_length(texts), REPEAT_MAX_CHARS)
    texts, resp_rows = texts.filter(short), rows[with_resp][short.to_numpy(zero_copy_only=False)]
    if len(texts):
        groups = pc.dictionary_encode(_normalized(texts))
        codes = groups.indices.to_numpy(zero_copy_only=False)
        _, first = np.unique(codes, return_index=True)  # codes number groups in order of first appearance
        (keys,) = _keys(groups.dictionary)
        counts = np.bincount(codes, minlength=len(groups.dictionary))
        state.count_responses(keys, counts, texts.take(pa.array(first)), file, resp_rows[first])

    reasons = {r: [name for k, name in enumerate(REASONS) if bits[r] >> k & 1] for r in np.flatnonzero(ok & ~candidate)}
    state.observe(file, rows, ok, f, prompt_tokens, mask_sums, candidate)
    pending += [
        (int(rows[r]), why, details.get(r, ""), ids[r], messages[r].as_py()[:200]) for r, why in reasons.items()
    ]
    pending += [
        (int(rows[r]), ["malformed"], f"{file}:{rows[r]}: {d}", None, _row_excerpt(table, r))
        for r, d in t.errors.items()
    ]
    for row, why, detail, cid, excerpt in sorted(pending, key=lambda x: x[0]):
        state.reject(file, row, why, detail, cid, excerpt)

    keep = pa.array(candidate)
    n_keep = int(candidate.sum())
    cols = {
        "conversation_id": pa.array(ids, pa.string()).filter(keep),
        "source_file": pa.array([file] * n_keep, pa.string()),
        "source_row": pa.array(rows).filter(keep),
        "messages": messages.filter(keep),
        "prompt_messages": prompt.filter(keep),
        "tools": tools.filter(keep),
        "num_user_turns": pa.array(f["num_user"][candidate].astype(np.int32)),
        "num_assistant_turns": pa.array(f["num_assistant"][candidate].astype(np.int32)),
        "has_system": pa.array(f["has_system"][candidate]),
        "has_tool_calls": pa.array(f["has_tool_calls"][candidate]),
        "prompt_chars": pa.array(f["prompt_chars"][candidate].astype(np.int64)),
        "prompt_tokens": pa.array(prompt_tokens[candidate]),
        "placeholder_turns": pa.array(f["placeholder_turns"][candidate].astype(np.int32)),
        "response_chars": pa.array(f["response_chars"][candidate].astype(np.int64)),
    }
    return pa.Table.from_pydict(cols, schema=OUT_SCHEMA)


def _row_excerpt(table: pa.Table, r: int) -> str:
    row = {k: v for k, v in table.slice(r, 1).to_pylist()[0].items() if v is not None and k != "source_row"}
    return json.dumps(row, ensure_ascii=False)[:200]


# ---------------------------------------------------------------------------- the whole audit


def resolve_tokenizer(setting: str, target_dir: str) -> Path | None:
    """audit.tokenizer -> a folder with tokenizer.json, or None. "auto": the target's if present."""
    if setting == "none":
        return None
    if setting not in ("auto", "target"):
        folder = Path(setting)
        if not (folder / "tokenizer.json").exists():
            raise ValueError(f"audit.tokenizer={setting!r}: {folder}/tokenizer.json not found")
        return folder
    candidates = [Path(target_dir)]
    info = Path(target_dir) / "target.json"
    if info.exists():
        candidates.append(Path(json.loads(info.read_text()).get("model", "")))
    for folder in candidates:
        if (folder / "tokenizer.json").exists():
            return folder
    if setting == "target":
        raise ValueError(
            f"audit.tokenizer=target: no tokenizer.json in {target_dir} (run the target stage) or in the model "
            "folder named by its target.json; set audit.tokenizer to a tokenizer folder or to none"
        )
    log.warning("audit.tokenizer=auto: no tokenizer under %s; auditing without token counts", target_dir)
    return None


def run_audit(p: AuditParams, base: BaseParams) -> dict:
    """Audit `p.input`, write every output under `p.out`, return the metrics (also in audit.json).
    Gates are evaluated into the metrics; the caller decides to fail (`failed_gates`)."""
    start = time.perf_counter()
    out = Path(p.out)
    folder = resolve_tokenizer(p.tokenizer, base.target_dir)
    chat = load_fast_chat(folder) if folder is not None else None
    kwargs = template_kwargs(base.enable_thinking, base.chat_template_kwargs)
    state = AuditState(p)
    options = ipc.IpcWriteOptions(compression="zstd")
    with (
        atomic_path(out / "conversations.arrow") as tmp,
        pa.OSFile(str(tmp), "wb") as sink,
        ipc.new_file(sink, OUT_SCHEMA, options=options) as writer,
        atomic_path(out / "rejected.jsonl") as rej_tmp,
        open(rej_tmp, "w", encoding="utf-8") as rejected,
    ):
        state.rejected_file = rejected
        for chunk in prefetch(iter_chunks(p.input, p.chunk_bytes)):
            state.files.add(chunk.file)
            kept = audit_chunk(chunk, state, chat, kwargs)
            if kept.num_rows:
                writer.write_table(kept)
    metrics = state.metrics(tokenizer=str(folder) if folder else None)
    # The pipeline's target (its tokenizer counted the prompt tokens): a plan of another target ignores this file.
    metrics["target_signature"] = target_signature(Path(base.target_dir) / "config.json")
    metrics["gates"] = evaluate_gates(metrics, p.gates, GATE_FIXES)  # each gate compares the metric of its name
    metrics["failed_gates"] = failed_gates(metrics["gates"])
    metrics["gate_failed"] = bool(metrics["failed_gates"])
    metrics["elapsed_s"] = round(time.perf_counter() - start, 3)
    metrics["rows_per_s"] = round(metrics["num_rows"] / max(metrics["elapsed_s"], 1e-9), 1)
    write_outputs(out, metrics, state)
    return metrics


__all__ = [
    "GATE_FIXES",
    "OUT_SCHEMA",
    "REASONS",
    "conversation_id",
    "evaluate_gates",
    "failed_gates",
    "gate_failure_message",
    "loss_mask_spike",
    "resolve_tokenizer",
    "run_audit",
]
