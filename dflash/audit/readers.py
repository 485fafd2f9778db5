"""Raw conversation files -> one normalized layout, streamed chunk by chunk (pyarrow, no torch).

Formats (one row = one conversation):
- JSONL (`.jsonl`, or a `.json` that does not start with `[`): one JSON object per line. Row number =
  1-based line number; blank lines are not rows.
- JSON array (`.json` starting with `[`): row number = 0-based index in the array, read element by
  element (bounded memory). A syntax error mid-array makes the rest unreadable: it becomes ONE
  malformed row at the error's line.
- Parquet (`.parquet`): row number = 0-based row index in the file.
What a row may hold, and the RAW layout every reader yields: dflash/audit/records.py.

Fast path: JSONL chunks go through `pyarrow.json` with an explicit schema; a chunk that pyarrow
refuses is bisected until the offending lines are found, and only those lines are read by Python
(`coerce_record`), so one bad line costs microseconds, not a Python pass over the chunk.

Parquet columns whose nested types fit the RAW layout are conformed by Arrow (fields matched by
name, missing ones null); other shapes are read row by row with `coerce_record`.

dflash/audit/turns.py then turns a chunk into per-turn arrays.
"""

from __future__ import annotations

import codecs
import glob
import json
import os
import queue
import re
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pajson

from dflash.audit.records import (
    EXCERPT_CHARS,
    PARSE_SCHEMA,
    RAW_SCHEMA,
    Chunk,
    Malformed,
    RowError,
    excerpt,
    python_rows,
    tools_json,
)
from dflash.core.errors import UserError

INPUT_SUFFIXES = (".json", ".jsonl", ".parquet")
_TOOLS_KEY = re.compile(rb'"tools"\s*:')


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
        raise UserError(f"audit.input={spec!r}: no .json / .jsonl / .parquet files found")
    return files


