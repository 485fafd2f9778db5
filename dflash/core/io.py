"""Files: atomic writes, JSON, content hashes and Arrow IPC shards.

Every artifact a stage writes goes through `atomic_write` (temp file in the same folder, fsync,
rename), so a crash leaves either the old file or the new one, never half of one. Arrow shards are
IPC files (`.arrow`) with zstd compression; readers stream them record batch by record batch.
No torch here: audit, tokenize and plan import this module on data boxes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temp path beside `path`; on success fsync and rename it over `path`. The temp file is created as a
    plain open() creates one (0666 under the umask), not with mkstemp's private 0600: reports and artifacts are read
    by other users."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    os.close(os.open(tmp_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))  # the umask applies, as to open()
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp_path, path)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


@contextlib.contextmanager
def staged_folder(out: str | Path) -> Iterator[Path]:
    """Yield an empty staging folder beside `out`; on success it replaces `out` whole (old contents gone, new
    ones in place in two renames). On an exception the staging folder is removed and `out` is left as it was,
    so a failed or refused run never leaves new files beside old ones (dflash.core.paths keeps `out` free of
    anything else)."""
    out = Path(out)
    staging = out.parent / f".{out.name}.partial"
    old = out.parent / f".{out.name}.old"
    for leftover in (staging, old):  # from a run killed mid-way
        if leftover.exists():
            shutil.rmtree(leftover)
    staging.mkdir(parents=True)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if out.exists():
        out.rename(old)
    staging.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def atomic_write(path: str | Path, data: bytes | str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)


def write_json(path: str | Path, obj: Any) -> None:
    atomic_write(path, json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")


def read_json(path: str | Path) -> Any:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item"):  # numpy / torch scalars
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def canonical_json(obj: Any) -> str:
    """The one text form used for hashing: sorted keys, no whitespace."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=_json_default)


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def config_hash(obj: Any, length: int = 12) -> str:
    """Short stable hash of a JSON-able object (used in folder names that must change with config)."""
    return sha256_text(canonical_json(obj))[:length]


def file_sha256(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------------------------- Arrow shards


def write_arrow(path: str | Path, table: pa.Table, compression: str | None = "zstd") -> None:
    """Write `table` as one Arrow IPC file, atomically."""
    options = ipc.IpcWriteOptions(compression=compression) if compression else ipc.IpcWriteOptions()
    with (
        atomic_path(path) as tmp,
        pa.OSFile(str(tmp), "wb") as sink,
        ipc.new_file(sink, table.schema, options=options) as writer,
    ):
        writer.write_table(table)


def read_arrow(path: str | Path) -> pa.Table:
    with pa.memory_map(str(path), "r") as source:
        return ipc.open_file(source).read_all()


def iter_arrow_batches(path: str | Path) -> Iterator[pa.RecordBatch]:
    """Stream one Arrow IPC file batch by batch (bounded memory)."""
    with pa.memory_map(str(path), "r") as source:
        reader = ipc.open_file(source)
        for i in range(reader.num_record_batches):
            yield reader.get_batch(i)


def list_shards(folder: str | Path, pattern: str = "*.arrow") -> list[Path]:
    """Committed shards in a folder, sorted by name (temp files start with '.' and are skipped)."""
    return sorted(p for p in Path(folder).glob(pattern) if not p.name.startswith("."))
