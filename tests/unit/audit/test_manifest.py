"""The audit input's manifest (dflash/audit/manifest.py): which files it lists, what it records for a hub id, and
the hash cache that spares unchanged files. `dvc repro` with these manifests: tests/integration/test_audit_input_repro.py.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from dflash.audit.manifest import HashCache, input_manifest
from dflash.core.errors import ParamsError, UserError
from tests.helpers import repo_params
from tests.helpers.audit import HUB_COMMIT, JUDGED_CONVERSATIONS, save_dataset_to_disk, write_jsonl

ROWS = [{"messages": c} for c in JUDGED_CONVERSATIONS]


def _audit(*overrides: str):
    return repo_params(list(overrides)).audit


def _manifest(spec: str, cache: HashCache, *overrides: str) -> dict:
    return input_manifest(_audit(f"audit.input={spec}", *overrides), cache)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def cache(tmp_path) -> HashCache:
    return HashCache.load(tmp_path / "cache" / "hashes.json")


def test_a_glob_lists_its_matches_sorted_with_size_and_sha256(tmp_path, monkeypatch, cache):
    monkeypatch.chdir(tmp_path)
    Path("chats").mkdir()
    write_jsonl(Path("chats/b.jsonl"), ROWS[:3])
    write_jsonl(Path("chats/a.jsonl"), ROWS[3:])
    Path("chats/c.txt").write_text("not matched")
    manifest = _manifest("chats/*.jsonl", cache)
    assert manifest == {
        "input": "chats/*.jsonl",
        "files": [
            {
                "path": f"chats/{n}.jsonl",
                "size": Path(f"chats/{n}.jsonl").stat().st_size,
                "sha256": _sha(Path(f"chats/{n}.jsonl")),
            }
            for n in ("a", "b")
        ],
    }


def test_a_folder_lists_what_the_audit_reads_and_skips_and_every_file_of_a_saved_dataset(tmp_path, cache):
    write_jsonl(tmp_path / "a.jsonl", ROWS)
    (tmp_path / "README.txt").write_text("skipped: the report lists it")
    save_dataset_to_disk(tmp_path / "saved", ROWS, shards=2)
    paths = [f["path"] for f in _manifest(str(tmp_path), cache)["files"]]
    saved = sorted(str(p) for p in (tmp_path / "saved").iterdir())
    assert paths == sorted([str(tmp_path / "a.jsonl"), str(tmp_path / "README.txt"), *saved])
    assert any(p.endswith("state.json") for p in saved) and sum(p.endswith(".arrow") for p in saved) == 2


def test_an_input_that_matches_nothing_is_the_audits_own_error(tmp_path, cache):
    with pytest.raises(UserError, match=r"audit.input='.*\*.jsonl': no .json / .jsonl"):
        _manifest(str(tmp_path / "*.jsonl"), cache)


def test_a_hub_input_is_its_id_split_revision_and_columns(cache):
    manifest = _manifest(
        "hf:someone/Chat-Data",
        cache,
        f"audit.hf_revision={HUB_COMMIT}",
        "audit.hf_split=test",
        "++audit.hf_columns.messages=chat",
    )
    assert manifest == {
        "input": "hf:someone/Chat-Data",
        "dataset": "someone/Chat-Data",
        "split": "test",
        "revision": HUB_COMMIT,
        "columns": {"messages": "chat"},
    }
    assert cache.hashed == 0  # nothing read: neither the hub nor the datasets cache
    with pytest.raises(ParamsError, match="audit.hf_revision=''"):
        _manifest("hf:someone/Chat-Data", cache)


def test_unchanged_files_are_not_hashed_again_and_a_rewritten_one_is(tmp_path, cache):
    data = write_jsonl(tmp_path / "a.jsonl", ROWS)
    first = _manifest(str(data), cache)
    assert cache.hashed == 1
    cache.save()

    again = HashCache.load(cache.path)
    assert _manifest(str(data), again) == first and again.hashed == 0

    # Same size, new bytes: the new mtime makes it a cache miss (the sha256 is never taken from a stale entry).
    text = data.read_text()
    data.write_text(text.replace("Blue.", "Red!."))
    os.utime(data, ns=(data.stat().st_atime_ns, data.stat().st_mtime_ns + 1_000_000))
    changed = _manifest(str(data), again)
    assert again.hashed == 1 and changed["files"][0]["sha256"] == _sha(data) != first["files"][0]["sha256"]


def test_a_damaged_or_unwritable_cache_only_costs_the_hashing(tmp_path, caplog):
    data = write_jsonl(tmp_path / "a.jsonl", ROWS)
    damaged = tmp_path / "damaged.json"
    damaged.write_text("{not json")
    cache = HashCache.load(damaged)
    assert _manifest(str(data), cache)["files"][0]["sha256"] == _sha(data) and cache.hashed == 1
    cache.save()
    assert list(json.loads(damaged.read_text())) == [str(data.resolve())]

    blocked = tmp_path / "a-file"
    blocked.write_text("")
    unwritable = HashCache.load(blocked / "hashes.json")  # its folder cannot be made: a file is in the way
    _manifest(str(data), unwritable)
    unwritable.save()
    assert "not written" in caplog.text


def test_the_default_cache_lives_under_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert HashCache.default().path == tmp_path / "dflash" / "input-hashes.json"


def test_the_audit_stage_depends_on_the_manifest_that_stage_audit_input_writes():
    """dvc.yaml: audit_input runs on every repro and writes the file stages/audit_input.py names; the audit
    depends on it and never on `${audit.input}` (DVC cannot hash a glob or an hf: id)."""
    import yaml

    from stages.audit_input import MANIFEST
    from tests.helpers import REPO

    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    manifest = "${base.reports_dir}/" + MANIFEST
    assert stages["audit_input"]["always_changed"] is True
    assert [next(iter(o)) for o in stages["audit_input"]["outs"]] == [manifest]
    assert manifest in stages["audit"]["deps"]
    assert not [d for d in stages["audit"]["deps"] if "audit.input" in d]
    assert list(stages).index("audit_input") < list(stages).index("audit")
