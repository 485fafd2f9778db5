"""Eval: the drafter's acceptance length tau measured by the engine that serves it (real vLLM speculative
decoding), beside a PyTorch reference evaluator and baselines on the same held-out prompts.

Inputs: the exported drafter `${train.out}/drafter` (z-lab format), the target (`${base.target_dir}/target.json`),
held-out prompts `${tokenize.out}/eval/shard-*.arrow` (tokenize's eval split: prompt = input_ids[:num_prompt_tokens],
already rendered with the training template and thinking mode). Outputs (dflash/eval_report.py):
`reports/eval.json`, `reports/eval.md`, `reports/eval_acceptance.csv` (DVC plot).

Command: python -m stages.eval --params params.yaml

Engine configurations (`eval.engines`), each in its own spawned worker process with its own engine, all on
the same prompts with the same sampling settings:
  dflash     speculative_config {"method": "dflash", "model": drafter_dir, "num_speculative_tokens": B-1}
  untrained  the same with a seeded, untrained drafter of the same geometry (exported to a temp folder)
  ngram      vLLM's prompt-lookup proposer ({"method": "ngram", prompt_lookup_min / max})
  none       no speculation: the throughput baseline (speedup) and, at temperature 0, the greedy output
             that every speculative configuration must reproduce
From the engine's own counters, diffed around the timed run (a short warm-up request runs first):
tau = 1 + vllm:spec_decode_num_accepted_tokens / vllm:spec_decode_num_drafts, acceptance at position k =
vllm:spec_decode_num_accepted_tokens_per_pos[k] / drafts. tau counts only steps that carried a draft (an
n-gram step without a match has none), so each configuration also reports tokens_per_step: output tokens /
engine steps that gave the request tokens (prefill step included; 1.0 without speculation).
Throughput: output tokens / wall time of the timed run, at `eval.max_num_seqs` concurrent requests.

Only this module and dflash/generate.py import vLLM (inside the worker). Workers reuse generate's
`shutdown_engine` / `kill_tree` (dflash/engines.py): vLLM leaves engine-core child processes behind that must be killed.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.config import EvalParams, Params
from dflash.engines import kill_tree, shutdown_engine
from dflash.io import list_shards, read_arrow

log = logging.getLogger(__name__)

ENGINES = ("dflash", "untrained", "ngram", "none")
SPECULATIVE = ("dflash", "untrained", "ngram")
PROMPT_COLUMNS = ("sample_id", "input_ids", "num_prompt_tokens")
WARMUP_TOKENS = 8
COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


# ------------------------------------------------------------------------------------------ inputs


def load_prompts(folder: str | Path, num_prompts: int) -> list[dict]:
    """The first `num_prompts` (0 = all) held-out prompts in shard order: {"sample_id", "prompt_ids"}."""
    shards = list_shards(folder, "shard-*.arrow")
    if not shards:
        raise FileNotFoundError(f"{folder}: no shard-*.arrow (the tokenize stage's eval split); run tokenize first")
    prompts: list[dict] = []
    for shard in shards:
        table = read_arrow(shard)
        missing = [c for c in PROMPT_COLUMNS if c not in table.column_names]
        if missing:
            raise ValueError(f"{shard}: columns {missing} missing (expected the tokenize stage's shard schema)")
        cols = table.select(list(PROMPT_COLUMNS)).to_pydict()
        for row, (sid, ids, n) in enumerate(zip(*(cols[c] for c in PROMPT_COLUMNS), strict=True)):
            if not 0 < n <= len(ids):
                raise ValueError(f"{shard}: row {row} ({sid}): num_prompt_tokens {n} outside 1..{len(ids)} (input_ids)")
            prompts.append({"sample_id": sid, "prompt_ids": list(ids[:n])})
            if num_prompts and len(prompts) == num_prompts:
                return prompts
    return prompts


def stop_token_ids(model: str, tokenizer: Any) -> list[int]:
    """The ids that end a request: the tokenizer's eos plus the generation config's eos ids (what vLLM
    stops on). Passed explicitly to vLLM and to the reference so both stop at the same tokens."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    try:
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(model).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    if eos is not None:
        ids |= set(eos) if isinstance(eos, list) else {eos}
    return sorted(ids)


def split_by_length(prompts: list[dict], e: EvalParams, block_size: int) -> tuple[list[dict], list[str]]:
    """(kept, skipped sample ids): a prompt plus its output budget plus one block must fit max_model_len."""
    room = e.max_model_len - e.max_tokens - block_size
    kept = [p for p in prompts if len(p["prompt_ids"]) <= room]
    return kept, [p["sample_id"] for p in prompts if len(p["prompt_ids"]) > room]


# ------------------------------------------------------------------------------------------ engines


