"""The servers backend's client, piece by piece: reply validation, Retry-After, a server's health rules, the
dispatcher's moves against fake OpenAI servers on 127.0.0.1 (benchmarks/fake_openai_servers.py: quarantine moves
in-flight requests, a retry goes to another server, a quarantined server is probed with a real completion
before it rejoins, a 429 pauses a server without failing anything), resuming a unit from its rows, and the
progress bar's clock.
"""

from __future__ import annotations

import json
import logging
import time

import pytest

from benchmarks.fake_openai_servers import FakeServer
from dflash.core.chat import template_kwargs
from dflash.core.io import list_shards, read_arrow
from dflash.generate import servers_backend as client
from dflash.generate.contract import Unit, count_prompts
from dflash.generate.health import HealthRules, ServerHealth
from dflash.generate.progress import Progress
from dflash.generate.servers import ServerError, http_failure, parse_reply, retry_after_s
from dflash.generate.turns import TurnBook
from dflash.generate.units import make_units
from tests.helpers import repo_params
from tests.helpers.generate import fake_worker_config

VOCAB = 151936


# ------------------------------------------------------------------------------------------ reply validation


def _reply(**choice) -> bytes:
    base = {"text": "x", "token_ids": [1, 2, 3], "finish_reason": "stop", "prompt_token_ids": [7, 8]}
    return json.dumps({"choices": [{**base, **choice}]}).encode()


def test_a_valid_reply_is_returned_as_sent():
    out = parse_reply("u", _reply(), "application/json", [7, 8], 16, VOCAB)
    assert (out.token_ids, out.text, out.finish_reason) == ([1, 2, 3], "x", "stop")
    assert parse_reply("u", _reply(prompt_token_ids=None), "", [9], 3, VOCAB).token_ids == [1, 2, 3]  # no echo: fine


@pytest.mark.parametrize(
    "body,why",
    [
        (_reply(token_ids=[1, VOCAB, 3]), rf"token id {VOCAB} at position 1 is outside the vocabulary \[0, {VOCAB}\)"),
        (_reply(token_ids=[-1]), r"token id -1 at position 0 is outside"),
        (_reply(token_ids=[1, "2"]), r"token id '2' at position 1 is not an integer"),
        (_reply(token_ids=[1, True]), r"token id True at position 1 is not an integer"),
        (_reply(token_ids=[1.0]), r"token id 1.0 at position 0 is not an integer"),
        (_reply(token_ids=[]), r"token_ids is \[\], not a list of token ids"),
        (_reply(token_ids=None), r"without choices\[0\]\.token_ids"),
        (_reply(token_ids=list(range(17))), r"17 token ids, more than max_tokens 16"),
        (_reply(finish_reason="abort"), r"finish_reason 'abort', expected one of \('stop', 'length'\)"),
        (_reply(prompt_token_ids=[7, 9]), r"prompt_token_ids echo differs .*from position 1"),
        (_reply(text=5), r"text is int, not a string"),
        (b'{"choices": []}', r"reply with no choices"),
        (b'{"error": "boom"}', r"reply with no choices"),
        (b"<html>oops</html>", r"reply is not JSON \(text/html\): <html>oops</html>"),
    ],
)
def test_a_bad_reply_is_a_server_error_saying_what_was_sent(body, why):
    with pytest.raises(ServerError, match=why) as err:
        parse_reply("http://n1:8000/v1", body, "text/html", [7, 8], 16, VOCAB)
    assert str(err.value).startswith("http://n1:8000/v1: ") and "\n" not in str(err.value)


def test_a_reply_is_checked_against_the_request_one_choice_and_an_honest_length_finish():
    two = json.dumps({"choices": [json.loads(_reply())["choices"][0]] * 2}).encode()
    with pytest.raises(ServerError, match=r"2 choices for a request of one \(n = 1\)"):
        parse_reply("u", two, "", [7, 8], 16, VOCAB, max_model_len=64)
    # "length" is honest with max_tokens ids, or with the prompt and the completion filling the server's context.
    assert parse_reply("u", _reply(finish_reason="length"), "", [7, 8], 3, VOCAB).finish_reason == "length"
    assert parse_reply("u", _reply(finish_reason="length"), "", [7, 8], 16, VOCAB, max_model_len=5).token_ids == [
        1,
        2,
        3,
    ]
    for mml, said in ((64, "max_model_len 64"), (None, "a max_model_len it does not report")):
        with pytest.raises(
            ServerError, match=rf'"length" after 3 token ids, below max_tokens 16, with 2 \+ 3 .*{said}'
        ):
            parse_reply("u", _reply(finish_reason="length"), "", [7, 8], 16, VOCAB, max_model_len=mml)


def test_the_model_card_gives_the_servers_context():
    from dflash.generate.servers import check_model_card

    g = repo_params().generate
    card = {"data": [{"id": "m", "max_model_len": g.max_model_len + 100}]}
    assert check_model_card("u", card, "m", g) == g.max_model_len + 100
    assert check_model_card("u", {"data": [{"id": "m"}]}, "m", g) is None  # not said: the client uses its own


