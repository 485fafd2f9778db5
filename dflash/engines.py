"""vLLM engine processes: engine arguments from params, device pinning, and a clean shutdown.

Shared by the generate and eval stages (the only two that run vLLM). vLLM starts engine-core child
processes of its own; a worker that exits through multiprocessing's normal exit hook would wait on
them forever, and a killed worker would orphan them, so workers end through `shutdown_engine`, and
the parent kills whole process trees with `kill_tree`.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from dflash.config import GenerateParams


def engine_kwargs(g: GenerateParams, model: str, revision: str, seed: int, trust_remote_code: bool) -> dict:
    kw = {
        "model": model,
        "tokenizer": model,
        "revision": revision or None,
        "dtype": g.dtype,
        "quantization": g.quantization or None,
        "tensor_parallel_size": g.tensor_parallel_size,
        "max_model_len": g.max_model_len,
        "max_num_seqs": g.max_num_seqs,
        "max_num_batched_tokens": g.max_num_batched_tokens,
        "gpu_memory_utilization": g.gpu_memory_utilization,
        "enable_prefix_caching": g.enable_prefix_caching,
        "enforce_eager": g.enforce_eager,
        "seed": seed,
        "trust_remote_code": trust_remote_code,
        "disable_log_stats": True,
    }
    return kw


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


# ------------------------------------------------------------------------------- dispatcher


def kill_tree(pid: int) -> None:
    """Kill a worker and every process it started (vLLM engine cores), so nothing is left running."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    kill_procs(procs)


def kill_procs(procs: list) -> None:
    """Kill psutil processes noted earlier (psutil checks the start time, so a reused pid is spared)."""
    import psutil

    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(procs, timeout=10)


def device_groups(num_engines: int, tp: int) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES for each engine (None on CPU machines: nothing to pin)."""
    try:
        import torch

        n = torch.cuda.device_count()
    except Exception:
        n = 0
    if n == 0:
        return [None] * num_engines
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",")] if visible else [str(i) for i in range(n)]
    if len(ids) < num_engines * tp:
        raise ValueError(
            f"generate.num_engines={num_engines} x generate.tensor_parallel_size={tp} needs "
            f"{num_engines * tp} GPUs, {len(ids)} visible"
        )
    return [",".join(ids[i * tp : (i + 1) * tp]) for i in range(num_engines)]
