"""Property-based fuzzing of the audit's readers (hypothesis): random valid conversations in every
supported format (OpenAI `messages` JSONL, ShareGPT JSONL and JSON arrays, JSON arrays of messages,
parquet `messages` and HF `conversations` columns, Arrow stream files, `datasets.save_to_disk` folders, a
hub split in a `datasets` cache, conversations stored as JSON strings in JSONL and parquet), then random
corruptions (bytes flipped, lines cut or joined, nulls, scalars, deep nesting, bad UTF-8, lone surrogates,
BOMs, CRLF, huge fields; the binary forms' bytes flipped, JSON strings cut).

Property: `run_audit` either completes with kept + rejected equal to the rows an independent counter
finds (JSONL: non-blank lines; a JSON array that still parses: its length, else the metrics report an
unreadable region; parquet: the footer's row count; Arrow forms: the rows pyarrow reads from the files, a
hub split's declared count), every rejected row named by file and line / element / row with a reason and a
detail, or it raises UserError with one line naming the file.
Never another exception. A few cases run the stage as a subprocess, so a signal or a traceback shows.

Examples: DFLASH_FUZZ_EXAMPLES (default 30) for the in-process property; derandomized, no deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from dflash.audit.run import run_audit
from dflash.core.errors import UserError
from tests.helpers import REPO, repo_params

EXAMPLES = int(os.environ.get("DFLASH_FUZZ_EXAMPLES", "30"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)
REPORT_ONLY = [
    f"audit.gates.{g}.action=report"
    for g in (
        "malformed_frac",
        "rejected_frac",
        "duplicate_prompt_frac",
        "placeholder_response_frac",
        "response_length_spike_frac",
        "repeated_response_frac",
    )
]
WS = b" \t\r\n\x0b\x0c"

# ---------------------------------------------------------------------------------------------- data

text = st.text(st.characters(codec="utf-8"), max_size=24)
openai_role = st.sampled_from(["system", "user", "user", "assistant", "assistant", "tool", "narrator"])
content = st.one_of(text, text.map(lambda t: [{"type": "text", "text": t}]), st.none())
call = st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries({"name": text, "arguments": text})}
)
message = st.fixed_dictionaries(
    {"role": openai_role, "content": content}, optional={"tool_calls": st.lists(call, max_size=1), "name": text}
)
messages_row = st.fixed_dictionaries({"messages": st.lists(message, max_size=4)})
sharegpt_turn = st.fixed_dictionaries(
    {"from": st.sampled_from(["human", "gpt", "system", "observation", "function_call", "bot"]), "value": text}
)
sharegpt_row = st.fixed_dictionaries({"conversations": st.lists(sharegpt_turn, max_size=4)}, optional={"system": text})
FORMATS = (
    "messages.jsonl",
    "sharegpt.jsonl",
    "sharegpt.json",
    "messages.json",
    "messages.parquet",
    "conv.parquet",
    "messages.arrow",
    "messages.saved",
    "conv.saved",
    "messages.hub",
    "strings.jsonl",
    "strings.parquet",
)
HUB_COMMIT = "f" * 40


@st.composite
def dataset(draw):
    fmt = draw(st.sampled_from(FORMATS))
    rows = draw(st.lists(sharegpt_row if ("sharegpt" in fmt or "conv" in fmt) else messages_row, max_size=8))
    return fmt, rows


corruption = st.tuples(
    st.sampled_from(
        [
            "flip",
            "cut",
            "join",
            "null",
            "scalar",
            "deep",
            "bad_utf8",
            "surrogate",
            "bom",
            "crlf",
            "huge",
            "blank",
            "drop",
        ]
    ),
    st.floats(0, 1),
    st.integers(0, 255),
)


def serialize(fmt: str, rows: list[dict], indent) -> bytes:
    if fmt == "strings.jsonl":  # each conversation as a JSON string
        rows = [{"messages": json.dumps(r["messages"], ensure_ascii=False)} for r in rows]
    if fmt.endswith(".jsonl"):
        return b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in rows)
    return json.dumps(rows, ensure_ascii=False, indent=indent).encode()


def corrupt(data: bytes, ops: list) -> bytes:
    for kind, where, byte in ops:
        at = int(where * len(data))
        lines = data.split(b"\n")
        k = min(int(where * len(lines)), len(lines) - 1)
        if kind == "flip" and data:
            data = data[:at] + bytes([byte]) + data[at + 1 :]
        elif kind == "cut":
            data = data[:at] + data[at:].split(b"\n", 1)[-1] if b"\n" in data[at:] else data[:at]
        elif kind == "join" and k + 1 < len(lines):
            data = b"\n".join([*lines[:k], lines[k] + lines[k + 1], *lines[k + 2 :]])
        elif kind in ("null", "scalar", "deep", "huge", "blank"):
            new = {
                "null": b"null",
                "scalar": [b"1", b'"x"', b"[]", b"true", b"{}", b"[{}]"][byte % 6],
                "deep": b'{"messages": ' + b"[" * 3000 + b"]" * 3000 + b"}",
                "huge": json.dumps({"messages": [{"role": "user", "content": "x" * (1 << 20)}]}).encode(),
                "blank": b" " * (byte % 40),
            }[kind]
            data = b"\n".join([*lines[:k], new, *lines[k:]])
        elif kind == "bad_utf8":
            data = data[:at] + bytes([0x80 | byte % 64, 0xFF])[: 1 + byte % 2] + data[at:]
        elif kind == "surrogate":
            data = data.replace(b'": "', b'": "\\ud800', 1) if byte % 2 else data.replace(b'": "', b'": "\\udfff', 1)
        elif kind == "bom":
            data = b"\n".join([*lines[:k], b"\xef\xbb\xbf" + lines[k], *lines[k + 1 :]])
        elif kind == "crlf":
            data = data.replace(b"\n", b"\r\n")
        elif kind == "drop" and lines:
            data = b"\n".join(lines[:k] + lines[k + 1 :])
    return data


def table_of(fmt: str, rows: list[dict]) -> pa.Table:
    """The rows as one table (one type per column: contents as strings, no tool calls)."""
    col = "conversations" if fmt.startswith("conv") else "messages"
    values = [r[col] for r in rows]
    if col == "messages":
        values = [[{"role": m["role"], "content": _flat(m["content"])} for m in v] for v in values]
    return pa.table({col: pa.array(values)}) if values else pa.table({col: pa.array([], pa.null())})


def write_parquet(path: Path, fmt: str, rows: list[dict]) -> None:
    pq.write_table(table_of(fmt, rows), path)


def write_strings(path: Path, rows: list[dict], ops: list) -> None:
    """Parquet whose messages column holds JSON strings; each op cuts one string short (bad JSON)."""
    texts = [json.dumps(r["messages"], ensure_ascii=False) for r in rows]
    for _, where, byte in ops:
        if texts:
            k = int(where * len(texts)) % len(texts)
            texts[k] = texts[k][: byte % (len(texts[k]) + 1)]
    pq.write_table(pa.table({"messages": pa.array(texts, pa.string())}), path)


def write_arrow_form(path: Path, fmt: str, rows: list[dict], ops: list, shards: int) -> Path:
    """An Arrow stream file, a save_to_disk folder (datasets writes it) or a hub split's `datasets` cache (its
    parquet builder, under a hub id's names); then the ops flip bytes of one of its Arrow files."""
    table = table_of(fmt, rows)
    if fmt.endswith(".arrow"):
        with pa.ipc.new_stream(str(path), table.schema) as writer:
            writer.write_table(table, max_chunksize=3)
        files = [path]
    elif fmt.endswith(".saved"):
        import datasets
        from datasets.table import InMemoryTable

        datasets.Dataset(InMemoryTable(table)).save_to_disk(str(path), num_shards=min(shards, max(1, len(rows))))
        files = sorted(path.glob("*.arrow"))
    else:  # hub: path is the datasets cache
        from datasets.packaged_modules.parquet.parquet import Parquet

        write_parquet(path.parent / "hub.parquet", fmt, rows)
        builder = Parquet(
            cache_dir=str(path.parent / "staging"),
            dataset_name="data",
            config_id="default",
            hash=HUB_COMMIT,
            data_files={"train": [str(path.parent / "hub.parquet")]},
        )
        builder.download_and_prepare()
        path.mkdir()
        (path.parent / "staging" / "data").rename(path / "fuzz___data")
        files = sorted(path.rglob("*.arrow"))
    if ops and files:
        target = files[int(ops[0][1] * len(files)) % len(files)]
        target.write_bytes(corrupt(target.read_bytes(), [("flip", w, b) for _, w, b in ops]))
    return path


