"""Audit inputs that are not what their names say (dflash/audit/forms.py), and rows the pipeline cannot train on:
- a pretty-printed JSON array saved as `.jsonl` keeps its conversations, one row each (not a malformed row per
  line), and the report says it was read as a JSON array though named .jsonl;
- gzip data in a `.zst` file (and zstd in `.gz`, plain text in `.gz`, parquet in `.json`) is read by its bytes;
- bytes the audit cannot read (bzip2, a zip archive, an HTML page, a cut gzip stream) are one line naming the
  file, what the bytes look like and the fix;
- a message with an image or audio part is rejected as `non_text_part`, not `malformed`, in every format, and the
  report lists the reason and says what to do.
"""

from __future__ import annotations

import bz2
import gzip
import json
import zipfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash.audit.forms import sniff
from dflash.audit.readers import count_rows
from dflash.core.errors import UserError
from tests.unit.audit.test_inputs import _audit, _line, _row


def _zstd(path: Path, data: bytes) -> Path:
    with pa.output_stream(str(path), compression="zstd") as fh:
        fh.write(data)
    return path


def _rows(n: int) -> list[dict]:
    return [_row(i) for i in range(n)]


def test_a_pretty_printed_json_array_saved_as_jsonl_keeps_its_five_conversations(tmp_path):
    src = tmp_path / "export.jsonl"
    src.write_text(json.dumps(_rows(5), indent=2) + "\n", encoding="utf-8")
    assert src.read_text().count("\n") > 50  # each conversation over many lines, as the export
    m, rejected, out = _audit(tmp_path, src)
    assert (m["num_rows"], m["num_kept"], m["num_rejected"], rejected) == (5, 5, 0, {})
    assert m["num_kept"] + m["num_rejected"] == 5
    assert m["input_forms"] == {str(src): "a JSON array"}
    assert m["form_notes"] == {str(src): "read as a JSON array, though named .jsonl"}
    assert f"`{src}` read as a JSON array, though named .jsonl" in (out / "report.md").read_text()
    assert count_rows(str(src)) >= 5


def test_json_lines_whose_first_row_is_a_list_stay_json_lines(tmp_path):
    """A `[` first decides for a JSON array, except where the first line is a whole value and lines follow."""
    src = tmp_path / "rows.json"
    src.write_bytes(b"[1, 2]\n" + _line(0) + b"\n" + _line(1) + b"\n")
    m, rejected, _ = _audit(tmp_path, src)
    assert (m["num_rows"], m["num_kept"]) == (3, 2)
    assert rejected[1].startswith(f"{src}:line 1: row is not a JSON object")
    one_line = tmp_path / "one.jsonl"
    one_line.write_text(json.dumps(_rows(3)) + "\n")  # json.dumps without indent: an array on one line
    assert sniff(one_line).kind == "json" and _audit(tmp_path, one_line)[0]["num_kept"] == 3


def test_compression_is_read_from_the_magic_bytes_not_the_suffix(tmp_path):
    data = b"".join(_line(i) + b"\n" for i in range(4))
    files = {
        "gzip.jsonl.zst": (gzip.compress(data), "read as gzip-compressed JSON lines, though named .jsonl.zst"),
        "zstd.jsonl.gz": (None, "read as zstd-compressed JSON lines, though named .jsonl.gz"),
        "plain.jsonl.gz": (data, "read as JSON lines, though named .jsonl.gz"),
        "array.json.zst": (gzip.compress(json.dumps(_rows(4), indent=1).encode()), None),
    }
    for name, (raw, note) in files.items():
        path = tmp_path / name
        if raw is None:
            _zstd(path, data)
        else:
            path.write_bytes(raw)
        m, rejected, _ = _audit(tmp_path / name.replace(".", "_"), path)
        assert (m["num_rows"], m["num_kept"], rejected) == (4, 4, {}), name
        if note:
            assert m["form_notes"] == {str(path): note}
    assert m["input_forms"] == {str(tmp_path / "array.json.zst"): "a gzip-compressed JSON array"}
    parquet = tmp_path / "table.json"  # parquet bytes under a JSON name
    pq.write_table(pa.table({"messages": [r["messages"] for r in _rows(3)]}), parquet)
    m, _, _ = _audit(tmp_path / "pq", parquet)
    assert m["num_kept"] == 3 and m["form_notes"] == {str(parquet): "read as parquet, though named .json"}