def iter_chunks(spec: str, chunk_bytes: int) -> Iterator[Chunk]:
    for path in resolve_inputs(spec):
        if path.suffix == ".parquet":
            yield from iter_parquet(path, chunk_rows=max(1000, chunk_bytes // 1024))
        elif path.suffix == ".json" and _first_char(path) == b"[":
            yield from iter_json_array(path, chunk_bytes)
        else:
            yield from iter_jsonl(path, chunk_bytes)


def prefetch(chunks: Iterator[Chunk], depth: int = 1) -> Iterator[Chunk]:
    """Read the next chunk(s) on a background thread while the caller checks the current one (the
    parse and most Arrow kernels release the GIL, so reading and checking overlap on 2 cores)."""
    done = object()
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for chunk in chunks:
                while not stop.is_set():
                    try:
                        q.put(chunk, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put(done)
        except BaseException as exc:  # re-raised in the consumer, with its traceback
            q.put(exc)

    worker = threading.Thread(target=produce, name="audit-read", daemon=True)
    worker.start()
    try:
        while (item := q.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        worker.join(timeout=5)


def _first_char(path: Path) -> bytes:
    with open(path, "rb") as fh:
        head = fh.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return head[:1]


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
                    Malformed(int(line_no[i]), f"{file}:{line_no[i]}: bad UTF-8 (byte {exc.start})", excerpt(raw))
                )
                keep[i] = False
    idx = np.flatnonzero(keep)
    table, more = _parse_lines(body, starts, ends, line_no, idx, file)
    malformed.extend(more)
    malformed.sort(key=lambda m: m.row)
    return Chunk(file, table, malformed)


PIECE_BYTES = 1 << 20  # lines parsed per pyarrow call; a bad line costs at most ~2 pieces of re-parsing
_ERROR_ROW = re.compile(r" in row (\d+)$")
_READ_ERRORS = (pa.ArrowInvalid, pa.ArrowNotImplementedError, UnicodeDecodeError)
_POOL: ThreadPoolExecutor | None = None


def _read_json(data: bytes) -> pa.Table:
    """One pyarrow.json call over whole lines, as ONE block: its errors then name the failing row
    of `data` exactly ("... in row R"). Parallelism comes from parsing pieces on a thread pool."""
    return pajson.read_json(
        pa.BufferReader(data),
        read_options=pajson.ReadOptions(block_size=len(data) + 1, use_threads=False),
        parse_options=pajson.ParseOptions(explicit_schema=PARSE_SCHEMA, unexpected_field_behavior="ignore"),
    )


def _parse_lines(body, starts, ends, line_no, idx, file) -> tuple[pa.Table, list[Malformed]]:
    """Parse the lines `idx` with pyarrow, ~PIECE_BYTES at a time on a thread pool (pyarrow releases
    the GIL); lines it refuses are read by Python instead, with the reason."""
    global _POOL
    if len(idx) == 0:
        return RAW_SCHEMA.empty_table(), []
    size = np.cumsum(ends[idx] - starts[idx] + 1)
    cuts = np.unique(np.searchsorted(size, np.arange(PIECE_BYTES, size[-1], PIECE_BYTES)))
    pieces = [p for p in np.split(idx, cuts) if len(p)]
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="audit-json")
    results = list(_POOL.map(lambda sel: _parse_piece(body, starts, ends, line_no, sel, file), pieces))
    return pa.concat_tables([r[0] for r in results]), [m for r in results for m in r[1]]


def _parse_piece(body, starts, ends, line_no, sel, file, budget: int = 8) -> tuple[pa.Table, list[Malformed]]:
    """pyarrow on the lines `sel`; at a refused line R: rows before R again, R by Python, go on after R.
    After `budget` refusals the rest of the piece is read by Python (cheaper than re-parsing)."""

    def span(lines):
        if len(lines) == lines[-1] - lines[0] + 1:  # contiguous: no copy
            return body[starts[lines[0]] : ends[lines[-1]] + 1]
        return b"\n".join(body[starts[i] : ends[i]] for i in lines) + b"\n"

    def python(lines):
        return python_rows([(int(line_no[i]), body[starts[i] : ends[i]]) for i in lines], file)

    tables, malformed = [], []
    while len(sel):
        try:
            table, bad_tools = _finish(_read_json(span(sel)), body, starts, ends, line_no, sel, file)
            tables.append(table)
            malformed += bad_tools
            break
        except _READ_ERRORS as exc:
            m = _ERROR_ROW.search(str(exc))
            bad = int(m.group(1)) if m and int(m.group(1)) < len(sel) else None
        if bad is None or budget == 0:
            chunk = python(sel)
            tables.append(chunk.table)
            malformed += chunk.malformed
            break
        if bad:
            table, bad_tools = _parse_piece(body, starts, ends, line_no, sel[:bad], file, budget=0)
            tables.append(table)
            malformed += bad_tools
        chunk = python(sel[bad : bad + 1])
        tables.append(chunk.table)
        malformed += chunk.malformed
        sel, budget = sel[bad + 1 :], budget - 1
    return (pa.concat_tables(tables) if tables else RAW_SCHEMA.empty_table()), malformed


def _finish(table, body, starts, ends, line_no, idx, file) -> tuple[pa.Table, list[Malformed]]:
    """Add source_row and tools to a pyarrow-parsed table of the lines `idx`."""
    assert table.num_rows == len(idx), "pyarrow.json must yield one row per non-blank line"
    tools = pa.nulls(len(idx), pa.string())
    malformed = []
    # Tool definitions are free-form JSON schemas (no fixed Arrow type): read them with Python, only
    # on the lines that have a "tools" key.
    hits: set[int] = set()
    if body.find(b'"tools"', int(starts[idx[0]]), int(ends[idx[-1]]) + 1) >= 0:  # only this piece's bytes
        found = [m.start() for m in _TOOLS_KEY.finditer(body, int(starts[idx[0]]), int(ends[idx[-1]]) + 1)]
        lines = np.searchsorted(ends, np.array(found, dtype=np.int64))  # line holding each match
        j = np.searchsorted(idx, lines)
        hits = {int(k) for k, line in zip(j, lines, strict=True) if k < len(idx) and idx[k] == line}
    if hits:
        values, drop = [None] * len(idx), np.zeros(len(idx), dtype=bool)
        for j in sorted(hits):
            raw = body[starts[idx[j]] : ends[idx[j]]]
            try:
                values[j] = tools_json(json.loads(raw).get("tools"))
            except RowError as exc:
                malformed.append(Malformed(int(line_no[idx[j]]), f"{file}:{line_no[idx[j]]}: {exc}", excerpt(raw)))
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
            raise UserError(f"{file}: expected a JSON array")
        pos += 1
        while True:
            m = ws.match(buf, pos)
            line += buf.count("\n", pos, m.end())
            pos = m.end()
            if pos >= len(buf) and not eof:
                fill()
                continue
            if buf[pos : pos + 1] == ",":  # the separator may arrive after a read boundary
                pos += 1
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
                        excerpt(buf[pos : pos + EXCERPT_CHARS]),
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
                        excerpt(text.encode("utf-8", "surrogateescape")),
                    )
                )
            line += text.count("\n")
            index += 1
            pos = end
            if len(items) >= chunk_rows:
                chunk = python_rows(items, file, parsed=True)
                chunk.malformed[:0], malformed, items = malformed, [], []
                yield chunk
        chunk = python_rows(items, file, parsed=True)
        chunk.malformed[:0] = malformed
        yield chunk


