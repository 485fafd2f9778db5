"""A file holding one top-level JSON array -> RAW chunks, element by element (bounded memory).

Input: the file (plain / .gz / .zst, UTF-8, optional BOM, any line endings). Output: Chunks of kind
`json`: source_row = 0-based element index; every detail names `FILE element N (line L)` (L: the line
the element starts on). Whatever is not one readable element becomes ONE malformed row, and a region
in `Chunk.unreadable` (lines, bytes) so that the metrics never claim a complete read silently:
- bad JSON in an element: the reader resynchronises at the next line that starts with the array's
  element indentation and `{` (json.dumps(indent=k) output, one element per line); the skipped text
  is the malformed row. Without such a line (a one-line array) the rest of the array is one malformed
  row: "the rest of the array (bytes X-Y, lines A-B, ~K elements) cannot be read".
- an element nested deeper than Python's JSON reader goes: skipped by bracket matching, one row.
- bad UTF-8 inside an element: that element (bytes are kept through `surrogateescape`).
- data after the closing `]` (e.g. a second array): one malformed row; no closing `]` (a cut file):
  one malformed row "unterminated array".
Elements are parsed with `json.JSONDecoder.raw_decode` and read by records.python_rows.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dflash.audit.forms import open_input, read_block
from dflash.audit.records import Chunk, Malformed, excerpt, python_rows, row_ref, too_deep
from dflash.core.errors import UserError

_WS = re.compile(r"[ \t\r\n]*")
_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')
RESYNC_CHARS = 1 << 26  # how far past an error the reader looks for the next element before giving up


def skip_value(buf: str, pos: int) -> int | None:
    """End of the object / array starting at buf[pos] by bracket matching (strings skipped); None when
    the brackets do not match or the value runs past the buffer."""
    stack = []
    for m in _TOKENS.finditer(buf, pos):
        ch = m.group()
        if ch[0] == '"':
            continue
        if ch in "[{":
            stack.append("]" if ch == "[" else "}")
        elif not stack or stack.pop() != ch:
            return None
        if not stack:
            return m.end()
    return None


class _Reader:
    """The decoded text window `buf[pos:]` over the file, with the line and byte offset of `pos`."""

    def __init__(self, fh, file: str, chunk_bytes: int) -> None:
        self.fh, self.file, self.chunk_bytes = fh, file, chunk_bytes
        # surrogateescape keeps bad UTF-8 bytes as lone surrogates; the element holding one is malformed.
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")
        self.buf, self.pos, self.eof, self.line, self.byte = "", 0, False, 1, 0

    def fill(self) -> None:
        block = read_block(self.fh, self.chunk_bytes, self.file)
        self.eof = not block
        self.buf = self.buf[self.pos :] + self.decoder.decode(block, final=self.eof)
        self.pos = 0

    def can_grow(self) -> bool:
        return not self.eof and len(self.buf) - self.pos < 4 * self.chunk_bytes + RESYNC_CHARS

    def advance(self, end: int, nbytes: int | None = None) -> None:
        text = self.buf[self.pos : end]
        self.line += text.count("\n")
        self.byte += len(text.encode("utf-8", "surrogateescape")) if nbytes is None else nbytes
        self.pos = end

    def skip_ws(self, indent: str | None) -> str | None:
        """Skip whitespace (reading on as needed); returns the indentation after the last newline
        skipped (None if none), continuing `indent` from earlier whitespace."""
        while True:
            end = _WS.match(self.buf, self.pos).end()
            seg = self.buf[self.pos : end]
            nl = seg.rfind("\n")
            indent = seg[nl + 1 :] if nl >= 0 else (None if indent is None else indent + seg)
            self.advance(end, len(seg))
            if self.pos < len(self.buf) or self.eof:
                return indent
            self.fill()

    def drain(self) -> tuple[int, int]:
        """Read to the end: (byte offset, line) of the end of the file."""
        text = self.buf[self.pos :]
        byte = self.byte + len(text.encode("utf-8", "surrogateescape"))
        line = self.line + text.count("\n")
        self.buf, self.pos = "", 0
        while block := read_block(self.fh, self.chunk_bytes, self.file):
            byte, line = byte + len(block), line + block.count(b"\n")
        self.eof = True
        return byte, line


def iter_json_array(path: Path, chunk_bytes: int, chunk_rows: int = 20000) -> Iterator[Chunk]:
    """Stream the elements of a top-level JSON array with `raw_decode` (bounded memory)."""
    file = str(path)
    decoder = json.JSONDecoder()
    with open_input(path) as fh:
        r = _Reader(fh, file, max(1, chunk_bytes))
        r.fill()
        if r.buf.startswith("\ufeff"):
            r.advance(1)
        r.skip_ws(None)
        if r.buf[r.pos : r.pos + 1] != "[":
            raise UserError(f"{file}: expected a JSON array")
        r.advance(r.pos + 1)
        index, indent, elem_indent, first_byte = 0, None, None, None
        items: list[tuple[int, Any]] = []
        item_lines: list[int] = []
        malformed: list[Malformed] = []
        unreadable: list[dict] = []

        def ref(i: int, line: int) -> str:
            return row_ref("json", file, i, line)

        def flush() -> Chunk:
            nonlocal items, item_lines, malformed, unreadable
            chunk = python_rows(items, file, parsed=True, kind="json", lines=item_lines)
            chunk.malformed = sorted(malformed + chunk.malformed, key=lambda m: m.row)
            chunk.unreadable = unreadable
            items, item_lines, malformed, unreadable = [], [], [], []
            return chunk

        def rest_unreadable(i: int, why: str) -> None:
            """Element i and everything after it cannot be read: one malformed row, one region."""
            start_line, start_byte, text = r.line, r.byte, r.buf[r.pos : r.pos + 200]
            end_byte, end_line = r.drain()
            avg = (start_byte - first_byte) / i if i and first_byte is not None else None
            guess = f", ~{max(1, round((end_byte - start_byte) / avg))} elements" if avg else ""
            span = f"bytes {start_byte}-{end_byte}, lines {start_line}-{end_line}{guess}"
            malformed.append(
                Malformed(
                    i, f"{ref(i, start_line)}: {why}; the rest of the array ({span}) cannot be read", excerpt(text)
                )
            )
            unreadable.append(
                {
                    "file": file,
                    "element": i,
                    "lines": [start_line, end_line],
                    "bytes": [start_byte, end_byte],
                    "reason": why,
                }
            )

        def region(i: int, lines: list[int], span: list[int], why: str) -> None:
            unreadable.append({"file": file, "element": i, "lines": lines, "bytes": span, "reason": why})

        closed, need_sep = False, False
        while True:
            indent = r.skip_ws(indent)
            ch = r.buf[r.pos : r.pos + 1]
            if ch == ",":
                r.advance(r.pos + 1, 1)
                indent, need_sep = None, False
                continue
            if ch == "]":
                r.advance(r.pos + 1, 1)
                closed = True
                break
            if not ch:  # end of the file inside the array
                malformed.append(
                    Malformed(
                        index,
                        f"{ref(index, r.line)}: unterminated array: the file ends after {index} elements "
                        "without the closing `]` (is it cut?)",
                        "",
                    )
                )
                region(index, [r.line, r.line], [r.byte, r.byte], "unterminated array")
                break
            if indent is not None:
                elem_indent = indent
            if need_sep:  # read on, but the file is not the JSON it claims to be: say so
                region(index, [r.line, r.line], [r.byte, r.byte], f"missing `,` before element {index}")
                need_sep = False
            if first_byte is None:
                first_byte = r.byte
            pos, line = r.pos, r.line
            try:
                obj, end = decoder.raw_decode(r.buf, pos)
            except (json.JSONDecodeError, RecursionError) as exc:
                if r.can_grow():
                    r.fill()  # probably an element cut by the read boundary: read more and retry
                    continue
                if isinstance(exc, RecursionError):
                    end = skip_value(r.buf, pos)
                    if end is not None:
                        malformed.append(
                            Malformed(index, f"{ref(index, line)}: {too_deep(r.buf[pos:end])}", excerpt(r.buf[pos:end]))
                        )
                        span = [r.byte, 0]
                        r.advance(end)
                        span[1] = r.byte
                        region(index, [line, r.line], span, "nested too deep to read")
                        index, indent, need_sep = index + 1, None, True
                        continue
                    why, err = "bad JSON: nested too deep, and its brackets do not match", pos
                else:
                    err = exc.pos
                    why = (
                        f"bad JSON: {exc.msg} at line {line + r.buf.count(chr(10), pos, err)}"
                        if err < len(r.buf)
                        else "bad JSON: the element is cut off at the end of the file (unterminated array)"
                    )
                nxt = None
                if elem_indent is not None and err < len(r.buf):
                    nxt = re.compile(r"\n" + re.escape(elem_indent) + r"\{").search(r.buf, max(err - 1, pos))
                if nxt is None:
                    rest_unreadable(index, why)
                    break
                start_byte = r.byte
                text = r.buf[pos : nxt.start()]
                r.advance(nxt.start())
                end_line = r.line
                malformed.append(
                    Malformed(
                        index,
                        f"{ref(index, line)}: {why}; lines {line}-{end_line} (bytes {start_byte}-{r.byte}) skipped "
                        f"up to the next element at line {end_line + 1}",
                        excerpt(text),
                    )
                )
                region(index, [line, end_line], [start_byte, r.byte], why)
                index, indent = index + 1, None
                continue
            text = r.buf[pos:end]
            try:
                nbytes = len(text.encode("utf-8"))
                items.append((index, obj))
                item_lines.append(line)
            except UnicodeEncodeError as exc:
                raw = text.encode("utf-8", "surrogateescape")
                nbytes = len(raw)
                malformed.append(
                    Malformed(
                        index, f"{ref(index, line)}: bad UTF-8 (character {exc.start} of the element)", excerpt(raw)
                    )
                )
            r.advance(end, nbytes)
            index, indent, need_sep = index + 1, None, True
            if len(items) >= chunk_rows:
                yield flush()
        if closed:
            r.skip_ws(None)
            if r.pos < len(r.buf):  # something after the closing bracket: a second array, or garbage
                start_line, start_byte, text = r.line, r.byte, r.buf[r.pos : r.pos + 200]
                end_byte, end_line = r.drain()
                malformed.append(
                    Malformed(
                        index,
                        f"{ref(index, start_line)}: data after the array's closing `]`: a JSON array file holds one "
                        f"array; bytes {start_byte}-{end_byte} (lines {start_line}-{end_line}) are not read",
                        excerpt(text),
                    )
                )
                unreadable.append(
                    {
                        "file": file,
                        "element": index,
                        "lines": [start_line, end_line],
                        "bytes": [start_byte, end_byte],
                        "reason": "data after the closing ]",
                    }
                )
        yield flush()
