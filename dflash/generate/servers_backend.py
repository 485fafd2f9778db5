"""The `servers` backend's dispatcher: the generate stage as an asynchronous client of OpenAI-compatible servers.

One process, one event loop, one aiohttp session (dflash/generate/endpoint.py). A `TurnBook`
(dflash/generate/turns.py, shared with the engines worker) renders the turns and commits unit shards; this
module moves requests and judges the servers by what they do:
- Load: each serving server holds at most `generate.max_num_seqs` requests in flight; units are opened while
  fewer than 2 x the total capacity of requests wait, so the servers' batches stay full across unit boundaries;
  a conversation's next turn goes to the front of the queue the moment its previous turn returns (turn order
  kept: a conversation has one request at a time).
- Replies are validated before anything of them is stored (dflash.generate.servers.parse_reply): token ids
  inside the target's vocabulary, at most max_tokens, a known finish reason, the prompt echo. A bad reply is a
  failure of the server that sent it.
- A server that cannot be reached is down at once. A failed request (timeout, reset, HTTP 5xx, a bad reply)
  first asks the server's /health (one check a second per server at most): failing -> down. Otherwise the
  failure counts on the server (dflash/generate/health.py: failures in a row, a failure share over a window;
  timeouts count) and against the request. A server found sick is quarantined like a down one.
- Down or quarantined: the server's in-flight and queued requests move to the others and what they were charged
  there is refunded (the server failed, not the request). Every REPROBE_S s it is probed again: /health, the
  model identity check, then a real one-token completion, validated; it rejoins only when all three pass.
- HTTP 429, or 503 with Retry-After: the server is left alone that long; not a failure, the request is not
  charged (a server that does nothing but back off for longer than a request's timeout is quarantined).
- A charged request is retried after min(30, 0.5 x 2^tries) s on a server it has not failed on when there is
  one; past `generate.request_retries` retries it is a failed turn (TurnBook.fail: reason `request_failed`,
  the error of every try kept for reports/generate_details.json), its conversation's later turns are skipped,
  and the rest of its unit is committed as usual. A rerun asks again for exactly those turns.
- The run stops only when no server can serve: every one down or quarantined and each probed once since (at
  once when none is left): a UserError naming every URL and its last error. Committed units stay (each was
  written atomically when it finished), so a rerun resumes.
- `generate.server_registry` (dflash/generate/registry.py): the servers are what the registry folder lists,
  re-read every registry.POLL_S s. A URL that appears is probed like a down server and then served; one that
  leaves is withdrawn: no new requests, its in-flight ones finish there or, failing there, move to the others
  uncharged. With a registry the run never stops for want of servers: it waits for the registry to list one.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash.core.errors import UserError
from dflash.core.params import GenerateParams
from dflash.generate.contract import DispatchResult, EngineStats, Unit, WorkerConfig
from dflash.generate.endpoint import Endpoint, new_session, run_async
from dflash.generate.health import HealthRules, ServerHealth
from dflash.generate.progress import Progress
from dflash.generate.registry import ServerRegistry, changes
from dflash.generate.servers import Completion, ServerError, local_servers
from dflash.generate.turns import Request, TurnBook

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 30.0
REPROBE_S = 30.0  # seconds between probes of a server that is down or quarantined
HEALTH_REUSE_S = 1.0  # a /health answer younger than this is reused by the next failure on that server
PROBE_PROMPT = [{"role": "user", "content": "Hello"}]  # the probe's one-token completion
JOINING = "joined from the registry"  # a new registry server's reason for being out of rotation until probed


def backoff_s(attempts: int) -> float:
    """Seconds before retry number `attempts` (1, 2, ...): 1, 2, 4 ... capped at 30."""
    return min(MAX_BACKOFF_S, 0.5 * 2**attempts)


@dataclass
class Server:
    """The client's view of one server."""

    index: int
    url: str
    endpoint: Endpoint
    health: ServerHealth
    version: str = ""
    inflight: dict[str, tuple[asyncio.Task, Request]] = field(default_factory=dict)  # by sample id
    down: str = ""  # why it is out of rotation (unreachable, /health failing, quarantined); "" = serving
    down_since: float = 0.0  # when it went down or was last probed
    probed: bool = False  # a probe failed since it went down
    last_error: str = ""  # what its last failed request or probe got
    probe: asyncio.Task | None = None
    health_check: asyncio.Task | None = None  # a /health check in flight, shared by concurrent failures
    health_at: float = float("-inf")  # when the last /health check answered
    health_ok: bool = True
    stats: EngineStats = field(default_factory=EngineStats)
    withdrawn: bool = False  # its registry file is gone: draining (no new requests, never probed)


