"""Columnar inputs -> RAW chunks: parquet files, Arrow files, `datasets.save_to_disk` folders and a hub
dataset's cached split (dflash/audit/hub.py), all read as Arrow record batches (pyarrow, no torch).

What a row number means (records.row_ref: `LABEL row N`, 0-based):
- parquet (`.parquet`) and Arrow (`.arrow`, IPC stream or file format): the row index in the file;
- a save_to_disk folder (dflash/audit/files.py recognises it by its `state.json`): the row index in the
  dataset, `datasets.load_from_disk(FOLDER)[N]`, counted across its Arrow files in the order state.json
  lists them;
- a hub split (`hf:ID split S`): the row index in the split, `load_dataset(ID, split=S, revision=R)[N]`.
Columns read: `messages` (OpenAI) or `conversations` (ShareGPT), optional `system` and `tools`; a hub dataset
may hold them under other names (`audit.hf_columns`, e.g. {messages: chat}). Every other column is ignored.

Columns whose nested types fit RAW_SCHEMA are conformed by Arrow one batch at a time (struct fields matched
by name, missing ones null). A batch with another shape (OpenAI content parts, a conversation stored as a
JSON string, a number where text belongs, bad UTF-8) is read row by row with records.coerce_record, the
reader of the JSON formats, so every format judges a row alike; a JSON string that does not parse is a
malformed row naming the column. Memory: one chunk (`audit.chunk_bytes` / 1 KiB rows) at a time; Arrow files
are memory-mapped, so a 1M-row dataset never holds 1M rows in memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dflash.audit.records import (
    PARSE_SCHEMA,
    RAW_SCHEMA,
    Chunk,
    Malformed,
    RowError,
    excerpt,
    python_rows,
    row_ref,
    tools_json,
)
from dflash.core.errors import UserError

COLUMNS = ("messages", "conversations", "system", "tools")  # the RAW fields a columnar input may hold
_READ_ERRORS = (OSError, ValueError, pa.ArrowException)  # ValueError: a column name that is not UTF-8


def chunk_rows(chunk_bytes: int) -> int:
    """Rows per chunk of a columnar input: ~1 KiB a conversation, at least 1000 rows."""
    return max(1000, chunk_bytes // 1024)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def select_columns(have: list[str], label: str, rename: dict[str, str] | None = None, param: str = "") -> dict:
    """{RAW field: source column} of the fields present. `rename` ({field: column}, from `param`) names
    columns that are not called like the field. UserError naming the columns when no conversation column is there."""
    rename = dict(rename or {})
    listed = ", ".join(have[:12]) + (f" and {len(have) - 12} more" if len(have) > 12 else "")
    missing = [f"{param}.{field}={column!r}" for field, column in rename.items() if column not in have]
    if missing:
        raise UserError(f"{label}: no such column: {', '.join(missing)} (columns: {listed})")
    picked = {field: rename.get(field, field) for field in COLUMNS if rename.get(field, field) in have}
    if "messages" not in picked and "conversations" not in picked:
        fix = f"; set {param}, e.g. {{messages: COLUMN}}" if param else ""
        raise UserError(f"{label}: no `messages` or `conversations` column (columns: {listed}){fix}")
    return picked


def _renamed(batch: pa.RecordBatch, picked: dict[str, str]) -> pa.RecordBatch:
    """The picked source columns under their RAW field names."""
    return pa.RecordBatch.from_arrays([batch.column(c) for c in picked.values()], names=list(picked))


def batch_chunk(
    batch: pa.RecordBatch, base: int, label: str, kind: str, picked: dict[str, str], valid: bool = False
) -> Chunk:
    """One batch (rows base, base+1, ...) -> a RAW chunk: Arrow conforms it when its types fit, else row by row.
    `valid`: the batch passed a full validation already (UTF-8 included)."""
    batch = _renamed(batch, picked)
    try:
        return _fast(batch, base, label, kind, valid)
    except (TypeError, pa.ArrowInvalid):  # a shape Arrow cannot conform (or bad UTF-8): row by row
        items, bad = _python_items(batch, base, label, kind)
        names = {field: column for field, column in picked.items() if field != column}
        chunk = python_rows(items, label, parsed=True, kind=kind, names=names)
        chunk.malformed = sorted(chunk.malformed + bad, key=lambda m: m.row)
        return chunk


def _python_items(batch: pa.RecordBatch, base: int, label: str, kind: str) -> tuple[list, list[Malformed]]:
    """(row, value) of each row of a batch Python can read, and a malformed row for each it cannot
    (a string that is not UTF-8)."""
    try:
        return [(base + i, r) for i, r in enumerate(batch.to_pylist())], []
    except (UnicodeDecodeError, pa.ArrowException):
        items, bad = [], []
        for i in range(batch.num_rows):
            try:
                items.append((base + i, batch.slice(i, 1).to_pylist()[0]))
            except (UnicodeDecodeError, pa.ArrowException) as exc:
                bad.append(Malformed(base + i, f"{row_ref(kind, label, base + i)}: bad UTF-8 in a string ({exc})", ""))
        return items, bad


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


def _fast(batch: pa.RecordBatch, base: int, label: str, kind: str, valid: bool = False) -> Chunk:
    if not valid:
        batch.validate(full=True)  # ArrowInvalid on a string that is not UTF-8 (parquet does not check)
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
                malformed.append(
                    Malformed(base + i, f"{row_ref(kind, label, base + i)}: {exc}", excerpt(str(col[i].as_py())))
                )
                drop[i] = True
    table = pa.Table.from_arrays(
        [pa.array(np.arange(base, base + n, dtype=np.int64)), *columns, pa.array(tools, pa.string())], schema=RAW_SCHEMA
    )
    return Chunk(label, table.filter(pa.array(~drop)) if drop.any() else table, malformed, kind=kind)


# ------------------------------------------------------------------------------ parquet


def iter_parquet(path: Path, rows: int) -> Iterator[Chunk]:
    import pyarrow.parquet as pq

    file, base = str(path), 0
    try:
        pf = pq.ParquetFile(path)
        schema = pf.schema_arrow
    except _READ_ERRORS as exc:
        raise UserError(f"{file}: not a readable parquet file ({_one_line(exc)})") from None
    picked = select_columns(schema.names, file)
    batches = pf.iter_batches(batch_size=rows, columns=list(dict.fromkeys(picked.values())))
    while True:
        try:
            batch = next(batches, None)
        except _READ_ERRORS as exc:  # a corrupt page: the file cannot be read on
            raise UserError(f"{file}: parquet data after row {base} cannot be read ({_one_line(exc)})") from None
        if batch is None:
            return
        yield batch_chunk(batch, base, file, "parquet", picked)
        base += batch.num_rows


# ------------------------------------------------------------------------------ Arrow files


def _open_arrow(path: Path) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
    """(schema, batches) of an Arrow IPC file (`ARROW1` magic) or stream (what `datasets` writes), memory-mapped."""
    try:
        source = pa.memory_map(str(path))
        if source.read(6) == b"ARROW1":
            source.seek(0)
            reader = pa.ipc.open_file(source)
            schema, batches = reader.schema, (reader.get_batch(i) for i in range(reader.num_record_batches))
        else:
            source.seek(0)
            stream = pa.ipc.open_stream(source)
            schema, batches = stream.schema, iter(stream)
        schema.names  # noqa: B018 (decodes every column name: a damaged one is not UTF-8)
        return schema, batches
    except _READ_ERRORS as exc:  # UnicodeDecodeError is a ValueError
        raise UserError(f"{path}: not a readable Arrow file ({_one_line(exc)})") from None


def _as_binary(t: pa.DataType) -> pa.DataType:
    """`t` with every string type (nested too) read as bytes, whose validation does not check UTF-8."""
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return pa.large_binary() if pa.types.is_large_string(t) else pa.binary()
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        item = t.value_field.with_type(_as_binary(t.value_type))
        return pa.large_list(item) if pa.types.is_large_list(t) else pa.list_(item)
    if pa.types.is_struct(t):
        return pa.struct([f.with_type(_as_binary(f.type)) for f in t])
    return t


def _check_structure(batch: pa.RecordBatch) -> bool:
    """ArrowInvalid when the batch's buffers are damaged (offsets out of bounds...): reading them could crash.
    Strings that are not UTF-8 pass (False: batch_chunk reads that batch row by row, naming those rows)."""
    try:
        batch.validate(full=True)
        return True
    except pa.ArrowInvalid as exc:
        if "UTF8" not in str(exc):
            raise
        schema = pa.schema([f.with_type(_as_binary(f.type)) for f in batch.schema])
        batch.cast(schema).validate(full=True)
        return False


def _batches(path: Path, first_row: int) -> Iterator[tuple[pa.RecordBatch, bool]]:
    """(batch, its strings are all UTF-8) of one Arrow file; a damaged batch is a UserError naming the file and row."""
    _, batches = _open_arrow(path)
    row = first_row
    while True:
        try:
            batch = next(batches, None)
            utf8 = _check_structure(batch) if batch is not None else True
        except _READ_ERRORS as exc:
            raise UserError(f"{path}: Arrow data after row {row} cannot be read ({_one_line(exc)})") from None
        if batch is None:
            return
        row += batch.num_rows
        yield batch, utf8


def arrow_rows(files: list[Path]) -> int:
    """Rows in Arrow files (batch headers only: the data stays on disk)."""
    return sum(batch.num_rows for path in files for batch in _open_arrow(path)[1])


def iter_arrow(
    files: list[Path],
    label: str,
    kind: str,
    rows: int,
    rename: dict[str, str] | None = None,
    param: str = "",
    expect_rows: int | None = None,
) -> Iterator[Chunk]:
    """Chunks of ~`rows` rows over Arrow files read as one dataset (row numbers continue from file to file).
    `rename` / `param`: select_columns. `expect_rows`: the row count the dataset declares; a different
    count read is a UserError (every row is accounted for)."""
    base = 0
    for path in files:
        schema, _ = _open_arrow(path)
        picked = select_columns(schema.names, label if len(files) == 1 else f"{label} ({path.name})", rename, param)
        pending: list[pa.RecordBatch] = []
        held, valid = 0, True  # valid: every pending batch passed the full validation (UTF-8 included)
        for batch, utf8 in _batches(path, base):
            while batch.num_rows:
                take = min(batch.num_rows, rows - held)
                pending.append(batch.slice(0, take))
                held, valid = held + take, valid and utf8
                batch = batch.slice(take)
                if held == rows:
                    yield batch_chunk(pa.concat_batches(pending), base, label, kind, picked, valid)
                    base, pending, held, valid = base + held, [], 0, True
        if held:
            yield batch_chunk(pa.concat_batches(pending), base, label, kind, picked, valid)
            base += held
    if expect_rows is not None and base != expect_rows:
        raise UserError(
            f"{label}: read {base} rows from its Arrow files {', '.join(str(p) for p in files[:3])}"
            f"{' ...' if len(files) > 3 else ''}, but it declares {expect_rows}; the files are incomplete"
        )
