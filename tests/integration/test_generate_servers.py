"""Generate's `servers` backend against real vLLM api_server processes on 127.0.0.1: exactly the engines
backend's completion ids at temperature 0; SIGKILL of the client (then a rerun) or of one of two servers loses
and duplicates nothing; a stage that started its own servers takes them down when it is SIGKILLed; a server that
serves another model, or a shorter context, is refused naming its URL. Every address used here is 127.0.0.1.
Fake-server tests of the client: tests/unit/generate/test_servers.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from dflash.core.errors import UserError
from dflash.core.io import file_sha256, list_shards, read_arrow, read_json
from dflash.core.processes import kill_tree
from dflash.generate import servers
from tests.helpers import REPO, repo_params
from tests.helpers.generate import generate_cmd
from tests.helpers.inputs import write_conversations

# ------------------------------------------------------------------------------------------ real servers

SERVER_OVERRIDES = ("generate.sampling.max_tokens=64", "generate.unit_size=4")  # KV cache: params.yaml's explicit size
NUM_CONVS = 40


def _stage(ws: Path, target: Path, *extra: str, wait: bool = True):
    cmd = generate_cmd(ws, target, *SERVER_OVERRIDES, *extra)
    if not wait:
        return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    m = read_json(ws / "reports" / "generate_details.json")
    return {
        r["sample_id"]: r for s in list_shards(Path(m["run_dir"]), "unit-*.arrow") for r in read_arrow(s).to_pylist()
    }


def _ws(base: Path, name: str, audit: Path) -> Path:
    ws = base / name
    ws.mkdir()
    (ws / "audit").symlink_to(audit)
    return ws


@pytest.fixture(scope="module")
def audit_dir(tmp_path_factory, sample_conversations):
    d = tmp_path_factory.mktemp("servers_audit")
    write_conversations(d / "conversations.arrow", sample_conversations[:NUM_CONVS])
    return d


@pytest.fixture(scope="module")
def two_servers(tiny_target):
    """Two real vLLM api_server processes on 127.0.0.1, started by our own launcher (module-scoped)."""
    g = repo_params(SERVER_OVERRIDES).generate
    with servers.local_servers(g, str(tiny_target), "tiny-under-test", count=2, seed=0) as started:
        yield started


@pytest.fixture(scope="module")
def engines_rows(tmp_path_factory, tiny_target, audit_dir):
    ws = _ws(tmp_path_factory.mktemp("eng"), "ws", audit_dir)
    return _stage(ws, tiny_target)


def _urls(started) -> str:
    return "generate.server_urls=[" + ",".join(s["url"] for s in started) + "]"


@pytest.mark.slow
@pytest.mark.vllm
def test_servers_backend_matches_the_engines_backend(tmp_path, tiny_target, audit_dir, two_servers, engines_rows):
    rows = _stage(
        _ws(tmp_path, "ws", audit_dir),
        tiny_target,
        "generate.backend=servers",
        _urls(two_servers),
        "generate.server_model=tiny-under-test",
    )
    assert set(rows) == set(engines_rows)
    assert any(r["turn_index"] > 0 and r["status"] == "completed" for r in rows.values())  # multi-turn included
    for sid, r in rows.items():
        e = engines_rows[sid]
        for key in ("status", "prompt_ids", "completion_ids", "text", "finish_reason", "messages", "run_hash"):
            assert r[key] == e[key], f"{sid}: {key} differs"


@pytest.mark.slow
@pytest.mark.vllm
def test_a_server_of_another_model_or_context_is_refused(tmp_path, tiny_target, audit_dir, two_servers):
    url = two_servers[0]["url"]
    g = repo_params(SERVER_OVERRIDES).generate
    with pytest.raises(UserError, match=rf"{url} serves \['tiny-under-test'\], not the expected model 'other'"):
        servers.check_servers([url], "other", g)
    longer = repo_params((*SERVER_OVERRIDES, "generate.max_model_len=4096")).generate
    with pytest.raises(UserError, match=rf"{url} serves 'tiny-under-test' with max_model_len 1024, below"):
        servers.check_servers([url], "tiny-under-test", longer)
    # Through the stage: served name "" = target.json's model (the tiny target's folder), not this server's.
    ws = _ws(tmp_path, "ws", audit_dir)
    proc = _stage(ws, tiny_target, "generate.backend=servers", f"generate.server_urls=[{url}]", wait=False)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and f"{url} serves ['tiny-under-test'], not the expected model" in err


def _wait_for_a_unit(ws: Path, proc, timeout_s: float = 300) -> list[Path]:
    """Block until the stage at `ws` has committed a unit; its committed shards (the run must still go on)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline and proc.poll() is None:
        runs = list((ws / "generate").glob("run-*"))
        if runs and list_shards(runs[0], "unit-*.arrow"):
            break
        time.sleep(0.1)
    assert proc.poll() is None, "the run finished before it could be killed: make the workload larger"
    return list_shards(list((ws / "generate").glob("run-*"))[0], "unit-*.arrow")


