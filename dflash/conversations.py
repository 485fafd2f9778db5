"""Raw conversation files -> one normalized layout, streamed chunk by chunk (pyarrow, no torch).

Formats (one row = one conversation):
- JSONL (`.jsonl`, or a `.json` that does not start with `[`): one JSON object per line. Row number =
  1-based line number; blank lines are not rows.
- JSON array (`.json` starting with `[`): row number = 0-based index in the array, read element by
  element (bounded memory). A syntax error mid-array makes the rest unreadable: it becomes ONE
  malformed row at the error's line.
- Parquet (`.parquet`): row number = 0-based row index in the file.
Each row holds either OpenAI `messages` (roles system/user/assistant/tool; `content`, `tool_calls`,
`tool_call_id`, `name`, `reasoning_content`) or ShareGPT `conversations` (`from`/`value`; roles
human/gpt/system/function_call/observation/tool), optionally a top-level `system` (ShareGPT) and
`tools` (a list, or a JSON string of one).

Fast path: JSONL chunks go through `pyarrow.json` with an explicit schema; a chunk that pyarrow
refuses is bisected until the offending lines are found, and only those lines are read by Python
(`coerce_record`), so one bad line costs microseconds, not a Python pass over the chunk.

`Chunk.table` (RAW layout): source_row int64, messages list<MESSAGE>, conversations list<{from,
value}>, system string, tools string (canonical JSON list, null if absent). `Chunk.malformed` lists
the rows that could not be read, each with a detail naming file and line. `flatten_turns` turns a
chunk into per-turn arrays with roles already normalized (ShareGPT mapped to OpenAI roles).
"""

from __future__ import annotations

import codecs
import glob
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pajson

from dflash.io import canonical_json

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
INPUT_SUFFIXES = (".json", ".jsonl", ".parquet")
_TOOLS_KEY = re.compile(rb'"tools"\s*:')
_EXCERPT = 200


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


# ------------------------------------------------------------------------------ input resolution


def resolve_inputs(spec: str) -> list[Path]:
    """A file, a folder (every .json/.jsonl/.parquet below it, sorted) or a glob -> files."""
    path = Path(spec)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in INPUT_SUFFIXES)
    else:
        files = sorted(Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file())
    if not files:
        raise ValueError(f"audit.input={spec!r}: no .json / .jsonl / .parquet files found")
    return files


