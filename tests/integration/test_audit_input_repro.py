"""`dvc repro` and `dvc exp run` with `audit.input` a glob or `hf:OWNER/NAME`: the audit runs, is skipped when the
input did not change, and reruns when a matched file changes, a file starts matching, or the hub revision changes.

Each test builds a throw-away git + DVC repo holding this checkout's dflash/ and stages/, its params.yaml and the
`audit_input` and `audit` stages of its dvc.yaml as they are, but for the target-folder dep (these tests audit
without a tokenizer, so no target is built). Before the `audit_input` stage the audit stage listed
`${audit.input}` as a dep, and `dvc repro` stopped with "No such file or directory" for both inputs here.
The hash cache of stages/audit_input.py goes to the test's own XDG_CACHE_HOME.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import yaml

from tests.helpers import REPO
from tests.helpers.audit import AUDIT_REPORT_ONLY, HUB_COMMIT, JUDGED_CONVERSATIONS, warm_hf_home, write_jsonl
from tests.helpers.dvc import changed_stages, dvc_env, write_params

STAGES = ("audit_input", "audit")
OTHER_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


def _run(repo: Path, env: dict, *cmd: str, check: bool = True) -> str:
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 or not check, f"{' '.join(cmd)} exited {proc.returncode}:\n{out[-3000:]}"
    return out


def _commit(repo: Path, env: dict) -> None:
    _run(repo, env, "git", "add", "-A")
    _run(repo, env, "git", "-c", "commit.gpgsign=false", "commit", "-q", "--allow-empty", "-m", "state")


def _repo(tmp_path: Path, env: dict, *overrides: str) -> Path:
    """A git + DVC repo with this checkout's code, params (plus `overrides`) and its audit_input + audit stages."""
    repo = tmp_path / "repo"
    tracked = subprocess.run(["git", "ls-files", "-z", "dflash", "stages"], cwd=REPO, capture_output=True, text=True)
    for rel in filter(None, tracked.stdout.split("\0")):
        if (REPO / rel).is_file():
            (repo / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, repo / rel)
    shutil.copy2(REPO / "params.yaml", repo / "params.yaml")
    write_params(repo, ["audit.tokenizer=none", *AUDIT_REPORT_ONLY, *overrides])
    stages = {k: v for k, v in yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"].items() if k in STAGES}
    stages["audit"]["deps"].remove("${base.target_dir}")  # no tokenizer: no target to build
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    _run(repo, env, "git", "init", "-q")
    _run(repo, env, "dvc", "init", "-q")
    _commit(repo, env)
    return repo


def _repro(repo: Path, env: dict, *cmd: str) -> bool:
    """Run a DVC command that reproduces the pipeline; True when it ran the audit, False when DVC skipped it."""
    out = _run(repo, env, "dvc", *(cmd or ("repro",)))
    assert "Running stage 'audit_input'" in out, out[-3000:]  # always_changed: it looks at the input every time
    ran, skipped = "Running stage 'audit':" in out, "Stage 'audit' didn't change, skipping" in out
    assert ran != skipped, out[-3000:]
    status = json.loads(_run(repo, env, "dvc", "status", "--json").strip() or "{}")
    assert changed_stages(status) == {}, status  # after a repro, nothing is left to run
    _commit(repo, env)
    return ran


def _num_rows(repo: Path) -> int:
    return json.loads((repo / "reports/audit.json").read_text())["num_rows"]


def test_glob_input_reruns_the_audit_only_when_a_matched_file_changes(tmp_path):
    env = dvc_env(XDG_CACHE_HOME=str(tmp_path / "xdg"))
    rows = [{"messages": c} for c in JUDGED_CONVERSATIONS]
    repo = _repo(tmp_path, env, "audit.input=data/chats/*.jsonl")
    (repo / "data/chats").mkdir(parents=True)
    write_jsonl(repo / "data/chats/a.jsonl", rows[:6])
    write_jsonl(repo / "data/chats/b.jsonl", rows[6:10])
    (repo / "data/chats/notes.txt").write_text("not matched\n")

    assert _repro(repo, env) and _num_rows(repo) == 10
    manifest = json.loads((repo / "reports/audit_input.json").read_text())
    assert [f["path"] for f in manifest["files"]] == ["data/chats/a.jsonl", "data/chats/b.jsonl"]
    assert not _repro(repo, env)  # nothing changed

    os.utime(repo / "data/chats/a.jsonl", ns=(1, 1))  # a new mtime, the same bytes: hashed again, same manifest
    (repo / "data/chats/notes.txt").write_text("changed, still not matched\n")
    assert not _repro(repo, env)

    write_jsonl(repo / "data/chats/b.jsonl", rows[6:11])  # a matched file changes
    assert _repro(repo, env) and _num_rows(repo) == 11
    write_jsonl(repo / "data/chats/c.jsonl", rows[11:])  # a new file matches
    assert _repro(repo, env) and _num_rows(repo) == len(rows)
    assert not _repro(repo, env)


def test_hub_input_runs_under_exp_run_and_reruns_when_the_revision_changes(tmp_path):
    hf_home = warm_hf_home(tmp_path)[0]
    env = {k: v for k, v in dvc_env().items() if not k.startswith("HF_")}  # only the test's own hub settings
    env.update(HF_HOME=str(hf_home), HF_DATASETS_OFFLINE="1", XDG_CACHE_HOME=str(tmp_path / "xdg"))
    repo = _repo(tmp_path, env)
    hub = ["-S", "audit.input=hf:someone/Chat-Data", "-S", f"audit.hf_revision={HUB_COMMIT}"]

    assert _repro(repo, env, "exp", "run", *hub) and _num_rows(repo) == len(JUDGED_CONVERSATIONS)
    manifest = json.loads((repo / "reports/audit_input.json").read_text())
    assert (manifest["dataset"], manifest["split"], manifest["revision"]) == ("someone/Chat-Data", "train", HUB_COMMIT)
    assert not _repro(repo, env)  # the same id, split, revision and columns
    assert not _repro(repo, env, "exp", "run", *hub)

    # Another pinned revision reruns the audit, which reads the cache and refuses the commit it does not hold.
    write_params(repo, [f"audit.hf_revision={OTHER_COMMIT}"])
    out = _run(repo, env, "dvc", "repro", check=False)
    assert "Running stage 'audit':" in out, out[-3000:]
    assert f"holds revision {HUB_COMMIT}" in out and f"audit.hf_revision={OTHER_COMMIT}" in out, out[-3000:]
