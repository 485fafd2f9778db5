"""The `engines` backend's dispatcher: keeps `generate.num_engines` worker processes fed with work units,
tracks which unit each worker holds and which of its requests are in the engine, restarts a worker whose engine
died, and shows progress bars per engine and in total (dflash/generate/progress.py: the clock starts when the
first engine is up).

An engine death loses nothing made before it: every finished row comes back to the dispatcher (RowDone) and a
retried unit starts from them (Unit.done_rows). The units the dead worker held are retried alone. A unit whose
engine dies a second time is searched for the request that kills it: the requests that were in the engine at
the death become its suspects, which the next worker runs after everything else, half of them at a time, so
each further death halves the suspects; a death with one request in the engine records that request as a failed
turn (reason `engine_died`, its conversation's later turns skipped) and every other prompt of the unit is
generated. A death with no request in the engine (the unit's start, the worker itself) counts against
`generate.unit_retries`; past it the unit fails whole, as does a unit past MAX_SEARCH_DEATHS more deaths. An engine
that dies before it is up counts against `generate.engine_start_retries`; past it the stage stops (a UserError).

Each worker reports on its own one-way pipe, never on a queue shared with the others: a worker that dies
in the middle of a write (OOM kill, segfault) would otherwise leave a shared queue's lock held and
every later worker blocked on it. A dead worker's pipe just reads EOF, after the messages it did send.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_readable
from typing import Any

from dflash.core.errors import UserError
from dflash.core.params import GenerateParams
from dflash.core.processes import kill_procs, kill_tree
from dflash.generate.contract import (
    DispatchResult,
    EngineStats,
    Exited,
    Ready,
    RowDone,
    Submitted,
    Unit,
    UnitDone,
    WorkerConfig,
    WorkerMessage,
)
from dflash.generate.engines import device_groups
from dflash.generate.progress import Progress
from dflash.generate.worker import worker_main

log = logging.getLogger(__name__)

MAX_SEARCH_DEATHS = 64  # engine deaths one unit may cost while its poison requests are searched for


@dataclass
class WorkerHandle:
    """The dispatcher's view of one worker process."""

    proc: Any  # multiprocessing.Process
    inbox: Any  # multiprocessing.Queue of Unit (None = no more work)
    conn: Connection  # read end of the worker's pipe
    eof: bool = False  # the pipe is closed: the worker is gone or going
    engine_procs: list = field(default_factory=list)  # vLLM's engine cores, noted at start-up
    held: dict[int, Unit] = field(default_factory=dict)  # units sent and not yet committed
    in_engine: dict[int, set[str]] = field(default_factory=dict)  # unit -> its requests in the engine now
    ready: bool = False
    alone: bool = False  # holds a retried (suspect) unit, which runs alone
    closed: bool = False  # told there is no more work


