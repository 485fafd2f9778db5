"""The pilot's concurrency sweep: one server, the client capping its in-flight requests at each level in turn.

Inputs: the pilot's conversations (their first turns, rendered and seeded as the stage renders them),
`generate.pilot_sweep` levels. Where: the first of `generate.server_urls` when the list is set (that server
must have been started with --max-num-seqs >= the largest level), else one local server started here
with max_num_seqs = the largest level, whatever generate.backend is (the servers machinery: the client
decides the concurrency, so one engine start covers every level).

Steady state, per level n (ascending): n requests are kept in flight throughout, cycling through the
prompts. Warm-up: the first n completions are discarded (the batch fills from empty and the first
requests all started together). Measured: the next max(2n, MIN_MEASURED) completions, still at n in
flight; their output tokens / the time from the last warm-up completion to the last measured one is the
level's output_tokens_per_s, and their latencies give p50 / p90. Requests still in flight then drain
unmeasured before the next level starts (levels never overlap). The knee rule: dflash/core/concurrency.py.

Output: [{"max_num_seqs", "output_tokens_per_s", "requests_per_s", "p50_latency_s", "p90_latency_s",
"measured_requests", "window_s"}] and the chosen level.
"""

from __future__ import annotations

import logging
import statistics
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

from dflash.core.concurrency import knee
from dflash.core.errors import UserError
from dflash.core.params import GenerateParams
from dflash.generate.contract import Unit, WorkerConfig
from dflash.generate.servers import ServerError, check_servers, complete, local_servers
from dflash.generate.turns import Request, TurnBook

log = logging.getLogger(__name__)

MIN_MEASURED = 32  # completions measured per level at least (small levels would otherwise measure a few requests)


def sweep_prompts(conversations: list[dict], cfg: WorkerConfig, tokenizer: Any) -> list[Request]:
    """The first turn of each conversation, rendered and seeded exactly as the stage does (never committed)."""
    book = TurnBook(cfg, tokenizer, "")
    return book.start_unit(Unit(-1, conversations, "sweep"))


def _timed(url: str, req: Request, g: GenerateParams, model: str) -> tuple[float, int]:
    t0 = time.time()
    out = complete(url, req, g, model)
    return time.time() - t0, len(out["token_ids"])


def measure_level(url: str, prompts: list[Request], n: int, g: GenerateParams, model: str) -> dict:
    """One level: n in flight, warm-up discarded, max(2n, MIN_MEASURED) completions measured (module docstring)."""
    warm, measured = n, max(2 * n, MIN_MEASURED)
    done: list[tuple[float, float, int]] = []  # (finished at, latency s, output tokens), in completion order
    sent = 0
    with ThreadPoolExecutor(max_workers=n) as pool:
        inflight = set()
        while len(done) < warm + measured:
            while len(inflight) < n:
                inflight.add(pool.submit(_timed, url, prompts[sent % len(prompts)], g, model))
                sent += 1
            finished, inflight = wait_futures(inflight, return_when=FIRST_COMPLETED)
            for f in finished:
                try:
                    latency, tokens = f.result()
                except ServerError as exc:
                    raise UserError(f"pilot sweep at {n} in flight: a request failed ({exc})") from None
                done.append((time.time(), latency, tokens))
        wait_futures(inflight)  # drain, unmeasured
    window = done[warm : warm + measured]
    t0, t1 = done[warm - 1][0], window[-1][0]
    span = max(1e-9, t1 - t0)
    lat = sorted(x[1] for x in window)
    return {
        "max_num_seqs": n,
        "output_tokens_per_s": round(sum(x[2] for x in window) / span, 2),
        "requests_per_s": round(len(window) / span, 3),
        "p50_latency_s": round(statistics.median(lat), 3),
        "p90_latency_s": round(lat[min(len(lat) - 1, int(0.9 * len(lat)))], 3),
        "measured_requests": len(window),
        "window_s": round(span, 2),
    }


def run_sweep(
    g: GenerateParams, cfg: WorkerConfig, tokenizer: Any, conversations: list[dict], model: str, **server_kw: Any
) -> dict:
    """{"sweep": [...], "chosen_max_num_seqs", "sweep_server", "sweep_server_start_s"} (module docstring)."""
    levels = sorted(set(g.pilot_sweep))
    prompts = sweep_prompts(conversations, cfg, tokenizer)
    if not prompts:
        raise UserError("generate.pilot_sweep: the pilot sample has no prompt to send (every first turn is skipped)")

    def sweep_at(url: str) -> list[dict]:
        rows = []
        for n in levels:
            rows.append(measure_level(url, prompts, n, g, model))
            log.info("pilot sweep: %s", rows[-1])
        return rows

    if g.server_urls:
        url = g.server_urls[0]
        check_servers([url], model, g)
        rows, start_s = sweep_at(url), None
    else:
        with local_servers(g, cfg.model, model, count=1, max_num_seqs=levels[-1], **server_kw) as servers:
            url, start_s = servers[0]["url"], servers[0]["start_s"]
            rows = sweep_at(url)
        url = "local"
    return {"sweep": rows, "chosen_max_num_seqs": knee(rows), "sweep_server": url, "sweep_server_start_s": start_s}
