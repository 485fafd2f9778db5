"""Eval: the drafter's acceptance length tau measured by the engine that serves it (real vLLM speculative
decoding), beside a PyTorch reference evaluator and baselines on the same held-out prompts.

Inputs: the exported drafter `${train.out}/drafter` (z-lab format), the target (`${base.target_dir}/target.json`),
held-out prompts `${tokenize.out}/eval/shard-*.arrow` (tokenize's eval split: prompt = input_ids[:num_prompt_tokens],
already rendered with the training template and thinking mode) and the named sets of `eval.prompt_sets`
(dflash/eval/prompt_sets.py: every engine and the reference measure each set separately). Outputs (dflash/eval/report.py):
`reports/eval.json`, `reports/eval.md`, `reports/eval_acceptance.csv` (DVC plot).

Command: python -m stages.eval --params params.yaml

Engine configurations (`eval.engines`), each in its own spawned worker process with its own engine, all on
the same prompts with the same sampling settings:
  dflash     the trained drafter: speculative_config {"method": "dflash" ("dspark" for drafter.kind dspark),
             "model": drafter_dir, "num_speculative_tokens": B-1}. DSpark and DFlash2 need vLLM's V2 model runner
             (CUDA + Triton): where the host has none, this engine and `untrained` are skipped, said so in the
             report's notes, and the drafter's tau is the reference's (eval.reference_temperatures)
  untrained  the same with a seeded, untrained drafter of the same geometry (exported to a temp folder)
  ngram      vLLM's prompt-lookup proposer ({"method": "ngram", prompt_lookup_min / max})
  none       no speculation: the throughput baseline (speedup) and, at temperature 0, the greedy output
             that every speculative configuration must reproduce
The speedup (eval.speed_rounds > 0): plain decoding and the trained drafter again, each engine kept alive in its
worker and run in interleaved rounds on the first eval.speed_prompts held-out prompts (dflash/eval/speed.py), the
median of the per-round ratios; 0 = the ratio of the timed runs above, measured one after another.
How tau, acceptance per position and throughput are read from the engine: dflash/eval/engines.py.
Reports: dflash/eval/report.py. The reference evaluator: dflash/eval/reference.py.
"""

from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.core.errors import UserError
from dflash.core.io import list_shards, read_arrow
from dflash.core.params import EvalParams, Params
from dflash.core.target_config import check_cpu_hybrid, resolve
from dflash.core.validate import check_eval
from dflash.eval.engines import engine_kwargs, run_engine, speculative_config, unservable_reason
from dflash.eval.progress import reference_bar
from dflash.eval.prompt_sets import HELDOUT, load_prompt_set, set_rows
from dflash.eval.speed import eval_speedup

log = logging.getLogger(__name__)

ENGINES = ("dflash", "untrained", "ngram", "none")
SPECULATIVE = ("dflash", "untrained", "ngram")
PROMPT_COLUMNS = ("sample_id", "input_ids", "num_prompt_tokens")


# ------------------------------------------------------------------------------------------ inputs


def load_prompts(folder: str | Path, num_prompts: int) -> list[dict]:
    """The first `num_prompts` (0 = all) held-out prompts in shard order: {"sample_id", "prompt_ids"}."""
    shards = list_shards(folder, "shard-*.arrow")
    if not shards:
        raise UserError(f"{folder}: no shard-*.arrow (the tokenize stage's eval split); run tokenize first")
    prompts: list[dict] = []
    for shard in shards:
        table = read_arrow(shard)
        missing = [c for c in PROMPT_COLUMNS if c not in table.column_names]
        if missing:
            raise UserError(f"{shard}: columns {missing} missing (expected the tokenize stage's shard schema)")
        cols = table.select(list(PROMPT_COLUMNS)).to_pydict()
        for row, (sid, ids, n) in enumerate(zip(*(cols[c] for c in PROMPT_COLUMNS), strict=True)):
            if not 0 < n <= len(ids):
                raise UserError(f"{shard}: row {row} ({sid}): num_prompt_tokens {n} outside 1..{len(ids)} (input_ids)")
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


# ------------------------------------------------------------------------------------------ stage


def _untrained_export(config: Any, dtype: Any, seed: int, out_dir: Path, drafter_dir: str) -> Path:
    """A seeded, untrained drafter of the trained one's geometry, exported for vLLM (the tau ~ 1 baseline); a pruned
    draft vocabulary is the trained one's (its head is the target's rows, nothing trained)."""
    import torch

    from dflash.drafter.build import build_drafter
    from dflash.drafter.export import load_draft_head, save_drafter

    torch.manual_seed(seed)
    head = load_draft_head(drafter_dir, config)
    return save_drafter(build_drafter(config, dtype=dtype), config, out_dir, head)