def speculative_config(kind: str, e: EvalParams, drafter_dir: str, block_size: int) -> dict | None:
    """vLLM speculative_config of an engine configuration (None = no speculation)."""
    if kind == "none":
        return None
    if kind == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": e.ngram_num_speculative_tokens or block_size - 1,
            "prompt_lookup_min": e.prompt_lookup_min,
            "prompt_lookup_max": e.prompt_lookup_max,
        }
    spec = {"method": "dflash", "model": drafter_dir, "num_speculative_tokens": block_size - 1}
    if e.draft_attention_backend:
        spec["attention_backend"] = e.draft_attention_backend
    return spec


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


def _drain(engine: Any, prompts: list[list[int]], sampling: list[Any], prefix: str) -> dict:
    """Submit every prompt at once and step the engine until all finish: tokens, steps, finish reasons."""
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
    return {"tokens": tokens, "steps": steps, "finish_reasons": finish}


def _measure(cfg: dict) -> tuple[Any, dict]:
    """Inside the worker: start the engine, warm it up, run the prompts, read the counters."""
    from vllm import LLM, SamplingParams
    from vllm import __version__ as vllm_version
    from vllm.platforms import current_platform
    from vllm.sampling_params import RequestOutputKind

    t0 = time.perf_counter()
    llm = LLM(**cfg["engine_kwargs"])
    start_s = time.perf_counter() - t0
    engine = llm.llm_engine

    def sampling(max_tokens: int, seed: int) -> Any:
        return SamplingParams(
            temperature=cfg["temperature"],
            max_tokens=max_tokens,
            seed=seed,
            stop_token_ids=cfg["stop_ids"],
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )

    prompts = cfg["prompts"]
    _drain(engine, prompts[:1], [sampling(WARMUP_TOKENS, 0)], "warmup-")
    before = read_counters(llm.get_metrics())
    t1 = time.perf_counter()
    run = _drain(engine, prompts, [sampling(cfg["max_tokens"], cfg["seed"] + i) for i in range(len(prompts))], "p-")
    wall = time.perf_counter() - t1
    after = read_counters(llm.get_metrics())
    out_tokens = sum(len(t) for t in run["tokens"])
    return llm, {
        **run,
        "counters": acceptance(before, after),
        "output_tokens": out_tokens,
        "wall_s": wall,
        "output_tokens_per_s": out_tokens / wall if wall > 0 else None,
        "tokens_per_step": out_tokens / max(1, sum(run["steps"])),
        "engine_start_s": start_s,
        "vllm_version": vllm_version,
        "platform": current_platform.device_type,
    }


def _engine_worker(cfg: dict, outbox: mp.Queue) -> None:
    """Worker process: one engine configuration, result or traceback on `outbox`, then a hard exit that
    kills vLLM's engine-core children (dflash.engines.shutdown_engine)."""
    logging.basicConfig(level=logging.WARNING)
    llm, code = None, 0
    try:
        llm, result = _measure(cfg)
        outbox.put(("done", result))
    except BaseException:
        outbox.put(("error", traceback.format_exc()))
        code = 1
    shutdown_engine(llm.llm_engine if llm is not None else None, outbox, code)


def run_engine(name: str, cfg: dict, timeout_s: float) -> dict:
    """Run one engine configuration in a spawned worker; kill it (and its children) on error or timeout."""
    ctx = mp.get_context("spawn")
    outbox = ctx.Queue()
    # Not daemonic: vLLM starts its own engine-core processes, which daemonic processes may not.
    proc = ctx.Process(target=_engine_worker, args=(cfg, outbox), name=f"eval-{name}")
    proc.start()
    deadline = time.time() + timeout_s
    msg = None
    try:
        while msg is None:
            try:
                msg = outbox.get(timeout=1.0)
            except queue.Empty:
                if not proc.is_alive():
                    raise RuntimeError(
                        f"eval engine {name!r} died (exit code {proc.exitcode}); see its log above"
                    ) from None
                if time.time() > deadline:
                    raise RuntimeError(
                        f"eval engine {name!r} took more than eval.engine_timeout_s={timeout_s:g} s; killed"
                    ) from None
        proc.join(timeout=60)
    finally:
        kill_tree(proc.pid)
    kind, payload = msg
    if kind == "error":
        raise RuntimeError(f"eval engine {name!r} failed:\n{payload}")
    return payload


# ------------------------------------------------------------------------------------------ stage


def _untrained_export(config: Any, dtype: Any, seed: int, out_dir: Path) -> Path:
    """A seeded, untrained drafter of the trained one's geometry, exported for vLLM (the tau ~ 1 baseline)."""
    import torch

    from dflash.export import save_drafter
    from dflash.model import build_drafter

    torch.manual_seed(seed)
    return save_drafter(build_drafter(config, dtype=dtype), config, out_dir)


