"""Generate's `servers` backend and the pilot's concurrency sweep.

Fast: the knee rule, `max_num_seqs: auto`, server URL validation, the model identity check, and the client's
retry / failover logic against fake OpenAI-style servers on 127.0.0.1 (500s, connection resets, a server
that goes away). Slow (vLLM): real api_server processes on 127.0.0.1 give exactly the engines backend's
completion ids at temperature 0; killing one of two servers mid-run loses and duplicates nothing; a server
that serves another model, or a shorter context, is refused naming its URL.
Every address used here is 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import REPO, generate_cmd, write_conversations

from dflash.core import concurrency
from dflash.core.chat import template_kwargs
from dflash.core.errors import ParamsError, UserError
from dflash.core.io import file_sha256, list_shards, read_arrow, read_json, write_json
from dflash.core.loader import load_params
from dflash.core.processes import kill_tree
from dflash.core.validate import check_generate
from dflash.generate import client, servers
from dflash.generate.contract import WorkerConfig, count_prompts
from dflash.generate.stage import make_units

U = {"role": "user", "content": "What is 2 + 2?"}
A = {"role": "assistant", "content": "OK."}


def _params(*overrides: str):
    return load_params(REPO / "params.yaml", list(overrides))


# ------------------------------------------------------------------------------------------ knee, auto


@pytest.mark.parametrize(
    "rates,chosen",
    [
        ({4: 100.0, 16: 300.0, 64: 310.0}, 16),  # 300 is within 5% of 310: the smaller level wins
        ({4: 100.0, 16: 280.0, 64: 310.0}, 64),  # 280 is 9.7% below the best
        ({4: 100.0, 16: 320.0, 64: 310.0}, 16),  # past the knee the rate can fall
        ({8: 50.0}, 8),
        ({}, None),
    ],
)
def test_knee_is_the_smallest_level_within_5_percent_of_the_best(rates, chosen):
    sweep = [{"max_num_seqs": n, "output_tokens_per_s": r} for n, r in rates.items()]
    assert concurrency.knee(list(reversed(sweep))) == chosen  # order of the rows does not matter


def test_max_num_seqs_auto_resolution(tmp_path):
    pilot = tmp_path / "pilot.json"
    g = _params("generate.max_num_seqs=auto", "generate.pilot_sweep=[4,16,64]").generate
    with pytest.raises(UserError, match=r"generate.max_num_seqs: auto, .*pilot.json.*run the pilot"):
        concurrency.resolve_max_num_seqs(g, pilot)
    write_json(pilot, {"chosen_max_num_seqs": None, "sweep": []})  # a pilot without a sweep
    with pytest.raises(UserError, match="run the pilot"):
        concurrency.resolve_max_num_seqs(g, pilot)
    write_json(pilot, {"chosen_max_num_seqs": 16, "target_signature": "Tiny/layers=2"})
    assert concurrency.resolve_max_num_seqs(g, pilot).max_num_seqs == 16
    assert concurrency.resolve_max_num_seqs(g, pilot, signature="Tiny/layers=2").max_num_seqs == 16
    with pytest.raises(UserError, match="for this target"):  # another target's knee is not this one's
        concurrency.resolve_max_num_seqs(g, pilot, signature="Qwen3_5/layers=64")
    assert concurrency.resolve_max_num_seqs(g, pilot, pilot=True).max_num_seqs == 64  # the pilot: the largest
    fixed = _params("generate.max_num_seqs=8").generate
    assert concurrency.resolve_max_num_seqs(fixed, pilot).max_num_seqs == 8  # an integer wins
    no_sweep = _params("generate.max_num_seqs=auto", "generate.pilot_sweep=[]").generate
    with pytest.raises(UserError, match="pilot_sweep"):
        concurrency.resolve_max_num_seqs(no_sweep, pilot, pilot=True)


def test_plan_models_the_chosen_level(tmp_path):
    from dflash.plan.estimate import planned_max_num_seqs

    pilot = tmp_path / "pilot.json"
    p = _params("generate.max_num_seqs=auto", f"plan.pilot_json={pilot}")
    assert planned_max_num_seqs(p)[0] == 64  # no sweep yet: the largest level
    write_json(pilot, {"chosen_max_num_seqs": 16})
    assert planned_max_num_seqs(p) == (16, f"{pilot} chosen_max_num_seqs (generate.max_num_seqs: auto)")


@pytest.mark.parametrize(
    "url,ok",
    [
        ("http://127.0.0.1:8000/v1", True),
        ("https://node7.cluster:8443/v1", True),
        ("ftp://127.0.0.1/v1", False),
        ("127.0.0.1:8000/v1", False),  # no scheme
        ("http:///v1", False),  # no host
        ("http://user:secret@127.0.0.1:8000/v1", False),  # credentials never go in params
        ("http://127.0.0.1:8000/v1?x=1", False),
        ("http://127.0.0.1:99999/v1", False),
    ],
)
def test_server_urls_are_validated(url, ok):
    p = _params(f"generate.server_urls=[{json.dumps(url)}]")
    if ok:
        check_generate(p)
    else:
        with pytest.raises(ParamsError, match=r"^generate\.server_urls\[0\]: "):
            check_generate(p)


def test_backoff_grows_and_is_capped():
    assert [client.backoff_s(a) for a in (1, 2, 3)] == [1.0, 2.0, 4.0]
    assert client.backoff_s(20) == client.MAX_BACKOFF_S


# ------------------------------------------------------------------------------------------ fake servers


class FakeServer:
    """An OpenAI-style server on 127.0.0.1: /health, /v1/models, /v1/completions with a fixed completion.
    `failures`: behaviours of the next completion requests, in order ("500": HTTP 500; "reset": TCP reset);
    `sick`: /health answers 503 and every completion HTTP 500; `delay_s`: seconds before each completion."""

    def __init__(self, completion: list[int], model: str = "m", max_model_len: int = 1024):
        self.completion, self.model, self.max_model_len = completion, model, max_model_len
        self.failures: list[str] = []  # queued behaviours for the next requests: "500" | "reset"
        self.sick, self.delay_s = False, 0.0
        self.seen: list[list[int]] = []  # prompts answered
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _json(self, code: int, obj) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/health":
                    self._json(503 if fake.sick else 200, {})
                elif self.path == "/v1/models":
                    self._json(200, {"data": [{"id": fake.model, "max_model_len": fake.max_model_len}]})
                else:
                    self._json(404, {})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    how = fake.failures.pop(0) if fake.failures else ""
                how = "500" if fake.sick else how
                time.sleep(fake.delay_s)
                if how == "reset":
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                    self.connection.close()
                    return
                if how == "500":
                    self._json(500, {"error": "boom"})
                    return
                assert body["return_token_ids"] is True and isinstance(body["prompt"], list)
                with fake.lock:
                    fake.seen.append(body["prompt"])
                self._json(200, {"choices": [{"text": "x", "token_ids": fake.completion, "finish_reason": "stop"}]})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.handle_error = lambda *args: None  # a reset connection is the point, not a test failure
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake_run(tmp_path, qwen_tokenizer, monkeypatch):
    """Run the servers dispatcher over `urls` on 6 conversations (8 prompts); returns (result, rows)."""
    monkeypatch.setattr(client, "backoff_s", lambda attempts: 0.01)
    convs = [{"conversation_id": f"c{i}", "messages": [U, A, U, A] if i < 2 else [U], "tools": None} for i in range(6)]

    def run(urls: list[str], *overrides: str):
        g = _params("generate.max_num_seqs=2", "generate.unit_size=2", "generate.request_timeout_s=5", *overrides)
        cfg = WorkerConfig(
            gparams=g.generate,
            model="fake",
            model_name="fake",
            revision="",
            seed=0,
            trust_remote_code=False,
            template_kwargs=template_kwargs(False, {}),
            run_dir=str(tmp_path),
            run_hash="h",
        )
        units = make_units(convs, 2)
        versions = {u: "fake-1" for u in urls}
        d = client.ServersDispatcher(units, cfg, g.generate, versions, "m", qwen_tokenizer, count_prompts(convs), 0)
        result = d.run()
        rows = [r for s in list_shards(tmp_path, "unit-*.arrow") for r in read_arrow(s).to_pylist()]
        return result, rows, units

    return run


def _answer(tok) -> list[int]:
    return tok("Four.<|im_end|>", add_special_tokens=False)["input_ids"]


def test_fake_server_all_prompts_once_multi_turn_in_order(fake_run, qwen_tokenizer):
    srv = FakeServer(_answer(qwen_tokenizer))
    result, rows, units = fake_run([srv.url])
    assert not result.failed_units
    assert sorted(r["sample_id"] for r in rows) == sorted(
        ["c0:0", "c0:1", "c1:0", "c1:1"] + [f"c{i}:0" for i in range(2, 6)]
    )
    second = next(r for r in rows if r["sample_id"] == "c0:1")
    history = json.loads(second["messages"])
    assert history[1] == {"role": "assistant", "content": "Four.", "reasoning_content": ""}  # its own first answer
    assert all(r["completion_ids"] == _answer(qwen_tokenizer) and r["engine_version"] == "fake-1" for r in rows)
    assert len(srv.seen) == 8
    srv.stop()


@pytest.mark.parametrize("how", ["500", "reset"])
def test_failed_requests_are_retried(fake_run, qwen_tokenizer, how):
    srv = FakeServer(_answer(qwen_tokenizer))
    srv.failures = [how] * 3  # three failures, spread over whichever requests come first
    result, rows, _ = fake_run([srv.url], "generate.max_unit_retries=3")
    assert not result.failed_units and len(rows) == 8
    assert len({r["sample_id"] for r in rows}) == 8
    srv.stop()


def test_a_request_failing_past_max_unit_retries_fails_only_its_unit(fake_run, qwen_tokenizer):
    srv = FakeServer(_answer(qwen_tokenizer))
    srv.failures = ["500"] * 2  # max_num_seqs=2: the first two requests, both of unit 0, fail
    result, rows, units = fake_run([srv.url], "generate.max_unit_retries=0")
    assert [f["unit"] for f in result.failed_units] == [0]
    assert "HTTP 500" in result.failed_units[0]["error"]
    assert {r["conversation_id"] for r in rows} == {f"c{i}" for i in range(2, 6)}  # the other units committed
    srv.stop()


def test_a_dead_server_is_marked_down_and_its_requests_move(fake_run, qwen_tokenizer):
    alive, dead = FakeServer(_answer(qwen_tokenizer)), FakeServer(_answer(qwen_tokenizer))
    dead.stop()  # connection refused from the start
    result, rows, _ = fake_run([dead.url, alive.url], "generate.max_unit_retries=0")
    assert not result.failed_units and len(rows) == 8  # refused requests do not count as attempts
    assert result.per_engine[0].prompts == 0 and result.per_engine[1].prompts == 8
    alive.stop()


def test_a_down_server_that_answers_again_is_used_again(fake_run, qwen_tokenizer, monkeypatch):
    monkeypatch.setattr(client, "REPROBE_S", 0.05)
    sick, slow = FakeServer(_answer(qwen_tokenizer)), FakeServer(_answer(qwen_tokenizer))
    sick.sick, slow.delay_s = True, 0.5  # sick: marked down at its first request; slow keeps the run going (>2 s)
    threading.Timer(0.2, lambda: setattr(sick, "sick", False)).start()
    result, rows, _ = fake_run([sick.url, slow.url], "generate.max_unit_retries=0")
    assert not result.failed_units and len(rows) == 8 and len({r["sample_id"] for r in rows}) == 8
    assert result.per_engine[0].prompts >= 1  # every completion it answered came after it was marked down
    sick.stop()
    slow.stop()


def test_all_servers_down_stops_naming_the_urls_and_keeps_committed_units(fake_run, qwen_tokenizer, tmp_path):
    a, b = FakeServer(_answer(qwen_tokenizer)), FakeServer(_answer(qwen_tokenizer))
    a.stop()
    b.stop()
    with pytest.raises(UserError, match="every server is down") as err:
        fake_run([a.url, b.url])
    assert a.url in str(err.value) and b.url in str(err.value)


def test_model_identity_is_checked(qwen_tokenizer):
    srv = FakeServer(_answer(qwen_tokenizer), model="other", max_model_len=512)
    g = _params().generate
    with pytest.raises(UserError, match=rf"{srv.url} serves \['other'\], not the expected model 'm'"):
        servers.check_servers([srv.url], "m", g)
    with pytest.raises(UserError, match=rf"{srv.url} serves 'other' with max_model_len 512, below .* 1024"):
        servers.check_servers([srv.url], "other", g)
    assert servers.check_servers([srv.url], "other", _params("generate.max_model_len=512").generate) == {srv.url: ""}
    srv.stop()


def test_request_body_carries_the_engines_sampling():
    from dflash.generate.turns import Request

    g = _params("generate.sampling.stop=[END]", "generate.sampling.top_k=5").generate
    body = servers.request_body(Request("c:0", 0, [1, 2, 3], 77), g, "m")
    assert body["prompt"] == [1, 2, 3] and body["seed"] == 77 and body["return_token_ids"] is True
    assert (body["temperature"], body["top_p"], body["top_k"], body["max_tokens"]) == (0.0, 1.0, 5, 128)
    assert body["stop"] == ["END"]


# ------------------------------------------------------------------------------------------ real servers

SERVER_OVERRIDES = ("generate.gpu_memory_utilization=0.05", "generate.sampling.max_tokens=64", "generate.unit_size=4")
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
    g = _params(*SERVER_OVERRIDES).generate
    with servers.local_servers(g, str(tiny_target), "tiny-under-test", count=2, seed=0) as started:
        yield started


@pytest.fixture(scope="module")
def engines_rows(tmp_path_factory, tiny_target, audit_dir):
    # An engine inside the worker process counts the worker's own ~1.6 GB against its share: 0.05 leaves no KV
    # cache there (servers run their engine core in a process of its own). The cache size does not change
    # greedy outputs.
    ws = _ws(tmp_path_factory.mktemp("eng"), "ws", audit_dir)
    return _stage(ws, tiny_target, "generate.gpu_memory_utilization=0.1")


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
    g = _params(*SERVER_OVERRIDES).generate
    with pytest.raises(UserError, match=rf"{url} serves \['tiny-under-test'\], not the expected model 'other'"):
        servers.check_servers([url], "other", g)
    longer = _params(*SERVER_OVERRIDES, "generate.max_model_len=4096").generate
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
    _wait_for_a_unit(ws, proc)
    kill_tree(two_servers[1]["proc"].pid)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert "marked down" in err
    m = read_json(ws / "reports" / "generate_details.json")
    rows = [r for s in list_shards(Path(m["run_dir"]), "unit-*.arrow") for r in read_arrow(s).to_pylist()]
    ids = [r["sample_id"] for r in rows]
    assert len(ids) == len(set(ids)) and set(ids) == set(engines_rows)  # every prompt exactly once
    assert m["num_completed"] + m["num_skipped"] == m["num_prompts"] and m["num_failed"] == 0
    differ = [r["sample_id"] for r in rows if r["completion_ids"] != engines_rows[r["sample_id"]]["completion_ids"]]
    assert not differ, f"{len(differ)} completions differ after the failover: {differ[:5]}"


def test_plan_eta_uses_the_rate_measured_at_the_chosen_level(tmp_path, repo_root, monkeypatch):
    from dflash.core.target_config import target_signature
    from dflash.plan import estimate, report

    monkeypatch.chdir(repo_root)
    reports = tmp_path / "reports"
    sweep = [{"max_num_seqs": n, "output_tokens_per_s": r} for n, r in ((8, 700.0), (32, 1900.0), (128, 1950.0))]
    pilot = {"output_tokens_per_s": 5000.0, "mean_output_tokens": 1500.0, "num_engines": 4, "sweep": sweep}
    pilot |= {"chosen_max_num_seqs": concurrency.knee(sweep), "target_signature": "Tiny/layers=2"}
    write_json(reports / "pilot.json", pilot)
    overrides = [f"base.reports_dir={reports}", "plan.audit_json=", "plan.tokenize_json=", "plan.pilot_json="]
    p = load_params("params.yaml", overrides, ["params/gpu-qwen3.6-27b.yaml"])
    assert estimate.make_plan(p)["generation"]["memory"]["batch"] == max(
        p.generate.pilot_sweep
    )  # other target's knee ignored
    overlay_sig = target_signature("params/targets/qwen3.6-27b.config.json")
    write_json(reports / "pilot.json", pilot | {"target_signature": overlay_sig})
    result = estimate.make_plan(p)
    gen = result["generation"]
    assert pilot["chosen_max_num_seqs"] == 32 and gen["memory"]["batch"] == 32
    pl = gen["pilot"]
    assert pl["measured_per_engine"] == 1900.0 and pl["rate_source"].startswith("sweep level max_num_seqs 32")
    engines = gen["engines"]
    assert gen["wall_hours"]["mid"] == pytest.approx(gen["output_tokens"] / (1900.0 * engines) / 3600)
    assert [r["max_num_seqs"] for r in pl["sweep_vs_model"]] == [8, 32, 128]
    assert all(r["model"] > 0 for r in pl["sweep_vs_model"])
    assert "Pilot sweep (one engine; chosen max_num_seqs 32)" in report.render_markdown(result)