def _reference(params: Params, info: dict, drafter_dir: str, sets: dict[str, list[dict]], stop_ids: list[int]) -> dict:
    """The PyTorch reference evaluator over the same prompts at every eval.reference_temperatures, set by set.
    Top level: the greedy run (or the first temperature's when 0 is not listed) with its held-out summary and
    tokens, every set's under "sets"; every temperature's set summaries under "by_temperature" (keys "0", "1"...).
    Prompt i of a set draws from seed base.seed + i at T > 0 (the engines' per-request seeds)."""
    import torch

    from dflash.core.hf import load_target_model
    from dflash.drafter.export import load_draft_head, load_drafter
    from dflash.eval.reference import reference_decode, summarize

    e = params.eval
    device = e.reference_device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, e.dtype)
    target = load_target_model(params.base.target_dir, dtype, device, params.base.trust_remote_code)
    drafter, cfg = load_drafter(drafter_dir, target_config=target.config, device=device, dtype=dtype)
    drafter.eval()
    head = load_draft_head(drafter_dir, cfg, device=device, dtype=dtype)  # None: the target's whole vocabulary
    runs: dict[str, dict[str, dict]] = {}
    count = sum(len(p) for p in sets.values()) * len(e.reference_temperatures)
    bar = reference_bar(count, len(sets))  # its clock starts with the models loaded
    for temp in e.reference_temperatures:
        out: dict[str, dict] = {}
        for name, prompts in sets.items():
            t0 = time.perf_counter()
            results = []
            for i, p in enumerate(prompts):
                results.append(
                    reference_decode(
                        target,
                        drafter,
                        p["prompt_ids"],
                        e.max_tokens,
                        stop_ids,
                        mode=e.reference_mode,
                        temperature=temp,
                        seed=params.base.seed + i,
                        draft_head=head,
                    )
                )
                bar.update(1)
            out[name] = {
                **summarize(results, cfg.block_size),
                "wall_s": time.perf_counter() - t0,
                "tokens": [r.tokens for r in results],
            }
            log.info("eval: reference at temperature %g on %s: tau %s", temp, name, out[name]["tau"])
        runs[f"{temp:g}"] = out
    bar.close()
    del target
    main_temp = 0.0 if 0.0 in e.reference_temperatures else e.reference_temperatures[0]
    main = runs[f"{main_temp:g}"]
    by_temperature = {
        t: {n: {k: v for k, v in r.items() if k != "tokens"} for n, r in o.items()} for t, o in runs.items()
    }
    return {
        **main[HELDOUT],
        "temperature": main_temp,
        "mode": e.reference_mode,
        "device": device,
        "kind": cfg.kind,
        "sets": main,
        "by_temperature": by_temperature,
    }


def _set_meta(source: str, kept: list[dict], skipped: list, thinking: bool) -> dict:
    return {"source": source, "num_prompts": len(kept), "num_skipped": len(skipped), "enable_thinking": thinking}


@dataclass
class EvalRun:
    report: dict  # eval.json
    tokens: dict[str, list[list[int]]]  # per prompt output ids: one entry per engine, plus "reference"


