"""One raw conversation row in one layout: the RAW Arrow schema, and the Python reader for rows Arrow refuses.

Each input row holds either OpenAI `messages` (roles system/user/assistant/tool; `content`, `tool_calls`,
`tool_call_id`, `name`, `reasoning_content`) or ShareGPT `conversations` (`from`/`value`; roles
human/gpt/system/function_call/observation/tool), optionally a top-level `system` (ShareGPT) and
`tools` (a list, or a JSON string of one).

`Chunk.table` (RAW_SCHEMA): source_row int64, messages list<MESSAGE>, conversations list<{from, value}>,
system string, tools string (canonical JSON list, null if absent). `Chunk.malformed` lists the rows that
could not be read (reason `malformed`) or hold content parts that are not text (reason `non_text_part`), each
with a detail that starts with `row_ref` (the one place that says what a row
number means: `FILE:line N` for JSONL, `FILE element N (line L)` for a JSON array, `FILE row N` for
parquet). A chunk also carries what its reader noticed about the file: empty, folder files skipped,
regions that could not be read (a JSON array's syntax error, trailing data). `coerce_record` fixes representation only
(content parts, argument objects, tools as a string); missing roles and contents stay None for the
vectorised checks (dflash.audit.checks), so both read paths judge rows alike.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
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
    """One input row that cannot be read; the message says what is wrong (the caller adds file:line).
    `reason`: the rejection reason it counts under (dflash/audit/checks.py REASONS)."""

    reason = "malformed"


class NonTextPart(RowError):
    """A message whose content holds a part the pipeline cannot train on (an image, audio, a file): readable
    data, but not text; its own rejection reason, so that a report can say the data is multimodal."""

    reason = "non_text_part"


# What a source_row means per reader: JSONL (1-based line), JSON array (0-based element), and 0-based row
# indices for parquet and Arrow files, save_to_disk folders (the dataset's index) and hub splits (the split's).
KINDS = ("jsonl", "json", "parquet", "arrow", "hf")


def row_ref(kind: str, file: str, row: int, line: int | None = None) -> str:
    """What a source_row means, spelled out: `FILE:line N`, `FILE element N (line L)`, or `FILE row N` for the
    columnar kinds (FILE: a parquet or Arrow file, a save_to_disk folder, or `hf:ID split S`)."""
    if kind == "jsonl":
        return f"{file}:line {row}"
    if kind == "json":
        return f"{file} element {row}" + (f" (line {line})" if line is not None else "")
    return f"{file} row {row}"


@dataclass
class Malformed:
    row: int  # source_row (see module docstring)
    detail: str  # "REF: what is wrong", REF from row_ref
    excerpt: str  # first ~200 characters of the raw row
    reason: str = "malformed"  # RowError.reason: malformed, or non_text_part


@dataclass
class Chunk:
    file: str
    table: pa.Table  # RAW_SCHEMA
    malformed: list[Malformed] = field(default_factory=list)
    kind: str = "jsonl"  # one of KINDS: what source_row means
    lines: np.ndarray | None = None  # JSON arrays: the line each table row starts on
    empty: bool = False  # the file holds no rows at all (0 bytes, only whitespace, 0-row parquet)
    skipped: list[str] = field(default_factory=list)  # folder files that are not inputs (first chunk only)
    unreadable: list[dict] = field(default_factory=list)  # regions that could not be read: file, lines, bytes, ...
    form: str = ""  # what the file was read as, from its bytes (forms.Form.label: "gzip-compressed JSON lines")
    form_note: str = ""  # where that differs from its name: "read as a JSON array, though named .jsonl"

    def ref(self, i: int) -> str:
        """row_ref of table row i."""
        row = int(self.table.column("source_row")[i].as_py())
        return row_ref(self.kind, self.file, row, None if self.lines is None else int(self.lines[i]))


def excerpt(raw: bytes | str) -> str:
    """The first EXCERPT_CHARS characters, always writable as UTF-8 (bad bytes / lone surrogates escaped)."""
    text = raw[: 4 * EXCERPT_CHARS].decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
    text = text[:EXCERPT_CHARS]
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def json_depth(text: str | bytes) -> int:
    """Deepest nesting of brackets in a JSON text, strings skipped (only called on rows too deep to parse)."""
    text = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
    depth = best = 0
    for m in _TOKENS.finditer(text):
        ch = m.group()
        if ch in "[{":
            depth += 1
            best = max(best, depth)
        elif ch in "]}":
            depth -= 1
    return best


def too_deep(text: str | bytes) -> str:
    return f"nested {json_depth(text)} levels deep (the JSON reader stops near {sys.getrecursionlimit()})"


def lone_surrogate(value: Any, where: str = "") -> str | None:
    """Where a string of a parsed row holds a lone surrogate (a JSON escape like \\ud800 with no pair,
    which UTF-8 cannot encode), e.g. 'lone surrogate \\ud800 at messages[0].content'; None if none."""
    stack = [(value, where)]
    while stack:
        v, w = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as exc:
                code = ord(v[exc.start])
                return f"lone surrogate \\u{code:04x} at {w or 'the row'} (character {exc.start})"
        elif isinstance(v, dict):
            stack.extend((x, f"{w}.{k}" if w else str(k)) for k, x in reversed(list(v.items())))
        elif isinstance(v, list):
            stack.extend((x, f"{w}[{i}]") for i, x in reversed(list(enumerate(v))))
    return None


def _str(value: Any, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise RowError(f"{where}: expected a string, got {type(value).__name__}")


def _content(value: Any, where: str) -> str | None:
    """A string, or OpenAI content parts [{"type": "text", "text": ...}] joined into one string. A part of
    another type (image_url, input_audio, file...) is NonTextPart: readable, but nothing to train a text drafter on."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                others = sorted({p["type"] for p in value if isinstance(p, dict) and isinstance(p.get("type"), str)})
                raise NonTextPart(
                    f"{where}[{i}]: a content part of type {kind!r} (parts: {', '.join(others)}); the pipeline trains on "
                    "text only: drop the non-text parts or the row at the source"
                )
            if kind != "text" or not isinstance(part.get("text"), str):
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
        except RecursionError:
            raise RowError(f"tools: {too_deep(value)}") from None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise RowError("tools: expected a list of tool definitions (objects)")
    if not value:
        return None
    try:
        text = canonical_json(value)
        text.encode("utf-8")
    except RecursionError:
        raise RowError("tools: nested too deep to write back as JSON") from None
    except UnicodeEncodeError:
        raise RowError(lone_surrogate(value, "tools") or "tools: not encodable as UTF-8") from None
    return text


