"""Measure one GPU's dense BF16 matmul rate and HBM bandwidth, to check a `params/hardware.yaml` profile.

The planner (dflash/plan/) multiplies vendor peaks by efficiency params; this probe gives the
measured numbers to put next to them in a profile's `source`. Needs torch with CUDA; prints JSON.

    python benchmarks/hw_probe.py [--size 8192] [--mem-gb 4]
"""

import argparse
import json
import time


def _timed(fn, iters: int) -> float:
    import torch

    fn()  # warm-up (kernel selection, allocation)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def _matmul_tflops(n: int, dev) -> float:
    import torch

    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    out = torch.empty(n, n, device=dev, dtype=torch.bfloat16)
    sec = _timed(lambda: torch.matmul(a, b, out=out), 50)
    return 2 * n**3 / sec / 1e12


def _copy_tbps(gb: float, dev) -> float:
    import torch

    elems = int(gb * 1e9 / 2)
    src = torch.empty(elems, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    sec = _timed(lambda: dst.copy_(src), 20)
    return 2 * elems * 2 / sec / 1e12  # a copy reads and writes every byte


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=8192, help="n for an n x n x n bf16 matmul")
    ap.add_argument("--mem-gb", type=float, default=4.0, help="GB copied per bandwidth iteration")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA device"
    dev = torch.device("cuda")
    tflops = _matmul_tflops(args.size, dev)
    tbps = _copy_tbps(args.mem_gb, dev)
    props = torch.cuda.get_device_properties(dev)
    print(
        json.dumps(
            {
                "device": props.name,
                "memory_gib": round(props.total_memory / 2**30, 1),
                "bf16_matmul_tflops": round(tflops, 1),
                "matmul_size": args.size,
                "copy_bandwidth_tbps": round(tbps, 3),
                "torch": torch.__version__,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
