"""What an audit input file holds, decided from its bytes where they and its name disagree; opening it so.

Names lie: a pretty-printed JSON array exported as `.jsonl`, gzip data saved as `.zst`, a parquet file named
`.json`. The name chooses which folder files are inputs (dflash/audit/files.py); the bytes choose how one is read:
- compression by magic bytes: gzip (1f 8b), zstd (28 b5 2f fd), else plain, whatever the suffix says;
- the form: parquet (`PAR1`) and Arrow (`ARROW1`, or an IPC stream's ff ff ff ff) by magic; text by its first
  non-blank byte after a UTF-8 byte-order mark: `[` is a JSON array, anything else JSON lines. One exception
  keeps JSON lines whose first row is a list readable row by row: a first line that is a whole JSON value
  followed by a line starting with `{` is JSON lines. An empty or blank text file is JSON lines (no rows either way).
  A parquet / Arrow name whose bytes are neither those formats nor JSON text keeps its name's form (its reader
  names the damage).
`sniff(path)` -> Form: the form read (`kind`, records.KINDS), the compression, `label` ("gzip-compressed JSON
lines") and `note` ("read as a JSON array, though named .jsonl"; "" when the name says the same), which the
audit report lists. Bytes that cannot be read are ONE UserError naming the file, what the bytes look like and the
fix: bzip2 / xz / zip / 7z data, an HTML or XML page, UTF-16 / UTF-32 text, a gzip or zstd stream that breaks.
`open_input(path)` is the byte stream of the file, decompressed as its magic bytes say; `read_block` reads it.
"""

from __future__ import annotations

import gzip
import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import pyarrow as pa

from dflash.audit.files import input_kind
from dflash.core.errors import UserError

HEAD_BYTES = 1 << 16  # read to decide the form (the first line of JSON lines is judged within it)
COMPRESSIONS = {b"\x1f\x8b": "gzip", b"\x28\xb5\x2f\xfd": "zstd"}
COLUMNAR = {b"PAR1": "parquet", b"ARROW1": "arrow", b"\xff\xff\xff\xff": "arrow"}
UNSUPPORTED = {  # magic -> (what it is, how to make it a file the audit reads)
    b"BZh": ("bzip2 data", "recompress it: `bunzip2 -c FILE | zstd -o FILE.jsonl.zst` (or gzip)"),
    b"\xfd7zXZ\x00": ("xz data", "recompress it: `xz -dc FILE | zstd -o FILE.jsonl.zst` (or gzip)"),
    b"PK\x03\x04": ("a zip archive", "unpack it (`unzip FILE -d DIR`) and set audit.input to the folder"),
    b"7z\xbc\xaf\x27\x1c": ("a 7z archive", "unpack it (`7z x FILE`) and set audit.input to the folder"),
}
BOMS = (
    (b"\xff\xfe\x00\x00", "UTF-32"),
    (b"\x00\x00\xfe\xff", "UTF-32"),
    (b"\xff\xfe", "UTF-16"),
    (b"\xfe\xff", "UTF-16"),
)
LABELS = {"jsonl": "JSON lines", "json": "a JSON array", "parquet": "parquet", "arrow": "Arrow"}
_DECOMPRESS_ERRORS = (OSError, EOFError, zlib.error, pa.ArrowException)
_TEXT_START = (b"{", b"[")


@dataclass(frozen=True)
class Form:
    kind: str  # jsonl | json | parquet | arrow (records.row_ref: what a row number means)
    compression: str = ""  # "" (plain) | gzip | zstd
    note: str = ""  # how the bytes differ from the name ("" when they agree), for the report

    @property
    def label(self) -> str:
        """e.g. "gzip-compressed JSON lines", "a JSON array", "parquet"."""
        if not self.compression:
            return LABELS[self.kind]
        if self.kind == "json":
            return f"a {self.compression}-compressed JSON array"
        return f"{self.compression}-compressed {LABELS[self.kind]}"


def compression_of(head: bytes) -> str:
    """gzip / zstd by the magic bytes at the start, "" for anything else."""
    return next((name for magic, name in COMPRESSIONS.items() if head.startswith(magic)), "")


def looks_like(head: bytes) -> str:
    """What the start of a file looks like, in words: "gzip data", "starts with '<html'"..."""
    for magic, (what, _) in UNSUPPORTED.items():
        if head.startswith(magic):
            return what
    if name := compression_of(head):
        return f"{name} data"
    text = head.lstrip(b"\xef\xbb\xbf").lstrip()[:12].decode("utf-8", "replace")
    return f"starts with {text!r}" if text else "empty"