def json_column(value: Any, name: str) -> Any:
    """A conversation stored as a JSON string (common in exported datasets) -> the parsed value; anything
    else as it is. RowError naming the column (`name`) when the string is not JSON."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise RowError(f"{name}: a string that is not valid JSON: {exc.msg} (character {exc.pos})") from None
    except RecursionError:
        raise RowError(f"{name}: a JSON string {too_deep(value)}") from None


def coerce_record(obj: Any, names: dict[str, str] | None = None) -> dict:
    """One parsed JSON row -> a dict of RAW_SCHEMA fields (without source_row). Raises RowError.

    Only representation is fixed here (content parts, argument objects, tools as a string, a conversation
    held as a JSON string); missing roles / contents are left as None for the vectorised checks, so both
    paths judge rows alike. `names`: the source's own name of a field (a renamed column), for the errors."""
    if not isinstance(obj, dict):
        raise RowError(f"row is not a JSON object (got {type(obj).__name__})")
    names = names or {}
    m_name, c_name = names.get("messages", "messages"), names.get("conversations", "conversations")
    messages = json_column(obj.get("messages"), m_name)
    conversations = None if messages is not None else json_column(obj.get("conversations"), c_name)
    out: dict[str, Any] = {
        "messages": None,
        "conversations": None,
        "system": None,
        "tools": tools_json(obj.get("tools")),
    }
    if messages is not None:
        if not isinstance(messages, list):
            raise RowError(f"{m_name}: expected a list, got {type(messages).__name__}")
        rows = []
        for i, m in enumerate(messages):
            w = f"{m_name}[{i}]"
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
            raise RowError(f"{c_name}: expected a list, got {type(conversations).__name__}")
        turns = []
        for i, t in enumerate(conversations):
            if t is not None and not isinstance(t, dict):
                raise RowError(f"{c_name}[{i}]: expected an object, got {type(t).__name__}")
            turns.append(
                None
                if t is None
                else {
                    "from": _str(t.get("from"), f"{c_name}[{i}].from"),
                    "value": _content(t.get("value"), f"{c_name}[{i}].value"),
                }
            )
        out["conversations"] = turns
        out["system"] = _str(obj.get("system"), names.get("system", "system"))
    else:
        raise RowError("missing field: neither `messages` nor `conversations`")
    return out


