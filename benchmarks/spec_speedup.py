"""Benchmark: how much faster speculative decoding is in vLLM, measured side by side in one run.

Configurations, each a vLLM engine in its own worker process (dflash/eval/speed.py), all on the same held-out
prompts with the eval's sampling settings, run in interleaved rounds (none dflash ngram [extra] none dflash ...):
  none     plain decoding (the baseline every speedup is paired with, round by round)
  dflash   the trained drafter the eval stage serves (`${train.out}/drafter`)
  ngram    vLLM's prompt-lookup proposer (the eval's n-gram settings)
  extra    a second exported drafter given with --extra-drafter (e.g. one with a pruned draft vocabulary)
At each concurrency (default 1 and eval.max_num_seqs): min and median over rounds of output tokens/s and ms per
output token, the paired speedup over `none` (median, min-max), output tokens per engine step, the share of
outputs equal to plain decoding's (temperature 0), and where an engine step's time goes (mean ms per step: the
target's forward passes, drafting with the drafter's logits inside it, the rest) from wall-clock hooks on vLLM's
model runner.

Inputs: params.yaml (+ overlays), the target (`${base.target_dir}`), the drafter export, the tokenize stage's
held-out split `${tokenize.out}/eval`. Output: the tables on stdout (markdown), and with --json every run.

    nice -n 10 python benchmarks/spec_speedup.py --rounds 5 --prompts 8 --concurrency 1 4 --json /tmp/speedup.json
    nice -n 10 python benchmarks/spec_speedup.py --extra-drafter artifacts/train_pruned/drafter
    nice -n 10 python benchmarks/spec_speedup.py -S base.target_dir=T -S train.out=D -S tokenize.out=E  # other inputs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dflash.core.loader import load_params  # noqa: E402
from dflash.eval.speed import RunResult, SpeedSetup, SpeedSummary, run_interleaved, summarize  # noqa: E402

BASELINE = "none"


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default=str(REPO / "params.yaml"))
    ap.add_argument("--overlay", action="append", default=[])
    ap.add_argument("-S", dest="overrides", action="append", default=[], help="SECTION.KEY=VALUE, as the stages take")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds per concurrency")
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts per run (the first N that fit)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=None, help="default: 1 and eval.max_num_seqs")
    ap.add_argument("--configs", nargs="+", default=["none", "dflash", "ngram"], choices=["none", "dflash", "ngram"])
    ap.add_argument("--extra-drafter", default="", help="a second exported drafter folder, run as `extra`")
    ap.add_argument("--json", default="", help="write every run and the summaries here")
    return ap.parse_args()


def _engine_kwargs(params, args, info: dict, concurrency: list[int], tokenizer) -> tuple[dict, int]:
    """name -> vLLM kwargs for every configuration, and the block size of the trained drafter."""
    from dflash.core.hf import target_config_dict
    from dflash.drafter.export import load_drafter
    from dflash.eval.engines import engine_kwargs, speculative_config

    e = dataclasses.replace(params.eval, max_num_seqs=max(concurrency))  # room for the largest concurrency
    target_config = target_config_dict(params.base.target_dir, params.base.trust_remote_code)
    drafters = {"dflash": str((Path(params.train.out) / "drafter").resolve())}
    if args.extra_drafter:
        drafters["extra"] = str(Path(args.extra_drafter).resolve())
    geometry = {}
    for name, folder in drafters.items():
        if not (Path(folder) / "config.json").exists():
            raise SystemExit(f"{folder}: no exported drafter (config.json); run the train stage first")
        _, dcfg = load_drafter(folder, target_config=target_config, tokenizer=tokenizer)
        geometry[name] = dcfg
    names = [*dict.fromkeys([BASELINE, *args.configs]), *(["extra"] if args.extra_drafter else [])]
    out = {}
    for name in names:
        d = geometry.get(name, geometry["dflash"])
        spec = speculative_config(
            name if name != "extra" else "dflash", e, drafters.get(name, ""), d.block_size, d.kind
        )
        out[name] = engine_kwargs(e, info, params.base.seed, params.base.trust_remote_code, spec)
    return out, geometry["dflash"].block_size


def _identical(a: list[list[int]], b: list[list[int]]) -> float:
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a) if a else 0.0


def speed_table(summaries: dict[str, SpeedSummary], identical: dict[str, float | None]) -> list[str]:
    lines = [
        "| config | tok/s min | tok/s median | ms/token min | ms/token median | speedup median (min-max) "
        "| tokens/step | = plain |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summaries.items():
        sp = f"{s.speedup.median:.3f} ({s.speedup.min:.3f}-{s.speedup.max:.3f})" if s.speedup else "1 (baseline)"
        same = identical.get(name)
        lines.append(
            f"| {name} | {s.tokens_per_s.min:.1f} | {s.tokens_per_s.median:.1f} | {s.ms_per_token.min:.2f} | "
            f"{s.ms_per_token.median:.2f} | {sp} | {s.tokens_per_step:.2f} | "
            f"{'-' if same is None else f'{same:.0%}'} |"
        )
    return lines


def breakdown_table(summaries: dict[str, SpeedSummary]) -> list[str]:
    lines = [
        "| config | ms per step | target forward | drafting | of it: draft logits | rest |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in summaries.items():
        b = s.breakdown_ms_per_step
        step = b["step"] or 1.0

        def cell(key: str, b=b, step=step) -> str:
            return f"{b[key]:.2f} ({b[key] / step:.0%})"

        lines.append(
            f"| {name} | {b['step']:.2f} | {cell('target_forward')} | {cell('drafting')} | {cell('draft_logits')} "
            f"| {cell('rest')} |"
        )
    return lines


def main() -> None:
    args = _args()
    params = load_params(args.params, args.overrides, args.overlay)
    from dflash.core.hf import load_tokenizer
    from dflash.core.target_config import resolve
    from dflash.eval.stage import load_prompts, split_by_length, stop_token_ids

    e = params.eval
    concurrency = args.concurrency or sorted({1, e.max_num_seqs})
    info = resolve(params.base.target_dir)
    tokenizer = load_tokenizer(info["model"], params.base.trust_remote_code, info.get("revision"))
    kwargs, block_size = _engine_kwargs(params, args, info, concurrency, tokenizer)
    prompts, _ = split_by_length(load_prompts(Path(params.tokenize.out) / "eval", 0), e, block_size)
    prompt_ids = [p["prompt_ids"] for p in prompts[: args.prompts]]
    setup = SpeedSetup(
        temperature=e.temperature,
        stop_ids=stop_token_ids(info["model"], tokenizer),
        max_tokens=e.max_tokens,
        seed=params.base.seed,
        engine_core_process=e.engine_core_process,
        timeout_s=e.engine_timeout_s,
    )
    t0 = time.perf_counter()

    def progress(r: RunResult) -> None:
        print(
            f"  round {r.round} c={r.concurrency} {r.name}: {r.tokens_per_s:.1f} tok/s ({r.output_tokens} tokens)",
            file=sys.stderr,
            flush=True,
        )

    results, starts = run_interleaved(kwargs, setup, prompt_ids, args.rounds, concurrency, progress)
    wall = time.perf_counter() - t0
    print(
        f"# spec_speedup: {len(prompt_ids)} held-out prompts, max_tokens {e.max_tokens}, temperature "
        f"{e.temperature:g}, {args.rounds} interleaved rounds ({' '.join(kwargs)}), {wall:.0f} s in all"
    )
    out = {"args": vars(args), "engine_start_s": starts, "concurrency": {}}
    for c in concurrency:
        runs = [r for r in results if r.concurrency == c]
        summaries = summarize(runs, baseline=BASELINE)
        plain = next(r.tokens for r in runs if r.name == BASELINE)
        identical = {
            n: _identical(next(r.tokens for r in runs if r.name == n), plain) if n != BASELINE else None
            for n in summaries
        }
        print(f"\n## concurrency {c}\n")
        print("\n".join(speed_table(summaries, identical)))
        print("\nWhere an engine step's time goes (mean ms per step, share of the step):\n")
        print("\n".join(breakdown_table(summaries)))
        out["concurrency"][str(c)] = {
            "summaries": {n: s.to_json() for n, s in summaries.items()},
            "identical_to_plain": identical,
            "runs": [{k: v for k, v in dataclasses.asdict(r).items() if k != "tokens"} for r in runs],
        }
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
