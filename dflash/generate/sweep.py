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
"measured_requests", "window_s"}] and the chosen level. Requests go out as the stage's client sends them
(dflash/generate/endpoint.py: asynchronous, replies validated). A progress bar counts every level's completions;
it says so while the server starts and its clock starts when the server is up.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from typing import Any

from dflash.core.concurrency import knee
from dflash.core.errors import UserError
from dflash.core.params import GenerateParams
from dflash.generate.contract import Unit, WorkerConfig
from dflash.generate.endpoint import Endpoint, new_session, run_async
from dflash.generate.progress import Progress
from dflash.generate.servers import ServerError, check_servers, local_servers
from dflash.generate.turns import Request, TurnBook

log = logging.getLogger(__name__)

MIN_MEASURED = 32  # completions measured per level at least (small levels would otherwise measure a few requests)


def sweep_prompts(conversations: list[dict], cfg: WorkerConfig, tokenizer: Any) -> list[Request]:
    """The first turn of each conversation, rendered and seeded exactly as the stage does (never committed)."""
    book = TurnBook(cfg, tokenizer, "")
    return book.start_unit(Unit(-1, conversations, "sweep"))


def level_requests(n: int) -> int:
    """Completions a level of n in flight takes: n warm-up + max(2n, MIN_MEASURED) measured."""
    return n + max(2 * n, MIN_MEASURED)


async def measure_level(endpoint: Endpoint, prompts: list[Request], n: int, progress: Progress | None = None) -> dict:
    """One level: n in flight, warm-up discarded, max(2n, MIN_MEASURED) completions measured (module docstring)."""
    warm, measured = n, max(2 * n, MIN_MEASURED)
    done: list[tuple[float, float, int]] = []  # (finished at, latency s, output tokens), in completion order
    sent = 0

    async def timed(req: Request) -> tuple[float, int]:
        t0 = time.time()
        out = await endpoint.complete(req)
        return time.time() - t0, len(out.token_ids)

    inflight: set[asyncio.Task] = set()
    try:
        while len(done) < warm + measured:
            while len(inflight) < n:
                inflight.add(asyncio.create_task(timed(prompts[sent % len(prompts)])))
                sent += 1
            finished, inflight = await asyncio.wait(inflight, return_when=asyncio.FIRST_COMPLETED)
            for f in finished:
                try:
                    latency, tokens = f.result()
                except ServerError as exc:
                    raise UserError(f"pilot sweep at {n} in flight: a request failed ({exc})") from None
                done.append((time.time(), latency, tokens))
                if progress is not None:
                    progress.update(1, 0, tokens)
        if inflight:  # empty when the last batch finished all at once (asyncio.wait refuses an empty set)
            await asyncio.wait(inflight)  # drain, unmeasured
    finally:
        for t in inflight:
            t.cancel()
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
    total = sum(level_requests(n) for n in levels)
    label = g.server_urls[0] if g.server_urls else "local server"
    starting = "checking the server" if g.server_urls else "starting a local server"
    progress = Progress("pilot sweep", total, 0, [label], starting, unit="request")

    async def sweep_at(url: str) -> list[dict]:
        rows = []
        async with new_session(g) as session:
            endpoint = Endpoint(session, url, g, model, cfg.vocab_size)
            progress.engine_up(0)
            for n in levels:
                progress.label(0, f"(level {n})")
                rows.append(await measure_level(endpoint, prompts, n, progress))
                log.info("pilot sweep: %s", rows[-1])
        return rows

    try:
        if g.server_urls:
            url = g.server_urls[0]
            check_servers([url], model, g)
            rows, start_s = run_async(sweep_at(url)), None
        else:
            with local_servers(
                g, cfg.model, model, count=1, on_wait=progress.tick, max_num_seqs=levels[-1], **server_kw
            ) as servers:
                url, start_s = servers[0]["url"], servers[0]["start_s"]
                rows = run_async(sweep_at(url))
            url = "local"
    finally:
        progress.close()
    return {"sweep": rows, "chosen_max_num_seqs": knee(rows), "sweep_server": url, "sweep_server_start_s": start_s}