class ServersDispatcher:
    """Runs units over the servers at `urls` (see the module docstring); `run()` returns DispatchResult."""

    def __init__(
        self,
        units: list[Unit],
        cfg: WorkerConfig,
        g: GenerateParams,
        *,
        urls: list[str],  # base URLs (a dict's keys are taken)
        model: str,  # the served model id requests name
        tokenizer: Any,
        total_prompts: int,
        done: int,
        progress: Progress | None = None,  # bars opened while local servers started (serve())
        registry: ServerRegistry | None = None,  # generate.server_registry: servers join and leave
    ):
        self.cfg, self.g, self.model, self.tokenizer = cfg, g, model, tokenizer
        self.urls = list(urls)
        self.registry = registry
        self.waiting_since = 0.0  # a registry run with no server serving: when the last "waiting" line went out
        self.units = list(units)
        self.rules = HealthRules.of(g)
        self.progress = progress or Progress("generate (all)", total_prompts, done, self.urls, "checking servers")
        self.book = TurnBook(cfg, tokenizer, "", on_row=self._on_row)
        self.ready: collections.deque[Request] = collections.deque()
        self.delayed: list[tuple[float, Request]] = []  # (not before, request): backoff
        self.servers: list[Server] = []
        self.tokens = 0
        self.completions = 0
        self.closing = False  # the run is ending: cancelled requests must not send new ones
        self.last_done: float | None = None

    # ------------------------------------------------------------------------------------------ bookkeeping

    def _on_row(self, r: dict) -> None:
        self.progress.update(1, tokens=r["num_completion_tokens"])
        self.tokens += r["num_completion_tokens"]

    def serving(self) -> list[Server]:
        return [s for s in self.servers if not s.down and not s.withdrawn]

    def in_flight(self) -> int:
        return sum(len(s.inflight) for s in self.servers)

    def open_units(self) -> None:
        cap = self.g.max_num_seqs * max(1, len(self.serving()))
        while self.units and len(self.ready) + self.in_flight() + len(self.delayed) < 2 * cap:
            self.ready.extend(self.book.start_unit(self.units.pop(0)))
            self.commit()  # units whose every prompt was skipped
            self.send()  # the servers start on this unit while the next ones are rendered

    def commit(self) -> None:
        if self.book.commit_finished():
            self.last_done = time.time()

    def finished(self) -> bool:
        return not (self.in_flight() or self.ready or self.delayed or self.units or self.book.units)

    # ------------------------------------------------------------------------------------------ sending

    def _pick(self, req: Request, free: list[Server]) -> Server | None:
        """The least loaded free server `req` has not failed on; one it has failed on only when every serving
        server is one of those (a retry goes elsewhere when there is an elsewhere); None: wait."""
        tried = {url for url, _ in req.charges}
        if not tried:
            return min(free, key=lambda s: len(s.inflight))
        fresh = [s for s in free if s.url not in tried]
        if fresh:
            return min(fresh, key=lambda s: len(s.inflight))
        if any(s.url not in tried for s in self.serving()):
            return None  # a server it has not failed on is busy or paused: wait for it
        return min(free, key=lambda s: len(s.inflight))

    def send(self) -> None:
        now = time.time()
        if self.delayed:
            due = [r for t, r in self.delayed if t <= now]
            self.delayed = [(t, r) for t, r in self.delayed if t > now]
            self.ready.extendleft(reversed(due))
        cap = self.g.max_num_seqs
        free = [s for s in self.serving() if len(s.inflight) < cap and s.health.paused_until <= now]
        waiting: list[Request] = []
        while self.ready and free:
            req = self.ready.popleft()
            server = self._pick(req, free)
            if server is None:
                waiting.append(req)
                continue
            task = asyncio.get_running_loop().create_task(self._attempt(server, req))
            server.inflight[req.sid] = (task, req)
            if len(server.inflight) >= cap:
                free.remove(server)
        self.ready.extendleft(reversed(waiting))

    async def _attempt(self, server: Server, req: Request) -> None:
        try:
            out = await server.endpoint.complete(req)
        except ServerError as exc:
            await self._failed(server, req, exc)
        else:
            self._succeeded(server, req, out)
        finally:
            entry = server.inflight.get(req.sid)
            if entry is not None and entry[0] is asyncio.current_task():
                del server.inflight[req.sid]
            if not self.closing:  # refill the slot now, not when the main loop next runs (keeps servers full)
                self.open_units()
                self.send()
            self.wake.set()

    def _succeeded(self, server: Server, req: Request, out: Completion) -> None:
        server.health.success()
        n = len(out.token_ids)
        server.stats.prompts += 1
        server.stats.output_tokens += n
        server.stats.last_done = time.time()
        self.completions += 1
        self.progress.engines[server.index].update(1)
        nxt = self.book.complete(req.sid, out.token_ids, out.text, out.finish_reason, server.version)
        if nxt is not None:
            self.ready.appendleft(nxt)  # the conversation's next turn goes first
        self.commit()

    async def _failed(self, server: Server, req: Request, exc: ServerError) -> None:
        server.last_error = exc.reason
        if exc.unreachable or server.withdrawn:  # a withdrawn server's failures are its leaving, not the request's
            self.take_down(server, exc.reason)
            return
        if exc.retry_after is not None:
            why = server.health.throttle(exc.retry_after, time.time())
            if why:
                self.take_down(server, f"quarantined: {why}; last: {exc.reason}")
            else:
                self.ready.appendleft(req)  # not charged: the server asked for time, the request did nothing wrong
            return
        if not await self._health_ok(server):
            self.take_down(server, f"{exc.reason}; then /health failed")
            return
        if server.down:  # taken down while /health was asked: its requests (this one too) have moved
            return
        why = server.health.failure()
        if why:
            self.take_down(server, f"quarantined after {why}; last: {exc.reason}")
            return
        req.charges.append((server.url, exc.reason))
        if len(req.charges) > self.g.request_retries:
            tries = "; ".join(f"{url}: {reason}" for url, reason in req.charges)
            log.warning("turn %s failed on %d tries: %s", req.sid, len(req.charges), tries)
            self.book.fail(req.sid, "request_failed", f"{len(req.charges)} tries failed: {tries}")
            self.commit()
            return
        wait = backoff_s(len(req.charges))
        log.info("request %s failed (%s): retry %d in %.1f s", req.sid, exc, len(req.charges), wait)
        self.delayed.append((time.time() + wait, req))

    async def _health_ok(self, server: Server) -> bool:
        """GET /health of `server`, shared by the failures that arrive together and reused for HEALTH_REUSE_S."""
        if time.time() - server.health_at < HEALTH_REUSE_S:
            return server.health_ok
        if server.health_check is None:
            server.health_check = asyncio.get_running_loop().create_task(server.endpoint.healthy())

            def answered(task: asyncio.Task) -> None:
                server.health_check, server.health_at = None, time.time()
                server.health_ok = not task.cancelled() and task.exception() is None and task.result()

            server.health_check.add_done_callback(answered)
        return await asyncio.shield(server.health_check)  # a cancelled waiter must not cancel the others' check

    def take_down(self, server: Server, why: str) -> None:
        """Out of rotation: its in-flight requests move to the others, and nothing it charged a request counts."""
        if server.down:
            return
        server.down, server.down_since, server.probed = why, time.time(), False
        log.warning("server %s out of rotation: %s (probed again every %.0f s)", server.url, why, REPROBE_S)
        self.progress.label(server.index, "DOWN")
        moved = list(server.inflight.values())
        server.inflight.clear()
        current = asyncio.current_task()
        for task, req in moved:
            if task is not current:
                task.cancel()
            self.ready.appendleft(req)
        pending = [
            *self.ready,
            *(r for _, r in self.delayed),
            *(r for s in self.servers for _, r in s.inflight.values()),
        ]
        for req in pending:
            if any(url == server.url for url, _ in req.charges):
                req.charges = [(url, reason) for url, reason in req.charges if url != server.url]

    def sync_registry(self, session) -> None:
        """Apply the registry's changes (when a read is due): new servers join out of rotation and are probed at
        once; withdrawn ones drain; a withdrawn one listed again is served again (a down one is probed first)."""
        listed = self.registry.poll() if self.registry is not None else None
        if listed is None:
            return
        by_url = {s.url: s for s in self.servers}
        active = {u for u, s in by_url.items() if not s.withdrawn}
        change = changes(listed, active, set(by_url) - active)
        now = time.time()
        for url, name in change.joined.items():
            endpoint = Endpoint(session, url, self.g, self.model, self.cfg.vocab_size)
            server = Server(len(self.servers), url, endpoint, ServerHealth(self.rules), down=f"{JOINING} ({name})")
            server.down_since = now - REPROBE_S  # probed at once
            self.servers.append(server)
            self.progress.add(url)
            log.warning("server %s joins from the registry (%s)", url, name)
        for url in change.returned:
            server = by_url[url]
            server.withdrawn, server.down_since, server.probed = False, now - REPROBE_S, False
            log.warning("server %s is listed again in the registry", url)
        for url in change.withdrawn:
            server = by_url[url]
            server.withdrawn = True
            self.progress.label(server.index, "WITHDRAWN")
            log.warning("server %s left the registry: draining its %d in-flight requests", url, len(server.inflight))

    # ------------------------------------------------------------------------------------------ probing

    async def _probe(self, server: Server) -> None:
        """/health, the model identity check, then a validated one-token completion: back in rotation if all pass."""
        try:
            if not await server.endpoint.healthy():
                raise ServerError(server.url, "/health does not answer 200")
            version = await server.endpoint.identify()
            await server.endpoint.complete(self.probe_request, max_tokens=1)
        except (ServerError, UserError) as exc:
            server.last_error = exc.reason if isinstance(exc, ServerError) else str(exc)
            server.probed, server.down_since = True, time.time()
            log.info("server %s still out of rotation: %s", server.url, server.last_error)
        else:
            if server.down.startswith(JOINING):
                log.warning("server %s is serving (%s)", server.url, server.down)
            else:
                log.warning("server %s is back (was out of rotation: %s)", server.url, server.down)
            server.down, server.version, server.probed = "", version, False
            server.health.clear()
            self.progress.engine_up(server.index)
        finally:
            server.probe = None
            self.wake.set()

    def reprobe(self) -> None:
        """Start the probes that are due: every REPROBE_S s, at once when no server is serving."""
        now, none_serving = time.time(), not self.serving()
        for s in self.servers:
            if s.withdrawn:
                continue
            if s.down and s.probe is None and (now - s.down_since >= REPROBE_S or (none_serving and not s.probed)):
                s.probe = asyncio.get_running_loop().create_task(self._probe(s))

    def check_can_serve(self) -> None:
        if self.serving() or any(not s.probed for s in self.servers):
            return
        if self.registry is not None:  # servers may still join: wait, and say so once a minute
            if time.time() - self.waiting_since >= 60:
                self.waiting_since = time.time()
                log.warning("generate: no server serving; waiting for %s to list one", self.registry.folder)
            return
        raise UserError(
            "generate: no server can serve, every server is down or quarantined ("
            + "; ".join(self._why(s) for s in self.servers)
            + "). Rows committed so far are kept; fix or replace the servers and re-run to finish."
        )

    @staticmethod
    def _why(s: Server) -> str:
        def gist(text: str) -> str:  # the same fault at another position is the same fault
            return re.sub(r"position \d+", "", text)

        probe = s.last_error if s.last_error and gist(s.last_error) not in gist(s.down) else ""
        return f"{s.url}: {s.down}" + (f"; probed again: {probe}" if probe else "")

    def _deadline(self) -> float:
        """Seconds until something is due without a request answering: a backoff, a pause's end, a probe."""
        now, timeout = time.time(), 1.0
        if self.delayed:
            timeout = min(timeout, min(t for t, _ in self.delayed) - now)
        if self.ready:
            paused = [s.health.paused_until for s in self.serving() if s.health.paused_until > now]
            timeout = min(timeout, *(t - now for t in paused)) if paused else timeout
        for s in self.servers:
            if s.down and s.probe is None:
                timeout = min(timeout, s.down_since + REPROBE_S - now)
        return max(0.005, timeout)

    # ------------------------------------------------------------------------------------------ the run

    async def _join(self, server: Server) -> None:
        """The model identity check at the start: a mismatch stops the run (UserError); a server that does not
        answer starts out of rotation and is probed like a down one."""
        try:
            server.version = await server.endpoint.identify()
        except ServerError as exc:
            server.last_error = exc.reason
            self.take_down(server, exc.reason)
            server.probed = True
        else:
            self.progress.engine_up(server.index)

    async def _run(self) -> DispatchResult:
        from dflash.core.chat import render_ids

        self.wake = asyncio.Event()
        ids = render_ids(self.tokenizer, PROBE_PROMPT, True, self.cfg.template_kwargs)
        self.probe_request = Request("probe", -1, ids, 0)
        t_start = time.time()
        async with new_session(self.g) as session:
            self.servers = [
                Server(
                    i, url, Endpoint(session, url, self.g, self.model, self.cfg.vocab_size), ServerHealth(self.rules)
                )
                for i, url in enumerate(self.urls)
            ]
            try:
                await asyncio.gather(*(self._join(s) for s in self.servers))
                for s in self.servers:
                    s.stats.ready_at = time.time()
                self.t_start = time.time()
                while True:
                    if self.registry is not None:
                        self.sync_registry(session)
                    self.check_can_serve()
                    self.reprobe()
                    self.open_units()
                    self.send()
                    if self.finished():
                        break
                    self.wake.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.wake.wait(), self._deadline())
            finally:
                self.closing = True
                tasks = [t for s in self.servers for t, _ in s.inflight.values()]
                tasks += [t for s in self.servers for t in (s.probe, s.health_check) if t is not None]
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        return DispatchResult(
            failed_units=[],
            engine_start_s=[],
            per_engine={s.index: s.stats for s in self.servers},
            tokens_this_session=self.tokens,
            gen_wall_s=(self.last_done or time.time()) - self.t_start,
            wall_s=time.time() - t_start,
            failed_turns=self.book.failed_turns,
        )

    def run(self) -> DispatchResult:
        try:
            return run_async(self._run())
        finally:
            self.progress.close()


