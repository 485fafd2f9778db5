"""generate.server_registry (dflash/generate/registry.py) against fake OpenAI servers on 127.0.0.1
(benchmarks/fake_openai_servers.py): a server whose file appears after the run started is used; one whose file
disappears is drained (its in-flight requests finish there, or, failing there, move to another server without
being charged, so not even request_retries 0 fails a turn); a file that does not hold an http(s) base URL is
refused with one line naming it. Events are ordered by what the servers saw (their `hold`), not by the clock.
"""

from __future__ import annotations

import logging
import threading

import pytest

from benchmarks.fake_openai_servers import FakeServer
from dflash.core.errors import ParamsError
from dflash.core.io import list_shards, read_arrow
from dflash.core.validate import check_generate
from dflash.generate import servers_backend as client
from dflash.generate.contract import count_prompts
from dflash.generate.registry import ServerRegistry, changes
from dflash.generate.units import make_units
from tests.helpers import repo_params
from tests.helpers.generate import fake_worker_config


def _convs(n: int) -> list[dict]:
    return [
        {"conversation_id": f"c{i}", "messages": [{"role": "user", "content": f"Q{i}?"}], "tools": None}
        for i in range(n)
    ]


@pytest.fixture
def answer(qwen_tokenizer) -> list[int]:
    return qwen_tokenizer("Four.<|im_end|>", add_special_tokens=False)["input_ids"]


@pytest.fixture
def run_registry(tmp_path, qwen_tokenizer):
    """Run the servers dispatcher over the registry folder `reg` on `n` single-turn conversations, the folder
    read every 0.05 s; (result, rows by sample id)."""

    def run(reg, n: int, *overrides: str):
        g = repo_params(["generate.unit_size=4", "generate.max_num_seqs=2", *overrides])
        convs = _convs(n)
        out = tmp_path / "run"
        out.mkdir()
        d = client.ServersDispatcher(
            make_units(convs, 4),
            fake_worker_config(out, g.generate),
            g.generate,
            urls=[],
            model="m",
            tokenizer=qwen_tokenizer,
            total_prompts=count_prompts(convs),
            done=0,
            registry=ServerRegistry(reg, poll_s=0.05),
        )
        result = d.run()
        rows = [r for s in list_shards(out, "unit-*.arrow") for r in read_arrow(s).to_pylist()]
        assert len(rows) == len({r["sample_id"] for r in rows}) == n, "every prompt exactly once"
        assert all(r["status"] == "completed" for r in rows) and not result.failed_turns
        return result, {s.url: s.stats.prompts for s in d.servers}

    return run


def _announce(reg, name: str, url: str) -> None:
    """Write a registry file the way slurm/generate-servers.sbatch does: a hidden temporary, then a rename."""
    tmp = reg / f".{name}.tmp"
    tmp.write_text(url + "\n")
    tmp.rename(reg / f"{name}.url")


def test_a_server_that_joins_after_the_start_is_used(tmp_path, answer, run_registry, caplog):
    """A alone is listed at the start (beside a file holding no URL); A holds its answers until B has answered.
    B's file is written when A gets its first real request, so B can only be a server that joined late."""
    reg = tmp_path / "registry"
    reg.mkdir()
    (reg / "bad.url").write_text("node7:8000/v1\n")
    with FakeServer(answer) as a, FakeServer(answer) as b, caplog.at_level(logging.WARNING):
        _announce(reg, "a", a.url)

        def hold_a() -> bool:
            if a.received >= 2 and not (reg / "b.url").exists():  # the probe, then a real request
                _announce(reg, "b", b.url)
            return a.received < 2 or len(b.answered) >= 2  # B's probe and one real request

        a.hold = hold_a
        _, prompts = run_registry(reg, 8)
    assert prompts[b.url] >= 1 and prompts[a.url] >= 1
    assert f"server {b.url} joins from the registry (b.url)" in caplog.text
    refused = [line for line in caplog.text.splitlines() if "bad.url" in line]
    assert len(refused) == 1 and "refused" in refused[0], "the bad file is refused in one line, once"
    assert b.url not in refused[0] and "'node7:8000/v1'" in refused[0]


