"""The `servers` backend's dispatcher: the generate stage as a client of OpenAI-compatible servers.

One process. A `TurnBook` (dflash/generate/turns.py, shared with the engines worker) renders the turns and
commits unit shards; this module only moves requests:
- Load: each healthy server holds at most `generate.max_num_seqs` requests in flight (one thread each);
  units are opened while fewer than 2 x the total capacity of requests wait, so the servers' batches stay
  full across unit boundaries; a conversation's next turn goes to the front of the queue the moment its
  previous turn returns (turn order kept: a conversation has one request at a time).
- Faults: a failed request (timeout `generate.request_timeout_s`, connection reset, HTTP 5xx, a bad reply)
  triggers a /health probe of its server. Server unhealthy -> marked down for the rest of the run and its
  requests move to the others (not counted against the request). Server healthy -> the request's
  attempts + 1, retried after a backoff of min(30, 0.5 x 2^attempts) s on any healthy server; past
  `generate.max_unit_retries` its unit is recorded as failed (nothing of it committed).
- A server marked down is probed again every REPROBE_S s (/health, then the model identity check); healthy
  and the same model -> back in use (a restarted or preempted node rejoins the run).
- All servers down at once -> UserError naming every URL and why; committed units stay (each was written
  atomically when it finished), so a rerun resumes.
"""

from __future__ import annotations

import collections
import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any

from dflash.core.errors import UserError
from dflash.core.params import GenerateParams
from dflash.generate.contract import Unit, WorkerConfig
from dflash.generate.dispatch import DispatchResult, EngineStats, progress_bars
from dflash.generate.servers import ServerError, check_servers, complete, healthy, local_servers
from dflash.generate.turns import Request, TurnBook

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 30.0
REPROBE_S = 30.0  # seconds between probes of a server marked down


def backoff_s(attempts: int) -> float:
    """Seconds before retry number `attempts` (1, 2, ...): 1, 2, 4 ... capped at 30."""
    return min(MAX_BACKOFF_S, 0.5 * 2**attempts)


@dataclass
class Server:
    index: int
    url: str
    version: str
    pool: ThreadPoolExecutor
    inflight: int = 0
    down: str = ""  # why it was marked down ("" = healthy)
    down_since: float = 0.0  # when it was marked down or last probed
    probe: Future | None = None  # a probe of a down server in flight
    stats: EngineStats = field(default_factory=EngineStats)