def _wait_for_requests_on(server: dict, proc, timeout_s: float = 300) -> None:
    """Block until `server` (one of local_servers' records) has a request running, read from its own /metrics
    (vllm:num_requests_running), while the stage `proc` goes on: a kill then always cuts requests short."""
    import urllib.request

    metrics = server["url"].removesuffix("/v1") + "/metrics"
    deadline = time.time() + timeout_s
    while time.time() < deadline and proc.poll() is None:
        with urllib.request.urlopen(metrics, timeout=5) as resp:
            lines = resp.read().decode().splitlines()
        if sum(float(ln.split()[-1]) for ln in lines if ln.startswith("vllm:num_requests_running")) > 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"{server['url']} never had a request running before the stage ended")


def _committed(ws: Path) -> dict[str, str]:
    """sha256 of each unit shard the stage at `ws` has committed so far."""
    return {s.name: file_sha256(s) for s in list_shards(next((ws / "generate").glob("run-*")), "unit-*.arrow")}


def _rerun_finishes_once_each(ws, tiny_target, two_servers, engines_rows, committed: dict[str, str]) -> None:
    """Rerun over the module's servers: committed shards unchanged, every prompt exactly once, ids as engines."""
    rows = _stage(
        ws, tiny_target, "generate.backend=servers", _urls(two_servers), "generate.server_model=tiny-under-test"
    )
    run_dir = Path(read_json(ws / "reports" / "generate_details.json")["run_dir"])
    assert read_json(ws / "reports" / "generate_details.json")["units_reused"] >= len(committed) >= 1
    for name, sha in committed.items():
        assert file_sha256(run_dir / name) == sha, f"{name} changed after the rerun"
    assert not list(run_dir.glob(".*.tmp")), "half-written shards left behind"
    ids = [r["sample_id"] for s in list_shards(run_dir, "unit-*.arrow") for r in read_arrow(s).to_pylist()]
    assert len(ids) == len(set(ids)) and set(ids) == set(engines_rows)
    assert all(r["completion_ids"] == engines_rows[sid]["completion_ids"] for sid, r in rows.items())


@pytest.mark.slow
@pytest.mark.vllm
def test_sigkill_of_the_client_then_a_rerun_loses_and_duplicates_nothing(
    tmp_path, tiny_target, audit_dir, two_servers, engines_rows
):
    ws = _ws(tmp_path, "ws", audit_dir)
    args = ("generate.backend=servers", _urls(two_servers), "generate.server_model=tiny-under-test")
    proc = _stage(ws, tiny_target, *args, wait=False)
    _wait_for_a_unit(ws, proc)
    os.kill(proc.pid, signal.SIGKILL)  # the client only: requests in flight on the servers are abandoned
    proc.wait(timeout=30)
    _rerun_finishes_once_each(ws, tiny_target, two_servers, engines_rows, _committed(ws))


@pytest.mark.slow
@pytest.mark.vllm
def test_sigkill_of_a_stage_that_started_its_servers_takes_them_down(
    tmp_path, tiny_target, audit_dir, two_servers, engines_rows
):
    """generate.server_urls empty: the stage starts a local api_server; SIGKILL of the stage alone (no cleanup
    code runs) still stops that server and its engine core (PR_SET_PDEATHSIG); a rerun then finishes."""
    import psutil

    ws = _ws(tmp_path, "ws", audit_dir)
    proc = _stage(ws, tiny_target, "generate.backend=servers", "generate.num_engines=1", wait=False)
    _wait_for_a_unit(ws, proc, timeout_s=400)
    children = psutil.Process(proc.pid).children(recursive=True)
    assert any("api_server" in " ".join(c.cmdline()) for c in children), [c.cmdline()[:4] for c in children]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    _, alive = psutil.wait_procs(children, timeout=90)
    assert not alive, f"left running after the stage was killed: {[(p.pid, p.name()) for p in alive]}"
    _rerun_finishes_once_each(ws, tiny_target, two_servers, engines_rows, _committed(ws))


@pytest.mark.slow
@pytest.mark.vllm
def test_killing_one_of_two_servers_mid_run_loses_and_duplicates_nothing(
    tmp_path, tiny_target, audit_dir, two_servers, engines_rows
):
    """Runs last in this module: it kills one of the module's servers."""
    ws = _ws(tmp_path, "ws", audit_dir)
    args = ("generate.backend=servers", _urls(two_servers), "generate.server_model=tiny-under-test")
    proc = _stage(ws, tiny_target, *args, wait=False)
    _wait_for_requests_on(two_servers[1], proc)  # after a unit lands, the other server may have no work left
    kill_tree(two_servers[1]["proc"].pid)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    killed = two_servers[1]["url"]  # its requests failed: retried elsewhere, or the server taken out of rotation
    assert any(killed in line and ("out of rotation" in line or "failed" in line) for line in err.splitlines()), err[
        -3000:
    ]
    m = read_json(ws / "reports" / "generate_details.json")
    rows = [r for s in list_shards(Path(m["run_dir"]), "unit-*.arrow") for r in read_arrow(s).to_pylist()]
    ids = [r["sample_id"] for r in rows]
    assert len(ids) == len(set(ids)) and set(ids) == set(engines_rows)  # every prompt exactly once
    assert m["num_completed"] + m["num_skipped"] == m["num_prompts"] and m["num_failed"] == 0
    differ = [r["sample_id"] for r in rows if r["completion_ids"] != engines_rows[r["sample_id"]]["completion_ids"]]
    assert not differ, f"{len(differ)} completions differ after the failover: {differ[:5]}"
