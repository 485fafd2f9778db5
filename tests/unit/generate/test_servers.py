"""Generate's `servers` backend and the pilot's concurrency sweep, without vLLM: the knee rule,
`max_num_seqs: auto`, server URL validation, the model identity check, and the client's retry / failover logic
against fake OpenAI-style servers on 127.0.0.1 (500s, connection resets, a server that goes away and comes back).
Every address used here is 127.0.0.1. Real api_servers: tests/integration/test_generate_servers.py.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from dflash.core import concurrency
from dflash.core.errors import ParamsError, UserError
from dflash.core.io import list_shards, read_arrow, write_json
from dflash.core.validate import check_generate
from dflash.generate import servers, sweep
from dflash.generate import servers_backend as client
from dflash.generate.contract import count_prompts
from dflash.generate.units import make_units
from tests.helpers import repo_params
from tests.helpers.generate import fake_worker_config

U = {"role": "user", "content": "What is 2 + 2?"}
A = {"role": "assistant", "content": "OK."}


def _params(*overrides: str):
    return repo_params(overrides)


# ------------------------------------------------------------------------------------------ knee, auto
class _Together:
    """An endpoint whose in-flight requests all finish in the same turn of the loop (a batched engine)."""

    def __init__(self) -> None:
        self.sent = 0

    async def complete(self, req):
        self.sent += 1
        await asyncio.sleep(0)
        return SimpleNamespace(token_ids=[1, 2, 3])


@pytest.mark.parametrize("n", [1, 3])
def test_sweep_level_whose_last_batch_finishes_together_ends(n: int) -> None:
    # CI: a level ended with nothing left in flight and `asyncio.wait(set())` raised ValueError (the pilot failed)
    endpoint = _Together()
    row = asyncio.run(sweep.measure_level(endpoint, ["p0", "p1"], n))
    assert row["measured_requests"] == max(2 * n, sweep.MIN_MEASURED)
    assert endpoint.sent >= sweep.level_requests(n)


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
    from dflash.plan.inputs import resolve_paths

    pilot = tmp_path / "pilot.json"
    p = _params("generate.max_num_seqs=auto", f"plan.pilot_json={pilot}")
    paths = resolve_paths(p.plan, p.base)
    assert planned_max_num_seqs(p, paths)[0] == 64  # no sweep yet: the largest level
    write_json(pilot, {"chosen_max_num_seqs": 16})
    assert planned_max_num_seqs(p, paths) == (16, f"{pilot} chosen_max_num_seqs (generate.max_num_seqs: auto)")


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


HOLD_MAX_S = 60.0  # held completions are answered this long after the first was held (the test then fails)


class FakeServer:
    """An OpenAI-style server on 127.0.0.1: /health, /v1/models, /v1/completions with a fixed completion.
    `failures`: behaviours of the next completion requests, in order ("500": HTTP 500; "reset": TCP reset);
    `sick`: /health answers 503 and every completion HTTP 500 (`sick_health_checks` > 0: it recovers after that
    many /health answers); `delay_s`: seconds before each completion; `hold`: completions wait until it returns
    True (polled; until HOLD_MAX_S after the first was held), so a test orders events by what happened, not by
    the clock."""

    def __init__(self, completion: list[int], model: str = "m", max_model_len: int = 1024):
        self.completion, self.model, self.max_model_len = completion, model, max_model_len
        self.failures: list[str] = []  # queued behaviours for the next requests: "500" | "reset"
        self.sick, self.delay_s = False, 0.0
        self.sick_health_checks = 0  # > 0: sick for this many /health answers, then well
        self.hold = None  # a callable: completions are answered once it returns True
        self.hold_ends: float | None = None  # monotonic time when holding stops whatever hold() says
        self.sick_completions = 0  # completions answered HTTP 500 because it was sick
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
                    with fake.lock:
                        sick = fake.sick
                        if sick and fake.sick_health_checks > 0:
                            fake.sick_health_checks -= 1
                            fake.sick = fake.sick_health_checks > 0
                    self._json(503 if sick else 200, {})
                elif self.path == "/v1/models":
                    self._json(200, {"data": [{"id": fake.model, "max_model_len": fake.max_model_len}]})
                elif self.path == "/version":
                    self._json(200, {"version": "fake-1"})
                else:
                    self._json(404, {})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    how = fake.failures.pop(0) if fake.failures else ""
                    if fake.sick:
                        how = "500"
                        fake.sick_completions += 1
                time.sleep(fake.delay_s)
                with fake.lock:
                    if fake.hold is not None and fake.hold_ends is None:
                        fake.hold_ends = time.monotonic() + HOLD_MAX_S
                while fake.hold is not None and not fake.hold() and time.monotonic() < fake.hold_ends:
                    time.sleep(0.01)
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
                ids = fake.completion[: body["max_tokens"]]  # a probe asks for one token
                self._json(200, {"choices": [{"text": "x", "token_ids": ids, "finish_reason": "stop"}]})

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
        cfg = fake_worker_config(tmp_path, g.generate)
        units = make_units(convs, 2)
        d = client.ServersDispatcher(
            units,
            cfg,
            g.generate,
            urls=urls,
            model="m",
            tokenizer=qwen_tokenizer,
            total_prompts=count_prompts(convs),
            done=0,
        )
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
    result, rows, _ = fake_run([srv.url], "generate.request_retries=3")
    assert not result.failed_units and len(rows) == 8
    assert len({r["sample_id"] for r in rows}) == 8
    srv.stop()


def test_a_request_failing_past_request_retries_is_a_failed_turn(fake_run, qwen_tokenizer):
    srv = FakeServer(_answer(qwen_tokenizer))
    srv.failures = ["500"] * 2  # max_num_seqs=2: the first two requests, c0:0 and c1:0 of unit 0, fail
    result, rows, units = fake_run([srv.url], "generate.request_retries=0")
    assert not result.failed_units and sorted(t["sample_id"] for t in result.failed_turns) == ["c0:0", "c1:0"]
    assert all("HTTP 500" in t["error"] for t in result.failed_turns)
    status = {r["sample_id"]: (r["status"], r["skip_reason"]) for r in rows}
    assert status["c0:0"] == ("failed", "request_failed") and status["c0:1"] == ("skipped", "earlier_turn_failed")
    assert len(status) == 8 and [s for s, _ in status.values()].count("completed") == 4  # every other unit committed
    srv.stop()


def test_a_dead_server_is_marked_down_and_its_requests_move(fake_run, qwen_tokenizer):
    alive, dead = FakeServer(_answer(qwen_tokenizer)), FakeServer(_answer(qwen_tokenizer))
    dead.stop()  # connection refused from the start
    result, rows, _ = fake_run([dead.url, alive.url], "generate.request_retries=0")
    assert not result.failed_units and len(rows) == 8  # refused requests do not count as attempts
    assert result.per_engine[0].prompts == 0 and result.per_engine[1].prompts == 8
    alive.stop()


def test_a_down_server_that_answers_again_is_used_again(fake_run, qwen_tokenizer, monkeypatch):
    """`sick` fails its first completion, answers /health 503 (down) and 503 again to its first probe, then is
    well; `slow` holds every reply until `sick` has answered a completion after rejoining, so the run outlasts
    the rejoin however loaded the machine is. A client that never probed again would leave `sick` at 0 prompts."""
    monkeypatch.setattr(client, "REPROBE_S", 0.05)
    sick, slow = FakeServer(_answer(qwen_tokenizer)), FakeServer(_answer(qwen_tokenizer))
    sick.sick, sick.sick_health_checks = True, 2
    slow.hold = lambda: len(sick.seen) >= 2  # the probe's completion, then one of the run's
    result, rows, _ = fake_run([sick.url, slow.url], "generate.request_retries=0", "generate.request_timeout_s=120")
    assert sick.sick_completions >= 1, "sick was never asked while it was down: the test proves nothing"
    assert not result.failed_units and not result.failed_turns
    assert len(rows) == 8 and len({r["sample_id"] for r in rows}) == 8
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
    assert servers.check_servers([srv.url], "other", _params("generate.max_model_len=512").generate) == {
        srv.url: "fake-1"
    }
    srv.stop()


def test_request_body_carries_the_engines_sampling():
    from dflash.generate.turns import Request

    g = _params("generate.sampling.stop=[END]", "generate.sampling.top_k=5").generate
    body = servers.request_body(Request("c:0", 0, [1, 2, 3], 77), g, "m")
    assert body["prompt"] == [1, 2, 3] and body["seed"] == 77 and body["return_token_ids"] is True
    assert (body["temperature"], body["top_p"], body["top_k"], body["max_tokens"]) == (0.0, 1.0, 5, 128)
    assert body["stop"] == ["END"]


def test_plan_eta_uses_the_rate_measured_at_the_chosen_level(tmp_path, repo_root):
    from dflash.core.target_config import target_signature
    from dflash.plan import estimate, report

    reports = tmp_path / "reports"
    sweep = [{"max_num_seqs": n, "output_tokens_per_s": r} for n, r in ((8, 700.0), (32, 1900.0), (128, 1950.0))]
    pilot = {"output_tokens_per_s": 5000.0, "mean_output_tokens": 1500.0, "num_engines": 4, "sweep": sweep}
    pilot |= {"chosen_max_num_seqs": concurrency.knee(sweep), "target_signature": "Tiny/layers=2"}
    write_json(reports / "pilot.json", pilot)
    overrides = [f"base.reports_dir={reports}", "plan.audit_json=", "plan.tokenize_json=", "plan.pilot_json="]
    p = repo_params(overrides, ["params/gpu-qwen3.6-27b.yaml"])
    # another target's knee is ignored: the largest sweep level, as before any sweep
    assert estimate.make_plan(p)["generation"]["memory"]["batch"] == max(p.generate.pilot_sweep)
    overlay_sig = target_signature(repo_root / "params/targets/qwen3.6-27b.config.json")
    write_json(reports / "pilot.json", pilot | {"target_signature": overlay_sig})
    built = estimate.build_plan(p)
    result = built.to_json()
    gen = result["generation"]
    assert pilot["chosen_max_num_seqs"] == 32 and gen["memory"]["batch"] == 32
    pl = gen["pilot"]
    assert pl["measured_per_engine"] == 1900.0 and pl["rate_source"].startswith("sweep level max_num_seqs 32")
    engines = gen["engines"]
    assert gen["wall_hours"]["mid"] == pytest.approx(gen["output_tokens"] / (1900.0 * engines) / 3600)
    assert [r["max_num_seqs"] for r in pl["sweep_vs_model"]] == [8, 32, 128]
    assert all(r["model"] > 0 for r in pl["sweep_vs_model"])
    assert "Pilot sweep (one engine; chosen max_num_seqs 32)" in report.render_markdown(built)