@pytest.mark.parametrize("in_flight", ["finish", "fail"])
def test_a_withdrawn_server_is_drained_without_failing_its_turns(tmp_path, answer, run_registry, caplog, in_flight):
    """A and B are listed. A's file is removed once A holds two real requests; B waits until then. `finish`: A's
    two requests are answered there once the client has seen the withdrawal, and A gets no other. `fail`: they
    hang past the timeout while A's /health stays 200; request_retries 0, so a charged failure would be a
    failed turn: they move to B uncharged instead."""
    reg = tmp_path / "registry"
    reg.mkdir()
    seen = threading.Event()

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "left the registry" in record.getMessage():
                seen.set()

    handler = Seen()
    logging.getLogger(client.__name__).addHandler(handler)
    try:
        with FakeServer(answer) as a, FakeServer(answer) as b, caplog.at_level(logging.WARNING):
            if in_flight == "fail":
                a.script = ["ok", "hang", "hang"]  # the probe is answered, the two real requests hang

            def withdraw_a() -> bool:  # polled by both servers' held answers (hanging ones poll nothing)
                if a.received >= 3 and (reg / "a.url").exists():
                    (reg / "a.url").unlink()
                return a.received >= 3

            a.hold = lambda: (withdraw_a() and seen.is_set()) or a.received < 2
            b.hold = withdraw_a
            _announce(reg, "a", a.url)
            _announce(reg, "b", b.url)
            timeout = "generate.request_timeout_s=" + ("10" if in_flight == "fail" else "120")
            _, prompts = run_registry(reg, 8, timeout, "generate.request_retries=0")
    finally:
        logging.getLogger(client.__name__).removeHandler(handler)
    assert a.received == 3, "A got a request after its file was removed (or not the two the test needs)"
    assert f"server {a.url} left the registry: draining its 2 in-flight requests" in caplog.text
    if in_flight == "finish":
        assert prompts == {a.url: 2, b.url: 6} and len(a.answered) == 3
    else:
        assert prompts == {a.url: 0, b.url: 8}


def test_registry_reads_urls_refuses_bad_entries_once_and_computes_changes(tmp_path, caplog):
    reg = ServerRegistry(tmp_path / "reg")
    with caplog.at_level(logging.WARNING):
        assert reg.read() == {} and "is not a folder (yet)" in caplog.text
        reg.folder.mkdir()
        (reg.folder / "t1.url").write_text("http://node1:8000/v1/\n")
        (reg.folder / "t2.url").write_text("http://node1:8000/v1")  # the same server twice: listed once
        (reg.folder / ".t3.tmp").write_text("http://half")  # a writer's temporary: ignored
        (reg.folder / "t4.url").write_text("http://user:pw@node2:8000/v1")
        caplog.clear()
        assert reg.read() == {"http://node1:8000/v1": "t1.url"}
        assert reg.read() == {"http://node1:8000/v1": "t1.url"}
        lines = caplog.text.strip().splitlines()
        assert len(lines) == 1 and "t4.url" in lines[0] and "no user:password@" in lines[0]
        (reg.folder / "t4.url").write_text("https://node2:8443/v1")  # fixed: accepted, nothing more said
        assert reg.read() == {"http://node1:8000/v1": "t1.url", "https://node2:8443/v1": "t4.url"}
        assert len(caplog.text.strip().splitlines()) == 1
    ch = changes({"u1": "a.url", "u3": "c.url", "u4": "d.url"}, active={"u1", "u2"}, withdrawn={"u3"})
    assert (ch.joined, ch.returned, ch.withdrawn) == ({"u4": "d.url"}, ["u3"], ["u2"])
    assert reg.poll(now=1e12) is not None and reg.poll(now=1e12) is None  # one read per POLL_S


def test_server_registry_and_server_urls_are_one_or_the_other():
    params = repo_params(["generate.server_registry=/shared/reg", "generate.server_urls=[http://n1:8000/v1]"])
    with pytest.raises(ParamsError, match=r"^generate\.server_registry: set it or generate\.server_urls"):
        check_generate(params)
