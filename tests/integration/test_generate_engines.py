"""Generate stage through real vLLM (engines backend): every prompt accounted for, SIGKILL + resume loses and
duplicates nothing, an engine crash is retried and then fails only its unit.

The tests run `python -m stages.generate` as a subprocess against the session's tiny target, so a SIGKILL hits a
real process tree (dispatcher, worker, vLLM engine core) exactly as a crash would. Fast policy tests:
tests/unit/generate/test_stage.py.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
from pathlib import Path

import pytest

from dflash.core.io import file_sha256, list_shards, read_arrow, read_json
from dflash.core.processes import kill_tree
from dflash.generate import contract
from dflash.generate import stage as gen
from dflash.generate.units import make_units
from tests.helpers import REPO
from tests.helpers.generate import generate_cmd
from tests.helpers.inputs import write_conversations

# ---------------------------------------------------------------------------------------------- vLLM


def _rows(run_dir: Path) -> list[dict]:
    rows = []
    for shard in list_shards(run_dir, "unit-*.arrow"):
        rows.extend(read_arrow(shard).to_pylist())
    return rows


NUM_CONVS = 119  # every sample conversation: with fewer (48 tried) the run could finish before its second kill


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, sample_conversations):
    ws = tmp_path_factory.mktemp("generate")
    (ws / "audit").mkdir()
    write_conversations(ws / "audit" / "conversations.arrow", sample_conversations[:NUM_CONVS])
    return ws


@pytest.fixture(scope="module")
def reference(workspace, tiny_target):
    """One uninterrupted run: the outputs every interrupted run must reproduce."""
    ws = workspace / "reference"
    ws.mkdir()
    (ws / "audit").symlink_to(workspace / "audit")
    out = subprocess.run(
        generate_cmd(ws, tiny_target, "generate.unit_size=8"), cwd=REPO, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = read_json(ws / "reports" / "generate_details.json")
    return {"metrics": metrics, "rows": _rows(Path(metrics["run_dir"]))}


@pytest.mark.slow
@pytest.mark.vllm
def test_reference_run_accounts_for_every_prompt(reference, sample_conversations):
    m = reference["metrics"]
    assert m["num_prompts"] == contract.count_prompts(
        [
            {"conversation_id": str(i), "messages": c, "tools": None}
            for i, c in enumerate(sample_conversations[:NUM_CONVS])
        ]
    )
    assert m["num_completed"] + m["num_skipped"] + m["num_failed"] == m["num_prompts"]
    ids = [r["sample_id"] for r in reference["rows"]]
    assert len(ids) == len(set(ids)) == m["num_prompts"]
    done = [r for r in reference["rows"] if r["status"] == "completed"]
    assert done and all(r["prompt_ids"] and r["completion_ids"] for r in done)
    stopped = [r for r in done if r["finish_reason"] == "stop"]
    assert stopped and all(r["completion_ids"][-1] == 151645 for r in stopped)  # <|im_end|> kept verbatim
    # Multi-turn: the second turn's prompt holds the model's own first answer, not the placeholder.
    second = next(r for r in done if r["turn_index"] == 1)
    first = next(r for r in reference["rows"] if r["sample_id"] == f"{second['conversation_id']}:0")
    history = json.loads(second["messages"])
    assert any(m["role"] == "assistant" and m["content"] == first["answer"] for m in history)


@pytest.mark.slow
@pytest.mark.vllm
def test_sigkill_and_resume_loses_and_duplicates_nothing(workspace, tiny_target, reference):
    """SIGKILL the whole process tree at random moments, resume each time, then finish."""
    ws = workspace / "killed"
    ws.mkdir()
    (ws / "audit").symlink_to(workspace / "audit")
    cmd = generate_cmd(ws, tiny_target, "generate.unit_size=8")
    rng = random.Random(1234)
    committed: dict[str, str] = {}  # shard name -> sha256 at the time of a kill
    kills = 0
    for attempt in range(2):  # two kills at random moments (each restart costs an engine start, ~35 s)
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        run_dirs = []
        deadline = time.time() + 240
        before = len(committed)
        # Wait until this attempt commits a new unit, then kill after a random extra delay.
        while time.time() < deadline and proc.poll() is None:
            run_dirs = list((ws / "generate").glob("run-*"))
            if run_dirs and len(list_shards(run_dirs[0], "unit-*.arrow")) > before:
                break
            time.sleep(0.2)
        time.sleep(rng.uniform(0.0, 1.5))
        if proc.poll() is None:
            kill_tree(proc.pid)  # the whole tree: dispatcher, worker, vLLM engine core
            kills += 1
        assert run_dirs, f"attempt {attempt}: no run folder appeared"
        for shard in list_shards(run_dirs[0], "unit-*.arrow"):
            committed.setdefault(shard.name, file_sha256(shard))
    assert kills >= 2, "the run finished before it could be killed: make the workload larger"
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = read_json(ws / "reports" / "generate_details.json")
    run_dir = Path(metrics["run_dir"])
    assert metrics["units_reused"] >= 1
    # Units committed before a kill are byte-identical afterwards.
    for name, sha in committed.items():
        assert file_sha256(run_dir / name) == sha, f"{name} changed after resume"
    assert not list(run_dir.glob(".*.tmp")), "half-written shards left behind"
    rows = _rows(run_dir)
    ids = [r["sample_id"] for r in rows]
    assert len(ids) == len(set(ids)), "a sample id appears twice"
    ref = {r["sample_id"]: r for r in reference["rows"]}
    assert set(ids) == set(ref), "samples lost or invented"
    # Temperature 0: the resumed run reproduces the uninterrupted one. Measured, not hidden: any
    # difference would come from CPU numerics under a different batch composition.
    differ = [r["sample_id"] for r in rows if r["completion_ids"] != ref[r["sample_id"]]["completion_ids"]]
    print(f"kill/resume: {kills} kills, {len(differ)}/{len(rows)} completions differ from the uninterrupted run")
    assert not differ, f"{len(differ)} of {len(rows)} completions differ: {differ[:5]}"


RUN_TAG = "DFLASH_TEST_RUN_TAG"  # set in the stage's environment: its processes (and only they) inherit it


def _engine_processes(tag: str) -> set[int]:
    """pids of running vLLM engine processes (vLLM names them VLLM::EngineCore, VLLM::Worker...) started under
    `tag`: engines of other tests running side by side (pytest-xdist) do not count."""
    import psutil

    found = set()
    for proc in psutil.process_iter(["pid", "name", "cmdline"]):
        text = f"{proc.info['name']} {' '.join(proc.info['cmdline'] or [])}"
        if "VLLM::" not in text:
            continue
        try:
            if proc.environ().get(RUN_TAG) == tag:
                found.add(proc.info["pid"])
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


@pytest.mark.slow
@pytest.mark.vllm
def test_engine_crash_retries_then_fails_only_the_bad_unit(workspace, tiny_target, sample_conversations):
    ws = workspace / "crash"
    (ws / "audit").mkdir(parents=True)
    convs = sample_conversations[:8]  # units 0 and 1: one good unit, then the bad one, tried twice
    write_conversations(ws / "audit" / "conversations.arrow", convs)
    # vLLM's own engine-core processes (the GPU setting): a dead worker's engine cores must not be left running
    retries = ("generate.unit_retries=1", "generate.engine_start_retries=1")
    cmd = generate_cmd(ws, tiny_target, "generate.unit_size=4", *retries, "generate.engine_core_process=true")
    tag = str(ws)
    env = {**os.environ, contract.CRASH_ENV: "1", RUN_TAG: tag}  # the worker dies whenever it receives unit 1
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    assert out.returncode == 1
    left = _engine_processes(tag)
    for _ in range(10):  # a killed process is listed until the OS has reaped it: allow a few seconds for that
        if not left:
            break
        time.sleep(0.5)
        left &= _engine_processes(tag)
    assert not left, "engine-core processes left running after the stage exited"
    assert "unit-00001" in out.stderr and "failed after retries" in out.stderr
    m = read_json(ws / "reports" / "generate_details.json")
    bad = make_units(gen.load_conversations(ws / "audit" / "conversations.arrow"), 4)[1]
    assert m["num_failed"] == contract.count_prompts(bad.conversations)
    assert m["num_completed"] + m["num_skipped"] + m["num_failed"] == m["num_prompts"]
    assert [u["unit"] for u in m["units_failed"]] == [1]
    names = {p.name for p in list_shards(Path(m["run_dir"]), "unit-*.arrow")}
    assert names == {u.name for u in make_units(gen.load_conversations(ws / "audit" / "conversations.arrow"), 4)} - {
        bad.name
    }
    assert not (ws / "generate" / "current.json").exists()  # an incomplete run is never marked current
