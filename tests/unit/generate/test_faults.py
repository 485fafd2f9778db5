"""Generate's servers backend against a sick cluster: fake OpenAI servers on 127.0.0.1
(benchmarks/fake_openai_servers.py) that send ids outside the vocabulary, negative or string ids, an HTML page,
no token_ids, no choices, two choices for a request of one, a "length" finish short of max_tokens and of the
context (an answer cut short), HTTP 429 + Retry-After, or hang past the timeout.

Each misbehaviour runs through the real stage entry point (`stages.generate` via dflash.core.cli, in this
process, against a target folder that holds only a config and the real Qwen3 tokenizer: the servers backend
loads no weights), in the issue's settings (request_timeout_s 5, which a healthy reply on a loaded machine is well
inside; request_retries 1):
- beside a healthy server: exit 0, every prompt exactly once, every stored id inside the vocabulary;
- alone: exit 1 with one line naming the server's URL and what it sent, no traceback, no shard stored.
And a request that always fails (on every server) is one failed turn: every other prompt of its unit is
committed, the conversation's later turns are skipped with a reason, the report counts it by reason, and a rerun
asks the servers for exactly the failed turns.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from benchmarks.fake_openai_servers import FakeServer
from dflash.core import cli
from dflash.core.io import list_shards, read_arrow, read_json, write_json
from stages import generate as generate_stage
from tests.helpers import PARAMS, repo_params
from tests.helpers.inputs import write_conversations

VOCAB = 151936  # the fake target's config.json vocab_size (every Qwen3 checkpoint's)
POISON = "Recite the forbidden verse."


def _conversations() -> list[list[dict]]:
    """6 conversations, 8 prompts: two of two turns, four of one; the poison is the second one's first turn."""
    convs = []
    for i in range(6):
        u = {"role": "user", "content": POISON if i == 1 else f"What is {i} + {i}?"}
        a = {"role": "assistant", "content": "OK."}
        if i < 2:
            convs.append([u, a, {"role": "user", "content": f"And {i} x {i}?"}, a])
        else:
            convs.append([u])
    return convs


@pytest.fixture(scope="module")
def fake_target(tmp_path_factory) -> Path:
    """A target folder without weights: config.json (the tiny Qwen3 geometry, Qwen3's 151,936 vocab rows),
    target.json and the real Qwen3 tokenizer: all the servers backend reads."""
    import shutil

    from dflash.target.build import qwen3_tokenizer_dir, tiny_config

    out = tmp_path_factory.mktemp("fake_target") / "target"
    out.mkdir()
    params = repo_params()
    tiny_config(params.target).to_json_file(out / "config.json")
    for f in qwen3_tokenizer_dir().iterdir():
        shutil.copy(f, out / f.name)
    write_json(out / "target.json", {"source": "tiny", "model": str(out), "revision": "", "architectures": ["x"]})
    return out


@pytest.fixture(scope="module")
def answer(fake_target) -> list[int]:
    from dflash.core.hf import load_tokenizer

    return load_tokenizer(str(fake_target))("Four.<|im_end|>", add_special_tokens=False)["input_ids"]


def _audit(ws: Path) -> Path:
    audit = ws / "audit"
    audit.mkdir(parents=True, exist_ok=True)
    write_conversations(audit / "conversations.arrow", _conversations())
    return audit


def run_stage(ws: Path, target: Path, urls: list[str], capsys, *extra: str) -> tuple[int, str]:
    """`python -m stages.generate` (servers backend over `urls`) in this process: (exit code, stderr)."""
    if not (ws / "audit").exists():
        _audit(ws)
    overrides = [
        f"base.target_dir={target}",
        f"base.reports_dir={ws / 'reports'}",
        f"audit.out={ws / 'audit'}",
        f"generate.out={ws / 'generate'}",
        f"generate.pilot_out={ws / 'pilot'}",
        "generate.backend=servers",
        "generate.server_urls=[" + ",".join(urls) + "]",
        "generate.server_model=m",
        "generate.max_num_seqs=2",
        "generate.unit_size=2",
        "generate.request_timeout_s=5",
        "generate.request_retries=1",
        "generate.sampling.max_tokens=64",
        *extra,
    ]
    argv = ["--params", str(PARAMS)]
    for o in overrides:
        argv += ["-S", o]
    capsys.readouterr()
    code = 0
    try:
        cli.run(generate_stage.main, "generate", argv=argv, add_args=generate_stage.add_args)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    return code, capsys.readouterr().err


def stored_rows(ws: Path) -> list[dict]:
    return [
        r
        for d in (ws / "generate").glob("run-*")
        for s in list_shards(d, "unit-*.arrow")
        for r in read_arrow(s).to_pylist()
    ]


