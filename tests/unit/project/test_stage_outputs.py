"""Stage outputs are replaced as a whole, never overlap, and an empty or failed run changes nothing.

Covers issue items: empty input (0-byte file, whitespace-only file, 0-row parquet) names the file and leaves the
previous run's outputs as they were; `audit.chunk_bytes: 0` is refused; `tokenize.out` equal to `audit.out` (or
any two outputs nesting, an input inside an output, an output holding the working tree) is refused before any
work; a run that fails mid-way leaves the old folder untouched and no staging folder behind.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash.audit.run import run_audit
from dflash.core.errors import ParamsError, UserError
from dflash.core.io import staged_folder
from dflash.core.paths import check_paths
from tests.helpers import REPO, repo_params

ROW = {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello there."}]}


def _params(tmp_path: Path, source: Path | str, *overrides: str):
    return repo_params(
        [
            f"audit.input={source}",
            f"audit.out={tmp_path / 'audit'}",
            "audit.tokenizer=none",
            f"base.reports_dir={tmp_path / 'reports'}",
            *overrides,
        ],
    )


def _stage(tmp_path: Path, name: str, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", f"stages.{name}", "--params", "params.yaml"]
    for o in (f"base.reports_dir={tmp_path / 'reports'}", "audit.tokenizer=none", *overrides):
        cmd += ["-S", o]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def audited(tmp_path):
    """A finished audit of two good rows: (params overrides' tmp root, the out folder, its files)."""
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps(ROW) + "\n" + json.dumps({"messages": [ROW["messages"][0] | {"content": "Yo?"}]}) + "\n")
    p = _params(tmp_path, good)
    run_audit(p.audit, p.base)
    out = tmp_path / "audit"
    return out, _snapshot(out)


@pytest.mark.parametrize("kind", ["zero_bytes", "whitespace", "zero_row_parquet"])
def test_empty_input_names_the_file_and_changes_nothing(tmp_path, audited, kind):
    out, before = audited
    path = tmp_path / ("empty.parquet" if kind == "zero_row_parquet" else "empty.jsonl")
    if kind == "zero_bytes":
        path.write_bytes(b"")
    elif kind == "whitespace":
        path.write_text("\n  \n\t\r\n")
    else:
        pq.write_table(pa.table({"messages": pa.array([], pa.list_(pa.struct([("role", pa.string())])))}), path)
    p = _params(tmp_path, path)
    with pytest.raises(UserError, match=rf"no rows in {path}.*{out} was left as it was"):
        run_audit(p.audit, p.base)
    assert _snapshot(out) == before  # the previous run's files, all of them, byte for byte
    assert sorted(x.name for x in tmp_path.iterdir() if x.name.startswith(".audit")) == []

    proc = _stage(tmp_path, "audit", f"audit.input={path}", f"audit.out={out}")
    assert proc.returncode == 1 and f"no rows in {path}" in proc.stderr and "Traceback" not in proc.stderr
    assert _snapshot(out) == before


def test_a_run_that_fails_midway_leaves_the_old_output_whole(tmp_path, audited, monkeypatch):
    out, before = audited
    import dflash.audit.run as run

    def boom(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(run, "audit_chunk", boom)
    p = _params(tmp_path, tmp_path / "good.jsonl")
    with pytest.raises(RuntimeError, match="disk full"):
        run_audit(p.audit, p.base)
    assert _snapshot(out) == before
    assert not (tmp_path / ".audit.partial").exists() and not (tmp_path / ".audit.old").exists()


def test_a_new_run_replaces_every_file_of_the_old_one(tmp_path, audited):
    out, _ = audited
    (out / "stale-from-an-old-version.txt").write_text("x")
    p = _params(tmp_path, tmp_path / "good.jsonl")
    run_audit(p.audit, p.base)
    assert not (out / "stale-from-an-old-version.txt").exists() and (out / "conversations.arrow").exists()


def test_staged_folder_swaps_whole_and_cleans_leftovers(tmp_path):
    out = tmp_path / "o"
    (tmp_path / ".o.partial").mkdir()  # left by a killed run
    (tmp_path / ".o.partial" / "half").write_text("half")
    with staged_folder(out) as staging:
        (staging / "a").write_text("1")
    assert _snapshot(out) == {"a": b"1"}
    with pytest.raises(KeyError), staged_folder(out) as staging:
        (staging / "b").write_text("2")
        raise KeyError("x")
    assert _snapshot(out) == {"a": b"1"} and sorted(p.name for p in tmp_path.iterdir()) == ["o"]


@pytest.mark.parametrize("value", [0, -5])
def test_chunk_bytes_must_be_positive(tmp_path, value):
    p = _params(tmp_path, tmp_path / "x.jsonl", f"audit.chunk_bytes={value}")
    with pytest.raises(ParamsError, match=rf"audit.chunk_bytes: must be >= 1, got {value}"):
        run_audit(p.audit, p.base)


def test_gate_max_must_be_a_share(tmp_path):
    p = _params(tmp_path, tmp_path / "x.jsonl", "audit.gates.malformed_frac.max=1.5")
    with pytest.raises(ParamsError, match=r"audit.gates.malformed_frac.max: must be a share in \[0, 1\], got 1.5"):
        run_audit(p.audit, p.base)


# ------------------------------------------------------------------ overlapping paths


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["tokenize.out=artifacts/audit"], "audit.out=artifacts/audit and tokenize.out=artifacts/audit overlap"),
        (["train.out=artifacts/tokenize/train"], "tokenize.out=artifacts/tokenize and train.out="),
        (["generate.pilot_out=artifacts/generate"], "generate.out=artifacts/generate and generate.pilot_out="),
        (["audit.input=artifacts"], "audit.input=artifacts and base.target_dir=artifacts/target overlap"),
        (["audit.input=artifacts/audit/old.jsonl"], "audit.input=artifacts/audit/old.jsonl and audit.out"),
        (["audit.input=artifacts/au*/x.jsonl"], "audit.input=artifacts/au*/x.jsonl and base.target_dir"),
        (["audit.out=."], "audit.out=. holds base.reports_dir"),
        (["tokenize.out=.."], "tokenize.out=.. holds base.reports_dir"),
        (["base.reports_dir=artifacts/train/r"], "train.out=artifacts/train holds base.reports_dir"),
        (["audit.out="], "audit.out: empty path"),
    ],
)
def test_overlapping_outputs_are_refused(overrides, words, monkeypatch):
    monkeypatch.chdir(REPO)
    params = repo_params(overrides)
    with pytest.raises(ParamsError) as exc:
        check_paths(params)
    assert words in str(exc.value)


def test_the_default_layout_passes(monkeypatch):
    monkeypatch.chdir(REPO)
    check_paths(repo_params())
    check_paths(repo_params(overlays=[REPO / "params/gpu-qwen3.6-27b.yaml"]))


def test_tokenize_out_equal_to_audit_out_is_refused_before_any_work(tmp_path, audited):
    """The issue: tokenize.out == audit.out deleted the audit's output, which is tokenize's own input."""
    out, before = audited
    proc = _stage(tmp_path, "tokenize", f"audit.out={out}", f"tokenize.out={out}", "tokenize.source=recorded")
    assert proc.returncode == 2, proc.stderr
    assert f"audit.out={out} and tokenize.out={out} overlap" in proc.stderr and "Traceback" not in proc.stderr
    assert _snapshot(out) == before