def _named(path: Path) -> tuple[str | None, str]:
    """(the form the name declares, None for none; the compression its suffix declares: "" / gzip / zstd)."""
    name = path.name.lower()
    return input_kind(path), "gzip" if name.endswith(".gz") else "zstd" if name.endswith(".zst") else ""


def _head(path: Path, compression: str) -> bytes:
    """The first HEAD_BYTES of the file's content (decompressed); a broken stream is one UserError."""
    with _open(path, compression) as fh:
        return read_block(fh, HEAD_BYTES, str(path))


def _text_kind(path: Path, text: bytes) -> str:
    """JSON array or JSON lines, from decompressed text: `[` first is an array unless the first line is a whole
    JSON value and the next non-blank line starts with `{`. UTF-16 / UTF-32, HTML or XML: a UserError saying
    what and how to fix."""
    for bom, name in BOMS:
        if text.startswith(bom):
            raise UserError(
                f"{path}: {name} text (byte-order mark {bom.hex(' ').upper()}); the audit reads UTF-8: convert it, "
                f"e.g. `iconv -f {name} -t UTF-8 {path} > out.jsonl`"
            )
    body = text.lstrip(b"\xef\xbb\xbf").lstrip(b" \t\r\n")
    if body[:1] == b"<":
        raise UserError(
            f"{path}: {looks_like(body)} (an HTML or XML page, not conversations: a download that saved an error or "
            "login page?); fetch the data file itself"
        )
    if body[:1] != b"[":
        return "jsonl"
    first, newline, rest = body.partition(b"\n")
    if newline and rest.lstrip(b" \t\r\n")[:1] == b"{":
        try:
            json.loads(first)
        except (ValueError, RecursionError):
            return "json"
        return "jsonl"  # a whole value on line 1, then an object line: JSON lines whose first row is a list
    return "json"


def sniff(path: Path) -> Form:
    """The form of one input file (a save_to_disk folder is Arrow), decided by its bytes (module docstring)."""
    if path.is_dir():
        return Form("arrow")
    named, named_compression = _named(path)
    with open(path, "rb") as fh:
        raw = fh.read(16)
    for magic, (what, fix) in UNSUPPORTED.items():
        if raw.startswith(magic):
            raise UserError(
                f"{path}: {what}; the audit reads plain, gzip or zstd files: {fix.replace('FILE', str(path))}"
            )
    kind = next((k for magic, k in COLUMNAR.items() if raw.startswith(magic)), None)
    compression = "" if kind else compression_of(raw)
    if kind is None:
        head = _head(path, compression)
        text_like = head.lstrip(b"\xef\xbb\xbf").lstrip()[:1] in _TEXT_START or not head.strip()
        if named in ("parquet", "arrow") and not compression and not text_like:
            return Form(named)  # damaged columnar data: its reader says what is wrong
        kind = _text_kind(path, head)
    form = Form(kind, compression)
    if named is None or (named, named_compression) == (kind, compression):
        return form
    suffix = "".join(path.suffixes[-2:]) if named_compression else path.suffix
    return Form(kind, compression, f"read as {form.label}, though named {suffix}")


def _open(path: Path, compression: str) -> BinaryIO:
    if compression == "gzip":
        return gzip.open(path, "rb")  # type: ignore[return-value]
    if compression == "zstd":
        return pa.input_stream(str(path), compression="zstd")  # type: ignore[return-value]
    return open(path, "rb")


def open_input(path: Path) -> BinaryIO:
    """A binary stream of the file's bytes, decompressed when its magic bytes say gzip or zstd (not its name)."""
    with open(path, "rb") as fh:
        return _open(path, compression_of(fh.read(4)))


def read_block(fh: BinaryIO, size: int, file: str) -> bytes:
    """fh.read(size); a compressed stream that breaks is one UserError naming the file, what it is and the fix."""
    try:
        return fh.read(size)
    except _DECOMPRESS_ERRORS as exc:
        why = " ".join(str(exc).split())
        with open(file, "rb") as raw:
            what = looks_like(raw.read(16))
        tool = "gzip" if what.startswith("gzip") else "zstd"
        raise UserError(
            f"{file}: {what} that cannot be read or decompressed ({type(exc).__name__}: {why}); the file is cut or "
            f"damaged: check it with `{tool} -t {file}` and copy it again"
        ) from None
