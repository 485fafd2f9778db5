"""The datasets people already have (issue 29): a hub dataset (`audit.input: hf:ID`) read through the
`datasets` cache offline, `save_to_disk` folders, Arrow files and conversations stored as JSON strings, each
audited with the same kept / rejected rows and reasons as the same rows in JSONL.

The hub-format cache is made here without network, by `datasets` itself: its packaged JSON builder
(`datasets.packaged_modules.json.Json`, what `load_dataset` runs for a hub repo of JSONL files) converts a
local JSONL into Arrow under the names a hub load uses (dataset name = the id's name in snake case, config
`default`, builder hash = the commit), in a staging folder that is then moved to
`<HF_DATASETS_CACHE>/<owner>___<name>`: the folder `load_dataset(ID)` reads offline (`datasets`' cached-module
factory and its `cache` builder). A hub load online writes the same layout, its builder hash being the
commit it resolved, so these tests read what an online first run leaves behind.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash.audit import hub as hub_mod
from dflash.audit.run import run_audit
from dflash.core.errors import ParamsError, UserError
from dflash.core.io import read_arrow
from dflash.core.loader import load_params
from dflash.target.build import qwen3_tokenizer_dir

REPO = Path(__file__).resolve().parents[1]
REPORT_ONLY = [f"audit.gates.{g}.action=report" for g in ("malformed_frac", "rejected_frac", "duplicate_prompt_frac")]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def m(role: str, content: str | None) -> dict:
    return {"role": role, "content": content}


# Rows of one type (datasets needs that) that the audit judges every way it can: kept, each rejection reason.
CONVERSATIONS = [
    [m("user", "What is 2+2?"), m("assistant", "4")],  # 0 kept
    [m("user", "Name a colour."), m("assistant", "Blue.")],  # 1 kept
    [m("user", "What is 2+2?"), m("assistant", "Four.")],  # 2 duplicate_prompt of 0
    [m("user", "what is  2+2?"), m("assistant", "4")],  # 3 near_duplicate_prompt of 0
    [m("narrator", "Once upon a time"), m("user", "Go on"), m("assistant", "OK.")],  # 4 unknown_role
    [m("assistant", "Hi"), m("user", "Hello"), m("assistant", "Hey")],  # 5 first_turn_not_user
    [m("system", "Be brief."), m("assistant", "Hello")],  # 6 no_user_turn
    [m("user", "   "), m("assistant", "Nothing to say?")],  # 7 empty_prompt
    [m("user", "Tell a joke."), m("assistant", "A joke."), m("assistant", "Another.")],  # 8 assistant_after_assistant
    [m("user", None), m("assistant", "?")],  # 9 malformed: missing content
    [m("user", "A long question: " + "word " * 120), m("assistant", "Short.")],  # 10 prompt_too_long (64 tokens)
    [m("user", "One"), m("assistant", "two"), m("user", "three"), m("assistant", "four")],  # 11 kept, multi-turn
    [m("user", "Say ok."), m("assistant", "ok")],  # 12 kept (a placeholder answer is reported, not rejected)
]
BAD_JSON = '[{"role": "user", "content": "cut'  # a conversation string that is not JSON: malformed


def _params(source, out: Path, *extra: str):
    return load_params(
        REPO / "params.yaml",
        [
            f"audit.input={source}",
            f"audit.out={out}",
            f"audit.tokenizer={qwen3_tokenizer_dir()}",
            "audit.max_prompt_tokens=64",
            *REPORT_ONLY,
            *extra,
        ],
    )


def audit(source, out: Path, *extra: str) -> tuple[dict, dict, dict]:
    """(metrics, {row index: (reasons, detail)} of rejected rows, {row index: conversation_id} of kept rows);
    the row index is 0-based in every format (JSONL line - 1)."""
    p = _params(source, out, *extra)
    metrics = run_audit(p.audit, p.base)
    jsonl = str(source).endswith(".jsonl")
    rejected = {}
    for line in (out / "rejected.jsonl").read_text(encoding="utf-8").splitlines():
        r = json.loads(line)
        rejected[r["source_row"] - jsonl] = (tuple(r["reasons"]), r["detail"])
    kept = read_arrow(out / "conversations.arrow")
    ids = dict(
        zip(
            (x - jsonl for x in kept.column("source_row").to_pylist()),
            kept.column("conversation_id").to_pylist(),
            strict=True,
        )
    )
    assert metrics["num_kept"] + metrics["num_rejected"] == metrics["num_rows"]
    return metrics, rejected, ids


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def save_to_disk(folder: Path, rows: list[dict], shards: int = 3) -> Path:
    import datasets

    datasets.Dataset.from_list(rows).save_to_disk(str(folder), num_shards=shards)
    return folder


def hub_cache(cache: Path, dataset_id: str, revision: str, jsonl: Path) -> Path:
    """The `datasets` cache a hub load of `dataset_id` at `revision` (a repo holding `jsonl`) leaves, made
    offline (see the module docstring). Returns the cache folder of that revision."""
    from datasets.naming import camelcase_to_snakecase
    from datasets.packaged_modules.json.json import Json

    owner, name = dataset_id.split("/")
    name = camelcase_to_snakecase(name)
    staging = cache.parent / f"staging-{name}"
    builder = Json(
        cache_dir=str(staging),
        dataset_name=name,
        config_id="default",
        hash=revision,
        data_files={"train": [str(jsonl)]},
    )
    builder.download_and_prepare()
    cache.mkdir(parents=True, exist_ok=True)
    shutil.move(str(staging / name), str(cache / f"{owner}___{name}"))
    shutil.rmtree(staging, ignore_errors=True)
    return cache / f"{owner}___{name}" / "default" / "0.0.0" / revision


@pytest.fixture
def datasets_cache(tmp_path, monkeypatch) -> Path:
    """An empty `datasets` cache for this test (the process is offline: tests/conftest.py sets HF_HUB_OFFLINE)."""
    import datasets

    cache = tmp_path / "hf-datasets"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(hub_mod, "_LOADED", {})
    return cache


def _same(reference: tuple, other: tuple, name: str) -> None:
    """Same kept rows (and conversation ids) and the same reasons for every rejected row; malformed rows'
    details are equal after the row reference."""
    (_, ref_rej, ref_ids), (_, rej, ids) = reference, other
    assert ids == ref_ids, f"{name}: kept rows differ"
    assert {k: v[0] for k, v in rej.items()} == {k: v[0] for k, v in ref_rej.items()}, f"{name}: reasons differ"
    for k, (reasons, detail) in rej.items():
        if reasons == ("malformed",):
            assert detail.split(": ", 1)[1] == ref_rej[k][1].split(": ", 1)[1], (name, detail, ref_rej[k][1])


# ---------------------------------------------------------------------------------------------- every form


def test_every_columnar_form_judges_rows_as_jsonl_does(tmp_path, datasets_cache):
    rows = [{"messages": c} for c in CONVERSATIONS]
    jsonl = write_jsonl(tmp_path / "rows.jsonl", rows)
    reference = audit(jsonl, tmp_path / "out-jsonl")
    _, rejected, kept = reference
    assert sorted(kept) == [0, 1, 11, 12]
    assert {k: v[0] for k, v in rejected.items()} == {
        2: ("duplicate_prompt",),
        3: ("near_duplicate_prompt",),
        4: ("unknown_role", "first_turn_not_user"),
        5: ("first_turn_not_user",),
        6: ("first_turn_not_user", "no_user_turn"),
        7: ("empty_prompt",),
        8: ("assistant_after_assistant",),
        9: ("malformed",),
        10: ("prompt_too_long",),
    }

    table = pa.table({"messages": pa.array(CONVERSATIONS)})
    pq.write_table(table, tmp_path / "rows.parquet", row_group_size=4)
    with pa.ipc.new_stream(str(tmp_path / "rows.arrow"), table.schema) as writer:
        writer.write_table(table, max_chunksize=5)
    saved = save_to_disk(tmp_path / "saved", rows)
    hub_cache(datasets_cache, "someone/Chat-Data", COMMIT, jsonl)
    forms = {
        "parquet": (tmp_path / "rows.parquet",),
        "arrow file": (tmp_path / "rows.arrow",),
        "save_to_disk (3 shards)": (saved,),
        "save_to_disk, 2-row chunks": (saved, "audit.chunk_bytes=2048"),
        "hub cache": ("hf:someone/Chat-Data", f"audit.hf_revision={COMMIT}"),
    }
    for i, (name, (source, *extra)) in enumerate(forms.items()):
        got = audit(source, tmp_path / f"out-{i}", *extra)
        _same(reference, got, name)
    metrics, rejected, _ = got  # the hub split: rows named by dataset, split and row index
    assert metrics["input_files"] == ["hf:someone/Chat-Data split train"]
    assert metrics["hub"]["revision"] == COMMIT and metrics["hub"]["split"] == "train"
    assert rejected[2][1] == (
        "hf:someone/Chat-Data split train row 2: same prompt as hf:someone/Chat-Data split train row 0, which is kept"
    )


def test_json_string_columns_are_parsed_in_every_format(tmp_path, datasets_cache):
    """A conversation stored as a JSON string reads like the list itself; a string that is not JSON is a
    malformed row naming the column, in JSONL, parquet, Arrow, save_to_disk and a hub split alike."""
    reference = audit(
        write_jsonl(tmp_path / "lists.jsonl", [{"messages": c} for c in CONVERSATIONS] + [{"messages": BAD_JSON}]),
        tmp_path / "out-ref",
    )
    bad = len(CONVERSATIONS)
    assert reference[1][bad][0] == ("malformed",)
    assert reference[1][bad][1].endswith(
        ": messages: a string that is not valid JSON: Unterminated string starting at (character 29)"
    )

    strings = [json.dumps(c) for c in CONVERSATIONS] + [BAD_JSON]
    rows = [{"messages": s} for s in strings]
    pq.write_table(pa.table({"messages": strings}), tmp_path / "strings.parquet")
    with pa.ipc.new_stream(str(tmp_path / "strings.arrow"), pa.schema([("messages", pa.large_string())])) as w:
        w.write_table(pa.table({"messages": pa.array(strings, pa.large_string())}))
    hub_cache(
        datasets_cache,
        "someone/strings",
        COMMIT,
        write_jsonl(tmp_path / "dialog.jsonl", [{"dialog": s} for s in strings]),
    )
    forms = {
        "jsonl": (write_jsonl(tmp_path / "strings.jsonl", rows),),
        "parquet": (tmp_path / "strings.parquet",),
        "arrow (large_string)": (tmp_path / "strings.arrow",),
        "save_to_disk": (save_to_disk(tmp_path / "saved", rows, shards=2),),
        "hub, column renamed": (
            "hf:someone/strings",
            f"audit.hf_revision={COMMIT}",
            "++audit.hf_columns={messages: dialog}",
        ),
    }
    for i, (name, (source, *extra)) in enumerate(forms.items()):
        got = audit(source, tmp_path / f"out-{i}", *extra)
        if name.startswith("hub"):  # the error names the dataset's own column
            assert got[1][bad][1].endswith(
                ": dialog: a string that is not valid JSON: Unterminated string starting at (character 29)"
            )
            got[1][bad] = (got[1][bad][0], got[1][bad][1].replace(": dialog: ", ": messages: "))
        _same(reference, got, name)


def test_a_save_to_disk_folder_is_one_input_and_its_metadata_never_rows(tmp_path):
    """The issue's case: 8 conversations saved with save_to_disk were '2 rows, 2 malformed' (the two metadata
    files read as rows, the Arrow file skipped)."""
    rows = [{"messages": [m("user", f"Question {i}?"), m("assistant", f"Answer {i}.")]} for i in range(8)]
    saved = save_to_disk(tmp_path / "saved", rows, shards=1)
    metrics, rejected, kept = audit(saved, tmp_path / "out")
    assert (metrics["num_rows"], metrics["num_malformed"], len(kept)) == (8, 0, 8)
    assert metrics["input_files"] == [str(saved)] and metrics["num_skipped_files"] == 0

    # A DatasetDict is one input per split; beside it a JSONL and a stray file; rows named by folder and index.
    import datasets

    root = tmp_path / "mixed"
    dd = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows[:5]), "test": datasets.Dataset.from_list(rows[5:] + rows[:1])}
    )
    dd.save_to_disk(str(root / "dd"))
    write_jsonl(root / "more.jsonl", [{"messages": [m("user", "Extra?"), m("assistant", "Yes.")]}])
    (root / "notes.txt").write_text("not data")
    metrics, rejected, kept = audit(root, tmp_path / "out2")
    assert metrics["input_files"] == sorted(
        [str(root / "dd" / "train"), str(root / "dd" / "test"), str(root / "more.jsonl")]
    )
    assert metrics["skipped_files"] == [str(root / "notes.txt")]
    assert (metrics["num_rows"], metrics["num_kept"], metrics["num_malformed"]) == (10, 9, 0)
    ((_, (reasons, detail)),) = rejected.items()  # train row 0 repeats test row 3 (test is read first)
    assert reasons == ("duplicate_prompt",)
    assert detail == f"{root / 'dd' / 'train'} row 0: same prompt as {root / 'dd' / 'test'} row 3, which is kept"


def test_a_damaged_save_to_disk_folder_is_one_line_naming_the_file(tmp_path):
    rows = [{"messages": [m("user", f"Question {i}? " * 50), m("assistant", "Fine.")]} for i in range(200)]
    saved = save_to_disk(tmp_path / "saved", rows, shards=2)
    shard = saved / "data-00001-of-00002.arrow"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # a copy cut short
    with pytest.raises(UserError, match=rf"^{shard}: Arrow data after row 100 cannot be read") as err:
        audit(saved, tmp_path / "out")
    assert "\n" not in str(err.value)
    first = saved / "data-00000-of-00002.arrow"
    first.write_bytes(first.read_bytes().replace(b"messages", b"\x80essages"))  # a column name, not UTF-8
    with pytest.raises(UserError, match=rf"^{first}: not a readable Arrow file"):
        audit(saved, tmp_path / "out")
    shard.unlink()
    with pytest.raises(UserError, match="lists 1 Arrow files that are not there"):
        audit(saved, tmp_path / "out")
    (saved / "state.json").write_text("{}")
    with pytest.raises(UserError, match="not a `datasets` save_to_disk state"):
        audit(saved, tmp_path / "out")


# ---------------------------------------------------------------------------------------------- hub errors


def test_hub_errors_name_the_param_and_the_fix(tmp_path, datasets_cache):
    rows = [{"messages": c} for c in CONVERSATIONS[:2]]
    hub_cache(datasets_cache, "someone/chats", COMMIT, write_jsonl(tmp_path / "rows.jsonl", rows))
    pinned = f"audit.hf_revision={COMMIT}"
    cases = {  # overrides -> what the one-line error must say
        (
            "hf:someone/nothing",
            pinned,
        ): r"^audit.input=hf:someone/nothing: not in the datasets cache .* hub cannot be reached",
        (
            "hf:someone/chats",
            "audit.hf_revision=" + "f" * 40,
        ): rf"holds revision {COMMIT} .*not the pinned audit.hf_revision=f{{40}}",
        ("hf:someone/chats", pinned, "audit.hf_split=test"): r"^audit.hf_split='test': Unknown split",
        (
            "hf:someone/chats",
            pinned,
            "++audit.hf_columns={messages: chat}",
        ): r"no such column: audit.hf_columns.messages='chat'",
    }
    for (source, *extra), pattern in cases.items():
        with pytest.raises(UserError, match=pattern) as err:
            audit(source, tmp_path / "out", *extra)
        assert "\n" not in str(err.value) and not isinstance(err.value, ParamsError), err.value
    (cached,) = (datasets_cache / "someone___chats").rglob("*.arrow")
    cached.write_bytes(b"\x00" * 16 + cached.read_bytes()[16:])  # a damaged cache file
    with pytest.raises(UserError, match=rf"^{cached}: not a readable Arrow file") as err:
        audit("hf:someone/chats", tmp_path / "out", pinned)
    assert "\n" not in str(err.value)
    # What `datasets` itself raises on a damaged cache (found by the fuzz suite): one line naming the folder.
    for exc in (OSError("Invalid IPC stream: negative continuation token"), ValueError("Keys mismatch: ...")):
        error = hub_mod._user_error(
            hub_mod.HubSpec("someone/chats"), exc, "audit.input=hf:someone/chats", datasets_cache
        )
        assert str(error).startswith("audit.input=hf:someone/chats: `datasets` cannot read it"), error
        assert str(error).endswith(
            f"delete {datasets_cache / 'someone___chats'} (its name in lower case) and run again with network"
        )
    params = {  # params refused before anything is read
        "audit.hf_revision=main": "audit.hf_revision='main': hf:someone/chats needs a pinned commit",
        'audit.hf_split="train[:10%]"': "audit.hf_split='train[:10%]': expected a split name",
        "++audit.hf_columns={content: text}": "audit.hf_columns.content: unknown field",
    }
    for override, words in params.items():
        with pytest.raises(ParamsError, match=re.escape(words)):
            audit("hf:someone/chats", tmp_path / "out", pinned, override)


def _stage(tmp_path: Path, env: dict, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "stages.audit", "--params", "params.yaml", "-S", f"audit.out={tmp_path / 'out'}"]
    cmd += ["-S", f"base.reports_dir={tmp_path / 'reports'}", "-S", "audit.tokenizer=none"]
    cmd += [x for o in (*REPORT_ONLY, *overrides) for x in ("-S", o)]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)


def _warm_home(tmp_path: Path) -> tuple[Path, dict]:
    """An HF_HOME whose datasets cache holds someone/Chat-Data at COMMIT (made in a subprocess: `datasets` reads
    its settings from the environment when imported), and an environment without any HF_ setting but it."""
    home = tmp_path / "hf"
    jsonl = write_jsonl(tmp_path / "rows.jsonl", [{"messages": c} for c in CONVERSATIONS])
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from pathlib import Path; import tests.test_audit_datasets as t; "
        "t.hub_cache(Path(sys.argv[2]), 'someone/Chat-Data', t.COMMIT, Path(sys.argv[3]))"
    )
    base = {k: v for k, v in os.environ.items() if not k.startswith("HF_") and k != "TRANSFORMERS_OFFLINE"}
    base["HF_HOME"] = str(home)
    subprocess.run(
        [sys.executable, "-c", code, str(REPO), str(home / "datasets"), str(jsonl)],
        cwd=REPO,
        env={**base, "HF_HUB_OFFLINE": "1"},
        check=True,
        capture_output=True,
        timeout=180,
    )
    return home, base


def _stage_reads_cache_or_names_the_id(tmp_path: Path, env: dict) -> None:
    pinned = f"audit.hf_revision={COMMIT}"
    proc = _stage(tmp_path, env, "audit.input=hf:someone/Chat-Data", pinned)
    assert proc.returncode == 0, proc.stderr[-2000:]
    details = json.loads((tmp_path / "out" / "audit_details.json").read_text())
    assert (details["num_rows"], details["num_kept"]) == (len(CONVERSATIONS), 5)
    proc = _stage(tmp_path, env, "audit.input=hf:someone/Unknown", pinned)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert last.startswith("error: audit.input=hf:someone/Unknown: not in the datasets cache"), last


def test_the_stage_reads_a_warm_cache_offline_and_names_the_id_without_one(tmp_path):
    """HF_DATASETS_OFFLINE=1: the warm cache is read; an id it does not hold is one line naming the id."""
    _, base = _warm_home(tmp_path)
    _stage_reads_cache_or_names_the_id(tmp_path, {**base, "HF_DATASETS_OFFLINE": "1"})


@pytest.mark.slow
def test_without_network_the_cache_is_read_and_a_missing_id_named(tmp_path):
    """No offline flag, the network gone (the hub endpoint a closed local port): `datasets` falls back to the
    cache; for an id it does not hold, the error names it (after huggingface_hub's retries, ~25 s)."""
    from tests.conftest import free_port

    _, base = _warm_home(tmp_path)
    _stage_reads_cache_or_names_the_id(tmp_path, {**base, "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"})