def test_retry_after_and_which_http_answers_are_backoffs():
    assert retry_after_s("2") == 2.0 and retry_after_s(" 0.5 ") == 0.5
    assert retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # a date in the past: now
    assert retry_after_s("99999") == 300.0 and retry_after_s("soon") is None and retry_after_s(None) is None
    assert http_failure("u", 429, b"slow down", None).retry_after == 1.0  # a 429 is a backoff even without one
    assert http_failure("u", 503, b"", "3").retry_after == 3.0
    assert http_failure("u", 503, b"", None).retry_after is None  # a 503 without Retry-After is a failure
    assert http_failure("u", 500, b"<h1>x</h1>", "3").retry_after is None


# ------------------------------------------------------------------------------------------ health rules


def test_health_quarantines_on_failures_in_a_row_a_failure_share_or_endless_backoffs():
    h = ServerHealth(HealthRules(failures_in_a_row=5, failure_share=0.75, window=4, throttle_limit_s=10))
    assert h.failure() == ""
    h.success()
    h.success()
    assert h.failure() == ""  # F S S F: 2 of 4, and the window just filled
    assert h.failure() == ""  # S S F F
    assert h.failure() == "3 of its last 4 requests failed"  # S F F F
    h = ServerHealth(HealthRules(failures_in_a_row=3, failure_share=1.0, window=20, throttle_limit_s=10))
    assert [h.failure() for _ in range(3)] == ["", "", "3 failed requests in a row"]
    h = ServerHealth(HealthRules(failures_in_a_row=3, failure_share=0.5, window=20, throttle_limit_s=10))
    assert h.throttle(1.0, now=100.0) == "" and h.paused_until == 101.0
    assert h.throttle(1.0, now=105.0) == ""
    h.success()  # served something: the backoff streak starts over
    assert h.throttle(1.0, now=111.0) == "" and h.throttle(1.0, now=121.5) == "only backoffs (HTTP 429 / 503) for 10 s"


# ------------------------------------------------------------------------------------------ the dispatcher


def _convs(n: int) -> list[dict]:
    return [
        {"conversation_id": f"c{i}", "messages": [{"role": "user", "content": f"Q{i}?"}], "tools": None}
        for i in range(n)
    ]


@pytest.fixture
def dispatch(tmp_path, qwen_tokenizer, monkeypatch):
    """Run the servers dispatcher over `urls` on `n` single-turn conversations; (result, rows by sample id)."""
    monkeypatch.setattr(client, "backoff_s", lambda attempts: 0.01)

    def run(urls: list[str], n: int, *overrides: str):
        g = repo_params(["generate.unit_size=4", "generate.request_timeout_s=30", *overrides])
        convs = _convs(n)
        d = client.ServersDispatcher(
            make_units(convs, 4),
            fake_worker_config(tmp_path, g.generate),
            g.generate,
            urls=urls,
            model="m",
            tokenizer=qwen_tokenizer,
            total_prompts=count_prompts(convs),
            done=0,
        )
        result = d.run()
        rows = {r["sample_id"]: r for s in list_shards(tmp_path, "unit-*.arrow") for r in read_arrow(s).to_pylist()}
        return result, rows

    return run


@pytest.fixture
def answer(qwen_tokenizer) -> list[int]:
    return qwen_tokenizer("Four.<|im_end|>", add_special_tokens=False)["input_ids"]


def _prompt_of(qwen_tokenizer, i: int) -> list[int]:
    from dflash.core.chat import render_ids

    return render_ids(qwen_tokenizer, [{"role": "user", "content": f"Q{i}?"}], True, template_kwargs(False, {}))


def test_a_quarantined_server_s_in_flight_requests_move_without_waiting_for_their_timeout(
    dispatch, answer, qwen_tokenizer, caplog
):
    """A: three requests fail at once, every other request it gets hangs (120 s timeout); B is healthy. The third
    failure quarantines A and its hanging requests move to B at once, uncharged: the run takes seconds (the bound
    of 60 s leaves a loaded machine room and still catches requests that waited for their timeout)."""
    fast_fail = [_prompt_of(qwen_tokenizer, i) for i in (0, 2, 4)]  # the first three A gets (A, B alternate)
    t0 = time.time()
    with FakeServer(answer, mode="hang") as a, FakeServer(answer) as b, caplog.at_level(logging.WARNING):
        a.fail_if = lambda prompt: prompt in fast_fail
        overrides = ("generate.max_num_seqs=6", "generate.request_retries=1", "generate.request_timeout_s=120")
        result, rows = dispatch([a.url, b.url], 12, *overrides)
    assert time.time() - t0 < 60, "the hanging requests waited for their timeout"
    assert len(rows) == 12 and all(r["status"] == "completed" for r in rows.values())
    assert not result.failed_turns and result.per_engine[0].prompts == 0 and result.per_engine[1].prompts == 12
    assert "quarantined after 3 failed requests in a row" in caplog.text


