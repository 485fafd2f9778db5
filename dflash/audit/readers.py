"""Raw conversation files -> one normalized layout, streamed chunk by chunk (pyarrow, no torch).

Formats (one row = one conversation; which files are inputs: dflash/audit/files.py; the form a file is read
in comes from its bytes, not its name: dflash/audit/forms.py, and each chunk carries it for the report):
- JSONL (`.jsonl`, `.ndjson`, or text that does not start with `[`): one JSON object per line.
  Row number = 1-based line number (`FILE:line N`); blank lines are not rows. Every other non-blank
  line is exactly one row or one malformed rejection: a line that is not an object ("row is not a
  JSON object"), two objects on a line ("extra data after the object at column N"), an object
  pretty-printed over lines A-B (each of those lines: "looks like a pretty-printed JSON object
  spanning lines A-B"), bad UTF-8, a lone surrogate escape, nesting too deep for the JSON reader.
- JSON array (text starting with `[`, whatever its name): dflash/audit/json_array.py (`FILE element N (line L)`).
- Columnar inputs, parquet (`.parquet`), Arrow (`.arrow`), `datasets.save_to_disk` folders and a hub split
  (`hf:ID`, dflash/audit/hub.py): dflash/audit/tables.py (`FILE row N`, 0-based; `hf:ID split S row N`).
An input with no rows (0 bytes, whitespace only, `[]`, a 0-row table) yields one empty chunk marked
`empty`; the first chunk lists the folder files that were skipped.
What a row may hold, and the RAW layout every reader yields: dflash/audit/records.py.

Fast path: JSONL chunks go through `pyarrow.json` with an explicit schema. Only lines that start with
`{` and end with `}` (whitespace aside) reach pyarrow: such a line cannot continue on the next one
(after a closing `}` no JSON container goes on with `{`; strings cannot hold a raw newline), so a
parse yields one row per line unless a line holds two objects, which the row count reveals. Every
other line (`null`, `1`, `[...]`, half an object...) goes to Python first: pyarrow 26 crashes
(SIGSEGV) on a leading `null`. A chunk that pyarrow refuses is bisected until the offending lines
are found, and only those lines are read by Python (`python_rows`), so one bad line costs
microseconds, not a Python pass over the chunk.

dflash/audit/turns.py then turns a chunk into per-turn arrays.
"""

from __future__ import annotations

import json
import os
import queue
import re
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.json as pajson

from dflash.audit.files import resolve_inputs, saved_files, scan_inputs
from dflash.audit.forms import open_input, read_block, sniff
from dflash.audit.hub import HubSpec, is_hub, load_split
from dflash.audit.json_array import iter_json_array
from dflash.audit.records import (
    PARSE_SCHEMA,
    RAW_SCHEMA,
    Chunk,
    Malformed,
    RowError,
    excerpt,
    python_rows,
    row_ref,
    too_deep,
    tools_json,
)
from dflash.audit.tables import arrow_rows, chunk_rows, iter_arrow, iter_parquet
from dflash.core.errors import UserError

__all__ = ["count_rows", "iter_chunks", "iter_json_array", "iter_jsonl", "iter_parquet", "prefetch", "resolve_inputs"]
_TOOLS_KEY = re.compile(rb'"tools"\s*:')
_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')


# ------------------------------------------------------------------------------ input resolution


def iter_chunks(spec: str, chunk_bytes: int, hub: HubSpec | None = None) -> Iterator[Chunk]:
    """Every input's chunks. `spec`: audit.input; `hub`: the split, revision and columns of an `hf:` spec
    (HubSpec.from_params; the train split, unpinned, when None)."""
    if is_hub(spec):
        hub = hub or HubSpec(spec[len("hf:") :])
        split = load_split(hub)
        chunks = iter_arrow(
            list(split.files),
            split.label,
            "hf",
            chunk_rows(chunk_bytes),
            hub.columns,
            "audit.hf_columns",
            split.num_rows,
        )
        yield from _with_empty(chunks, split.label, "hf")
        return
    files, skipped = scan_inputs(spec)
    if not files:
        resolve_inputs(spec)  # raises the UserError naming what was found
    skipped_names = [str(p) for p in skipped]
    for path in files:
        for chunk in _iter_file(path, chunk_bytes):
            chunk.skipped, skipped_names = skipped_names, []
            yield chunk


