"""Benchmark: the generate stage vs a bare `vllm.LLM.generate` over the same prompts and engine settings.

Both sides exclude engine start-up and time only generation: the stage's `output_tokens_per_s` in
reports/generate_details.json (from the first engine ready to the last unit committed, dispatcher, rendering,
reasoning split and atomic shard writes included) against one bare `LLM.generate` call over the same
token-id prompts with the same SamplingParams. Goal: stage >= 0.95x bare (overhead < 5%).

Inputs: a target folder (default: the demo's artifacts/target, built by `dvc repro target`).
Outputs: prints both figures and the ratio; writes nothing outside a temp folder.

    python benchmarks/generate.py --prompts 512 --max-tokens 128
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _conversations(n: int, seed: int) -> list[list[dict]]:
    from dflash.target.synthetic import conversation

    rng = random.Random(seed)
    return [[m for m in conversation(rng) if m["role"] != "assistant"] for _ in range(n)]


def _write(path: Path, convs: list[list[dict]]) -> None:
    import pyarrow as pa

    from dflash.core.io import canonical_json, sha256_text, write_arrow

    rows = []
    for i, messages in enumerate(convs):
        cid = sha256_text(canonical_json({"messages": messages, "tools": None, "i": i}))[:16]
        rows.append({"conversation_id": cid, "messages": json.dumps(messages), "tools": ""})
    write_arrow(path, pa.Table.from_pylist(rows))


def _bare(target: str, prompts: list[list[int]], params, queue) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from dflash.core.processes import place_engine_core
    from dflash.generate.engines import engine_kwargs

    g = params.generate
    place_engine_core(g.engine_core_process)  # the same engine placement as the stage's workers
    llm = LLM(**engine_kwargs(g, target, "", params.base.seed, False))
    s = g.sampling
    sp = SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens)
    t0 = time.time()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    dt = time.time() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    queue.put((tokens, dt))
    from dflash.core.processes import shutdown_engine

    shutdown_engine(llm.llm_engine, queue, 0)  # stops vLLM's engine-core processes too


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=str(REPO / "artifacts/target"))
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--unit-size", type=int, default=64)
    args = parser.parse_args()

    from dflash.core.chat import render_ids, template_kwargs
    from dflash.core.hf import load_tokenizer
    from dflash.core.loader import load_params

    overrides = [
        f"base.target_dir={args.target}",
        f"generate.sampling.max_tokens={args.max_tokens}",
        f"generate.unit_size={args.unit_size}",
    ]
    params = load_params(REPO / "params.yaml", overrides)
    convs = _conversations(args.prompts, params.base.seed)
    tok = load_tokenizer(args.target)
    kw = template_kwargs(params.base.enable_thinking, params.base.chat_template_kwargs)
    prompts = [render_ids(tok, c, True, kw) for c in convs]

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_bare, args=(args.target, prompts, params, q))
    p.start()
    bare_tokens, bare_s = q.get()
    p.join(timeout=60)

    with tempfile.TemporaryDirectory() as tmp:
        ws = Path(tmp)
        (ws / "audit").mkdir()
        _write(ws / "audit" / "conversations.arrow", convs)
        cmd = [sys.executable, "-m", "stages.generate"]
        for o in [*overrides, f"audit.out={ws / 'audit'}", f"generate.out={ws / 'gen'}", f"base.reports_dir={ws}"]:
            cmd += ["-S", o]
        subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        m = json.loads((ws / "generate_details.json").read_text())

    bare = bare_tokens / bare_s
    stage = m["output_tokens_per_s"]
    print(f"prompts {args.prompts}, max_tokens {args.max_tokens}, unit_size {args.unit_size}")
    print(f"bare LLM.generate : {bare_tokens} output tokens in {bare_s:.2f} s = {bare:.1f} tok/s")
    print(
        f"generate stage    : {m['output_tokens']} output tokens in {m['generation_wall_s']:.2f} s = {stage:.1f} tok/s"
    )
    print(f"stage / bare      : {stage / bare:.3f}  (goal >= 0.95)")


if __name__ == "__main__":
    main()
