"""Generate dispatcher: keeps `generate.num_engines` worker processes fed with work units, tracks which
unit each worker holds, restarts a worker whose engine died and retries its units alone (so a bad unit
cannot fail innocent ones), and shows progress bars per engine and in total (prompts, tok/s, ETA).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import sys
import time

from dflash.config import GenerateParams
from dflash.engines import device_groups, kill_tree
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
    outbox = ctx.Queue()
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
        # Not daemonic: vLLM starts its own engine-core processes, which daemonic processes may not.
        proc = ctx.Process(target=worker_main, args=(i, {**cfg, "devices": devices[i]}, inbox, outbox))
        proc.start()
        workers[i] = {"proc": proc, "inbox": inbox, "held": {}, "ready": False, "alone": False, "closed": False}

    def feed(i: int) -> None:
        w = workers[i]
        if not w["ready"] or w["closed"]:
            return
        while pending and len(w["held"]) < 2 and not w["alone"]:
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

    for i in range(g.num_engines):
        spawn(i)
    try:
        while workers:
            try:
                msg = outbox.get(timeout=1.0)
            except queue.Empty:
                msg = None
            if msg is not None:
                kind, i = msg[0], msg[1]
                if kind == "ready":
                    workers[i]["ready"] = True
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
                    del workers[i]
                    continue
            # Dead workers: retry their units alone, or give up on them.
            for i, w in list(workers.items()):
                if w["proc"].is_alive() or w["proc"].exitcode == 0:
                    continue
                code = w["proc"].exitcode
                held = list(w["held"].values())
                log.warning("engine %d died (exit code %s) holding units %s", i, code, [u.index for u in held])
                kill_tree(w["proc"].pid)
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
            kill_tree(w["proc"].pid)
        bar.close()
        for b in engine_bars:
            b.close()
    stats["failed_units"] = failed
    stats["tokens_this_session"] = tokens
    stats["gen_wall_s"] = time.time() - (first_ready or t_start)
    stats["wall_s"] = time.time() - t_start
    return stats


# ------------------------------------------------------------------------------- stage