def test_a_retried_request_goes_to_another_server(dispatch, answer, qwen_tokenizer):
    poison = _prompt_of(qwen_tokenizer, 0)
    with FakeServer(answer) as a, FakeServer(answer) as b:
        a.fail_if = lambda prompt: prompt == poison  # c0:0 goes to A first (least loaded, first listed)
        result, rows = dispatch([a.url, b.url], 4, "generate.max_num_seqs=4", "generate.request_retries=3")
    assert rows["c0:0"]["status"] == "completed" and not result.failed_turns
    assert a.received == 2 and poison in b.answered  # A got c0:0 (failed) and c2:0; B served c0:0's retry


def test_a_quarantined_server_rejoins_only_after_a_real_completion(dispatch, answer, monkeypatch, caplog):
    """A's first 7 completions carry an id outside the vocabulary while /health says 200: its first 3 requests
    quarantine it, its next 4 probes' one-token completions are bad, the 5th probe is good and it rejoins. A
    /health-only probe would let it back after the 3rd request and lose it again to requests 4-6 (two
    quarantines). B holds its replies until A has answered a request after rejoining, so the run outlasts the
    probes however loaded the machine is (events ordered by what happened, not by the clock)."""
    monkeypatch.setattr(client, "REPROBE_S", 0.05)
    with FakeServer(answer) as a, FakeServer(answer) as b, caplog.at_level(logging.WARNING):
        a.script = ["vocab"] * 7
        b.hold = lambda: len(a.answered) >= 2  # the good probe, then one of the run's prompts
        overrides = ("generate.max_num_seqs=1", "generate.request_retries=5", "generate.request_timeout_s=120")
        result, rows = dispatch([a.url, b.url], 12, *overrides)
    assert a.received >= 8, "A was not probed until its script ran out: the test proves nothing"
    assert len(rows) == 12 and all(r["status"] == "completed" for r in rows.values())
    assert all(0 <= t < VOCAB for r in rows.values() for t in r["completion_ids"])
    assert caplog.text.count(f"server {a.url} out of rotation") == 1
    assert caplog.text.count(f"server {a.url} is back") == 1 and result.per_engine[0].prompts >= 1


def test_a_throttling_server_is_left_alone_for_its_retry_after_and_nothing_fails(dispatch, answer, caplog):
    t0 = time.time()
    with FakeServer(answer) as a, caplog.at_level(logging.WARNING):
        a.script = ["throttle", "throttle"]  # the first two requests get 429 + Retry-After: 1, then it serves
        result, rows = dispatch([a.url], 4, "generate.max_num_seqs=2", "generate.request_retries=0")
    assert time.time() - t0 >= 1.0, "the server was asked again before its Retry-After"
    assert len(rows) == 4 and all(r["status"] == "completed" for r in rows.values()) and not result.failed_turns
    assert "out of rotation" not in caplog.text


# ------------------------------------------------------------------------------------------ resume, progress


def test_a_unit_resumes_from_its_rows_with_the_same_history(tmp_path, qwen_tokenizer):
    """Rows made earlier (a re-opened shard, or a dead engine's finished turns) are replayed: the next turn's
    prompt is exactly the one an uninterrupted run sends."""
    g = repo_params().generate
    u, a = {"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "OK."}
    conv = {"conversation_id": "c", "messages": [u, a, {"role": "user", "content": "And 3 + 3?"}, a], "tools": None}
    answer = qwen_tokenizer("<think>\nsum\n</think>\n\nFour.<|im_end|>", add_special_tokens=False)["input_ids"]
    book = TurnBook(fake_worker_config(tmp_path, g), qwen_tokenizer, "v")
    (first,) = book.start_unit(Unit(0, [conv], "unit-0.arrow"))
    second = book.complete(first.sid, answer, "t", "stop")
    made = [r for r in book.units[0]["rows"]]
    fresh = TurnBook(fake_worker_config(tmp_path, g), qwen_tokenizer, "v")
    (again,) = fresh.start_unit(Unit(0, [conv], "unit-0.arrow", done_rows=made))
    assert again.sid == second.sid == "c:1" and again.ids == second.ids and again.seed == second.seed
    assert fresh.units[0]["rows"] == made


def test_the_progress_clock_starts_when_the_engines_are_up():
    p = Progress("generate (all)", total=100, initial=10, labels=["engine 0"], starting="starting 1 engine(s)")
    try:
        assert "starting 1 engine(s)" in p.bar.desc
        time.sleep(0.5)  # the engine start
        up = time.time()
        p.engine_up(0)
        p.update(5, 0, tokens=50)
        d = p.bar.format_dict
        since_up = time.time() - up  # however long a loaded machine took since: the bar may count only that
        assert p.bar.desc == "generate (all)" and (d["n"], d["initial"]) == (15, 10)
        assert d["elapsed"] <= since_up + 0.1, "the engine's start-up counts in the rate and the ETA"
    finally:
        p.close()
