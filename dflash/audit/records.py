"""One raw conversation row in one layout: the RAW Arrow schema, and the Python reader for rows Arrow refuses.

Each input row holds either OpenAI `messages` (roles system/user/assistant/tool; `content`, `tool_calls`,
`tool_call_id`, `name`, `reasoning_content`) or ShareGPT `conversations` (`from`/`value`; roles
human/gpt/system/function_call/observation/tool), optionally a top-level `system` (ShareGPT) and
`tools` (a list, or a JSON string of one).

`Chunk.table` (RAW_SCHEMA): source_row int64, messages list<MESSAGE>, conversations list<{from, value}>,
system string, tools string (canonical JSON list, null if absent). `Chunk.malformed` lists the rows that
could not be read, each with a detail naming file and line. `coerce_record` fixes representation only
(content parts, argument objects, tools as a string); missing roles and contents stay None for the
vectorised checks (dflash.audit.checks), so both read paths judge rows alike.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from dflash.core.io import canonical_json

TOOL_CALL = pa.struct(
    [
        ("id", pa.string()),
        ("type", pa.string()),
        ("function", pa.struct([("name", pa.string()), ("arguments", pa.string())])),
    ]
)
MESSAGE = pa.struct(
    [
        ("role", pa.string()),
        ("content", pa.string()),
        ("name", pa.string()),
        ("tool_call_id", pa.string()),
        ("reasoning_content", pa.string()),
        ("tool_calls", pa.list_(TOOL_CALL)),
    ]
)
SHAREGPT_TURN = pa.struct([("from", pa.string()), ("value", pa.string())])
PARSE_SCHEMA = pa.schema(
    [("messages", pa.list_(MESSAGE)), ("conversations", pa.list_(SHAREGPT_TURN)), ("system", pa.string())]
)
RAW_SCHEMA = pa.schema([("source_row", pa.int64()), *PARSE_SCHEMA, ("tools", pa.string())])
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "function_call": "assistant",
    "observation": "tool",
    "tool": "tool",
}
EXCERPT_CHARS = 200


class RowError(ValueError):
    """One input row that cannot be read; the message says what is wrong (the caller adds file:line)."""


@dataclass
class Malformed:
    row: int  # source_row (see module docstring)
    detail: str  # "FILE:LINE: what is wrong"
    excerpt: str  # first ~200 characters of the raw row


@dataclass
class Chunk:
    file: str
    table: pa.Table  # RAW_SCHEMA
    malformed: list[Malformed] = field(default_factory=list)


def excerpt(raw: bytes | str) -> str:
    text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
    return text[:EXCERPT_CHARS]


def _str(value: Any, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise RowError(f"{where}: expected a string, got {type(value).__name__}")


def _content(value: Any, where: str) -> str | None:
    """A string, or OpenAI content parts [{"type": "text", "text": ...}] joined into one string."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RowError(f"{where}[{i}]: only text content parts are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise RowError(f"{where}: expected a string or a list of text parts, got {type(value).__name__}")


def _tool_call(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise RowError(f"{where}: expected an object, got {type(value).__name__}")
    fn = value.get("function")
    if fn is not None and not isinstance(fn, dict):
        raise RowError(f"{where}.function: expected an object, got {type(fn).__name__}")
    out_fn = None
    if fn is not None:
        args = fn.get("arguments")
        if args is not None and not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)  # some datasets store the arguments object itself
        out_fn = {"name": _str(fn.get("name"), f"{where}.function.name"), "arguments": args}
    return {
        "id": _str(value.get("id"), f"{where}.id"),
        "type": _str(value.get("type"), f"{where}.type"),
        "function": out_fn,
    }


def tools_json(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):  # LLaMA-Factory stores tools as a JSON string
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise RowError(f"tools: not valid JSON ({exc.msg})") from None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise RowError("tools: expected a list of tool definitions (objects)")
    return canonical_json(value) if value else None


def coerce_record(obj: Any) -> dict:
    """One parsed JSON row -> a dict of RAW_SCHEMA fields (without source_row). Raises RowError.

    Only representation is fixed here (content parts, argument objects, tools as a string); missing
    roles / contents are left as None for the vectorised checks, so both paths judge rows alike."""
    if not isinstance(obj, dict):
        raise RowError(f"row is not a JSON object (got {type(obj).__name__})")
    messages, conversations = obj.get("messages"), obj.get("conversations")
    out: dict[str, Any] = {
        "messages": None,
        "conversations": None,
        "system": None,
        "tools": tools_json(obj.get("tools")),
    }
    if messages is not None:
        if not isinstance(messages, list):
            raise RowError(f"messages: expected a list, got {type(messages).__name__}")
        rows = []
        for i, m in enumerate(messages):
            w = f"messages[{i}]"
            if m is None:
                rows.append(None)
                continue
            if not isinstance(m, dict):
                raise RowError(f"{w}: expected an object, got {type(m).__name__}")
            calls = m.get("tool_calls")
            if calls is not None and not isinstance(calls, list):
                raise RowError(f"{w}.tool_calls: expected a list, got {type(calls).__name__}")
            rows.append(
                {
                    "role": _str(m.get("role"), f"{w}.role"),
                    "content": _content(m.get("content"), f"{w}.content"),
                    "name": _str(m.get("name"), f"{w}.name"),
                    "tool_call_id": _str(m.get("tool_call_id"), f"{w}.tool_call_id"),
                    "reasoning_content": _str(m.get("reasoning_content"), f"{w}.reasoning_content"),
                    "tool_calls": None
                    if calls is None
                    else [_tool_call(c, f"{w}.tool_calls[{k}]") for k, c in enumerate(calls)],
                }
            )
        out["messages"] = rows
    elif conversations is not None:
        if not isinstance(conversations, list):
            raise RowError(f"conversations: expected a list, got {type(conversations).__name__}")
        turns = []
        for i, t in enumerate(conversations):
            if t is not None and not isinstance(t, dict):
                raise RowError(f"conversations[{i}]: expected an object, got {type(t).__name__}")
            turns.append(
                None
                if t is None
                else {
                    "from": _str(t.get("from"), f"conversations[{i}].from"),
                    "value": _content(t.get("value"), f"conversations[{i}].value"),
                }
            )
        out["conversations"] = turns
        out["system"] = _str(obj.get("system"), "system")
    else:
        raise RowError("missing field: neither `messages` nor `conversations`")
    return out


def python_rows(items: list[tuple[int, bytes | str | Any]], file: str, parsed: bool = False) -> Chunk:
    """Read rows with Python (fallback path). items: (source_row, raw line or already-parsed object)."""
    rows, malformed = [], []
    for row, raw in items:
        try:
            obj = raw if parsed else json.loads(raw)
        except json.JSONDecodeError as exc:
            malformed.append(Malformed(row, f"{file}:{row}: bad JSON: {exc.msg} (column {exc.colno})", excerpt(raw)))
            continue
        try:
            rec = coerce_record(obj)
        except RowError as exc:
            malformed.append(
                Malformed(
                    row, f"{file}:{row}: {exc}", excerpt(raw if not parsed else json.dumps(obj, ensure_ascii=False))
                )
            )
            continue
        rec["source_row"] = row
        rows.append(rec)
    return Chunk(file, pa.Table.from_pylist(rows, schema=RAW_SCHEMA), malformed)