def count_rows(spec: str, hub: HubSpec | None = None) -> int:
    """Rows of the input, for the token sample's rate: parquet and Arrow metadata, a hub split's count, else
    lines (a pretty-printed JSON array overestimates: the sample is then smaller; its real size is reported)."""
    import pyarrow.parquet as pq

    if is_hub(spec):
        return load_split(hub or HubSpec(spec[len("hf:") :])).num_rows
    total = 0
    for path in resolve_inputs(spec):
        try:
            kind = sniff(path).kind
            if kind == "parquet":
                total += pq.ParquetFile(path).metadata.num_rows
                continue
            if kind == "arrow":
                total += arrow_rows(saved_files(path) if path.is_dir() else [path])
                continue
        except (OSError, pa.ArrowException, UserError):
            continue  # the reader names the file
        last = b"\n"
        with open(path, "rb") as fh:
            while block := fh.read(1 << 24):
                total += block.count(b"\n")
                last = block[-1:]
        total += last != b"\n"
    return total


def _iter_file(path: Path, chunk_bytes: int) -> Iterator[Chunk]:
    """One input's chunks, read in the form its bytes hold (forms.sniff: the name only where they agree or say
    nothing); every chunk carries that form; an input without any row yields one chunk marked `empty`."""
    form = sniff(path)
    if form.kind == "parquet":
        chunks = iter_parquet(path, chunk_rows(chunk_bytes))
    elif form.kind == "arrow":
        chunks = iter_arrow(saved_files(path) if path.is_dir() else [path], str(path), "arrow", chunk_rows(chunk_bytes))
    elif form.kind == "json":
        chunks = iter_json_array(path, chunk_bytes)
    else:
        chunks = iter_jsonl(path, chunk_bytes)
    for chunk in _with_empty(chunks, str(path), form.kind):
        chunk.form, chunk.form_note = form.label, form.note
        yield chunk


def _with_empty(chunks: Iterator[Chunk], label: str, kind: str) -> Iterator[Chunk]:
    """The chunks, then one chunk marked `empty` when none held a row."""
    rows = 0
    for chunk in chunks:
        rows += chunk.table.num_rows + len(chunk.malformed)
        yield chunk
    if rows == 0:
        yield Chunk(label, RAW_SCHEMA.empty_table(), kind=kind, empty=True)


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


# ------------------------------------------------------------------------------ JSONL


def iter_jsonl(path: Path, chunk_bytes: int) -> Iterator[Chunk]:
    file, line_base, carry = str(path), 0, b""
    chunk_bytes = max(1, chunk_bytes)
    with open_input(path) as fh:
        first = True
        while True:
            block = read_block(fh, chunk_bytes, file)
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


class _Lines:
    """One JSONL chunk: `body` (complete lines), each line's start / end ('\\n') and line number."""

    def __init__(self, body: bytes, file: str, line_base: int) -> None:
        self.body, self.file = body, file
        buf = np.frombuffer(body, dtype=np.uint8)
        self.ends = np.flatnonzero(buf == 10)
        self.starts = np.concatenate(([0], self.ends[:-1] + 1)).astype(np.int64)
        self.line_no = np.arange(1, len(self.ends) + 1, dtype=np.int64) + line_base
        self.direct = np.zeros(len(self.ends), dtype=bool)  # lines read by Python, never by pyarrow

    def raw(self, i: int) -> bytes:
        return self.body[self.starts[i] : self.ends[i]]

    def ref(self, i: int) -> str:
        return row_ref("jsonl", self.file, int(self.line_no[i]))

    def python(self, lines) -> Chunk:
        return python_rows([(int(self.line_no[i]), self.raw(i)) for i in lines], self.file)