def _loads_error(exc: json.JSONDecodeError) -> str:
    if exc.msg == "Extra data":
        return f"extra data after the object at column {exc.colno}: JSONL needs exactly one object per line"
    return f"bad JSON: {exc.msg} (column {exc.colno})"


def python_rows(
    items: list[tuple[int, bytes | str | Any]],
    file: str,
    parsed: bool = False,
    kind: str = "jsonl",
    lines: list[int] | None = None,
    names: dict[str, str] | None = None,
) -> Chunk:
    """Read rows with Python (fallback path). items: (source_row, raw line or already-parsed object);
    lines: for JSON arrays, the line each item starts on (details name it); names: see coerce_record."""
    rows, malformed, kept_lines = [], [], []
    for k, (row, raw) in enumerate(items):
        line = None if lines is None else lines[k]
        ref = row_ref(kind, file, row, line)
        try:
            obj = raw if parsed else json.loads(_text(raw))
        except UnicodeDecodeError as exc:
            malformed.append(Malformed(row, f"{ref}: bad UTF-8 (byte {exc.start})", excerpt(raw)))
            continue
        except json.JSONDecodeError as exc:
            malformed.append(Malformed(row, f"{ref}: {_loads_error(exc)}", excerpt(raw)))
            continue
        except RecursionError:
            malformed.append(Malformed(row, f"{ref}: {too_deep(raw)}", excerpt(raw)))
            continue
        try:
            rec = coerce_record(obj, names)
        except (RowError, RecursionError) as exc:
            why = str(exc) if isinstance(exc, RowError) else "nested too deep to read"
            reason = exc.reason if isinstance(exc, RowError) else RowError.reason
            malformed.append(Malformed(row, f"{ref}: {why}", excerpt(raw if not parsed else _dumps(obj)), reason))
            continue
        rec["source_row"] = row
        rows.append(rec)
        kept_lines.append(line)
    try:
        table = pa.Table.from_pylist(rows, schema=RAW_SCHEMA)
    except UnicodeEncodeError:  # a lone surrogate somewhere: find the rows (rare, so only then row by row)
        good = []
        for k, rec in enumerate(rows):
            where = lone_surrogate({key: v for key, v in rec.items() if key != "source_row"})
            if where is None:
                good.append(k)
            else:
                row = rec["source_row"]
                malformed.append(Malformed(row, f"{row_ref(kind, file, row, kept_lines[k])}: {where}", _dumps(rec)))
        rows, kept_lines = [rows[k] for k in good], [kept_lines[k] for k in good]
        malformed.sort(key=lambda m: m.row)
        table = pa.Table.from_pylist(rows, schema=RAW_SCHEMA)
    out_lines = np.array(kept_lines, dtype=np.int64) if lines is not None else None
    return Chunk(file, table, malformed, kind=kind, lines=out_lines)


def _text(raw: bytes | str) -> str:
    """A raw line as text: UTF-8 always (json.loads would guess UTF-16 from a leading NUL), a BOM dropped."""
    text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    return text[1:] if text.startswith("\ufeff") else text


def _dumps(obj: Any) -> str:
    """An excerpt of a parsed row (surrogates escaped, depth bounded by the parse that made it)."""
    try:
        return excerpt(json.dumps(obj, ensure_ascii=False))
    except (RecursionError, ValueError):
        return excerpt(repr(obj))
