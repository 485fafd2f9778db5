"""Generate dispatcher: keeps `generate.num_engines` worker processes fed with work units, tracks which
unit each worker holds, restarts a worker whose engine died and retries its units alone (so a bad unit
cannot fail innocent ones), and shows progress bars per engine and in total (prompts, tok/s, ETA).

Each worker reports on its own one-way pipe, never on a queue shared with the others: a worker that dies
in the middle of a write (OOM kill, segfault) would otherwise leave a shared queue's lock held and
every later worker blocked on it. A dead worker's pipe just reads EOF.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import sys
import time
from multiprocessing.connection import wait as wait_readable

from dflash.config import GenerateParams
from dflash.engines import device_groups, kill_procs, kill_tree
from dflash.generate import Unit
from dflash.generate_worker import worker_main

log = logging.getLogger(__name__)


def progress_bars(total: int, num_engines: int, initial: int):
    from tqdm import tqdm

    interactive = sys.stderr.isatty()
    kw = {"mininterval": 0.5 if interactive else 10.0, "dynamic_ncols": True}
    bar = tqdm(total=total, initial=initial, desc="generate (all)", unit="prompt", position=0, **kw)
    engines = [
        tqdm(total=None, desc=f"  engine {i}", unit="prompt", position=i + 1, leave=False, **kw)
        for i in range(num_engines)
    ]
    return bar, engines


def dispatch(units: list[Unit], cfg: dict, g: GenerateParams, total_prompts: int, done_prompts: int) -> dict:
    """Run `units` over `g.num_engines` workers; return timing, per-engine and failure stats."""
    ctx = mp.get_context("spawn")
    pending = list(units)  # front = next; suspects (retries) go to the front and run alone
    workers: dict[int, dict] = {}
    failed: list[dict] = []
    stats = {
        "engine_start_s": [],
        "per_engine": {
            i: {"prompts": 0, "output_tokens": 0, "ready_at": None, "last_done": None} for i in range(g.num_engines)
        },
    }
    devices = device_groups(g.num_engines, g.tensor_parallel_size)
    bar, engine_bars = progress_bars(total_prompts, g.num_engines, done_prompts)
    t_start = time.time()
    tokens = 0
    first_ready = None
    start_failures = 0

    def spawn(i: int) -> None:
        inbox = ctx.Queue()
        reader, writer = ctx.Pipe(duplex=False)
        # Not daemonic: vLLM starts its own engine-core processes, which daemonic processes may not.
        proc = ctx.Process(target=worker_main, args=(i, {**cfg, "devices": devices[i]}, inbox, writer))
        proc.start()
        writer.close()  # only the worker holds the write end: its death reads as EOF here
        workers[i] = {
            "proc": proc,
            "inbox": inbox,
            "conn": reader,
            "eof": False,
            "engine_procs": [],  # vLLM's engine cores, noted at start-up: killed even if the worker is gone
            "held": {},
            "ready": False,
            "alone": False,
            "closed": False,
        }

    def handle(msg: tuple) -> None:
        nonlocal tokens, first_ready
        kind, i = msg[0], msg[1]
        if kind == "ready":
            import psutil

            workers[i]["ready"] = True
            with contextlib.suppress(psutil.NoSuchProcess):
                workers[i]["engine_procs"] = psutil.Process(workers[i]["proc"].pid).children(recursive=True)
            stats["engine_start_s"].append(round(msg[2], 2))
            stats["per_engine"][i]["ready_at"] = time.time()
            first_ready = first_ready or time.time()
        elif kind == "progress":
            bar.update(msg[2])
            engine_bars[i].update(msg[2])
            tokens += msg[3]
            stats["per_engine"][i]["prompts"] += msg[2]
            stats["per_engine"][i]["output_tokens"] += msg[3]
            elapsed = max(1e-9, time.time() - (first_ready or t_start))
            bar.set_postfix_str(f"{tokens / elapsed:.0f} tok/s", refresh=False)
        elif kind == "unit_done":
            unit = workers[i]["held"].pop(msg[2])
            workers[i]["alone"] = False
            stats["per_engine"][i]["last_done"] = time.time()
            if unit.attempts > 0:
                log.info("unit %d succeeded on retry %d", unit.index, unit.attempts)
        elif kind == "exit":
            workers[i]["proc"].join(timeout=60)
            workers[i]["conn"].close()
            del workers[i]

    def discard(w: dict) -> None:
        kill_tree(w["proc"].pid)
        kill_procs(w["engine_procs"])  # orphaned if the worker died before its children
        w["conn"].close()
        w["inbox"].cancel_join_thread()  # units queued for a dead worker are retried, not flushed
        w["inbox"].close()

    def feed(i: int) -> None:
        w = workers[i]
        if not w["ready"] or w["closed"]:
            return
        while pending and len(w["held"]) < max_held and not w["alone"]:
            unit = pending[0]
            if unit.attempts > 0 and w["held"]:
                break  # a suspect unit runs alone
            pending.pop(0)
            w["held"][unit.index] = unit
            w["alone"] = unit.attempts > 0
            w["inbox"].put(unit)
        if not pending and not w["held"]:
            w["inbox"].put(None)
            w["closed"] = True

    # Units a worker holds at once: enough queued conversations (2 x max_num_seqs) that the engine's batch
    # stays full while a unit's last, longest requests finish and the next unit is on its way.
    max_held = max(2, -(-2 * g.max_num_seqs // max(1, g.unit_size)) + 1)
    for i in range(g.num_engines):
        spawn(i)
    try:
        while workers:
            live = {w["conn"]: i for i, w in workers.items() if not w["eof"]}
            ready = wait_readable(list(live), timeout=1.0) if live else []
            if not live:
                time.sleep(1.0)  # every worker is exiting: wait for the liveness check below
            for conn in ready:
                i = live[conn]
                try:
                    while i in workers and conn.poll():
                        handle(conn.recv())
                except (EOFError, OSError):
                    workers[i]["eof"] = True  # the worker is gone: the liveness check below retries its units
            # Dead workers: retry their units alone, or give up on them.
            for i, w in list(workers.items()):
                if w["proc"].is_alive():
                    continue
                if w["proc"].exitcode == 0 and not w["held"]:  # finished, its "exit" message lost: not a failure
                    discard(w)
                    del workers[i]
                    continue
                code = w["proc"].exitcode
                held = list(w["held"].values())
                log.warning("engine %d died (exit code %s) holding units %s", i, code, [u.index for u in held])
                discard(w)
                del workers[i]
                if not w["ready"]:
                    start_failures += 1
                    if start_failures > g.max_unit_retries:
                        raise RuntimeError(
                            f"vLLM engine failed to start {start_failures} times (last exit code {code}); "
                            "see the engine log above (model path, memory: generate.gpu_memory_utilization)"
                        )
                for unit in held:
                    unit.attempts += 1
                    if unit.attempts > g.max_unit_retries:
                        failed.append(
                            {"unit": unit.index, "name": unit.name, "attempts": unit.attempts, "exit_code": code}
                        )
                    else:
                        pending.insert(0, unit)
                if pending:
                    spawn(i)
            for i in list(workers):
                feed(i)
            if not workers and pending:  # every worker gone with work left (cannot happen unless spawn failed)
                raise RuntimeError("all generate workers exited with work pending")
    finally:
        for w in workers.values():
            discard(w)
        bar.close()
        for b in engine_bars:
            b.close()
    stats["failed_units"] = failed
    stats["tokens_this_session"] = tokens
    # Generation time: first engine ready -> last unit committed (engine shutdown is not generation).
    last_done = max((e["last_done"] for e in stats["per_engine"].values() if e["last_done"]), default=None)
    stats["gen_wall_s"] = (last_done or time.time()) - (first_ready or t_start)
    stats["wall_s"] = time.time() - t_start
    return stats


# ------------------------------------------------------------------------------- stage