def run(params: Params) -> EvalRun:
    """The eval stage: every engine configuration, the reference, then the reports (written)."""
    check_eval(params)  # dflash/core/validate.py: engine list and engine sizes (the rules generate's engines obey)
    from dflash.core.hf import load_tokenizer, target_config_dict
    from dflash.drafter.export import load_drafter
    from dflash.eval.report import build_report, write_reports

    e = params.eval
    info = resolve(params.base.target_dir)
    import torch

    # The engines run with prefix caching off (engine_kwargs); the reference runs in eval.dtype too.
    hybrid = check_cpu_hybrid(params.base.target_dir, "eval", e.dtype, False, not torch.cuda.is_available())
    if hybrid:
        log.info("eval: %s; reference restores the recurrent state after each rejection", hybrid)
    target_config = target_config_dict(params.base.target_dir, params.base.trust_remote_code)
    tokenizer = load_tokenizer(info["model"], params.base.trust_remote_code, info.get("revision"))
    drafter_path = Path(params.train.out) / "drafter"  # what the train stage exports
    prompts_dir = Path(params.tokenize.out) / "eval"  # the tokenize stage's held-out split
    drafter_dir = str(drafter_path.resolve())
    if not (drafter_path / "config.json").exists():
        raise UserError(f"{drafter_path}: no exported drafter (config.json); run the train stage first")
    # Refuses a drafter built for another target (hidden size, vocab, layer count) or a mask token the data uses.
    drafter, dcfg = load_drafter(drafter_dir, target_config=target_config, tokenizer=tokenizer)
    prompts, skipped = split_by_length(load_prompts(prompts_dir, e.num_prompts), e, dcfg.block_size)
    if not prompts:
        raise UserError(f"{prompts_dir}: no prompt fits eval.max_model_len={e.max_model_len} with its output budget")
    sets = {HELDOUT: prompts}
    meta = {HELDOUT: _set_meta(str(prompts_dir), prompts, skipped, params.base.enable_thinking)}
    for name, spec in e.prompt_sets.items():
        kept, too_long = split_by_length(
            load_prompt_set(name, spec, tokenizer, params.base.chat_template_kwargs), e, dcfg.block_size
        )
        if not kept:
            raise UserError(f"eval.prompt_sets.{name}: no prompt fits eval.max_model_len={e.max_model_len}")
        sets[name], meta[name] = kept, _set_meta(spec.source, kept, too_long, spec.enable_thinking)
    stops = stop_token_ids(info["model"], tokenizer)
    log.info(
        "eval: %s prompts (%d held-out skipped as too long), engines %s",
        ", ".join(f"{n} {len(p)}" for n, p in sets.items()),
        len(skipped),
        e.engines,
    )

    engines: dict[str, dict] = {}
    unservable = unservable_reason(dcfg.kind)  # DSpark / DFlash2 without vLLM's V2 runner: the reference measures
    run = [n for n in e.engines if not (unservable and n in ("dflash", "untrained"))]
    if unservable:
        log.warning("eval: %s; engines dflash and untrained skipped", unservable)
        if not e.reference:
            raise UserError(f"eval.reference: must be true here: {unservable}")
    with tempfile.TemporaryDirectory(prefix="dflash-eval-") as tmp:
        dirs = {"dflash": drafter_dir}
        if "untrained" in run:
            dirs["untrained"] = str(
                _untrained_export(dcfg, drafter.fc.weight.dtype, params.base.seed, Path(tmp), drafter_dir)
            )
        del drafter
        speed_kwargs: dict[str, dict] = {}
        for name in run:
            spec = speculative_config(name, e, dirs.get(name, ""), dcfg.block_size, dcfg.kind)
            cfg = {
                "engine_kwargs": engine_kwargs(e, info, params.base.seed, params.base.trust_remote_code, spec),
                "prompt_sets": [[name, [p["prompt_ids"] for p in ps]] for name, ps in sets.items()],
                "max_tokens": e.max_tokens,
                "temperature": e.temperature,
                "seed": params.base.seed,
                "stop_ids": stops,
                "engine_core_process": e.engine_core_process,
            }
            log.info("eval: engine %s (speculative_config %s)", name, spec)
            engines[name] = {"speculative_config": spec, **run_engine(name, cfg, e.engine_timeout_s)}
            speed_kwargs[name] = cfg["engine_kwargs"]
            r = engines[name]
            log.info(
                "eval: %s tau %s, %.1f output tok/s, %.2f tokens/step",
                name,
                r["counters"]["tau"],
                r["output_tokens_per_s"] or 0.0,
                r["tokens_per_step"],
            )
    if e.speed_rounds and {"dflash", "none"} <= set(engines):  # the speedup from interleaved rounds (speed.py)
        pair = {name: speed_kwargs[name] for name in ("none", "dflash")}
        speed = eval_speedup(e, pair, [p["prompt_ids"] for p in prompts], stops, params.base.seed)
        for name, summary in speed.items():
            engines[name]["interleaved"] = summary
        log.info(
            "eval: interleaved speedup %.3f (median of %d rounds)", speed["dflash"]["speedup"]["median"], e.speed_rounds
        )
    reference = _reference(params, info, drafter_dir, sets, stops) if e.reference else None
    prompt_sets = set_rows(meta, engines, reference, e.temperature == 0)
    report = build_report(e, dcfg, prompts, skipped, engines, reference, prompt_sets, unservable)
    write_reports(report, Path(params.base.reports_dir))
    tokens = {name: r["tokens"] for name, r in engines.items()}
    if reference is not None:
        tokens["reference"] = reference["tokens"]
    return EvalRun(report, tokens)