class EnginesDispatcher:
    """Runs units over `g.num_engines` workers (see the module docstring); `run()` returns DispatchResult."""

    def __init__(self, units: list[Unit], cfg: WorkerConfig, g: GenerateParams, total_prompts: int, done: int):
        self.cfg, self.g = cfg, g
        self.ctx = mp.get_context("spawn")
        self.pending = list(units)  # front = next; suspects (retries) go to the front and run alone
        self.workers: dict[int, WorkerHandle] = {}
        self.failed: list[dict] = []
        self.failed_turns: list[dict] = []
        self.engine_start_s: list[float] = []
        self.per_engine = {i: EngineStats() for i in range(g.num_engines)}
        self.devices = device_groups(g.num_engines, g.tensor_parallel_size)
        self.total_prompts, self.done_prompts = total_prompts, done
        self.tokens = 0
        self.first_ready: float | None = None
        self.start_failures = 0
        # Units a worker holds at once: enough queued conversations (2 x max_num_seqs) that the engine's batch
        # stays full while a unit's last, longest requests finish and the next unit is on its way.
        self.max_held = max(2, -(-2 * g.max_num_seqs // max(1, g.unit_size)) + 1)
        n = g.num_engines
        labels = [f"engine {i}" for i in range(n)]  # (message handlers and reap() label and count on these bars)
        self.progress = Progress("generate (all)", total_prompts, done, labels, f"starting {n} engine(s)")

    def spawn(self, i: int) -> None:
        inbox = self.ctx.Queue()
        reader, writer = self.ctx.Pipe(duplex=False)
        cfg = dataclasses.replace(self.cfg, devices=self.devices[i])
        # Not daemonic: vLLM starts its own engine-core processes, which daemonic processes may not.
        proc = self.ctx.Process(target=worker_main, args=(i, cfg, inbox, writer))
        proc.start()
        writer.close()  # only the worker holds the write end: its death reads as EOF here
        self.workers[i] = WorkerHandle(proc, inbox, reader)

    def handle(self, msg: WorkerMessage) -> None:
        w, stats = self.workers[msg.engine], self.per_engine[msg.engine]
        if isinstance(msg, Ready):
            import psutil

            w.ready = True
            with contextlib.suppress(psutil.NoSuchProcess):
                w.engine_procs = psutil.Process(w.proc.pid).children(recursive=True)
            self.engine_start_s.append(round(msg.start_s, 2))
            stats.ready_at = time.time()
            self.first_ready = self.first_ready or time.time()
            self.progress.engine_up(msg.engine)
        elif isinstance(msg, Submitted):
            w.in_engine.setdefault(msg.unit, set()).update(msg.sids)
        elif isinstance(msg, RowDone):
            w.held[msg.unit].done_rows.append(msg.row)
            w.in_engine.get(msg.unit, set()).discard(msg.row["sample_id"])
            tokens = msg.row["num_completion_tokens"]
            self.progress.update(1, msg.engine, tokens)
            self.tokens += tokens
            stats.prompts += 1
            stats.output_tokens += tokens
        elif isinstance(msg, UnitDone):
            unit = w.held.pop(msg.unit)
            w.in_engine.pop(msg.unit, None)
            unit.done_rows = []  # committed: the shard holds them now
            w.alone = False
            stats.last_done = time.time()
            if unit.attempts > 0:
                log.info("unit %d done after %d engine death(s)", unit.index, unit.attempts)
        elif isinstance(msg, Exited):
            w.proc.join(timeout=60)
            w.conn.close()
            del self.workers[msg.engine]

    @staticmethod
    def discard(w: WorkerHandle) -> None:
        kill_tree(w.proc.pid)
        kill_procs(w.engine_procs)  # orphaned if the worker died before its children
        w.conn.close()
        w.inbox.cancel_join_thread()  # units queued for a dead worker are retried, not flushed
        w.inbox.close()

    def feed(self, w: WorkerHandle) -> None:
        if not w.ready or w.closed:
            return
        while self.pending and len(w.held) < self.max_held and not w.alone:
            unit = self.pending[0]
            if unit.attempts > 0 and w.held:
                break  # a suspect unit runs alone
            self.pending.pop(0)
            w.held[unit.index] = unit
            w.alone = unit.attempts > 0
            w.inbox.put(unit)
        if not self.pending and not w.held:
            w.inbox.put(None)
            w.closed = True

    def _drain(self, i: int, w: WorkerHandle) -> None:
        """Every message the worker sent before it went (rows it finished, requests it had submitted)."""
        with contextlib.suppress(EOFError, OSError):
            while i in self.workers and w.conn.poll():
                self.handle(w.conn.recv())

    def read_messages(self) -> None:
        live = {w.conn: i for i, w in self.workers.items() if not w.eof}
        ready = wait_readable(list(live), timeout=1.0) if live else []
        if not live:
            time.sleep(1.0)  # every worker is exiting: wait for the liveness check
        for conn in ready:
            i = live[conn]
            try:
                while i in self.workers and conn.poll():
                    self.handle(conn.recv())
            except (EOFError, OSError):
                self.workers[i].eof = True  # the worker is gone: the liveness check retries its units

    def _narrow(self, unit: Unit, in_engine: set[str], code: int | None) -> None:
        """After an engine death with `in_engine` requests of `unit` in it: the suspects of the next try, or the
        one request found to kill the engine (a failed turn)."""
        done = {r["sample_id"] for r in unit.done_rows}
        searching = bool(unit.suspects) or unit.attempts >= 2
        if not searching:
            log.warning(
                "unit %d: engine died with %d of its requests in it; retrying it alone", unit.index, len(in_engine)
            )
            return
        if len(in_engine) == 1:
            (sid,) = in_engine
            error = f"the engine died with this request alone in it (exit code {code}; unit {unit.index}, death {unit.attempts})"
            log.warning("unit %d: request %s kills the engine; recorded as a failed turn", unit.index, sid)
            unit.failed_turns[sid] = {"reason": "engine_died", "error": error}
            self.failed_turns.append({"sample_id": sid, "reason": "engine_died", "error": error})
            unit.suspects = [x for x in unit.suspects if x != sid and x not in done]
        else:
            unit.suspects = sorted(in_engine)
            log.warning(
                "unit %d: engine died again with %d requests in it; running them last, half at a time",
                unit.index,
                len(in_engine),
            )

    def reap(self) -> None:
        """Dead workers: retry their units (alone, searching for a poison request when they keep killing it)."""
        for i, w in list(self.workers.items()):
            if w.proc.is_alive():
                continue
            self._drain(i, w)
            if i not in self.workers:  # its Exited message was still in the pipe: a clean exit
                continue
            if w.proc.exitcode == 0 and not w.held:  # finished, its Exited message lost: not a failure
                self.discard(w)
                del self.workers[i]
                continue
            code = w.proc.exitcode
            held = list(w.held.values())
            log.warning("engine %d died (exit code %s) holding units %s", i, code, [u.index for u in held])
            self.discard(w)
            del self.workers[i]
            if not w.ready:
                self.start_failures += 1
                if self.start_failures > self.g.engine_start_retries:
                    raise UserError(
                        f"vLLM engine failed to start {self.start_failures} times (last exit code {code}); "
                        "see the engine log above (model path, memory: generate.gpu_memory_utilization)"
                    )
            for unit in held:
                unit.attempts += 1
                in_engine = w.in_engine.get(unit.index, set())
                if in_engine:
                    self._narrow(unit, in_engine, code)
                no_request = not in_engine and unit.attempts > self.g.unit_retries
                if no_request or unit.attempts > self.g.unit_retries + MAX_SEARCH_DEATHS:
                    why = "with no request in the engine" if no_request else "past the poison search's budget"
                    self.failed.append(
                        {
                            "unit": unit.index,
                            "name": unit.name,
                            "attempts": unit.attempts,
                            "exit_code": code,
                            "error": f"engine died {unit.attempts} times ({why}; last exit code {code})",
                        }
                    )
                else:
                    self.pending.insert(0, unit)
            if self.pending:
                self.spawn(i)
                self.progress.label(i, "(restarting)")

    def run(self) -> DispatchResult:
        n = self.g.num_engines
        self.t_start = time.time()
        for i in range(n):
            self.spawn(i)
        try:
            while self.workers:
                self.read_messages()
                self.reap()
                for w in list(self.workers.values()):
                    self.feed(w)
                if not self.workers and self.pending:  # every worker gone with work left (a failed spawn)
                    raise RuntimeError("all generate workers exited with work pending")
                if not self.progress.clock_started:
                    self.progress.tick()
        finally:
            for w in self.workers.values():
                self.discard(w)
            self.progress.close()
        last_done = max((e.last_done for e in self.per_engine.values() if e.last_done), default=None)
        return DispatchResult(
            failed_units=self.failed,
            engine_start_s=self.engine_start_s,
            per_engine=self.per_engine,
            tokens_this_session=self.tokens,
            gen_wall_s=(last_done or time.time()) - (self.first_ready or self.t_start),
            wall_s=time.time() - self.t_start,
            failed_turns=self.failed_turns,
        )


def run_engines(
    units: list[Unit], cfg: WorkerConfig, g: GenerateParams, *, total_prompts: int, done: int
) -> DispatchResult:
    """The engines backend: `units` over `g.num_engines` workers; timing, per-engine and failure stats."""
    return EnginesDispatcher(units, cfg, g, total_prompts, done).run()
