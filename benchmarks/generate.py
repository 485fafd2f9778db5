"""Benchmark: the generate stage's two backends vs a bare `vllm.LLM.generate`, and the pilot sweep.

Printed side by side, in one run, over the same prompts, engine settings and concurrency (max_num_seqs):
  bare LLM.generate      one call over the token-id prompts with the same SamplingParams (the stage's engine
                         placement), and again with vLLM's engine core in its own process (a server's placement:
                         what the servers backend can reach at best on this host)
  engines backend        the stage's `output_tokens_per_s` (first engine ready -> last unit committed:
                         dispatcher, rendering, reasoning split and atomic shard writes included)
  servers backend        the same, the stage driving one local vLLM api_server over HTTP (server start excluded)
  pilot sweep            `--pilot` with generate.pilot_sweep = --sweep: each level's measured tok/s, the best
                         level and the knee (chosen_max_num_seqs) vs the default level (--max-num-seqs)
Every side excludes engine / server start-up. Goal: both backends >= 0.9x bare. For each backend the CPU seconds
of its process tree by role (the stage = client, api_server frontend, engine core) say where the cycles go.

Inputs: a target folder (default: the demo's artifacts/target, built by `dvc repro target`).
Outputs: prints the figures; writes nothing outside a temp folder.

    python benchmarks/generate.py --prompts 256 --max-tokens 64 --max-num-seqs 64 --sweep 4,16,64
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


def _bare(target: str, prompts: list[list[int]], params, queue, own_process: bool) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from dflash.core.processes import place_engine_core
    from dflash.generate.engines import engine_kwargs

    g = params.generate
    place_engine_core(own_process)  # False: the stage's workers' placement; True: a server's (core in its own process)
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


class _CpuByRole:
    """CPU seconds (user + system) of a process tree by role, sampled every 0.5 s from a thread while it runs:
    where a backend's cycles go (the stage's own process = the client / dispatcher; an api_server's frontend;
    vLLM's engine core and its workers)."""

    def __init__(self, pid: int):
        import threading

        self.pid, self.seen = pid, {}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _role(self, p) -> str:
        if p.pid == self.pid:
            return "stage (client)"
        line = " ".join(p.cmdline())
        if "api_server" in line:
            return "api_server frontend"
        return "engine core / workers" if "multiprocessing" in line or p.name().startswith("VLLM") else p.name()

    def _loop(self) -> None:
        import psutil

        while not self.done.is_set():
            try:
                root = psutil.Process(self.pid)
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                return
            for p in procs:
                try:
                    with p.oneshot():
                        t = p.cpu_times()
                        self.seen[p.pid] = (self._role(p), t.user + t.system)
                except psutil.Error:
                    continue
            self.done.wait(0.5)

    def stop(self) -> None:
        self.done.set()
        self.thread.join()

    def summary(self) -> str:
        by: dict[str, float] = {}
        for role, sec in self.seen.values():
            by[role] = by.get(role, 0.0) + sec
        return ", ".join(f"{r} {s:.1f}" for r, s in sorted(by.items(), key=lambda kv: -kv[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=str(REPO / "artifacts/target"))
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--unit-size", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=64, help="the concurrency of every side (default level)")
    parser.add_argument("--sweep", default="4,16,64", help="pilot sweep levels, comma-separated ('' = no sweep)")
    parser.add_argument("--kv-cache-memory-gb", type=float, default=1.0, help="KV cache per engine (GB)")
    args = parser.parse_args()

    from dflash.core.chat import render_ids, template_kwargs
    from dflash.core.hf import load_tokenizer
    from dflash.core.loader import load_params

    overrides = [
        f"base.target_dir={args.target}",
        f"generate.sampling.max_tokens={args.max_tokens}",
        f"generate.unit_size={args.unit_size}",
        f"generate.max_num_seqs={args.max_num_seqs}",
        f"generate.kv_cache_memory_gb={args.kv_cache_memory_gb}",
    ]
    params = load_params(REPO / "params.yaml", overrides)
    convs = _conversations(args.prompts, params.base.seed)
    tok = load_tokenizer(args.target)
    kw = template_kwargs(params.base.enable_thinking, params.base.chat_template_kwargs)
    prompts = [render_ids(tok, c, True, kw) for c in convs]

    ctx = mp.get_context("spawn")
    bare_runs = {}
    for own in (params.generate.engine_core_process, True):
        if own in bare_runs:
            continue
        q = ctx.Queue()
        p = ctx.Process(target=_bare, args=(args.target, prompts, params, q, own))
        p.start()
        bare_runs[own] = q.get()
        p.join(timeout=60)
    bare_tokens, bare_s = bare_runs[params.generate.engine_core_process]

    levels = [int(x) for x in args.sweep.split(",") if x.strip()]
    cpu: dict[str, _CpuByRole] = {}
    with tempfile.TemporaryDirectory() as tmp:
        ws = Path(tmp)
        (ws / "audit").mkdir()
        _write(ws / "audit" / "conversations.arrow", convs)

        def stage(name: str, *extra: str) -> dict:
            cmd = [sys.executable, "-m", "stages.generate"]
            run_overrides = [
                *overrides,
                f"audit.out={ws / 'audit'}",
                f"generate.out={ws / name}",
                f"generate.pilot_out={ws / name}-pilot",
                f"base.reports_dir={ws / name}-reports",
            ]
            for o in run_overrides:
                cmd += ["-S", o]
            proc = subprocess.Popen([*cmd, *extra], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            cpu[name] = _CpuByRole(proc.pid)
            if proc.wait() != 0:
                raise SystemExit(f"benchmark: the {name} run of the generate stage failed (exit {proc.returncode})")
            cpu[name].stop()
            report = "pilot_details.json" if "--pilot" in extra else "generate_details.json"
            return json.loads((ws / f"{name}-reports" / report).read_text())

        eng = stage("engines")
        srv = stage("servers", "-S", "generate.backend=servers")
        sweep = None
        if levels:
            sweep = stage(
                "sweep",
                "--pilot",
                "-S",
                f"generate.pilot_samples={args.prompts}",
                "-S",
                f"generate.pilot_sweep=[{','.join(map(str, levels))}]",
            )

    bare = bare_tokens / bare_s
    print(
        f"prompts {args.prompts}, max_tokens {args.max_tokens}, unit_size {args.unit_size}, max_num_seqs {args.max_num_seqs}"
    )
    print(f"bare LLM.generate : {bare_tokens} output tokens in {bare_s:.2f} s = {bare:.1f} tok/s")
    if True in bare_runs and params.generate.engine_core_process is False:
        t, sec = bare_runs[True]
        print(
            f"  same, engine core in its own process (a server's placement): {t / sec:.1f} tok/s = "
            f"{t / sec / bare:.3f}x bare"
        )
    for name, m in (("engines backend", eng), ("servers backend", srv)):
        rate = m["output_tokens_per_s"]
        print(
            f"{name:<18}: {m['output_tokens']} output tokens in {m['generation_wall_s']:.2f} s = {rate:.1f} tok/s"
            f" = {rate / bare:.3f}x bare (goal >= 0.9)"
        )
        print(f"  CPU seconds by process over the run: {cpu[name.split()[0]].summary()}")
    if sweep:
        rows = sweep["sweep"]
        for r in rows:
            print(
                f"sweep level {r['max_num_seqs']:>5}: {r['output_tokens_per_s']:.1f} tok/s, p50 latency "
                f"{r['p50_latency_s']:.2f} s ({r['measured_requests']} requests measured over {r['window_s']:.1f} s)"
            )
        best = max(rows, key=lambda r: r["output_tokens_per_s"])
        default = next((r for r in rows if r["max_num_seqs"] == args.max_num_seqs), None)
        print(
            f"sweep best level {best['max_num_seqs']}: {best['output_tokens_per_s']:.1f} tok/s; chosen (knee) "
            f"{sweep['chosen_max_num_seqs']}"
        )
        if default:
            print(
                f"default level {args.max_num_seqs}: {default['output_tokens_per_s']:.1f} tok/s = "
                f"{default['output_tokens_per_s'] / best['output_tokens_per_s']:.3f}x the best"
            )


if __name__ == "__main__":
    main()
