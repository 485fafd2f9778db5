"""Measure a device's dense matmul rates, memory bandwidth and memory: a GPU (to check a params/hardware.yaml
profile) or this CPU host (to write the host profile the demo's plan prices, params/hardware-host.yaml).

The planner (dflash/plan/) multiplies a profile's peaks by efficiency params; for a GPU the profile holds vendor
peaks and this probe gives the measured numbers to cite beside them, for a CPU host the profile IS the measurement.
Figures: an n x n x n matmul in bf16 and fp32 (2 n^3 FLOPs a call), a device-to-device copy (it reads and writes
every byte: 2 x bytes a call), the device's memory (GPU: total memory; CPU: MemTotal). Median of timed calls
after one warm-up call. Prints JSON; --write FILE writes a one-profile hardware file (the format of
params/hardware.yaml, loaded by dflash/core/hardware.py) with the figures, the date and this command as its source.

    python benchmarks/hw_probe.py [--device cuda] [--size 8192] [--mem-gb 4]
    python benchmarks/hw_probe.py --device cpu --write params/hardware-host.yaml --key cpu-host   # the demo's host
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timed(fn, dev, iters: int) -> float:
    """Median seconds of `iters` calls after one warm-up call (kernel selection, allocation, thread pools)."""
    fn()
    _sync(dev)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _matmul_tflops(n: int, dev, dtype=None, iters: int = 50) -> float:
    """Dense matmul rate (TFLOP/s) of an n x n x n product in `dtype` (default bf16)."""
    import torch

    dtype = dtype or torch.bfloat16
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    out = torch.empty(n, n, device=dev, dtype=dtype)
    sec = _timed(lambda: torch.matmul(a, b, out=out), dev, iters)
    return 2 * n**3 / sec / 1e12


def _copy_tbps(gb: float, dev, iters: int = 20) -> float:
    import torch

    elems = int(gb * 1e9 / 2)
    src = torch.empty(elems, device=dev, dtype=torch.bfloat16).fill_(1)
    dst = torch.empty_like(src)
    sec = _timed(lambda: dst.copy_(src), dev, iters)
    return 2 * elems * 2 / sec / 1e12  # a copy reads and writes every byte


def probe(device: str, size: int, mem_gb: float) -> dict:
    """Every figure of one device (module docstring), as a dict."""
    import torch

    from dflash.train.probes import device_name, host_memory_gb

    dev = torch.device(device)
    if dev.type == "cuda":
        assert torch.cuda.is_available(), "--device cuda needs a CUDA device (use --device cpu for this host)"
        props = torch.cuda.get_device_properties(dev)
        name, memory_gb, iters = props.name, props.total_memory / 1e9, (50, 20)
    else:
        name, memory_gb, iters = device_name(dev), host_memory_gb(), (5, 5)
    return {
        "device": name,
        "kind": "gpu" if dev.type == "cuda" else "cpu",
        "memory_gb": round(memory_gb, 2),
        "bf16_matmul_tflops": round(_matmul_tflops(size, dev, torch.bfloat16, iters[0]), 4),
        "fp32_matmul_tflops": round(_matmul_tflops(size, dev, torch.float32, iters[0]), 4),
        "matmul_size": size,
        "copy_bandwidth_tbps": round(_copy_tbps(mem_gb, dev, iters[1]), 5),
        "copy_gb": mem_gb,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def profile_yaml(key: str, fig: dict, command: str) -> str:
    """A hardware file with one profile holding `fig` (dflash/core/hardware.py's schema)."""
    today = datetime.date.today().isoformat()
    return (
        f"# A measured {fig['kind'].upper()} profile for the plan stage, written by benchmarks/hw_probe.py on {today}.\n"
        f"# Regenerate it on the machine you run on: {command}\n"
        "profiles:\n"
        f"  {key}:\n"
        f"    name: {json.dumps(fig['device'])}\n"
        f"    kind: {fig['kind']}\n"
        f"    memory_gb: {fig['memory_gb']}\n"
        f"    bandwidth_tbps: {fig['copy_bandwidth_tbps']}\n"
        f"    bf16_tflops: {fig['bf16_matmul_tflops']}\n"
        f"    fp32_tflops: {fig['fp32_matmul_tflops']}\n"
        "    interconnect: none (one host)\n"
        "    interconnect_gbps: 0\n"
        "    price_per_gpu_hour: 0.0\n"
        "    source: >-\n"
        f"      Measured on {today} by `{command}` (torch {fig['torch']}, {fig['threads']} threads):\n"
        f"      {fig['matmul_size']}^3 matmul {fig['bf16_matmul_tflops']} TFLOP/s bf16, {fig['fp32_matmul_tflops']} "
        f"TFLOP/s fp32;\n"
        f"      {fig['copy_gb']} GB copy {fig['copy_bandwidth_tbps'] * 1e3:.2f} GB/s (read + write); memory = "
        f"{'MemTotal' if fig['kind'] == 'cpu' else 'total device memory'}.\n"
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="cuda | cpu (default: cuda when present, else cpu)")
    ap.add_argument("--size", type=int, default=None, help="n for an n x n x n matmul (default 8192 GPU, 2048 CPU)")
    ap.add_argument("--mem-gb", type=float, default=None, help="GB copied per bandwidth call (default 4 GPU, 1 CPU)")
    ap.add_argument("--write", type=Path, default=None, help="write a one-profile hardware file here")
    ap.add_argument("--key", default="cpu-host", help="the profile's name in --write's file")
    args = ap.parse_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device.startswith("cuda")
    fig = probe(device, args.size or (8192 if gpu else 2048), args.mem_gb or (4.0 if gpu else 1.0))
    print(json.dumps(fig, indent=2))
    if args.write:
        shown = [a for a in (argv if argv is not None else sys.argv[1:])]
        command = " ".join(["python benchmarks/hw_probe.py", *shown])
        args.write.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.write.with_name(f".{args.write.name}.{os.getpid()}.tmp")
        tmp.write_text(profile_yaml(args.key, fig, command))
        tmp.replace(args.write)
        print(f"wrote {args.write} (profile {args.key})")


if __name__ == "__main__":
    main()