class ServersDispatcher:
    """Runs units over the servers at `urls` (see the module docstring); `run()` returns DispatchResult."""

    def __init__(
        self,
        units: list[Unit],
        cfg: WorkerConfig,
        g: GenerateParams,
        urls: dict[str, str],  # url -> engine version (dflash.generate.servers.check_servers)
        model: str,  # the served model id requests name
        tokenizer: Any,
        total_prompts: int,
        done: int,
    ):
        self.g, self.model = g, model
        self.units = list(units)
        self.total_prompts, self.done_prompts = total_prompts, done
        cap = g.max_num_seqs
        self.servers = [
            Server(i, u, v, ThreadPoolExecutor(max_workers=cap, thread_name_prefix=f"server{i}"))
            for i, (u, v) in enumerate(urls.items())
        ]
        for s in self.servers:
            s.stats.ready_at = time.time()
        self.book = TurnBook(cfg, tokenizer, next(iter(urls.values()), ""), on_row=self._on_row)
        self.ready: collections.deque[Request] = collections.deque()
        self.delayed: list[tuple[float, Request]] = []  # (not before, request): backoff
        self.inflight: dict[Future, tuple[Server, Request]] = {}
        self.failed: list[dict] = []
        self.tokens = 0
        self.last_done: float | None = None

    def _on_row(self, r: dict) -> None:
        self.bar.update(1)
        self.tokens += r["num_completion_tokens"]

    def live(self) -> list[Server]:
        return [s for s in self.servers if not s.down]

    def open_units(self) -> None:
        cap = self.g.max_num_seqs * max(1, len(self.live()))
        while self.units and len(self.ready) + len(self.inflight) + len(self.delayed) < 2 * cap:
            unit = self.units.pop(0)
            self.ready.extend(self.book.start_unit(unit))
            self.commit()  # units whose every prompt was skipped

    def commit(self) -> None:
        for _uidx, _rows, _tokens in self.book.commit_finished():
            self.last_done = time.time()

    def send(self) -> None:
        now = time.time()
        due = [r for t, r in self.delayed if t <= now]
        self.delayed = [(t, r) for t, r in self.delayed if t > now]
        self.ready.extendleft(reversed(due))
        while self.ready:
            free = [s for s in self.live() if s.inflight < self.g.max_num_seqs]
            if not free:
                return
            server = min(free, key=lambda s: s.inflight)
            req = self.ready.popleft()
            server.inflight += 1
            self.inflight[server.pool.submit(complete, server.url, req, self.g, self.model)] = (server, req)

    def mark_down(self, server: Server, why: str) -> None:
        if not server.down:
            server.down, server.down_since = why, time.time()
            log.warning("server %s marked down: %s (probed again every %.0f s)", server.url, why, REPROBE_S)
            self.engine_bars[server.index].set_description_str(f"  {server.url} DOWN")

    def _back_up(self, url: str) -> str | None:
        """In a pool thread: the engine version of the down server at `url` if it answers /health and still
        serves the expected model (it may have restarted on another vLLM), else None."""
        if not healthy(url):
            return None
        try:
            return check_servers([url], self.model, self.g)[url]
        except UserError as exc:
            log.warning("server %s answers again but is refused: %s", url, exc)
            return None

    def reprobe(self) -> None:
        """Start a probe of each down server due one; a server whose probe succeeded is back in use."""
        now = time.time()
        for s in self.servers:
            if not s.down:
                continue
            if s.probe is None:
                if now - s.down_since >= REPROBE_S:
                    s.probe = s.pool.submit(self._back_up, s.url)
                continue
            if not s.probe.done():
                continue
            version = s.probe.result() if s.probe.exception() is None else None
            s.probe, s.down_since = None, time.time()
            if version is not None:
                log.warning("server %s is back (was down: %s)", s.url, s.down)
                s.down, s.version = "", version
                self.engine_bars[s.index].set_description_str(f"  {s.url}")

    def fail_unit(self, req: Request, why: str) -> None:
        unit = self.book.units[req.unit]["unit"]
        log.warning("unit %d failed after %d attempts: %s", req.unit, req.attempts, why)
        self.failed.append(
            {"unit": req.unit, "name": unit.name, "attempts": req.attempts, "exit_code": None, "error": why}
        )
        gone = set(self.book.drop_unit(req.unit))
        self.ready = collections.deque(r for r in self.ready if r.sid not in gone)
        self.delayed = [(t, r) for t, r in self.delayed if r.sid not in gone]

    def on_done(self, fut: Future) -> None:
        server, req = self.inflight.pop(fut)
        server.inflight -= 1
        if req.sid not in self.book.requests:  # its unit failed meanwhile
            return
        try:
            out = fut.result()
        except ServerError as exc:
            if exc.down or not healthy(server.url):
                self.mark_down(server, exc.reason if exc.down else f"{exc.reason}; then /health failed")
                self.ready.appendleft(req)  # the server failed, not the request
                return
            req.attempts += 1
            if req.attempts > self.g.max_unit_retries:
                self.fail_unit(req, str(exc))
                return
            log.info("request %s failed (%s): retry %d in %.1f s", req.sid, exc, req.attempts, backoff_s(req.attempts))
            self.delayed.append((time.time() + backoff_s(req.attempts), req))
            return
        n = len(out["token_ids"])
        server.stats.prompts += 1
        server.stats.output_tokens += n
        server.stats.last_done = time.time()
        self.engine_bars[server.index].update(1)
        nxt = self.book.complete(req.sid, out["token_ids"], out["text"], out["finish_reason"], server.version)
        if nxt is not None:
            self.ready.appendleft(nxt)  # the conversation's next turn goes first
        self.commit()
        elapsed = max(1e-9, time.time() - self.t_start)
        self.bar.set_postfix_str(f"{self.tokens / elapsed:.0f} tok/s", refresh=False)

    def run(self) -> DispatchResult:
        self.bar, self.engine_bars = progress_bars(
            self.total_prompts, len(self.servers), self.done_prompts, [s.url for s in self.servers]
        )
        self.t_start = time.time()
        try:
            while True:
                if not self.live():
                    raise UserError(
                        "generate: every server is down ("
                        + "; ".join(f"{s.url}: {s.down}" for s in self.servers)
                        + "). Units committed so far are kept; restart the servers and re-run to finish."
                    )
                self.reprobe()
                self.open_units()
                self.send()
                if not (self.inflight or self.ready or self.delayed or self.units or self.book.units):
                    break
                timeout = 1.0
                if self.delayed:
                    timeout = max(0.01, min(timeout, min(t for t, _ in self.delayed) - time.time()))
                for s in self.servers:  # wake for a probe that is due or has been answered
                    if s.down:
                        due = 0.05 if s.probe is not None else s.down_since + REPROBE_S - time.time()
                        timeout = max(0.01, min(timeout, due))
                if self.inflight:
                    done, _ = wait_futures(list(self.inflight), timeout=timeout, return_when=FIRST_COMPLETED)
                    for fut in done:
                        self.on_done(fut)
                else:
                    time.sleep(timeout)
        finally:
            for s in self.servers:
                s.pool.shutdown(wait=False, cancel_futures=True)
            self.bar.close()
            for b in self.engine_bars:
                b.close()
        return DispatchResult(
            failed_units=self.failed,
            engine_start_s=[],
            per_engine={s.index: s.stats for s in self.servers},
            tokens_this_session=self.tokens,
            gen_wall_s=(self.last_done or time.time()) - self.t_start,
            wall_s=time.time() - self.t_start,
        )


def server_kwargs(cfg: WorkerConfig) -> dict:
    """What a local server takes from the run besides `generate` (dflash.generate.servers.server_command)."""
    return {"seed": cfg.seed, "revision": cfg.revision, "trust_remote_code": cfg.trust_remote_code}


def serve(
    units: list[Unit], cfg: WorkerConfig, g: GenerateParams, total_prompts: int, done: int, model: str
) -> DispatchResult:
    """The servers backend: `g.server_urls`, or `g.num_engines` local servers started (and stopped) here;
    each server's model identity checked before the first request."""
    from dflash.core.hf import load_tokenizer

    tokenizer = load_tokenizer(cfg.model, cfg.trust_remote_code, cfg.revision)
    if g.server_urls:
        versions = check_servers(list(g.server_urls), model, g)
        return ServersDispatcher(units, cfg, g, versions, model, tokenizer, total_prompts, done).run()
    with local_servers(g, cfg.model, model, **server_kwargs(cfg)) as servers:
        versions = check_servers([s["url"] for s in servers], model, g)
        result = ServersDispatcher(units, cfg, g, versions, model, tokenizer, total_prompts, done).run()
        result.engine_start_s = [s["start_s"] for s in servers]
        return result
