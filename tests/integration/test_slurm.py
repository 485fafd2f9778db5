"""The slurm/ job scripts under a real Slurm (tests/integration/slurm_cluster.py: Debian's slurm-wlm and munge,
installed when missing and root can, daemons started and stopped here; skipped only when they cannot be had).

Each script is used the way its header says: copied with its EDIT lines changed (no account, partition debug,
no GPUs, one node, no overlay), submitted with sbatch from the repository checkout, followed with squeue /
scontrol. Everything listens on 127.0.0.1 (the servers' SERVER_HOST).

- Generation: the generate job starts first and finds an empty registry (it waits); then a two-task server
  array is submitted (CPU vLLM api_servers on the tiny target, one request in flight each so the run lasts).
  Both tasks join and serve; once a unit is committed task 0 is scancelled; the job completes with every prompt
  exactly once and the engines backend's token ids at temperature 0; each task's trap withdrew its entry.
- Training: train.sbatch (srun, one torchrun of 2 processes, c10d on the allocation's first node) is requeued
  with scontrol once a checkpoint exists; the requeued job resumes from it and ends at the loss of the same
  training run in one process without Slurm.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from dflash.core.io import list_shards, read_arrow, read_json
from dflash.generate.turns import FAILED
from tests.helpers import REPO, repo_params
from tests.helpers.generate import generate_cmd
from tests.helpers.inputs import write_conversations
from tests.helpers.train import free_port, one_thread, train_overrides
from tests.integration.slurm_cluster import SlurmCluster, slurm_missing

pytestmark = pytest.mark.slow

NUM_CONVS = 24
GEN_OVERRIDES = ("generate.sampling.max_tokens=64", "generate.unit_size=2", "generate.max_num_seqs=1")
EDITS = {  # what this host puts at each script's EDIT lines (None: the line goes)
    "account": None,
    "partition": "#SBATCH --partition=debug",
    "gpus": None,
    "nodes": "#SBATCH --nodes=1",
    "overlay": 'OVERLAY=""',
}
JOB_TIMEOUT_S = 900


def edited(name: str, folder: Path) -> Path:
    """slurm/NAME copied into `folder` with every `# EDIT(key)` line replaced as EDITS says."""
    lines = []
    for line in (REPO / "slurm" / name).read_text().splitlines():
        m = re.search(r"# EDIT\((\w+)\)", line)
        if m is None:
            lines.append(line)
        elif EDITS[m.group(1)] is not None:
            lines.append(EDITS[m.group(1)])
    out = folder / name
    out.write_text("\n".join(lines) + "\n")
    return out


def params_args(overrides) -> str:
    """PARAMS_ARGS for a script: -S pairs as words (the scripts split on whitespace: none inside a value)."""
    return " ".join(f"-S {o.replace(', ', ',')}" for o in overrides)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    why = slurm_missing()
    if why:
        pytest.skip(f"no Slurm on this machine: {why}")
    cluster = SlurmCluster.start(tmp_path_factory.mktemp("slurm"))
    yield cluster
    cluster.run("scancel", "--full", "--user", "root", check=False)
    deadline = time.monotonic() + 60
    while cluster.run("squeue", "-h", "-o", "%i", check=False) and time.monotonic() < deadline:
        time.sleep(1)
    cluster.stop()


def _wait_for(ok, what: str, slurm: SlurmCluster, jobs: dict[str, Path], timeout_s: float = JOB_TIMEOUT_S):
    """Until ok() is true; fails when a job of `jobs` (id -> its output file) has ended first, or on timeout."""
    end = time.monotonic() + timeout_s
    while not (got := ok()):
        for job, log in jobs.items():
            if not slurm.in_queue(job) and not (got := ok()):
                tail = "\n".join(p.read_text()[-3000:] for p in sorted(log.parent.glob(log.name)))
                raise AssertionError(f"job {job} ended before {what}: {slurm.states(job)}\n{tail}")
        assert time.monotonic() < end, f"no {what} after {timeout_s} s; {slurm.run('squeue', check=False)}"
        time.sleep(0.5)
    return got


# ------------------------------------------------------------------------------------------ generation


def _rows(run_dir: Path) -> dict[str, dict]:
    return {r["sample_id"]: r for s in list_shards(run_dir, "unit-*.arrow") for r in read_arrow(s).to_pylist()}


def _free_pair() -> int:
    """A port p with p + 1 free too (the server array's tasks 0 and 1)."""
    while True:
        p = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
        return p


@pytest.fixture(scope="module")
def generation(slurm, tmp_path_factory, tiny_target, sample_conversations):
    """The engines backend's rows (no Slurm), then the Slurm run described in the module docstring."""
    tmp = tmp_path_factory.mktemp("slurm_gen")
    audit = tmp / "audit"
    audit.mkdir()
    write_conversations(audit / "conversations.arrow", sample_conversations[:NUM_CONVS])

    eng = tmp / "engines"
    eng.mkdir()
    (eng / "audit").symlink_to(audit)
    out = subprocess.run(generate_cmd(eng, tiny_target, *GEN_OVERRIDES), cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    engines = _rows(Path(read_json(eng / "reports/generate_details.json")["run_dir"]))

    ws, reg, logs = tmp / "servers", tmp / "registry", tmp / "logs"
    for d in (ws, logs):
        d.mkdir()
    (ws / "audit").symlink_to(audit)
    stage_args = generate_cmd(ws, tiny_target, *GEN_OVERRIDES)[6::2]  # the -S values after --params FILE
    env = {"REGISTRY": str(reg), "PARAMS_ARGS": params_args(stage_args), "SERVER_HOST": "127.0.0.1"}
    t0 = time.monotonic()
    gen = slurm.sbatch(
        edited("generate.sbatch", tmp), "--cpus-per-task=1", f"--output={logs}/gen-%j.out", env=env, cwd=REPO
    )
    gen_log = logs / f"gen-{gen}.out"
    _wait_for(
        lambda: gen_log.exists() and "waiting for" in gen_log.read_text(), "the stage waiting", slurm, {gen: gen_log}
    )
    # The tasks announce into a staging folder; once both have, the test links both entries into the stage's
    # registry at once, so that on a fast machine the first server up cannot finish the run before the second
    # joins. A task's trap then removes its staged file, and the link it leaves dangling reads as withdrawn.
    staging = tmp / "staging"
    srv_env = {**env, "REGISTRY": str(staging), "PORT_BASE": str(_free_pair())}
    servers = slurm.sbatch(
        edited("generate-servers.sbatch", tmp),
        "--array=0-1",
        "--cpus-per-task=1",
        f"--output={logs}/srv-%A_%a.out",
        env=srv_env,
        cwd=REPO,
    )
    entries = [reg / f"{servers}_{t}.url" for t in (0, 1)]
    jobs = {gen: gen_log, servers: logs / f"srv-{servers}_*.out"}
    staged = [staging / e.name for e in entries]
    _wait_for(lambda: all(e.exists() for e in staged), "both server tasks announced", slurm, jobs)
    reg.mkdir(exist_ok=True)
    for entry, target in zip(entries, staged, strict=True):
        entry.symlink_to(target)
    run_dir = _wait_for(lambda: next((ws / "generate").glob("run-*"), None), "a run folder", slurm, jobs)
    units_total = -(-len(sample_conversations[:NUM_CONVS]) // 2)

    srv_logs = [logs / f"srv-{servers}_{t}.out" for t in (0, 1)]

    def served(log: Path) -> bool:
        """More than the one-token probe in the task's vLLM access log: the stage gave it real work."""
        return log.exists() and log.read_text().count("POST /v1/completions") >= 2

    def both_serving_and_a_unit_committed() -> bool:
        return all(served(log) for log in srv_logs) and bool(list_shards(run_dir, "unit-*.arrow"))

    # Both tasks must have had a real request before task 0 goes: after the probe, the stage can hand its next
    # request to the other server, and a scancel in that gap leaves task 0 with the probe alone (seen in CI).
    _wait_for(both_serving_and_a_unit_committed, "both servers serving and a unit committed", slurm, jobs)
    committed_at_cancel = len(list_shards(run_dir, "unit-*.arrow"))
    slurm.run("scancel", f"{servers}_0")
    states = slurm.wait_done(gen, JOB_TIMEOUT_S)
    gen_wall = time.monotonic() - t0
    slurm.run("scancel", servers)
    slurm.wait_done(servers, 120)
    return {
        "engines": engines,
        "rows": _rows(run_dir),
        "gen_state": states[gen],
        "gen_log": gen_log.read_text(),
        "server_logs": [log.read_text() for log in srv_logs],
        "entries_left": [e.exists() for e in entries],
        "committed_at_cancel": committed_at_cancel,
        "units_total": units_total,
        "wall_s": gen_wall,
    }


@pytest.mark.vllm
def test_slurm_servers_give_the_engines_backend_token_ids(generation):
    print(f"Slurm generation: {generation['wall_s']:.0f} s from the generate job's submission to its end")
    assert generation["gen_state"] == "COMPLETED", generation["gen_log"][-3000:]
    rows, engines = generation["rows"], generation["engines"]
    assert set(rows) == set(engines)
    for sid, r in rows.items():
        for key in ("status", "prompt_ids", "completion_ids", "text", "finish_reason", "run_hash"):
            assert r[key] == engines[sid][key], f"{sid}: {key} differs"


@pytest.mark.vllm
def test_scancel_of_a_server_task_mid_run_loses_and_repeats_nothing(generation):
    assert generation["committed_at_cancel"] < generation["units_total"], "the run had ended before the scancel"
    rows = generation["rows"]
    ids = [r["sample_id"] for r in rows.values()]
    assert len(ids) == len(set(ids)) == len(generation["engines"])
    assert [r["status"] for r in rows.values()] == [generation["engines"][sid]["status"] for sid in rows]
    assert not [sid for sid, r in rows.items() if r["status"] == FAILED], "a server leaving failed a turn"
    assert generation["entries_left"] == [False, False], "a task's trap did not withdraw its registry entry"


@pytest.mark.vllm
def test_server_tasks_submitted_after_the_stage_started_are_used(generation):
    """The stage was waiting on an empty registry when the array was submitted; each task served requests
    (vLLM's access log: more than the one-token probe)."""
    for log in generation["server_logs"]:
        assert log.count("POST /v1/completions") >= 2, log[-2000:]
    assert "joins from the registry" in generation["gen_log"]


# ------------------------------------------------------------------------------------------ training


@pytest.fixture(scope="module")
def training(slurm, tmp_path_factory, train_target, train_data):
    tmp = tmp_path_factory.mktemp("slurm_train")
    shutil.copytree(train_data, tmp / "tok/train")
    common = ["train.global_batch=4", "train.batch_size=1", "train.checkpoint_every=2", "train.keep_checkpoints=20"]
    overrides = train_overrides(
        train_target, tmp / "out", f"tokenize.out={tmp / 'tok'}", *common, f"base.reports_dir={tmp / 'reports'}"
    )
    env = {
        "PARAMS_ARGS": params_args(overrides),
        "NPROC_PER_NODE": "2",
        "RDZV_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
    }
    t0 = time.monotonic()
    job = slurm.sbatch(
        edited("train.sbatch", tmp), "--cpus-per-task=1", f"--output={tmp}/train-%j.out", env=env, cwd=REPO
    )

    def a_checkpoint() -> list[Path]:
        return sorted((tmp / "out/checkpoints").glob("*/step-*")) if (tmp / "out/checkpoints").exists() else []

    first = _wait_for(a_checkpoint, "a checkpoint", slurm, {job: tmp / f"train-{job}.out"})
    slurm.run("scontrol", "requeue", job)
    # A requeued job waits 120 s (Slurm's BeginTime for requeued jobs) unless told otherwise.
    _wait_for(lambda: slurm.states(job).get(job) == "PENDING", "the requeued job pending", slurm, {})
    slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now")
    states = slurm.wait_done(job, JOB_TIMEOUT_S)
    wall = time.monotonic() - t0
    with one_thread():
        from dflash.train.loop import train

        ref = train(repo_params(train_overrides(train_target, tmp / "ref", *common)), train_data)
    return {
        "state": states[job],
        "log": (tmp / f"train-{job}.out").read_text(),
        "requeued_at": first[-1].name,
        "details": read_json(tmp / "reports/train_details.json"),
        "ref": ref,
        "wall_s": wall,
        "restarts": slurm.run("scontrol", "-o", "show", "job", job),
        "out": tmp / "out",
    }


def test_a_requeued_torchrun_job_resumes_and_ends_at_the_run_without_slurm(training):
    from dflash.train import checkpoint

    print(f"Slurm training: {training['wall_s']:.0f} s from submission to the requeued job's end")
    assert training["state"] == "COMPLETED", training["log"][-3000:]
    assert "Restarts=1" in training["restarts"], "the job was not requeued"
    ref, details = training["ref"], training["details"]
    assert int(training["requeued_at"].split("-")[1]) < ref["total_steps"], "the run had ended before the requeue"
    assert details["resumed"] and details["completed"] and details["world_size"] == 2
    got = checkpoint.get_history(training["out"] / "checkpoints" / Path(ref["checkpoint_dir"]).name)
    want = checkpoint.get_history(ref["checkpoint_dir"])
    assert [h["step"] for h in got] == [h["step"] for h in want]
    assert got[-1]["loss"] == pytest.approx(want[-1]["loss"], rel=1e-4)
