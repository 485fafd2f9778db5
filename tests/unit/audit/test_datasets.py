"""The datasets people already have a hub dataset (`audit.input: hf:ID`) read through the
`datasets` cache offline, `save_to_disk` folders, Arrow files and conversations stored as JSON strings, each
audited with the same kept / rejected rows and reasons as the same rows in JSONL.

The hub-format cache is made without network by `datasets` itself (tests/helpers/audit.py `hub_cache`): a hub load
online writes the same layout, its builder hash being the commit it resolved, so these tests read what an online
first run leaves behind. With the network gone: tests/integration/test_audit_hub_offline.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash.audit import hub as hub_mod
from dflash.audit.run import run_audit
from dflash.core.errors import ParamsError, UserError
from dflash.core.io import read_arrow
from dflash.target.build import qwen3_tokenizer_dir
from tests.helpers import repo_params
from tests.helpers.audit import (
    AUDIT_REPORT_ONLY,
    HUB_COMMIT,
    JUDGED_CONVERSATIONS,
    audit_stage_reads_cache_or_names_the_id,
    hub_cache,
    message,
    save_dataset_to_disk,
    warm_hf_home,
    write_jsonl,
)

BAD_JSON = '[{"role": "user", "content": "cut'  # a conversation string that is not JSON: malformed


def _params(source, out: Path, *extra: str):
    return repo_params(
        [
            f"audit.input={source}",
            f"audit.out={out}",
            f"audit.tokenizer={qwen3_tokenizer_dir()}",
            "audit.max_prompt_tokens=64",
            *AUDIT_REPORT_ONLY,
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
    rows = [{"messages": c} for c in JUDGED_CONVERSATIONS]
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

    table = pa.table({"messages": pa.array(JUDGED_CONVERSATIONS)})
    pq.write_table(table, tmp_path / "rows.parquet", row_group_size=4)
    with pa.ipc.new_stream(str(tmp_path / "rows.arrow"), table.schema) as writer:
        writer.write_table(table, max_chunksize=5)
    saved = save_dataset_to_disk(tmp_path / "saved", rows)
    hub_cache(datasets_cache, "someone/Chat-Data", HUB_COMMIT, jsonl)
    forms = {
        "parquet": (tmp_path / "rows.parquet",),
        "arrow file": (tmp_path / "rows.arrow",),
        "save_to_disk (3 shards)": (saved,),
        "save_to_disk, 2-row chunks": (saved, "audit.chunk_bytes=2048"),
        "hub cache": ("hf:someone/Chat-Data", f"audit.hf_revision={HUB_COMMIT}"),
    }
    for i, (name, (source, *extra)) in enumerate(forms.items()):
        got = audit(source, tmp_path / f"out-{i}", *extra)
        _same(reference, got, name)
    metrics, rejected, _ = got  # the hub split: rows named by dataset, split and row index
    assert metrics["input_files"] == ["hf:someone/Chat-Data split train"]
    assert metrics["hub"]["revision"] == HUB_COMMIT and metrics["hub"]["split"] == "train"
    assert rejected[2][1] == (
        "hf:someone/Chat-Data split train row 2: same prompt as hf:someone/Chat-Data split train row 0, which is kept"
    )


def test_json_string_columns_are_parsed_in_every_format(tmp_path, datasets_cache):
    """A conversation stored as a JSON string reads like the list itself; a string that is not JSON is a
    malformed row naming the column, in JSONL, parquet, Arrow, save_to_disk and a hub split alike."""
    reference = audit(
        write_jsonl(
            tmp_path / "lists.jsonl", [{"messages": c} for c in JUDGED_CONVERSATIONS] + [{"messages": BAD_JSON}]
        ),
        tmp_path / "out-ref",
    )
    bad = len(JUDGED_CONVERSATIONS)
    assert reference[1][bad][0] == ("malformed",)
    assert reference[1][bad][1].endswith(
        ": messages: a string that is not valid JSON: Unterminated string starting at (character 29)"
    )

    strings = [json.dumps(c) for c in JUDGED_CONVERSATIONS] + [BAD_JSON]
    rows = [{"messages": s} for s in strings]
    pq.write_table(pa.table({"messages": strings}), tmp_path / "strings.parquet")
    with pa.ipc.new_stream(str(tmp_path / "strings.arrow"), pa.schema([("messages", pa.large_string())])) as w:
        w.write_table(pa.table({"messages": pa.array(strings, pa.large_string())}))
    hub_cache(
        datasets_cache,
        "someone/strings",
        HUB_COMMIT,
        write_jsonl(tmp_path / "dialog.jsonl", [{"dialog": s} for s in strings]),
    )
    forms = {
        "jsonl": (write_jsonl(tmp_path / "strings.jsonl", rows),),
        "parquet": (tmp_path / "strings.parquet",),
        "arrow (large_string)": (tmp_path / "strings.arrow",),
        "save_to_disk": (save_dataset_to_disk(tmp_path / "saved", rows, shards=2),),
        "hub, column renamed": (
            "hf:someone/strings",
            f"audit.hf_revision={HUB_COMMIT}",
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
    rows = [{"messages": [message("user", f"Question {i}?"), message("assistant", f"Answer {i}.")]} for i in range(8)]
    saved = save_dataset_to_disk(tmp_path / "saved", rows, shards=1)
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
    write_jsonl(root / "more.jsonl", [{"messages": [message("user", "Extra?"), message("assistant", "Yes.")]}])
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
    rows = [{"messages": [message("user", f"Question {i}? " * 50), message("assistant", "Fine.")]} for i in range(200)]
    saved = save_dataset_to_disk(tmp_path / "saved", rows, shards=2)
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
    rows = [{"messages": c} for c in JUDGED_CONVERSATIONS[:2]]
    hub_cache(datasets_cache, "someone/chats", HUB_COMMIT, write_jsonl(tmp_path / "rows.jsonl", rows))
    pinned = f"audit.hf_revision={HUB_COMMIT}"
    cases = {  # overrides -> what the one-line error must say
        (
            "hf:someone/nothing",
            pinned,
        ): r"^audit.input=hf:someone/nothing: not in the datasets cache .* hub cannot be reached",
        (
            "hf:someone/chats",
            "audit.hf_revision=" + "f" * 40,
        ): rf"holds revision {HUB_COMMIT} .*not the pinned audit.hf_revision=f{{40}}",
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


def test_the_stage_reads_a_warm_cache_offline_and_names_the_id_without_one(tmp_path):
    """HF_DATASETS_OFFLINE=1: the warm cache is read; an id it does not hold is one line naming the id."""
    _, base = warm_hf_home(tmp_path)
    audit_stage_reads_cache_or_names_the_id(tmp_path, {**base, "HF_DATASETS_OFFLINE": "1"})