def iter_chunks(spec: str, chunk_bytes: int) -> Iterator[Chunk]:
    for path in resolve_inputs(spec):
        if path.suffix == ".parquet":
            yield from iter_parquet(path, chunk_rows=max(1000, chunk_bytes // 1024))
        elif path.suffix == ".json" and _first_char(path) == b"[":
            yield from iter_json_array(path, chunk_bytes)
        else:
            yield from iter_jsonl(path, chunk_bytes)


def _first_char(path: Path) -> bytes:
    with open(path, "rb") as fh:
        head = fh.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return head[:1]


def _excerpt(raw: bytes | str) -> str:
    text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
    return text[:_EXCERPT]


# ------------------------------------------------------------------------------ Python row reader


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


def _tools(value: Any) -> str | None:
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
    out: dict[str, Any] = {"messages": None, "conversations": None, "system": None, "tools": _tools(obj.get("tools"))}
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


def _python_rows(items: list[tuple[int, bytes | str | Any]], file: str, parsed: bool = False) -> Chunk:
    """Read rows with Python (fallback path). items: (source_row, raw line or already-parsed object)."""
    rows, malformed = [], []
    for row, raw in items:
        try:
            obj = raw if parsed else json.loads(raw)
        except json.JSONDecodeError as exc:
            malformed.append(Malformed(row, f"{file}:{row}: bad JSON: {exc.msg} (column {exc.colno})", _excerpt(raw)))
            continue
        try:
            rec = coerce_record(obj)
        except RowError as exc:
            malformed.append(
                Malformed(
                    row, f"{file}:{row}: {exc}", _excerpt(raw if not parsed else json.dumps(obj, ensure_ascii=False))
                )
            )
            continue
        rec["source_row"] = row
        rows.append(rec)
    return Chunk(file, pa.Table.from_pylist(rows, schema=RAW_SCHEMA), malformed)


# ------------------------------------------------------------------------------ JSONL


def iter_jsonl(path: Path, chunk_bytes: int) -> Iterator[Chunk]:
    file, line_base, carry = str(path), 0, b""
    with open(path, "rb") as fh:
        first = True
        while True:
            block = fh.read(chunk_bytes)
            data = carry + block
            if first:
                data, first = (data[3:] if data.startswith(b"\xef\xbb\xbf") else data), False
            if not block:  # EOF: whatever is left is the last line
                if data.strip():
                    yield _jsonl_chunk(data + b"\n", file, line_base)
                return
            cut = data.rfind(b"\n")
            if cut < 0:
                carry = data
                continue
            carry = data[cut + 1 :]
            body = data[: cut + 1]
            yield _jsonl_chunk(body, file, line_base)
            line_base += body.count(b"\n")


def _jsonl_chunk(body: bytes, file: str, line_base: int) -> Chunk:
    """`body`: complete lines, each ending in '\\n'; line_base: lines before it in the file."""
    buf = np.frombuffer(body, dtype=np.uint8)
    ends = np.flatnonzero(buf == 10)  # index of each line's '\n'
    starts = np.concatenate(([0], ends[:-1] + 1))
    keep = ends > starts
    for i in np.flatnonzero(keep & (ends - starts <= 16)):  # blank lines are not rows; only short ones can be
        keep[i] = bool(body[starts[i] : ends[i]].strip())
    line_no = np.arange(1, len(ends) + 1, dtype=np.int64) + line_base
    malformed: list[Malformed] = []
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        for i in np.flatnonzero(keep):
            raw = body[starts[i] : ends[i]]
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                malformed.append(
                    Malformed(int(line_no[i]), f"{file}:{line_no[i]}: bad UTF-8 (byte {exc.start})", _excerpt(raw))
                )
                keep[i] = False
    idx = np.flatnonzero(keep)
    table, more = _parse_lines(body, starts, ends, line_no, idx, file)
    malformed.extend(more)
    malformed.sort(key=lambda m: m.row)
    return Chunk(file, table, malformed)


def _read_json(data: bytes, longest: int, single_block: bool = False) -> pa.Table:
    block = len(data) + 1 if single_block else max(1 << 20, longest)
    return pajson.read_json(
        pa.BufferReader(data),
        read_options=pajson.ReadOptions(block_size=block, use_threads=not single_block),
        parse_options=pajson.ParseOptions(explicit_schema=PARSE_SCHEMA, unexpected_field_behavior="ignore"),
    )


_ERROR_ROW = re.compile(r" in row (\d+)$")
_READ_ERRORS = (pa.ArrowInvalid, pa.ArrowNotImplementedError, UnicodeDecodeError)


def _parse_lines(body, starts, ends, line_no, idx, file, budget: int = 8) -> tuple[pa.Table, list[Malformed]]:
    """Parse the lines `idx` with pyarrow; lines it refuses are located and read by Python instead.

    Locating: a one-block parse reports the failing row exactly ("... in row R"), so rows before R
    are re-parsed, row R goes to Python, and parsing resumes after it. After `budget` bad lines in
    one chunk the rest of the chunk is read by Python (cheaper than re-parsing it again and again)."""
    if len(idx) == 0:
        return RAW_SCHEMA.empty_table(), []

    def span(sel):
        contiguous = len(sel) == sel[-1] - sel[0] + 1
        if contiguous:
            return body[starts[sel[0]] : ends[sel[-1]] + 1]
        return b"\n".join(body[starts[i] : ends[i]] for i in sel) + b"\n"

    longest = int((ends[idx] - starts[idx]).max()) + 2
    try:
        return _finish(_read_json(span(idx), longest), body, starts, ends, line_no, idx, file)
    except _READ_ERRORS:
        pass
    tables, malformed, rest = [], [], idx
    while len(rest) and budget > 0:
        try:
            table = _read_json(span(rest), longest, single_block=True)
            piece = _finish(table, body, starts, ends, line_no, rest, file)
            tables.append(piece[0])
            malformed += piece[1]
            rest = rest[:0]
            break
        except _READ_ERRORS as exc:
            m = _ERROR_ROW.search(str(exc))
            bad = int(m.group(1)) if m and int(m.group(1)) < len(rest) else None
        if bad is None:
            break
        if bad:
            good, more = _parse_lines(body, starts, ends, line_no, rest[:bad], file, budget=0)
            tables.append(good)
            malformed += more
        python = _python_rows([(int(line_no[rest[bad]]), body[starts[rest[bad]] : ends[rest[bad]]])], file)
        tables.append(python.table)
        malformed += python.malformed
        rest, budget = rest[bad + 1 :], budget - 1
    if len(rest):
        python = _python_rows([(int(line_no[i]), body[starts[i] : ends[i]]) for i in rest], file)
        tables.append(python.table)
        malformed += python.malformed
    return pa.concat_tables(tables), malformed


def _finish(table, body, starts, ends, line_no, idx, file) -> tuple[pa.Table, list[Malformed]]:
    """Add source_row and tools to a pyarrow-parsed table of the lines `idx`."""
    assert table.num_rows == len(idx), "pyarrow.json must yield one row per non-blank line"
    tools = pa.nulls(len(idx), pa.string())
    malformed = []
    # Tool definitions are free-form JSON schemas (no fixed Arrow type): read them with Python, only
    # on the lines that have a "tools" key.
    hits: set[int] = set()
    if b'"tools"' in body:
        found = [m.start() for m in _TOOLS_KEY.finditer(body, int(starts[idx[0]]), int(ends[idx[-1]]) + 1)]
        lines = np.searchsorted(ends, np.array(found, dtype=np.int64))  # line holding each match
        j = np.searchsorted(idx, lines)
        hits = {int(k) for k, line in zip(j, lines, strict=True) if k < len(idx) and idx[k] == line}
    if hits:
        values, drop = [None] * len(idx), np.zeros(len(idx), dtype=bool)
        for j in sorted(hits):
            raw = body[starts[idx[j]] : ends[idx[j]]]
            try:
                values[j] = _tools(json.loads(raw).get("tools"))
            except RowError as exc:
                malformed.append(Malformed(int(line_no[idx[j]]), f"{file}:{line_no[idx[j]]}: {exc}", _excerpt(raw)))
                drop[j] = True
        tools = pa.array(values, pa.string())
        if drop.any():
            table, tools, idx = table.filter(pa.array(~drop)), tools.filter(pa.array(~drop)), idx[~drop]
    table = pa.Table.from_arrays([pa.array(line_no[idx]), *table.columns, tools], schema=RAW_SCHEMA)
    return table, malformed


# ------------------------------------------------------------------------------ JSON array


def iter_json_array(path: Path, chunk_bytes: int, chunk_rows: int = 20000) -> Iterator[Chunk]:
    """Stream the elements of a top-level JSON array with `raw_decode` (bounded memory)."""
    file = str(path)
    decoder = json.JSONDecoder()
    # surrogateescape keeps bad UTF-8 bytes as lone surrogates; the element holding one is malformed.
    reader = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")
    ws = re.compile(r"[ \t\r\n]*")
    with open(path, "rb") as fh:
        buf, eof, pos, line, index = "", False, 0, 1, 0
        items: list[tuple[int, Any]] = []
        malformed: list[Malformed] = []

        def fill() -> bool:
            nonlocal buf, pos, eof
            block = fh.read(chunk_bytes)
            eof = not block
            buf = buf[pos:] + reader.decode(block, final=eof)
            pos = 0
            return not eof

        fill()
        buf = buf.lstrip("\ufeff")
        pos = ws.match(buf, 0).end()
        if buf[pos : pos + 1] != "[":
            raise ValueError(f"{file}: expected a JSON array")
        pos += 1
        while True:
            m = ws.match(buf, pos)
            line += buf.count("\n", pos, m.end())
            pos = m.end()
            if pos >= len(buf) and not eof:
                fill()
                continue
            if buf[pos : pos + 1] == "]" or pos >= len(buf):
                break
            try:
                obj, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError as exc:
                if not eof and len(buf) - pos < 4 * chunk_bytes + (1 << 26):
                    fill()  # probably an element cut by the read boundary: read more and retry
                    continue
                bad_line = line + buf.count("\n", pos, exc.pos)
                malformed.append(
                    Malformed(
                        index,
                        f"{file}:{bad_line}: bad JSON in array element {index}: {exc.msg}; the rest of the array cannot be read",
                        _excerpt(buf[pos : pos + _EXCERPT]),
                    )
                )
                break
            text = buf[pos:end]
            try:
                text.encode("utf-8")
                items.append((index, obj))
            except UnicodeEncodeError:
                malformed.append(
                    Malformed(
                        index,
                        f"{file}:{line}: bad UTF-8 in array element {index}",
                        _excerpt(text.encode("utf-8", "surrogateescape")),
                    )
                )
            line += text.count("\n")
            index += 1
            m = ws.match(buf, end)
            line += buf.count("\n", end, m.end())
            pos = m.end()
            if buf[pos : pos + 1] == ",":
                pos += 1
            if len(items) >= chunk_rows:
                chunk = _python_rows(items, file, parsed=True)
                chunk.malformed[:0], malformed, items = malformed, [], []
                yield chunk
        chunk = _python_rows(items, file, parsed=True)
        chunk.malformed[:0] = malformed
        yield chunk


# ------------------------------------------------------------------------------ Parquet


def iter_parquet(path: Path, chunk_rows: int) -> Iterator[Chunk]:
    import pyarrow.parquet as pq

    file, base = str(path), 0
    pf = pq.ParquetFile(path)
    names = [n for n in ("messages", "conversations", "system", "tools") if n in pf.schema_arrow.names]
    if not {"messages", "conversations"} & set(names):
        raise ValueError(f"{file}: no `messages` or `conversations` column")
    for batch in pf.iter_batches(batch_size=chunk_rows, columns=names):
        rows = batch.to_pylist()  # nested columns vary too much between datasets to cast blindly
        yield _python_rows([(base + i, r) for i, r in enumerate(rows)], file, parsed=True)
        base += batch.num_rows


# ------------------------------------------------------------------------------ per-turn arrays

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


def _normalize_calls(calls: list, where: str) -> str:
    out = []
    for k, c in enumerate(calls):
        fn = (c or {}).get("function") or {}
        if not fn.get("name"):
            raise RowError(f"{where}.tool_calls[{k}]: missing function name")
        args = fn.get("arguments")
        out.append(
            {
                "id": c.get("id") or f"call_{k}",
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

    # Tool calls: canonical JSON built in Python, only for the (few) turns that have them.
    calls: dict[int, str] = {}
    if n_m:
        tc = pc.struct_field(flat_m, "tool_calls")
        has = pc.fill_null(pc.greater(pc.list_value_length(tc), 0), False).to_numpy(zero_copy_only=False)
        for i, value in zip(np.flatnonzero(has), tc.filter(pa.array(has)).to_pylist(), strict=True):
            j = int(inverse[i])
            try:
                calls[j] = _normalize_calls(value, f"messages[{pos[j]}]")
            except RowError as exc:
                errors.setdefault(int(parent[j]), str(exc))
    if n_s:
        is_call = pc.fill_null(pc.equal(sg_from, "function_call"), False).to_numpy(zero_copy_only=False)
        for i in np.flatnonzero(is_call):
            j = int(inverse[n_m + i])
            try:
                calls[j] = _normalize_calls(_sharegpt_call(sg_value[i].as_py()), f"conversations[{pos[j]}]")
            except RowError as exc:
                errors.setdefault(int(parent[j]), f"conversations[{pos[j]}]: {exc}")
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
        errors.setdefault(r, f"{key}[{pos[j]}]: missing {what}")
    return Turns(offsets, parent, pos, role, content, reasoning, name, call_id, tool_calls, errors)
