"""The audit's readers on bad or unusual input: every non-blank line / element / row becomes exactly one
kept row or one rejection whose detail names file and line (or element / row) and what is wrong;
nothing crashes (no segfault, assertion, RecursionError or encoding error), nothing is lost silently.
Also empty inputs, BOMs and CRLF line endings."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash.audit.readers import iter_chunks
from dflash.audit.run import run_audit
from dflash.core.errors import UserError
from tests.helpers import REPO, repo_params

REPORT_ONLY = [f"audit.gates.{g}.action=report" for g in ("malformed_frac", "rejected_frac", "duplicate_prompt_frac")]


def _audit(tmp_path: Path, source: Path, *overrides: str):
    out = tmp_path / "out"
    params = repo_params(
        [f"audit.input={source}", f"audit.out={out}", "audit.tokenizer=none", *REPORT_ONLY, *overrides],
    )
    m = run_audit(params.audit, params.base)
    rejected = [json.loads(line) for line in (out / "rejected.jsonl").read_text(encoding="utf-8").splitlines()]
    assert m["num_kept"] + m["num_rejected"] == m["num_rows"]
    return m, {r["source_row"]: r["detail"] for r in rejected}, out


def _row(i: int, role: str = "user") -> dict:
    return {"messages": [{"role": role, "content": f"question {i}?"}, {"role": "assistant", "content": f"Answer {i}."}]}


def _line(i: int) -> bytes:
    return json.dumps(_row(i)).encode()


def _write(path: Path, lines: list[bytes], end: bytes = b"\n") -> Path:
    path.write_bytes(end.join(lines) + end)
    return path


# ---------------------------------------------------------------------------------------------- item 1


def test_a_leading_null_line_is_a_malformed_row_not_a_segfault(tmp_path):
    """pyarrow 26 read_json(b"null\\n") is SIGSEGV: the stage runs as a subprocess so a signal shows."""
    src = _write(tmp_path / "n.jsonl", [b"null", b" null", _line(1)])
    cmd = [sys.executable, "-m", "stages.audit", "--params", "params.yaml", "-S", f"audit.input={src}"]
    cmd += ["-S", f"audit.out={tmp_path / 'out'}", "-S", f"base.reports_dir={tmp_path / 'reports'}"]
    cmd += ["-S", "audit.tokenizer=none"] + [x for o in REPORT_ONLY for x in ("-S", o)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    rejected = [json.loads(x) for x in (tmp_path / "out" / "rejected.jsonl").read_text().splitlines()]
    assert [(r["source_row"], r["detail"]) for r in rejected] == [
        (1, f"{src}:line 1: row is not a JSON object (got NoneType)"),
        (2, f"{src}:line 2: row is not a JSON object (got NoneType)"),
    ]


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 40])
def test_every_top_level_scalar_or_array_is_a_malformed_row(tmp_path, chunk_bytes):
    scalars = [b"1", b'"x"', b"[]", b"true", b"false", b"[1, 2]", b"[" + _line(9) + b"]", b"-0.5e3", b"null"]
    src = _write(tmp_path / "s.jsonl", [_line(0), *scalars, _line(1), b"null"])
    m, got, _ = _audit(tmp_path, src, f"audit.chunk_bytes={chunk_bytes}")
    assert (m["num_rows"], m["num_kept"], m["num_malformed"]) == (len(scalars) + 3, 2, len(scalars) + 1)
    expected = [2 + k for k in range(len(scalars))] + [len(scalars) + 3]
    assert sorted(got) == expected
    for line in expected:
        assert got[line].startswith(f"{src}:line {line}: row is not a JSON object (got "), got[line]


# ---------------------------------------------------------------------------------------------- item 2


PRETTY = json.dumps(_row(5), indent=2).encode().split(b"\n")  # one object over 12 lines


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 1 << 12])
def test_two_objects_on_a_line_and_a_pretty_printed_object(tmp_path, chunk_bytes):
    lines = [_line(0), _line(1) + _line(2), _line(3) + b"  " + b'{"x": 1}', _line(4), *PRETTY, b"", _line(6)]
    src = _write(tmp_path / "p.jsonl", lines)
    m, got, _ = _audit(tmp_path, src, f"audit.chunk_bytes={chunk_bytes}")
    non_blank = sum(1 for x in lines if x.strip())
    assert (m["num_rows"], m["num_kept"]) == (non_blank, 3)
    col = len(_line(1)) + 1
    assert (
        got[2] == f"{src}:line 2: extra data after the object at column {col}: JSONL needs exactly one object per line"
    )
    assert got[3].startswith(f"{src}:line 3: extra data after the object at column {len(_line(3)) + 3}")
    a, b = 5, 4 + len(PRETTY)
    assert sorted(got) == [2, 3, *range(a, b + 1)]
    for line in range(a, b + 1):
        assert got[line] == (
            f"{src}:line {line}: looks like a pretty-printed JSON object spanning lines {a}-{b}; "
            "JSONL needs one object per line (e.g. `jq -c . FILE`)"
        )


def test_a_cut_line_is_not_taken_for_a_pretty_printed_object(tmp_path):
    src = _write(tmp_path / "c.jsonl", [_line(0)[:-7], _line(1), b"{", _line(2)])
    m, got, _ = _audit(tmp_path, src)
    assert (m["num_rows"], m["num_kept"]) == (4, 2)
    assert "bad JSON" in got[1] and "bad JSON" in got[3], got


# ---------------------------------------------------------------------------------------------- item 3


DEEP = 5000


def test_content_nested_5000_levels_is_a_malformed_row(tmp_path):
    deep = "[" * DEEP + "]" * DEEP
    lines = [
        b'{"messages": [{"role": "user", "content": ' + deep.encode() + b"}]}",  # pyarrow refuses, Python recurses
        b'{"tools": ' + deep.encode() + b', "messages": [{"role": "user", "content": "q"}]}',  # pyarrow accepts
        _line(1),
    ]
    src = _write(tmp_path / "d.jsonl", lines)
    m, got, _ = _audit(tmp_path, src)
    assert (m["num_rows"], m["num_kept"]) == (3, 1)
    assert got[1].startswith(f"{src}:line 1: nested {DEEP + 3} levels deep"), got[1]
    assert got[2].startswith(f"{src}:line 2: nested {DEEP + 1} levels deep"), got[2]

    elements = [_row(0), "DEEP", _row(1)]
    for indent in (None, 2):
        text = json.dumps(elements, indent=indent).replace('"DEEP"', '{"messages": ' + deep + "}")
        arr = tmp_path / f"d{indent}.json"
        arr.write_text(text, encoding="utf-8")
        m, got, _ = _audit(tmp_path / str(indent), arr)
        assert (m["num_rows"], m["num_kept"], sorted(got)) == (3, 2, [1]), got
        assert f"{arr} element 1 (line " in got[1] and f"nested {DEEP + 1} levels deep" in got[1], got[1]


# ---------------------------------------------------------------------------------------------- item 4


def test_a_lone_surrogate_rejects_its_row_in_jsonl_and_json_arrays(tmp_path):
    bad = b'{"messages": [{"role": "user", "content": "x\\ud800y"}, {"role": "assistant", "content": "An answer."}]}'
    bad_tools = b'{"tools": [{"name": "\\udc00"}], "messages": [{"role": "user", "content": "q"}]}'
    pair = b'{"messages": [{"role": "user", "content": "smile \\ud83d\\ude00"}]}'
    src = _write(tmp_path / "u.jsonl", [_line(0), bad, bad_tools, pair])
    m, got, _ = _audit(tmp_path, src)
    assert (m["num_rows"], m["num_kept"]) == (4, 2)
    assert got[2] == f"{src}:line 2: lone surrogate \\ud800 at messages[0].content (character 1)"
    assert got[3].startswith(f"{src}:line 3: tools: lone surrogate \\udc00") or got[3].startswith(
        f"{src}:line 3: lone surrogate \\udc00 at tools"
    ), got[3]

    arr = tmp_path / "u.json"
    arr.write_bytes(b"[\n" + _line(0) + b",\n" + bad + b",\n" + pair + b"\n]")
    m, got, _ = _audit(tmp_path / "arr", arr)
    assert (m["num_rows"], m["num_kept"]) == (3, 2)
    assert got[1] == f"{arr} element 1 (line 3): lone surrogate \\ud800 at messages[0].content (character 1)"


# ---------------------------------------------------------------------------------------------- item 7


def test_data_after_the_closing_bracket_is_a_malformed_row(tmp_path):
    arr = tmp_path / "two.json"
    arr.write_text(json.dumps([_row(0), _row(1)]) + "\n" + json.dumps([_row(2)]) + "\n", encoding="utf-8")
    m, got, _ = _audit(tmp_path, arr)
    assert (m["num_rows"], m["num_kept"], sorted(got)) == (3, 2, [2])
    assert got[2].startswith(f"{arr} element 2 (line 2): data after the array's closing `]`"), got[2]
    assert m["num_unreadable_regions"] == 1 and m["unreadable"][0]["lines"] == [2, 3]


def test_a_missing_closing_bracket_is_a_malformed_row(tmp_path):
    arr = tmp_path / "open.json"
    arr.write_text("[\n" + json.dumps(_row(0)) + ",\n" + json.dumps(_row(1)) + "\n", encoding="utf-8")
    m, got, _ = _audit(tmp_path, arr)
    assert (m["num_rows"], m["num_kept"], sorted(got)) == (3, 2, [2])
    assert "unterminated array: the file ends after 2 elements without the closing `]`" in got[2]
    assert got[2].startswith(f"{arr} element 2 (line 4): ")


@pytest.mark.parametrize("indent", [2, 0, None])
@pytest.mark.parametrize("chunk_bytes", [1 << 20, 97])
def test_a_syntax_error_mid_array_resynchronises_or_says_what_is_lost(tmp_path, indent, chunk_bytes):
    rows = [_row(i) for i in range(6)]
    if indent == 0:  # one element per line
        text = "[\n" + ",\n".join(json.dumps(r) for r in rows) + "\n]\n"
    else:
        text = json.dumps(rows, indent=indent) + "\n"
    broken = text.replace('"question 2?"', '"question 2?" oops', 1)
    arr = tmp_path / "bad.json"
    arr.write_text(broken, encoding="utf-8")
    m, got, _ = _audit(tmp_path, arr, f"audit.chunk_bytes={chunk_bytes}")
    assert sorted(got) == [2]
    assert m["num_unreadable_regions"] == 1 and m["unreadable_bytes"] > 0
    if indent is None:  # one line: nothing to resynchronise at; the rest is one row that says so
        assert (m["num_rows"], m["num_kept"]) == (3, 2)
        assert "the rest of the array (bytes " in got[2] and "~4 elements) cannot be read" in got[2], got[2]
    else:
        assert (m["num_rows"], m["num_kept"]) == (6, 5)
        assert "skipped up to the next element at line" in got[2], got[2]
    assert got[2].startswith(f"{arr} element 2 (line ")


# ---------------------------------------------------------------------------------------------- item 8


def test_a_folder_reads_every_input_extension_and_lists_the_rest(tmp_path):
    import pyarrow as pa

    d = tmp_path / "data"
    (d / "sub").mkdir(parents=True)
    _write(d / "a.JSONL", [_line(0)])
    _write(d / "b.ndjson", [_line(1)])
    (d / "c.Json").write_text(json.dumps([_row(2)]), encoding="utf-8")
    (d / "sub" / "d.jsonl.gz").write_bytes(gzip.compress(_line(3) + b"\n"))
    with pa.output_stream(str(d / "e.NDJSON.zst"), compression="zstd") as fh:
        fh.write(_line(4) + b"\n")
    pq.write_table(pa.table({"messages": [_row(5)["messages"]]}), d / "f.PARQUET")
    (d / "notes.txt").write_text("not data\n")
    (d / "README.md").write_text("# data\n")
    m, got, out = _audit(tmp_path, d)
    assert (m["num_rows"], m["num_kept"], got) == (6, 6, {})
    assert len(m["input_files"]) == 6
    assert m["skipped_files"] == [str(d / "README.md"), str(d / "notes.txt")] and m["num_skipped_files"] == 2
    report = (out / "report.md").read_text()
    assert "notes.txt" in report and "README.md" in report


def test_corrupt_compressed_and_utf16_files_are_user_errors(tmp_path):
    (tmp_path / "x.jsonl.gz").write_bytes(gzip.compress(_line(0) * 50 + b"\n")[:-20] + b"garbage!")
    with pytest.raises(UserError, match=r"x\.jsonl\.gz: gzip data that cannot be read or decompressed .*gzip -t"):
        _audit(tmp_path, tmp_path / "x.jsonl.gz")
    (tmp_path / "w.jsonl").write_bytes((json.dumps(_row(0)) + "\n").encode("utf-16"))
    with pytest.raises(UserError, match=r"w\.jsonl: UTF-16 text .* convert it"):
        _audit(tmp_path, tmp_path / "w.jsonl")


# ---------------------------------------------------------------------------------------------- item 14


def test_every_detail_names_its_row_the_same_way_and_says_why(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    rows = [
        _row(0),
        {"messages": [{"role": "narrator", "content": "Once."}, *_row(1)["messages"]]},
        _row(0),  # duplicate of line 1
        {"messages": [{"role": "user", "content": "  QUESTION 0? "}, {"role": "assistant", "content": "Again."}]},
        {"conversations": [{"from": "human", "value": "q?"}, {"from": "robot", "value": "beep"}], "system": "S"},
    ]
    _write(d / "a.jsonl", [json.dumps(r).encode() for r in rows])
    (d / "b.json").write_text(json.dumps([_row(7), _row(0), {"messages": 3}], indent=1), encoding="utf-8")
    pq.write_table(pa.table({"messages": [_row(8)["messages"], _row(0)["messages"]]}), d / "c.parquet")
    m, _, out = _audit(tmp_path, d)
    got = {(r["source_file"], r["source_row"]): r for r in map(json.loads, (out / "rejected.jsonl").open())}
    a, b, c = (str(d / n) for n in ("a.jsonl", "b.json", "c.parquet"))
    assert got[(a, 2)]["detail"] == (
        f"{a}:line 2: messages[0].role is 'narrator': not one of system, user, assistant, tool"
    )
    assert got[(a, 5)]["detail"].startswith(
        f"{a}:line 5: conversations[1].from is 'robot': not one of human, user, gpt"
    )
    assert got[(a, 3)]["detail"] == f"{a}:line 3: same prompt as {a}:line 1, which is kept"
    assert got[(a, 4)]["detail"] == f"{a}:line 4: same (up to case and whitespace) prompt as {a}:line 1, which is kept"
    assert got[(b, 1)]["detail"] == f"{b} element 1 (line 14): same prompt as {a}:line 1, which is kept"
    assert got[(b, 2)]["detail"] == f"{b} element 2 (line 26): messages: expected a list, got int"
    assert got[(c, 1)]["detail"] == f"{c} row 1: same prompt as {a}:line 1, which is kept"
    assert all(r["detail"] for r in got.values())
    assert m["examples"]["duplicate_prompt"][:2] == [f"{a}:line 3", f"{b} element 1"]


# ---------------------------------------------------------------------------------------------- empty, BOM, CRLF


def test_empty_inputs_are_listed_and_never_crash(tmp_path):
    empties = {
        "zero.jsonl": b"",
        "blank.jsonl": b"  \n\r\n\t\n" + b" " * 40 + b"\n",
        "bom.ndjson": b"\xef\xbb\xbf\n",
        "none.json": b"[]",
        "ws.json": b" \n ",
    }
    for name, data in empties.items():
        (tmp_path / name).write_bytes(data)
        chunks = list(iter_chunks(str(tmp_path / name), 1 << 20))
        assert [c.empty for c in chunks][-1] and sum(c.table.num_rows + len(c.malformed) for c in chunks) == 0, name
    pq.write_table(
        pa.table({"messages": pa.array([], pa.list_(pa.struct([("role", pa.string())])))}), tmp_path / "z.parquet"
    )
    assert [c.empty for c in iter_chunks(str(tmp_path / "z.parquet"), 1 << 20)] == [True]

    d = tmp_path / "mixed"
    d.mkdir()
    for name, data in empties.items():
        (d / name).write_bytes(data)
    (d / "z.parquet").write_bytes((tmp_path / "z.parquet").read_bytes())
    _write(d / "rows.jsonl", [_line(0), _line(1)])
    m, got, _ = _audit(tmp_path, d)
    assert (m["num_rows"], m["num_kept"]) == (2, 2)
    assert sorted(m["empty_files"]) == sorted(str(d / n) for n in [*empties, "z.parquet"])


def test_bom_and_crlf_in_every_text_format(tmp_path):
    rows = [_row(i) for i in range(4)]
    bom = b"\xef\xbb\xbf"
    _write(
        tmp_path / "a.jsonl",
        [bom + json.dumps(rows[0]).encode(), b"", *(json.dumps(r).encode() for r in rows[1:])],
        b"\r\n",
    )
    # concatenated files: a BOM at the start of a later line too
    _write(tmp_path / "b.ndjson", [json.dumps(rows[0]).encode(), bom + json.dumps(rows[1]).encode()], b"\r\n")
    (tmp_path / "c.json").write_bytes(bom + json.dumps(rows, indent=2).replace("\n", "\r\n").encode())
    broken = json.dumps(rows, indent=2).replace('"question 1?"', "oops", 1).replace("\n", "\r\n")
    (tmp_path / "d.json").write_bytes(bom + broken.encode())
    for name, expect in (("a.jsonl", (4, 4)), ("b.ndjson", (2, 2)), ("c.json", (4, 4)), ("d.json", (4, 3))):
        m, got, _ = _audit(tmp_path / name.replace(".", "_"), tmp_path / name)
        assert (m["num_rows"], m["num_kept"]) == expect, (name, got)
    assert sorted(got) == [1] and "skipped up to the next element" in got[1]