def _flat(c):
    return "".join(p["text"] for p in c) if isinstance(c, list) else c


# ---------------------------------------------------------------------------------------------- counters


def expected_rows(path: Path) -> tuple[str, int | None]:
    """(kind, rows) found by a counter that shares no code with the readers; rows None when the file
    is a JSON array that no longer parses (then only an unreadable region may explain the count)."""
    if path.suffix in (".arrow", ".saved", ".hub"):
        return path.suffix[1:], _arrow_rows(path)
    data = path.read_bytes()
    if path.suffix == ".parquet":
        try:
            return "parquet", pq.read_metadata(path).num_rows
        except (OSError, ValueError, pa.ArrowException):
            return "parquet", None  # the audit must refuse it
    body = data[3:] if data.startswith(b"\xef\xbb\xbf") else data
    if path.suffix == ".json" and body.lstrip(b" \t\r\n")[:1] == b"[":
        try:
            value = json.loads(body.decode("utf-8"))
        except (ValueError, RecursionError):
            return "json", None
        return "json", len(value) if isinstance(value, list) else None
    return "jsonl", sum(1 for line in body.split(b"\n") if line.strip(WS))


def _arrow_rows(path: Path) -> int | None:
    """Rows pyarrow reads from an Arrow form (a hub split: what its dataset_info.json declares); None when a
    file cannot be read (the audit must refuse it)."""
    if path.suffix == ".hub":
        info = json.loads(next(path.rglob("dataset_info.json")).read_text())
        return info["splits"]["train"]["num_examples"]
    if path.suffix == ".saved":
        state = json.loads((path / "state.json").read_text())
        files = [path / f["filename"] for f in state["_data_files"]]
    else:
        files = [path]
    try:
        return sum(b.num_rows for f in files for b in pa.ipc.open_stream(pa.memory_map(str(f))))
    except (OSError, ValueError, pa.ArrowException):
        return None