# ------------------------------------------------------------------------------ Parquet


def iter_parquet(path: Path, chunk_rows: int) -> Iterator[Chunk]:
    import pyarrow.parquet as pq

    file, base = str(path), 0
    try:
        pf = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as exc:
        raise UserError(f"{file}: not a readable parquet file ({exc})") from None
    names = [n for n in ("messages", "conversations", "system", "tools") if n in pf.schema_arrow.names]
    if not {"messages", "conversations"} & set(names):
        raise UserError(f"{file}: no `messages` or `conversations` column")
    for batch in pf.iter_batches(batch_size=chunk_rows, columns=names):
        try:
            yield _parquet_fast(batch, base, file)
        except (TypeError, pa.ArrowInvalid):  # a nested shape Arrow cannot conform: read row by row
            rows = batch.to_pylist()
            yield python_rows([(base + i, r) for i, r in enumerate(rows)], file, parsed=True)
        base += batch.num_rows


def _conform(arr: pa.Array, target: pa.DataType) -> pa.Array:
    """`arr` rebuilt with exactly the `target` type: struct fields matched by name (missing -> null),
    lists re-wrapped, strings kept. TypeError when a value has another kind (e.g. content parts)."""
    if pa.types.is_null(arr.type):
        return pa.nulls(len(arr), target)
    mask = arr.is_null() if arr.null_count else None
    if pa.types.is_string(target):
        if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
            return arr.cast(pa.string())
        raise TypeError(f"expected strings, got {arr.type}")
    if pa.types.is_list(target):
        if not (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)):
            raise TypeError(f"expected a list, got {arr.type}")
        lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False)
        offsets = pa.array(np.concatenate(([0], np.cumsum(lengths))), pa.int32())  # zero-based: slices need it
        values = _conform(arr.flatten(), target.value_type)
        return pa.ListArray.from_arrays(offsets, values, type=target, mask=mask)
    if pa.types.is_struct(target):
        if not pa.types.is_struct(arr.type):
            raise TypeError(f"expected an object, got {arr.type}")
        have = {arr.type.field(i).name for i in range(arr.type.num_fields)}
        children = [
            _conform(arr.field(f.name), f.type) if f.name in have else pa.nulls(len(arr), f.type) for f in target
        ]
        return pa.StructArray.from_arrays(children, fields=list(target), mask=mask)
    raise TypeError(f"unsupported target type {target}")


def _parquet_fast(batch: pa.RecordBatch, base: int, file: str) -> Chunk:
    n = batch.num_rows
    columns = [
        _conform(batch.column(f.name), f.type) if f.name in batch.schema.names else pa.nulls(n, f.type)
        for f in PARSE_SCHEMA
    ]
    tools, malformed, drop = [None] * n, [], np.zeros(n, dtype=bool)
    if "tools" in batch.schema.names:
        col = batch.column("tools")
        for i in np.flatnonzero(col.is_valid().to_numpy(zero_copy_only=False)).tolist():
            try:
                tools[i] = tools_json(col[i].as_py())
            except RowError as exc:
                malformed.append(Malformed(base + i, f"{file}:{base + i}: {exc}", excerpt(str(col[i].as_py()))))
                drop[i] = True
    table = pa.Table.from_arrays(
        [pa.array(np.arange(base, base + n, dtype=np.int64)), *columns, pa.array(tools, pa.string())], schema=RAW_SCHEMA
    )
    return Chunk(file, table.filter(pa.array(~drop)) if drop.any() else table, malformed)
