"""The PyTorch reference evaluator on a hybrid target: cache mode (attention K/V cropped, Gated DeltaNet state
snapshot-restored and the verified tokens re-fed after each rejection) vs recompute mode (the whole sequence
through the target every cycle). Same prompts, drafter and output budget; reports wall time per mode, tau,
the re-fed tokens and whether both modes give the same tokens and counts.

Every prompt stops at the eval stage's stop ids (the tokenizer's and generation config's eos), as vLLM does.
Reads a finished pipeline folder (default: `make demo-hybrid`'s build/demo-hybrid/): its target, exported
drafter and held-out prompts, with the params it ran with.

    python benchmarks/hybrid_reference.py --dir build/demo-hybrid --prompts 8 --dtype bfloat16 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="build/demo-hybrid", help="pipeline folder of a finished run")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    import torch

    from dflash.core.hf import load_target_model, load_tokenizer
    from dflash.core.loader import load_params
    from dflash.drafter.export import load_drafter
    from dflash.eval.reference import _Target, reference_decode, summarize
    from dflash.eval.stage import load_prompts, stop_token_ids

    folder = Path(args.dir).resolve()
    params = load_params(folder / "params.yaml")
    dtype = getattr(torch, args.dtype)
    target = load_target_model(folder / params.base.target_dir, dtype, "cpu", False)
    drafter, cfg = load_drafter(str(folder / params.train.out / "drafter"), target_config=target.config, dtype=dtype)
    drafter.eval()
    prompts = [p["prompt_ids"] for p in load_prompts(folder / params.tokenize.out / "eval", args.prompts)]
    target_dir = str(folder / params.base.target_dir)
    stops = stop_token_ids(target_dir, load_tokenizer(target_dir))  # where vLLM and the eval stage stop
    targets: list = []  # every _Target of a mode: their refed_tokens are the restore's extra work
    original = _Target.commit

    def counting(self, new_ids, keep):
        if not any(t is self for t in targets):
            targets.append(self)
        original(self, new_ids, keep)

    out = {}
    for mode in ("cache", "recompute"):
        targets.clear()
        _Target.commit = counting
        t0 = time.perf_counter()
        results = [reference_decode(target, drafter, p, params.eval.max_tokens, stops, mode=mode) for p in prompts]
        wall = time.perf_counter() - t0
        _Target.commit = original
        s = summarize(results, cfg.block_size)
        out[mode] = {
            "wall_s": round(wall, 2),
            "tau": s["tau"],
            "output_tokens": s["output_tokens"],
            "refed_tokens": sum(t.refed_tokens for t in targets),
            "tokens": [r.tokens for r in results],
            "counts": [(r.drafts, r.accepted_per_pos) for r in results],
        }
    same = out["cache"]["tokens"] == out["recompute"]["tokens"] and out["cache"]["counts"] == out["recompute"]["counts"]
    report = {
        "prompts": len(prompts),
        "dtype": args.dtype,
        "cache_wall_s": out["cache"]["wall_s"],
        "recompute_wall_s": out["recompute"]["wall_s"],
        "speedup_cache_vs_recompute": round(out["recompute"]["wall_s"] / out["cache"]["wall_s"], 2),
        "tau_cache": out["cache"]["tau"],
        "tau_recompute": out["recompute"]["tau"],
        "output_tokens": out["cache"]["output_tokens"],
        "cache_refed_tokens": out["cache"]["refed_tokens"],
        "identical_tokens_and_counts": same,
    }
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