def _jsonl_chunk(body: bytes, file: str, line_base: int) -> Chunk:
    """`body`: complete lines, each ending in '\\n'; line_base: lines before it in the file."""
    c = _Lines(body, file, line_base)
    buf = np.frombuffer(body, dtype=np.uint8)
    starts, ends = c.starts, c.ends
    keep = ends > starts
    for i in np.flatnonzero(keep & (ends - starts <= 16)):  # blank lines are not rows; only short ones can be
        keep[i] = bool(c.raw(i).strip())
    malformed: list[Malformed] = []
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        for i in np.flatnonzero(keep):
            try:
                c.raw(i).decode("utf-8")
            except UnicodeDecodeError as exc:
                malformed.append(
                    Malformed(int(c.line_no[i]), f"{c.ref(i)}: bad UTF-8 (byte {exc.start})", excerpt(c.raw(i)))
                )
                keep[i] = False
    # Lines that look like one object ('{' ... '}', CR aside) may go to pyarrow; the rest go to Python.
    last = ends - 1 - ((ends > starts) & (buf[np.maximum(ends - 1, 0)] == 13))
    looks = keep & (buf[np.minimum(starts, len(buf) - 1)] == 123) & (last >= starts) & (buf[np.maximum(last, 0)] == 125)
    for i in np.flatnonzero(keep & ~looks):  # leading / trailing spaces, or not an object line
        text = c.raw(i).strip()
        looks[i] = text[:1] == b"{" and text[-1:] == b"}"
        keep[i] = bool(text)  # a long line of only whitespace is blank too
    for i in np.flatnonzero(keep & ~looks):
        if keep[i] and c.raw(i).lstrip()[:1] == b"{":
            end = _pretty_span(c, i, looks)
            if end is not None:
                a, b = int(c.line_no[i]), int(c.line_no[end])
                for j in range(i, end + 1):
                    if keep[j]:
                        why = f"looks like a pretty-printed JSON object spanning lines {a}-{b}; JSONL needs one object per line (e.g. `jq -c . FILE`)"
                        malformed.append(Malformed(int(c.line_no[j]), f"{c.ref(j)}: {why}", excerpt(c.raw(j))))
                keep[i : end + 1] = False
    c.direct = keep & ~looks
    table, more = _parse_lines(c, np.flatnonzero(keep))
    malformed.extend(more)
    malformed.sort(key=lambda m: m.row)
    return Chunk(file, table, malformed)


def _pretty_span(
    c: _Lines, a: int, looks: np.ndarray, max_lines: int = 100_000, max_bytes: int = 1 << 26
) -> int | None:
    """Line b when lines a..b (a opening with '{') hold exactly one JSON object written over several
    lines; None otherwise. Stops at a line that is a whole object no more indented than line a."""
    indent = len(c.raw(a)) - len(c.raw(a).lstrip())
    stack: list[bytes] = []
    size = 0
    for i in range(a, min(len(c.ends), a + max_lines)):
        line = c.raw(i)
        size += len(line)
        if size > max_bytes or (i > a and looks[i] and len(line) - len(line.lstrip()) <= indent):
            return None
        for m in _TOKENS.finditer(line):
            tok = m.group()
            if tok[:1] == b'"':
                continue
            if tok in (b"{", b"["):
                stack.append(b"}" if tok == b"{" else b"]")
            elif not stack or stack.pop() != tok:
                return None
            elif not stack:
                if i == a or line[m.end() :].strip():
                    return None
                try:
                    obj = json.loads(c.body[c.starts[a] : c.ends[i]])
                except (ValueError, RecursionError):
                    return None
                return i if isinstance(obj, dict) else None
    return None


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


def _parse_lines(c: _Lines, idx: np.ndarray) -> tuple[pa.Table, list[Malformed]]:
    """Parse the lines `idx` with pyarrow, ~PIECE_BYTES at a time on a thread pool (pyarrow releases
    the GIL); lines it refuses, and lines marked `direct`, are read by Python instead, with the reason."""
    global _POOL
    if len(idx) == 0:
        return RAW_SCHEMA.empty_table(), []
    size = np.cumsum(c.ends[idx] - c.starts[idx] + 1)
    cuts = np.unique(np.searchsorted(size, np.arange(PIECE_BYTES, size[-1], PIECE_BYTES)))
    pieces = [p for p in np.split(idx, cuts) if len(p)]
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="audit-json")
    results = list(_POOL.map(lambda sel: _parse_mixed(c, sel), pieces))
    return pa.concat_tables([r[0] for r in results]), [m for r in results for m in r[1]]