def check(path: Path, tmp: Path, generated: int, extra: tuple[str, ...] = ()) -> None:
    kind, rows = expected_rows(path)
    source = "hf:fuzz/data" if kind == "hub" else path
    if kind == "hub":
        extra = (*extra, f"audit.hf_revision={HUB_COMMIT}")
    params = repo_params(
        [f"audit.input={source}", f"audit.out={tmp / 'out'}", "audit.tokenizer=none", *REPORT_ONLY, *extra],
    )
    try:
        m = run_audit(params.audit, params.base)
    except UserError as exc:
        msg = str(exc)
        assert (str(path) in msg or str(source) in msg) and "\n" not in msg.strip(), msg
        return
    assert m["num_kept"] + m["num_rejected"] == m["num_rows"]
    if rows is not None:
        assert m["num_rows"] == rows, (kind, m["num_rows"], rows)
        if kind == "json":
            assert m["num_unreadable_regions"] == 0
    else:  # a broken array: either every element was still found, or the metrics say what was not read
        assert kind == "json", f"read a {kind} input that pyarrow cannot: {m['num_rows']} rows"
        assert m["num_rows"] == generated or m["num_unreadable_regions"] > 0, m
    label = "hf:fuzz/data split train" if kind == "hub" else str(path)
    prefix = {"jsonl": f"{path}:line ", "json": f"{path} element "}.get(kind, f"{label} row ")
    for line in (tmp / "out" / "rejected.jsonl").read_text(encoding="utf-8").split("\n")[:-1]:
        r = json.loads(line)
        assert r["source_file"] == label and isinstance(r["source_row"], int) and r["reasons"], r
        assert r["detail"].startswith(f"{prefix}{r['source_row']}"), r


@FUZZ
@given(dataset(), st.lists(corruption, max_size=3), st.sampled_from([None, 0, 2]), st.sampled_from([1 << 20, 64]))
def test_any_input_is_counted_exactly_or_refused_with_one_line(ds, ops, indent, chunk_bytes):
    fmt, rows = ds
    assume(rows or not fmt.endswith(".hub"))  # `datasets` cannot build a hub split of no rows to cache
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        path = tmp / f"in.{fmt.split('.')[1]}"
        if fmt == "strings.parquet":
            write_strings(path, rows, ops)
        elif fmt.endswith(".parquet"):
            write_parquet(path, fmt, rows)
            if ops:  # flip / cut the binary file itself
                data = path.read_bytes()
                path.write_bytes(corrupt(data, [("flip", w, b) for _, w, b in ops]))
        elif fmt.endswith((".arrow", ".saved", ".hub")):
            write_arrow_form(path, fmt, rows, ops, shards=1 + (indent or 0))
        else:
            path.write_bytes(corrupt(serialize(fmt, rows, indent), ops))
        with _hub_cache(path if fmt.endswith(".hub") else None):
            check(path, tmp, len(rows), (f"audit.chunk_bytes={chunk_bytes}",))


@contextlib.contextmanager
def _hub_cache(cache: Path | None):
    """The `datasets` cache of this example (hypothesis examples cannot use function-scoped fixtures)."""
    if cache is None:
        yield
        return
    import datasets

    from dflash.audit import hub

    old = datasets.config.HF_DATASETS_CACHE
    datasets.config.HF_DATASETS_CACHE, hub._LOADED = cache, {}
    try:
        yield
    finally:
        datasets.config.HF_DATASETS_CACHE, hub._LOADED = old, {}


@settings(FUZZ, max_examples=max(3, EXAMPLES // 10))
@given(st.lists(messages_row, min_size=1, max_size=5), st.lists(corruption, min_size=1, max_size=4))
def test_the_stage_never_dies_of_a_signal_or_a_traceback(rows, ops):
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        path = tmp / "in.jsonl"
        path.write_bytes(corrupt(serialize("messages.jsonl", rows, None), ops))
        cmd = [sys.executable, "-m", "stages.audit", "--params", "params.yaml", "-S", f"audit.input={path}"]
        cmd += ["-S", f"audit.out={tmp / 'out'}", "-S", f"base.reports_dir={tmp / 'reports'}"]
        cmd += ["-S", "audit.tokenizer=none"] + [x for o in REPORT_ONLY for x in ("-S", o)]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert proc.returncode in (0, 1), (proc.returncode, proc.stderr[-3000:])
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        if proc.returncode == 1:
            assert str(path) in proc.stderr.strip().splitlines()[-1], proc.stderr
        else:
            m = json.loads((tmp / "out" / "audit_details.json").read_text())
            assert m["num_rows"] == expected_rows(path)[1]
