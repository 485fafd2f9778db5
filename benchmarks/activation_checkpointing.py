"""train.activation_checkpointing measured: the same drafter training step with and without it, side by side.

One packed row of --seq context tokens (one document, the first eighth a prompt) with --anchors sorted random
anchors, the drafter geometry of params.yaml (+ --overlay), a random frozen lm_head of the target's vocabulary:
forward, chunked decayed CE, backward, AdamW, as dflash/train/loop.py runs it (bf16 autocast with fp32 master
weights on CUDA, fp32 on CPU, dense SDPA mask on CPU, flex BlockMask on CUDA). Per mode: forward, backward and
step time (median of --repeats after one warm-up), the bytes autograd keeps for backward (exact, any device), and
the step's peak memory above what the model and inputs hold (CUDA: max allocated; CPU: peak resident set, VmHWM
reset before each step). Public figure to compare with: about half the memory at 8K tokens for a 30-50% slower
backward (speculators PR #1100, DFlash / DSpark drafters).

    python benchmarks/activation_checkpointing.py                                     # CPU, demo drafter
    python benchmarks/activation_checkpointing.py --device cuda --overlay params/gpu-qwen3.6-27b.yaml --seq 8192 --anchors 2048
Prints one table; --json PATH writes the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dflash.core.loader import load_params  # noqa: E402
from dflash.core.target_config import load_target_arch  # noqa: E402
from dflash.drafter.geometry import build_drafter_config  # noqa: E402
from dflash.drafter.masks import build_masks  # noqa: E402
from dflash.drafter.model import block_input_ids, block_labels, build_drafter  # noqa: E402
from dflash.train.loss import LMHead, block_loss, slot_weights  # noqa: E402
from dflash.train.probes import PeakMemory, rss_gb  # noqa: E402

GB = 1e9


def setup(args) -> dict:
    """Drafter, optimizer and one row's inputs (fixed seed: both modes see the same step)."""
    dev = torch.device(args.device)
    params = load_params(REPO / "params.yaml", overlays=args.overlay)
    if args.overlay:
        target = load_target_arch(params.plan.target_config)
    else:  # the demo's tiny target geometry (hidden size, vocabulary, layers are all the drafter takes from it)
        tiny = params.target.tiny
        target = {"hidden_size": tiny.hidden_size, "vocab_size": 151936, "num_hidden_layers": tiny.num_hidden_layers}
        target |= {"num_attention_heads": tiny.num_attention_heads, "intermediate_size": tiny.intermediate_size}
    cfg = build_drafter_config(params.drafter, target)
    if args.layers:
        cfg = dataclasses.replace(cfg, num_hidden_layers=args.layers, layer_types=cfg.layer_types[:1] * args.layers)
    bf16 = dev.type == "cuda"
    torch.manual_seed(0)
    model = build_drafter(cfg, device=dev)
    g = torch.Generator().manual_seed(0)
    s, n, b = args.seq, args.anchors, cfg.block_size
    half = torch.bfloat16 if bf16 else torch.float32
    feats = torch.randn(s, cfg.num_target_features * cfg.hidden_size, generator=g).to(dev, half)
    ids = torch.randint(0, min(cfg.vocab_size, 100_000), (s,), generator=g).to(dev)
    mask = torch.ones(s, dtype=torch.bool, device=dev)
    mask[: s // 8] = False
    anchors = torch.sort(torch.randperm(s - 1 - s // 8, generator=g)[:n] + s // 8).values.to(dev)
    embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size, device=dev, dtype=half)
    head = LMHead.from_linear(torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device=dev, dtype=half))
    labels, valid = block_labels(ids, mask, anchors, b)
    backend = "flex" if bf16 else "sdpa"
    return {
        "cfg": cfg,
        "model": model,
        "opt": torch.optim.AdamW(model.parameters(), lr=1e-5),
        "inputs": (feats, embed(block_input_ids(ids, anchors, b, cfg.mask_token_id)).detach(), anchors, None, None),
        "backend": backend,
        "masks": build_masks(cfg.layer_types, anchors, s, b, cfg.sliding_window, None, backend),
        "loss": (labels, valid, head, slot_weights(b, params.train.loss_gamma).to(dev), 1.0, 128 * b),
        "autocast": torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16),
        "device": dev,
    }


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def measure(st: dict, checkpointing: bool, repeats: int) -> dict:
    """One mode's figures (module docstring)."""
    model, dev = st["model"], st["device"]
    model.activation_checkpointing = checkpointing
    kept = [0]

    def pack(t):
        kept[0] += t.numel() * t.element_size()
        return t

    def step(timed: list | None):
        st["opt"].zero_grad(set_to_none=True)
        _sync(dev)
        t0 = time.perf_counter()
        with st["autocast"]:
            hidden = model(*st["inputs"], st["backend"], st["masks"])
        out = block_loss(hidden, *st["loss"])
        _sync(dev)
        t1 = time.perf_counter()
        out.loss.backward()
        _sync(dev)
        t2 = time.perf_counter()
        st["opt"].step()
        _sync(dev)
        if timed is not None:
            timed.append((t1 - t0, t2 - t1, time.perf_counter() - t0))

    step(None)  # warm-up: AdamW state, kernels
    gc.collect()
    peak = PeakMemory([dev])
    base = torch.cuda.memory_allocated(dev) / GB if dev.type == "cuda" else rss_gb()
    peak.start()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step(None)
    mem = peak.read()[str(dev)]
    top = mem.get("max_allocated_gb", mem.get("peak_rss_gb"))
    timed: list = []
    for _ in range(repeats):
        step(timed)
    med = [statistics.median(x[i] for x in timed) for i in range(3)]
    return {
        "forward_ms": med[0] * 1e3,
        "backward_ms": med[1] * 1e3,
        "step_ms": med[2] * 1e3,
        "saved_for_backward_gb": kept[0] / GB,
        "step_peak_gb": top - base,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--overlay", action="append", default=[])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--anchors", type=int, default=256)
    ap.add_argument("--layers", type=int, default=0, help="drafter layers (0 = the params' own)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    st = setup(args)
    cfg = st["cfg"]
    rows = {mode: measure(st, mode == "on", args.repeats) for mode in ("off", "on")}
    off, on = rows["off"], rows["on"]
    print(
        f"\n== activation checkpointing: {args.device}, {cfg.num_hidden_layers} drafter layers, hidden "
        f"{cfg.hidden_size}, seq {args.seq}, {args.anchors} anchors x block {cfg.block_size}"
    )
    print(f"{'':<28}{'off':>12}{'on':>12}{'on / off':>10}")
    for key, label in (
        ("saved_for_backward_gb", "saved for backward GB"),
        ("step_peak_gb", "step peak memory GB"),
        ("forward_ms", "forward ms"),
        ("backward_ms", "backward ms"),
        ("step_ms", "step ms"),
    ):
        ratio = on[key] / off[key] if off[key] else float("nan")
        print(f"{label:<28}{off[key]:>12.4f}{on[key]:>12.4f}{ratio:>10.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, **rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