def _reference(params: Params, info: dict, drafter_dir: str, prompts: list[dict], stop_ids: list[int]) -> dict:
    """The PyTorch reference evaluator over the same prompts (greedy); summary + per-prompt tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    from dflash.export import load_drafter
    from dflash.reference import reference_decode, summarize

    e = params.eval
    device = e.reference_device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, e.dtype)
    target = AutoModelForCausalLM.from_pretrained(
        info["model"],
        revision=info.get("revision") or None,
        dtype=dtype,
        trust_remote_code=params.base.trust_remote_code,
    ).to(device)
    target.eval()
    drafter, cfg = load_drafter(drafter_dir, target_config=target.config, device=device, dtype=dtype)
    drafter.eval()
    t0 = time.perf_counter()
    results = [
        reference_decode(target, drafter, p["prompt_ids"], e.max_tokens, stop_ids, mode=e.reference_mode)
        for p in prompts
    ]
    wall = time.perf_counter() - t0
    del target
    return {
        **summarize(results, cfg.block_size),
        "mode": e.reference_mode,
        "device": device,
        "wall_s": wall,
        "tokens": [r.tokens for r in results],
    }


@dataclass
class EvalRun:
    report: dict  # eval.json
    tokens: dict[str, list[list[int]]]  # per prompt output ids: one entry per engine, plus "reference"


def run(params: Params) -> EvalRun:
    """The eval stage: every engine configuration, the reference, then the reports (written)."""
    from transformers import AutoConfig

    from dflash.eval_report import build_report, write_reports
    from dflash.export import load_drafter
    from dflash.target import load_tokenizer, resolve

    e = params.eval
    if "dflash" not in e.engines:
        raise ValueError(f"eval.engines: {e.engines} must include 'dflash' (the drafter under evaluation)")
    if len(set(e.engines)) != len(e.engines):
        raise ValueError(f"eval.engines: {e.engines} has duplicates")
    if e.temperature < 0:
        raise ValueError(f"eval.temperature: must be >= 0, got {e.temperature}")
    info = resolve(params.base.target_dir)
    target_config = AutoConfig.from_pretrained(
        info["model"], revision=info.get("revision") or None, trust_remote_code=params.base.trust_remote_code
    )
    tokenizer = load_tokenizer(info["model"], params.base.trust_remote_code, info.get("revision"))
    drafter_path = Path(params.train.out) / "drafter"  # what the train stage exports
    prompts_dir = Path(params.tokenize.out) / "eval"  # the tokenize stage's held-out split
    drafter_dir = str(drafter_path.resolve())
    if not (drafter_path / "config.json").exists():
        raise FileNotFoundError(f"{drafter_path}: no exported drafter (config.json); run the train stage first")
    # Refuses a drafter built for another target (hidden size, vocab, layer count) or a mask token the data uses.
    drafter, dcfg = load_drafter(drafter_dir, target_config=target_config, tokenizer=tokenizer)
    prompts, skipped = split_by_length(load_prompts(prompts_dir, e.num_prompts), e, dcfg.block_size)
    if not prompts:
        raise ValueError(f"{prompts_dir}: no prompt fits eval.max_model_len={e.max_model_len} with its output budget")
    stops = stop_token_ids(info["model"], tokenizer)
    log.info("eval: %d prompts (%d skipped as too long), engines %s", len(prompts), len(skipped), e.engines)

    engines: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="dflash-eval-") as tmp:
        dirs = {"dflash": drafter_dir}
        if "untrained" in e.engines:
            dirs["untrained"] = str(_untrained_export(dcfg, drafter.fc.weight.dtype, params.base.seed, Path(tmp)))
        del drafter
        for name in e.engines:
            spec = speculative_config(name, e, dirs.get(name, ""), dcfg.block_size)
            cfg = {
                "engine_kwargs": engine_kwargs(e, info, params.base.seed, params.base.trust_remote_code, spec),
                "prompts": [p["prompt_ids"] for p in prompts],
                "max_tokens": e.max_tokens,
                "temperature": e.temperature,
                "seed": params.base.seed,
                "stop_ids": stops,
            }
            log.info("eval: engine %s (speculative_config %s)", name, spec)
            engines[name] = {"speculative_config": spec, **run_engine(name, cfg, e.engine_timeout_s)}
            r = engines[name]
            log.info(
                "eval: %s tau %s, %.1f output tok/s, %.2f tokens/step",
                name,
                r["counters"]["tau"],
                r["output_tokens_per_s"] or 0.0,
                r["tokens_per_step"],
            )
    reference = _reference(params, info, drafter_dir, prompts, stops) if e.reference else None
    report = build_report(e, dcfg, prompts, skipped, engines, reference)
    write_reports(report, Path(params.base.reports_dir))
    tokens = {name: r["tokens"] for name, r in engines.items()}
    if reference is not None:
        tokens["reference"] = reference["tokens"]
    return EvalRun(report, tokens)