def _parse_mixed(c: _Lines, sel: np.ndarray) -> tuple[pa.Table, list[Malformed]]:
    """The lines `sel` in order: runs of `direct` lines by Python, the runs between them by pyarrow."""
    d = c.direct[sel]
    if not d.any():
        return _parse_piece(c, sel)
    tables, malformed = [], []
    for part in np.split(sel, np.flatnonzero(np.diff(d.astype(np.int8))) + 1):
        if c.direct[part[0]]:
            chunk = c.python(part)
            table, bad = chunk.table, chunk.malformed
        else:
            table, bad = _parse_piece(c, part)
        tables.append(table)
        malformed += bad
    return pa.concat_tables(tables), malformed


def _parse_piece(c: _Lines, sel: np.ndarray, budget: int = 8) -> tuple[pa.Table, list[Malformed]]:
    """pyarrow on the lines `sel`; at a refused line R: rows before R again, R by Python, go on after R.
    After `budget` refusals the rest of the piece is read by Python (cheaper than re-parsing)."""
    body, starts, ends = c.body, c.starts, c.ends

    def span(lines):
        if len(lines) == lines[-1] - lines[0] + 1:  # contiguous: no copy
            return body[starts[lines[0]] : ends[lines[-1]] + 1]
        return b"\n".join(body[starts[i] : ends[i]] for i in lines) + b"\n"

    tables, malformed = [], []
    while len(sel):
        bad = None
        try:
            parsed = _read_json(span(sel))
        except _READ_ERRORS as exc:
            m = _ERROR_ROW.search(str(exc))
            bad = int(m.group(1)) if m and int(m.group(1)) < len(sel) else None
        else:
            if parsed.num_rows == len(sel):
                table, bad_tools = _finish(parsed, c, sel)
                tables.append(table)
                malformed += bad_tools
                break
            budget = 0  # a line held two objects (more rows than lines): Python names it
        if bad is None or budget == 0:
            chunk = c.python(sel)
            tables.append(chunk.table)
            malformed += chunk.malformed
            break
        if bad:
            table, bad_tools = _parse_piece(c, sel[:bad], budget=0)
            tables.append(table)
            malformed += bad_tools
        chunk = c.python(sel[bad : bad + 1])
        tables.append(chunk.table)
        malformed += chunk.malformed
        sel, budget = sel[bad + 1 :], budget - 1
    return (pa.concat_tables(tables) if tables else RAW_SCHEMA.empty_table()), malformed


def _finish(table: pa.Table, c: _Lines, idx: np.ndarray) -> tuple[pa.Table, list[Malformed]]:
    """Add source_row and tools to a pyarrow-parsed table of the lines `idx` (one row per line)."""
    body, starts, ends, line_no = c.body, c.starts, c.ends, c.line_no
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
            raw = c.raw(idx[j])
            try:
                values[j] = tools_json(json.loads(raw).get("tools"))
            except RecursionError:
                malformed.append(Malformed(int(line_no[idx[j]]), f"{c.ref(idx[j])}: {too_deep(raw)}", excerpt(raw)))
                drop[j] = True
            except (RowError, ValueError) as exc:  # RowError, or JSON Python refuses where pyarrow did not
                malformed.append(Malformed(int(line_no[idx[j]]), f"{c.ref(idx[j])}: {exc}", excerpt(raw)))
                drop[j] = True
        tools = pa.array(values, pa.string())
        if drop.any():
            table, tools, idx = table.filter(pa.array(~drop)), tools.filter(pa.array(~drop)), idx[~drop]
    table = pa.Table.from_arrays([pa.array(line_no[idx]), *table.columns, tools], schema=RAW_SCHEMA)
    return table, malformed
