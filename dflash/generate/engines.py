"""vLLM engine arguments of a generate worker, and which devices each worker's engine is pinned to."""

from __future__ import annotations

import os

from dflash.core.errors import UserError
from dflash.core.params import GenerateParams, kv_cache_bytes


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
        "kv_cache_memory_bytes": kv_cache_bytes(g.kv_cache_memory_gb),
        "enable_prefix_caching": g.enable_prefix_caching,
        "enforce_eager": g.enforce_eager,
        "seed": seed,
        "trust_remote_code": trust_remote_code,
        "disable_log_stats": True,
    }
    return kw


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
        raise UserError(
            f"generate.num_engines={num_engines} x generate.tensor_parallel_size={tp} needs "
            f"{num_engines * tp} GPUs, {len(ids)} visible"
        )
    return [",".join(ids[i * tp : (i + 1) * tp]) for i in range(num_engines)]