# What each misbehaviour's error line must say about what the server sent.
MISBEHAVIOURS = {
    "vocab": rf"token id {VOCAB + 7} .*outside the vocabulary \[0, {VOCAB}\)",
    "negative": rf"token id -3 .*outside the vocabulary \[0, {VOCAB}\)",
    "string": r"token id '\d+' .*not an integer",
    "html": r"not JSON \(text/html\).*502 Bad Gateway",
    "no_token_ids": r"without choices\[0\]\.token_ids",
    "no_choices": r"no choices",
    "two_choices": r"2 choices for a request of one \(n = 1\)",
    "early_length": r'finish_reason "length" after \d+ token ids, below max_tokens 64, .* short of the server\'s '
    r"max_model_len 1024",
    "throttle": r"HTTP 429.*Retry-After 1",
    "hang": r"no reply within 5(\.0)? s",
}


@pytest.mark.parametrize("mode", list(MISBEHAVIOURS))
def test_a_sick_server_beside_a_healthy_one_costs_nothing(tmp_path, fake_target, answer, capsys, mode):
    with FakeServer(answer, mode=mode) as sick, FakeServer(answer) as healthy:
        code, err = run_stage(tmp_path, fake_target, [sick.url, healthy.url], capsys)
    assert code == 0, err[-2000:]
    rows = stored_rows(tmp_path)
    ids = [r["sample_id"] for r in rows]
    assert len(ids) == len(set(ids)) == 8, "every prompt exactly once"
    assert all(r["status"] == "completed" for r in rows)
    assert all(0 <= t < VOCAB for r in rows for t in r["completion_ids"]), "an invalid id was stored"
    assert all(r["completion_ids"] == answer for r in rows)
    m = read_json(tmp_path / "reports" / "generate.json")
    assert m["num_completed"] == 8 and m["num_failed"] == 0


@pytest.mark.parametrize("mode", list(MISBEHAVIOURS))
def test_a_sick_server_alone_stops_the_run_naming_it(tmp_path, fake_target, answer, capsys, mode):
    with FakeServer(answer, mode=mode) as sick:
        code, err = run_stage(tmp_path, fake_target, [sick.url], capsys)
    assert code == 1, err[-2000:]
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: generate: no server can serve"), last
    assert sick.url in last
    import re

    assert re.search(MISBEHAVIOURS[mode], last), last
    assert stored_rows(tmp_path) == [], "a row was stored from a sick server"


def _poisoned(server: FakeServer, tokenizer) -> None:
    marker = tokenizer(POISON, add_special_tokens=False)["input_ids"]

    def has_marker(prompt: list[int]) -> bool:
        n = len(marker)
        return any(prompt[i : i + n] == marker for i in range(len(prompt) - n + 1))

    server.fail_if = has_marker


def test_a_request_that_always_fails_is_one_failed_turn_and_a_rerun_retries_exactly_it(
    tmp_path, fake_target, answer, capsys, caplog
):
    from dflash.core.hf import load_tokenizer

    tok = load_tokenizer(str(fake_target))
    a, b = FakeServer(answer), FakeServer(answer)
    _poisoned(a, tok)
    _poisoned(b, tok)
    try:
        with caplog.at_level(logging.INFO):
            code, err = run_stage(tmp_path, fake_target, [a.url, b.url], capsys)
        assert code == 1
        last = err.strip().splitlines()[-1]
        assert "1 turn(s) failed" in last and "re-run" in last, last
        rows = {r["sample_id"]: r for r in stored_rows(tmp_path)}
        assert len(rows) == 8, "every other prompt of the unit is committed"
        poison = [sid for sid, r in rows.items() if r["status"] == "failed"]
        assert len(poison) == 1 and rows[poison[0]]["skip_reason"] == "request_failed"
        cid = rows[poison[0]]["conversation_id"]
        assert rows[f"{cid}:1"]["status"] == "skipped" and rows[f"{cid}:1"]["skip_reason"] == "earlier_turn_failed"
        assert sum(r["status"] == "completed" for r in rows.values()) == 6
        m = read_json(tmp_path / "reports" / "generate.json")
        assert (m["num_failed"], m["num_skipped"], m["num_completed"]) == (1, 1, 6)
        assert m["failed_by_reason"] == {"request_failed": 1}
        details = read_json(tmp_path / "reports" / "generate_details.json")
        (turn,) = details["failed_turns"]
        assert turn["sample_id"] == poison[0] and a.url in turn["error"] and b.url in turn["error"]
        # The rerun asks for exactly the failed turn (then the turn it had skipped) and keeps every other row.
        a.fail_if = b.fail_if = None
        seen_a, seen_b = len(a.answered), len(b.answered)
        code, err = run_stage(tmp_path, fake_target, [a.url, b.url], capsys)
        assert code == 0, err[-2000:]
        asked = [tok.decode(p) for p in a.answered[seen_a:] + b.answered[seen_b:]]
        assert len(asked) == 2 and all(POISON in p for p in asked), asked
        again = {r["sample_id"]: r for r in stored_rows(tmp_path)}
        assert set(again) == set(rows) and all(r["status"] == "completed" for r in again.values())
        for sid, r in rows.items():
            if r["conversation_id"] != cid:
                assert json.dumps(again[sid], sort_keys=True) == json.dumps(r, sort_keys=True)
        m = read_json(tmp_path / "reports" / "generate.json")
        assert m["num_failed"] == 0 and m["num_completed"] == 8
    finally:
        a.stop()
        b.stop()
