"""Per-turn arrays of a chunk of conversations, and their canonical JSON, built with pyarrow.compute.

`flatten_turns` maps every row of a RAW chunk (dflash.conversations) to its turns in conversation
order, with ShareGPT roles mapped to OpenAI ones (human->user, gpt->assistant, function_call->
assistant with `tool_calls` parsed from the value, observation/tool->tool), a top-level ShareGPT
`system` as a leading system turn, and OpenAI tool calls normalized to
{"id", "type": "function", "function": {"name", "arguments": JSON string}}. Structure errors (missing
role or content, a call without a function name, an unparseable function_call) are reported per row.

`turn_json` / `join_rows` write each turn / row as canonical JSON (`dflash.io.canonical_json`: sorted
keys, no spaces, UTF-8 kept) without a Python loop; tests check the text against json.dumps.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dflash.audit.records import SHAREGPT_ROLES, RowError
from dflash.core.io import canonical_json

ROLES = ("system", "user", "assistant", "tool")


@dataclass
class Turns:
    """Every turn of a chunk, in conversation order; roles already mapped to OpenAI names."""

    offsets: np.ndarray  # (rows + 1,) int64: turns of row r are [offsets[r], offsets[r+1])
    parent: np.ndarray  # (turns,) int64 row of each turn
    pos: np.ndarray  # (turns,) int64 position inside its conversation
    role: pa.Array  # string; unknown roles kept as written; null when missing
    content: pa.Array  # string; null when missing
    reasoning: pa.Array  # string or null
    name: pa.Array  # string or null
    tool_call_id: pa.Array  # string or null
    tool_calls: pa.Array  # canonical JSON of the normalized OpenAI tool calls, or null
    errors: dict[int, str]  # row -> what is structurally wrong (missing role/content, bad function_call...)
    where: np.ndarray | None = (
        None  # (turns,) index of each turn in its row's list as written (-1: the added system turn)
    )


def _normalize_calls(calls: list, where: str, turn: int) -> str:
    """OpenAI tool calls -> canonical JSON; a missing id becomes call_{turn}_{k} (unique in the conversation)."""
    out = []
    for k, c in enumerate(calls):
        fn = (c or {}).get("function") or {}
        if not fn.get("name"):
            raise RowError(f"{where}.tool_calls[{k}]: missing function name")
        args = fn.get("arguments")
        out.append(
            {
                "id": c.get("id") or f"call_{turn}_{k}",
                "type": c.get("type") or "function",
                "function": {"name": fn["name"], "arguments": "{}" if args is None else args},
            }
        )
    return canonical_json(out)


def _sharegpt_call(value: str | None) -> list:
    """ShareGPT `function_call` value: JSON {"name", "arguments"} -> one OpenAI tool call."""
    try:
        obj = json.loads(value or "")
    except json.JSONDecodeError:
        raise RowError("function_call value is not JSON") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise RowError('function_call value must be {"name": ..., "arguments": ...}')
    args = obj.get("arguments", {})
    return [
        {
            "id": None,
            "type": "function",
            "function": {
                "name": obj["name"],
                "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
            },
        }
    ]


def flatten_turns(table: pa.Table) -> Turns:
    n = table.num_rows
    msgs = table.column("messages").combine_chunks()
    convs = table.column("conversations").combine_chunks()
    system = table.column("system").combine_chunks()
    msg_valid = msgs.is_valid().to_numpy(zero_copy_only=False)
    errors: dict[int, str] = {}

    flat_m, parent_m = msgs.flatten(), msgs.value_parent_indices().to_numpy()
    flat_s, parent_s = convs.flatten(), convs.value_parent_indices().to_numpy()
    keep_s = ~msg_valid[parent_s]  # `messages` wins when a row has both
    flat_s, parent_s = flat_s.filter(pa.array(keep_s)), parent_s[keep_s]
    conv_valid = convs.is_valid().to_numpy(zero_copy_only=False) & ~msg_valid
    for r in np.flatnonzero(~msg_valid & ~conv_valid):
        errors[int(r)] = "missing field: neither `messages` nor `conversations`"

    # ShareGPT -> OpenAI roles; unknown names stay as written so the audit can count them.
    sg_from = pc.struct_field(flat_s, "from") if len(flat_s) else pa.array([], pa.string())
    mapped = pc.take(
        pa.array(list(SHAREGPT_ROLES.values())), pc.index_in(sg_from, value_set=pa.array(list(SHAREGPT_ROLES)))
    )
    sg_role = pc.coalesce(mapped, sg_from)
    sg_value = pc.struct_field(flat_s, "value") if len(flat_s) else pa.array([], pa.string())

    # A top-level ShareGPT `system` becomes a leading system turn (unless the first turn is one).
    system_len = pc.fill_null(pc.utf8_length(pc.utf8_trim_whitespace(system)), 0).to_numpy()
    sys_rows = np.flatnonzero(conv_valid & (system_len > 0))
    if len(sys_rows):
        rows, first = np.unique(parent_s, return_index=True)
        opens_with_system = pc.fill_null(pc.equal(pc.take(sg_from, pa.array(first, pa.int64())), "system"), False)
        sys_rows = sys_rows[~np.isin(sys_rows, rows[opens_with_system.to_numpy(zero_copy_only=False)])]
    n_m, n_s, n_x = len(flat_m), len(flat_s), len(sys_rows)

    def field(name, arr, length):
        return pc.struct_field(arr, name) if length else pa.array([], pa.string())

    nulls = pa.nulls
    role = pa.concat_arrays(
        [field("role", flat_m, n_m), sg_role.cast(pa.string()), pa.array(["system"] * n_x, pa.string())]
    )
    content = pa.concat_arrays([field("content", flat_m, n_m), sg_value, system.take(pa.array(sys_rows, pa.int64()))])
    reasoning = pa.concat_arrays([field("reasoning_content", flat_m, n_m), nulls(n_s + n_x, pa.string())])
    name = pa.concat_arrays([field("name", flat_m, n_m), nulls(n_s + n_x, pa.string())])
    call_id = pa.concat_arrays([field("tool_call_id", flat_m, n_m), nulls(n_s + n_x, pa.string())])
    parent = np.concatenate([parent_m, parent_s, sys_rows]).astype(np.int64)
    sub = np.concatenate([np.ones(n_m + n_s, dtype=np.int8), np.zeros(n_x, dtype=np.int8)])
    order = np.lexsort((np.arange(len(parent)), sub, parent))
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))
    parent = parent[order]
    counts = np.bincount(parent, minlength=n)
    offsets = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    pos = np.arange(len(parent), dtype=np.int64) - offsets[parent]
    take = pa.array(order)
    role, content, reasoning, name, call_id = (pc.take(a, take) for a in (role, content, reasoning, name, call_id))
    added = np.zeros(n, dtype=np.int64)
    added[sys_rows] = 1
    where = pos - added[parent]  # index in the row as written (error messages name it)

    # Tool calls: canonical JSON built in Python, only for the (few) turns that have them.
    calls: dict[int, str] = {}
    if n_m:
        tc = pc.struct_field(flat_m, "tool_calls")
        has = pc.fill_null(pc.greater(pc.list_value_length(tc), 0), False).to_numpy(zero_copy_only=False)
        for i, value in zip(np.flatnonzero(has), tc.filter(pa.array(has)).to_pylist(), strict=True):
            j = int(inverse[i])
            try:
                calls[j] = _normalize_calls(value, f"messages[{where[j]}]", int(pos[j]))
            except RowError as exc:
                errors.setdefault(int(parent[j]), str(exc))
    if n_s:
        is_call = pc.fill_null(pc.equal(sg_from, "function_call"), False).to_numpy(zero_copy_only=False)
        for i in np.flatnonzero(is_call):
            j = int(inverse[n_m + i])
            try:
                calls[j] = _normalize_calls(
                    _sharegpt_call(sg_value[i].as_py()), f"conversations[{where[j]}]", int(pos[j])
                )
            except RowError as exc:
                errors.setdefault(int(parent[j]), f"conversations[{where[j]}]: {exc}")
    tool_calls = nulls(len(parent), pa.string())
    if calls:
        mask = np.zeros(len(parent), dtype=bool)
        mask[list(calls)] = True
        tool_calls = pc.replace_with_mask(
            tool_calls, pa.array(mask), pa.array([calls[j] for j in sorted(calls)], pa.string())
        )
        # A call turn's text may be absent (OpenAI: content null) and a ShareGPT function_call's value IS
        # the call: both get content "".
        from_sharegpt = np.zeros(len(parent), dtype=bool)
        from_sharegpt[inverse[n_m : n_m + n_s]] = True
        blank = mask & (from_sharegpt | pc.is_null(content).to_numpy(zero_copy_only=False))
        content = pc.if_else(pa.array(blank), pa.scalar("", pa.string()), content)

    # Structure errors: a missing role, or missing content (allowed only on assistant tool calls).
    missing_role = pc.is_null(role).to_numpy(zero_copy_only=False)
    missing_content = pc.is_null(content).to_numpy(zero_copy_only=False)
    for j in np.flatnonzero(missing_role | missing_content):
        r = int(parent[j])
        key = "messages" if msg_valid[r] else "conversations"
        what = "role" if missing_role[j] else "content"
        if not msg_valid[r]:
            what = "from" if missing_role[j] else "value"
        errors.setdefault(r, f"{key}[{where[j]}]: missing {what}")
    return Turns(offsets, parent, pos, role, content, reasoning, name, call_id, tool_calls, errors, where)


# ---------------------------------------------------------------------------- canonical JSON


def escape(arr: pa.Array) -> pa.Array:
    """JSON string escaping exactly as json.dumps(ensure_ascii=False) does it. Only the rows that need
    it are rewritten (most roles and many texts need nothing)."""
    # Rows with a quote, a backslash, or anything but printable ASCII (a superset of control characters;
    # the replacements are no-ops on the rest). Plain kernels: a regex pass costs as much as all three.
    need = pc.fill_null(
        pc.or_(
            pc.invert(pc.ascii_is_printable(arr)), pc.or_(pc.match_substring(arr, '"'), pc.match_substring(arr, "\\"))
        ),
        False,
    )
    n_need = pc.sum(need).as_py() or 0
    if n_need == 0:
        return arr
    sub = arr.filter(need)
    for raw, esc in (
        ("\\", "\\\\"),
        ('"', '\\"'),
        ("\n", "\\n"),
        ("\r", "\\r"),
        ("\t", "\\t"),
        ("\b", "\\b"),
        ("\f", "\\f"),
    ):
        sub = pc.replace_substring(sub, raw, esc)
    if pc.any(pc.match_substring_regex(sub, r"[\x00-\x1f]")).as_py():
        for code in [*range(0x08), 0x0B, *range(0x0E, 0x20)]:
            sub = pc.replace_substring(sub, chr(code), f"\\u{code:04x}")
    return pc.replace_with_mask(arr, need, sub) if n_need < len(arr) else sub


def quoted(arr: pa.Array) -> pa.Array:
    return pc.binary_join_element_wise('"', escape(arr), '"', "")


def turn_json(t: Turns) -> pa.Array:
    """Each turn as canonical JSON (sorted keys: content, name, reasoning_content, role, tool_call_id, tool_calls)."""
    pieces: list = ['{"content":"', escape(pc.fill_null(t.content, "")), '"']
    for key, value, is_text in (
        ("name", t.name, True),
        ("reasoning_content", t.reasoning, True),
        ("role", None, True),
        ("tool_call_id", t.tool_call_id, True),
        ("tool_calls", t.tool_calls, False),
    ):
        if key == "role":
            pieces += [',"role":"', escape(pc.fill_null(t.role, "")), '"']
        elif value.null_count < len(value):  # an optional key: present only where the value is not null
            quote = '"' if is_text else ""
            # emit_null: a null value makes the whole piece null, which the outer join drops
            pieces.append(
                pc.binary_join_element_wise(f',"{key}":{quote}', escape(value) if is_text else value, quote, "")
            )
    return pc.binary_join_element_wise(*pieces, "}", "", null_handling="replace", null_replacement="")


def join_rows(values: pa.Array, offsets: np.ndarray) -> pa.Array:
    """Per-row JSON list text from per-turn JSON pieces."""
    lists = pa.ListArray.from_arrays(pa.array(offsets, pa.int64()).cast(pa.int32()), values)
    return pc.binary_join_element_wise("[", pc.binary_join(lists, ","), "]", "")
