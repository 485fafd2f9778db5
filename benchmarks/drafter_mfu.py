"""bf16 step time and MFU of the drafter (the 1.73 B Qwen3.6-27B one with the GPU overlay).

FLOPs per step come from benchmarks/train.py (`step_flops`: the planner's FLOPs model of
dflash/plan/training.py, target forward excluded), the step time from its JSON (--from: the fastest backend
that timed a training step) or, when that is missing or failed, from a dense-mask step timed here. MFU is
given against two peaks: the dense bf16 peak of the params/hardware.yaml profile for this GPU, and the bf16
matmul rate measured here with benchmarks/hw_probe.py's 8192^3 matmul (what a GPU actually sustains).

    python benchmarks/drafter_mfu.py --device cuda --overlay params/gpu-qwen3.6-27b.yaml --from flex.json --json mfu.json
    python benchmarks/drafter_mfu.py --device cpu --smoke --json mfu.json      # tiny: no peak, no MFU
Prints one line per figure; --json writes them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import train as bench  # noqa: E402  (benchmarks/train.py)


def best_step(figures: dict) -> tuple[str, dict] | None:
    """(backend, row) of the fastest backend with a training step time, or None."""
    rows = [(k, v) for k, v in (figures.get("backends") or {}).items() if v.get("step_ms")]
    return min(rows, key=lambda kv: kv[1]["step_ms"]) if rows else None


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--overlay", action="append", default=[])
    p.add_argument("--from", dest="source", type=Path, default=None, help="benchmarks/train.py --json output")
    p.add_argument("--matmul-size", type=int, default=8192)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    figures, origin = None, ""
    if args.source and args.source.exists():
        figures, origin = json.loads(args.source.read_text()), str(args.source)
    wrong_device = figures is not None and (figures.get("device") == "cpu") != (args.device == "cpu")
    if figures is None or wrong_device or best_step(figures) is None:
        argv2 = ["--device", args.device, "--skip-packing", "--backends", "sdpa", "--repeats", "3", "--backward"]
        argv2 += [a for o in args.overlay for a in ("--overlay", o)] + (["--smoke"] if args.smoke else [])
        figures, origin = bench.attention(bench.parse_args(argv2)), "timed here (dense mask)"
    picked = best_step(figures)
    if picked is None:
        raise SystemExit("no backend timed a training step")
    backend, row = picked
    flops = figures["flops_per_step"]["total"]
    achieved = flops / (row["step_ms"] / 1e3) / 1e12
    out = {
        "device": figures["device"],
        "parameters": figures["geometry"]["parameters"],
        "seq": figures["seq"],
        "anchors": figures["anchors"],
        "backend": backend,
        "step_from": origin,
        "step_ms": row["step_ms"],
        "tokens_per_s": row.get("tokens_per_s"),
        "flops_per_step": flops,
        "flops_parts": figures["flops_per_step"],
        "achieved_tflops": achieved,
        "peak_tflops": figures.get("peak_tflops"),
        "peak_source": figures.get("peak_source"),
        "mfu": achieved / figures["peak_tflops"] if figures.get("peak_tflops") else None,
    }
    if args.device.startswith("cuda"):
        import torch
        from hw_probe import _matmul_tflops

        size = 1024 if args.smoke else args.matmul_size
        out["matmul_tflops"] = _matmul_tflops(size, torch.device(args.device))
        out["matmul_size"] = size
        out["mfu_vs_matmul"] = achieved / out["matmul_tflops"]
    for k in ("device", "parameters", "backend", "step_ms", "flops_per_step", "achieved_tflops", "peak_tflops"):
        print(f"{k:<18}{out[k]}")
    for k in ("mfu", "matmul_tflops", "mfu_vs_matmul"):
        if out.get(k) is not None:
            print(f"{k:<18}{out[k]:.3f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