def server_kwargs(cfg: WorkerConfig) -> dict:
    """What a local server takes from the run besides `generate` (dflash.generate.servers.server_command)."""
    return {"seed": cfg.seed, "revision": cfg.revision, "trust_remote_code": cfg.trust_remote_code}


def run_servers(
    units: list[Unit], cfg: WorkerConfig, g: GenerateParams, *, total_prompts: int, done: int, model: str
) -> DispatchResult:
    """The servers backend: the servers `g.server_registry` lists, `g.server_urls`, or `g.num_engines` local servers
    started (and stopped) here; each server's model identity checked before its first request. The bars open first
    and say what is starting."""
    from dflash.core.hf import load_tokenizer

    tokenizer = load_tokenizer(cfg.model, cfg.trust_remote_code, cfg.revision)

    def dispatcher(urls: list[str], progress: Progress, registry: ServerRegistry | None = None) -> ServersDispatcher:
        return ServersDispatcher(
            units,
            cfg,
            g,
            urls=urls,
            model=model,
            tokenizer=tokenizer,
            total_prompts=total_prompts,
            done=done,
            progress=progress,
            registry=registry,
        )

    if g.server_registry:
        registry = ServerRegistry(Path(g.server_registry))
        progress = Progress("generate (all)", total_prompts, done, [], f"servers from {g.server_registry}")
        return dispatcher([], progress, registry).run()
    if g.server_urls:
        progress = Progress("generate (all)", total_prompts, done, list(g.server_urls), "checking servers")
        return dispatcher(list(g.server_urls), progress).run()
    labels = [f"local server {i}" for i in range(g.num_engines)]
    progress = Progress("generate (all)", total_prompts, done, labels, f"starting {g.num_engines} local server(s)")
    try:
        with local_servers(g, cfg.model, model, on_wait=progress.tick, **server_kwargs(cfg)) as servers:
            progress.labels = [s["url"] for s in servers]
            result = dispatcher([s["url"] for s in servers], progress).run()
            result.engine_start_s = [s["start_s"] for s in servers]
            return result
    finally:
        progress.close()
