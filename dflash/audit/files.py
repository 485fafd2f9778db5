"""Which files are audit inputs, and how they are opened (plain, gzip or zstd), for dflash/audit/readers.py.

Input: `audit.input`, a file, a folder or a glob. A folder contributes every file below it whose name
ends (case-insensitively) in `.jsonl`, `.ndjson`, `.json` or `.parquet`, the text formats also with
`.gz` or `.zst` after it; every other file in the folder is returned as skipped (the report lists
them). A file named explicitly, or matched by a glob, is read whatever its name: parquet by its
extension, a JSON array when a `.json` starts with `[`, JSONL otherwise.
Output: paths and a `kind` per path (`jsonl`, `json`, `parquet`; records.row_ref says what a row
number means for each). Unreadable bytes (a corrupt gzip stream, a UTF-16 file) are UserErrors naming
the file; nothing here parses JSON.
"""

from __future__ import annotations

import glob
import gzip
import zlib
from pathlib import Path
from typing import BinaryIO

import pyarrow as pa

from dflash.core.errors import UserError

SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet"}
COMPRESSED = (".gz", ".zst")  # text formats only (parquet compresses its own pages)
_DECOMPRESS_ERRORS = (OSError, EOFError, zlib.error, pa.ArrowException)


def input_kind(path: Path) -> str | None:
    """The format a folder file's name declares (case-insensitive), or None when it is not an input."""
    name = path.name.lower()
    compressed = name.endswith(COMPRESSED)
    if compressed:
        name = name[: name.rfind(".")]
    kind = next((k for s, k in SUFFIXES.items() if name.endswith(s)), None)
    return None if kind == "parquet" and compressed else kind


def scan_inputs(spec: str) -> tuple[list[Path], list[Path]]:
    """(input files, folder files skipped because their names are not inputs), both sorted."""
    path = Path(spec)
    if path.is_file():
        return [path], []
    if path.is_dir():
        found = sorted(p for p in path.rglob("*") if p.is_file())
        return [p for p in found if input_kind(p)], [p for p in found if not input_kind(p)]
    return sorted(Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file()), []


def resolve_inputs(spec: str) -> list[Path]:
    """A file, a folder (every input file below it, sorted) or a glob -> files; UserError when none."""
    files, skipped = scan_inputs(spec)
    if not files:
        names = ", ".join(str(p) for p in skipped[:5]) + (f" and {len(skipped) - 5} more" if len(skipped) > 5 else "")
        seen = f"; skipped {len(skipped)} other files: {names}" if skipped else ""
        raise UserError(
            f"audit.input={spec!r}: no .json / .jsonl / .parquet files found (also read: .ndjson, any case, and the "
            f"text formats with .gz or .zst after them){seen}"
        )
    return files


def open_input(path: Path) -> BinaryIO:
    """A binary stream of the file's bytes, decompressed when its name ends in .gz or .zst."""
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")  # type: ignore[return-value]
    if name.endswith(".zst"):
        return pa.input_stream(str(path), compression="zstd")  # type: ignore[return-value]
    return open(path, "rb")


def read_block(fh: BinaryIO, size: int, file: str) -> bytes:
    """fh.read(size); a corrupt compressed stream is a UserError naming the file."""
    try:
        return fh.read(size)
    except _DECOMPRESS_ERRORS as exc:
        why = " ".join(str(exc).split())
        raise UserError(f"{file}: cannot be read or decompressed ({type(exc).__name__}: {why})") from None


def first_byte(path: Path) -> bytes:
    """The first byte after a UTF-8 byte-order mark and whitespace (b'' for an empty file). UTF-16 and
    UTF-32 text (their byte-order marks) is a UserError: the audit reads UTF-8."""
    with open_input(path) as fh:
        head = read_block(fh, 4096, str(path))
    for bom, name in (
        (b"\xff\xfe\x00\x00", "UTF-32"),
        (b"\x00\x00\xfe\xff", "UTF-32"),
        (b"\xff\xfe", "UTF-16"),
        (b"\xfe\xff", "UTF-16"),
    ):
        if head.startswith(bom):
            raise UserError(
                f"{path}: {name} text (byte-order mark {bom.hex(' ').upper()}); the audit reads UTF-8: convert it, "
                f"e.g. `iconv -f {name} -t UTF-8 {path} > out.jsonl`"
            )
    return head.lstrip(b"\xef\xbb\xbf").lstrip(b" \t\r\n")[:1]