def test_a_folder_reports_every_files_form_and_names_agree_quietly(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    (d / "a.jsonl").write_bytes(_line(0) + b"\n")
    (d / "b.json.gz").write_bytes(gzip.compress(json.dumps([_row(1)]).encode()))
    m, _, out = _audit(tmp_path, d)
    assert m["num_kept"] == 2 and m["form_notes"] == {}
    assert m["input_forms"] == {str(d / "a.jsonl"): "JSON lines", str(d / "b.json.gz"): "a gzip-compressed JSON array"}
    assert f"`{d / 'a.jsonl'}` as JSON lines" in (out / "report.md").read_text()


@pytest.mark.parametrize(
    "name,content,says",
    [
        ("x.jsonl.bz2.zst", bz2.compress(b"{}\n"), r"bzip2 data; the audit reads plain, gzip or zstd files: .*bunzip2"),
        ("x.zip.jsonl", None, r"a zip archive; .*unzip .* -d DIR"),
        ("page.jsonl", b"\n  <html><body>Sign in</body></html>\n", r"starts with '<html><body>'.*HTML or XML page"),
        (
            "cut.jsonl.zst",
            gzip.compress(b"".join(_line(i) + b"\n" for i in range(200)))[:-30],
            r"gzip data that cannot",
        ),
    ],
)
def test_bytes_the_audit_cannot_read_are_one_line_naming_file_what_and_fix(tmp_path, name, content, says):
    path = tmp_path / name
    if content is None:
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("rows.jsonl", _line(0) + b"\n")
    else:
        path.write_bytes(content)
    with pytest.raises(UserError, match=says) as err:
        _audit(tmp_path, path)
    assert str(err.value).startswith(f"{path}: ") and "\n" not in str(err.value)


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}


def _multimodal() -> list[dict]:
    """Row 0 text parts (kept), row 1 an image part beside a text part, row 2 audio, row 3 a broken part."""
    text = {"type": "text", "text": "What is in this picture?"}
    audio = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
    answer = {"role": "assistant", "content": "A cat."}
    return [
        {"messages": [{"role": "user", "content": [text]}, answer]},
        {"messages": [{"role": "user", "content": [text, IMAGE]}, answer]},
        {"messages": [{"role": "user", "content": [audio]}, answer]},
        {"messages": [{"role": "user", "content": [{"type": "text"}]}, answer]},
    ]


def test_a_message_with_an_image_part_has_its_own_reason_in_every_format(tmp_path):
    rows = _multimodal()
    jsonl = tmp_path / "mm.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    array = tmp_path / "mm.json"
    array.write_text(json.dumps(rows, indent=2))
    parquet = tmp_path / "mm.parquet"
    pq.write_table(pa.table({"messages": [json.dumps(r["messages"]) for r in rows]}), parquet)
    for src in (jsonl, array, parquet):
        m, details, out = _audit(tmp_path / src.suffix[1:], src)
        assert (m["num_rows"], m["num_kept"], m["num_non_text_part"], m["num_malformed"]) == (4, 1, 2, 1), src
        assert m["rejected_by_reason"] == {"malformed": 1, "non_text_part": 2}
        first = 1 if src == jsonl else 0  # JSONL numbers lines from 1, the others rows / elements from 0
        assert "content[1]: a content part of type 'image_url' (parts: image_url, text)" in details[first + 1]
        assert "content[0]: a content part of type 'input_audio'" in details[first + 2]
        assert "only text content parts are supported" in details[first + 3]
        rejected = [json.loads(x) for x in (out / "rejected.jsonl").read_text().splitlines()]
        assert [r["reasons"] for r in rejected] == [["non_text_part"], ["non_text_part"], ["malformed"]]
        report = (out / "report.md").read_text()
        assert "| non_text_part | 2 |" in report and "the data is multimodal" in report
