"""The audit's checks of one chunk of conversations: rejection reasons, placeholder and empty answers,
role order, duplicates, prompt tokens, repeated responses; the kept rows in CONVERSATIONS_SCHEMA.

Speed: each chunk of input is parsed by pyarrow and checked with pyarrow.compute / numpy over all
its turns at once; Python touches each row only to hash it. Memory is bounded by the chunk size
plus ~50 bytes a kept row for the duplicate keys, their first-occurrence refs and prompt lengths
(dflash/audit/state.py), whatever the size
of the text. The stage around it: dflash/audit/run.py.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dflash.audit.records import SHAREGPT_ROLES
from dflash.audit.state import AuditState, segment_max, segment_min, segment_sum
from dflash.audit.tokens import TokenPath
from dflash.audit.turns import ROLES, Turns, flatten_turns, join_rows, turn_json
from dflash.core.contracts import CONVERSATIONS_SCHEMA
from dflash.core.io import canonical_json

log = logging.getLogger(__name__)

REASONS = (
    "malformed",  # bad JSON / UTF-8, missing fields, wrong types
    "non_text_part",  # a message content part that is not text (image_url, input_audio, file...): multimodal data
    "unknown_role",  # a role outside system/user/assistant/tool (after ShareGPT mapping)
    "first_turn_not_user",  # the first turn after optional system prompts is not from the user
    "no_user_turn",  # the prompt has no user turn (nothing to answer)
    "empty_prompt",  # the last user turn of the prompt is empty or whitespace
    "assistant_after_assistant",  # an assistant turn right after an assistant turn without tool calls (no user
    # turn between: it answers nothing, and chat templates render the earlier turn differently once one follows)
    "template_error",  # the target's chat template refused the conversation
    "prompt_too_long",  # prompt tokens > audit.max_prompt_tokens
    "duplicate_prompt",  # same prompt (messages + tools) as an earlier kept row
    "near_duplicate_prompt",  # same prompt up to case and whitespace as an earlier kept row
)
REPEAT_MAX_CHARS = 1024  # responses longer than this are not counted for repetition (mass-repeated texts are short)


# ---------------------------------------------------------------------------- public helpers


def conversation_id(messages: list[dict], tools: list[dict] | None = None) -> str:
    """The stable id: first 16 hex chars of sha256 of canonical JSON {"messages": ..., "tools": [...]}."""
    return hashlib.sha256(canonical_json({"messages": messages, "tools": tools or []}).encode()).hexdigest()[:16]


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
    # calls, a tool turn not answering a call, a system turn after the start. Assistant after assistant
    # is also a rejection (assistant_after_assistant): the first such turn is named in the detail.
    prev = np.roll(code, 1)
    prev_call = np.roll(has_call, 1)
    has_prev = pos > 0
    double = has_prev & asst & (prev == 2) & ~prev_call
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
        "assistant_after_assistant": segment_sum(double, off) > 0,
        "double_pos": segment_min(np.where(double, pos, np.iinfo(np.int64).max), off),
        "prompt_chars": segment_sum(np.where(in_prompt, content_len, 0), off),
        "response_chars": segment_sum(np.where(response, content_len + reasoning_len + calls_len, 0), off),
        "has_response": prompt_len < length,
        "placeholder_turns": segment_sum(placeholder, off),
        "empty_turns": segment_sum(empty, off),
        "placeholder_in_prompt": segment_sum(placeholder & in_prompt, off),
        "assistant_turns": int(asst.sum()),
        "placeholder_turn_total": int(placeholder.sum()),
    }


def audit_chunk(chunk, state: AuditState, chat, kwargs: dict) -> pa.Table:
    """Check one chunk, update `state` (counts, keys, histograms, rejected rows) and return its kept rows."""
    p = state.params
    table, file = chunk.table, chunk.file
    state.note_chunk(chunk)
    n = table.num_rows
    rows = table.column("source_row").to_numpy()
    pending = [(m.row, [m.reason], m.detail, None, m.excerpt) for m in chunk.malformed]
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
    for key in ("unknown_role", "first_turn_not_user", "no_user_turn", "empty_prompt", "assistant_after_assistant"):
        bits |= (f[key] & ok).astype(np.int32) << REASONS.index(key)
    candidate = ok & (bits == 0)
    details: dict[int, str] = {}
    for r in np.flatnonzero(ok & f["assistant_after_assistant"]):
        details[int(r)] = (
            f"turn {f['double_pos'][r]}: an assistant turn right after an assistant turn without tool calls "
            "(no user turn between); merge the two answers or drop one"
        )
    why = _role_details(t, table, np.flatnonzero(f["unknown_role"] & ok))  # row -> what the reason means here

    prompt_tokens = np.full(n, -1, dtype=np.int64)
    mask_sums = np.full(n, -1, dtype=np.int64)
    sampled = np.zeros(n, dtype=bool)
    if chat is not None:  # dflash/audit/tokens.py: exact verdicts, counts where needed and for a seeded sample
        if state.tokens is None:
            state.tokens = TokenPath(chat, p, kwargs)
        tok = state.tokens.chunk(chunk.ref, t, f, messages, tools, ids, candidate)
        prompt_tokens, mask_sums, sampled = tok.prompt_tokens, tok.mask_sums, tok.sampled
        for r, msg in tok.errors.items():
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
    refs = state.ref_code(file, rows[idx])
    exact_dup, exact_first = state.seen_exact.lookup(exact_key, refs)
    norm_dup, norm_first = state.seen_norm.lookup(norm_key, refs)
    norm_dup &= ~exact_dup
    bits[idx[exact_dup]] |= 1 << REASONS.index("duplicate_prompt")
    bits[idx[norm_dup]] |= 1 << REASONS.index("near_duplicate_prompt")
    for k in np.flatnonzero(exact_dup | norm_dup):
        first, what = (exact_first[k], "same") if exact_dup[k] else (norm_first[k], "same (up to case and whitespace)")
        why[idx[k]] = f"{what} prompt as {state.ref_text(int(first))}, which is kept"
    fresh = ~(exact_dup | norm_dup)
    candidate[idx[~fresh]] = False
    state.seen_exact.add(exact_key[fresh], refs[fresh])
    state.seen_norm.add(norm_key[fresh], refs[fresh])

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
    state.observe(file, rows, ok, f, prompt_tokens, mask_sums, candidate, sampled)
    pending += [
        (
            int(rows[r]),
            names,
            f"{chunk.ref(r)}: {details.get(r) or why.get(r) or REASON_TEXT[names[0]]}",
            ids[r],
            messages[r].as_py()[:200],
        )
        for r, names in reasons.items()
    ]
    pending += [
        (int(rows[r]), ["malformed"], f"{chunk.ref(r)}: {d}", None, _row_excerpt(table, r)) for r, d in t.errors.items()
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
    return pa.Table.from_pydict(cols, schema=CONVERSATIONS_SCHEMA)


REASON_TEXT = {  # the detail of a rejection when nothing more specific is known
    "unknown_role": "a role outside system / user / assistant / tool",
    "first_turn_not_user": "the first turn after the system prompt is not from the user",
    "no_user_turn": "the prompt has no user turn",
    "empty_prompt": "the last user turn of the prompt is empty or whitespace",
    "template_error": "the chat template refused the conversation",
    "prompt_too_long": "the prompt is longer than audit.max_prompt_tokens",
    "duplicate_prompt": "same prompt as an earlier kept row",
    "near_duplicate_prompt": "same prompt up to case and whitespace as an earlier kept row",
}


def _role_details(t, table: pa.Table, rows: np.ndarray) -> dict[int, str]:
    """'messages[2].role is "narrator"...' for the rows with an unknown role: the first such turn."""
    out: dict[int, str] = {}
    if not len(rows):
        return out
    sharegpt = table.column("messages").is_null().to_numpy(zero_copy_only=False)
    for r in rows.tolist():
        for j in range(int(t.offsets[r]), int(t.offsets[r + 1])):
            role = t.role[j].as_py()
            if role not in ROLES:
                w = -1 if t.where is None else int(t.where[j])
                if sharegpt[r]:
                    out[r] = f"conversations[{w}].from is {role!r}: not one of {', '.join(SHAREGPT_ROLES)}"
                else:
                    out[r] = f"messages[{w}].role is {role!r}: not one of {', '.join(ROLES)}"
                break
    return out


def _row_excerpt(table: pa.Table, r: int) -> str:
    row = {k: v for k, v in table.slice(r, 1).to_pylist()[0].items() if v is not None and k != "source_row"}
    return json.dumps(row, ensure_ascii=False)[:200]
