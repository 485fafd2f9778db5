"""Training benchmarks: packing efficiency, flex BlockMask vs dense SDPA mask, drafter tokens/s, FLOPs and MFU.

1. Packing: real tokens / row capacity of the packer (dflash.train.data.pack_best_fit over windows of
   train.pack_window documents) on demo-like lengths (prompt ~30 + completion 50-100 tokens: 50-130 in all)
   and at the 27B regeneration case's scale (~2,070-token samples, 4096-token rows). Goal on demo-like data: >= 95%.
2. Attention: one packed row of --seq context tokens (one document) with --anchors sorted random anchors, the
   drafter geometry of a params file (+ overlay). Times mask construction, the drafter forward and (with
   --backward, the default on CUDA) a full training step: forward, chunked decayed CE through a random lm_head
   of the target's vocabulary, backward, AdamW step, under bf16 autocast with fp32 master weights on CUDA.
   Backends: sdpa (dense bool mask), flex (BlockMask; create_block_mask and the flex_attention kernel compiled
   on CUDA, eager on CPU, where it materialises the scores) and flex-compiled (flex with the whole drafter under
   torch.compile(dynamic=True), as train.compile=true runs it; CUDA only). A backend that fails (OOM, compile
   error) gets an `error` row; the others still run. Goal on CUDA at seq 4096 / 512 anchors: flex >= 3x dense.
   On CPU the default is forward-only (a training step at seq 4096 / 512 anchors takes minutes there).
3. Drafter tokens/s = context tokens of the row / step time (the drafter side only: no target forward).
4. FLOPs per step: dflash.plan.training_costs.training_flops_per_sequence (the planner's model: the drafter's
   parameter count per block / context token, attention over the visible keys, the frozen lm_head on the
   drafted slots) minus its target-forward part; MFU = FLOPs / step time / the GPU's dense bf16 peak from
   params/hardware.yaml (matched by device name) or --peak-tflops.

    python benchmarks/train.py                                                  # CPU, demo drafter, forward only
    python benchmarks/train.py --device cuda --overlay params/gpu-qwen3.6-27b.yaml  # H200: the 1.7B drafter
    python benchmarks/train.py --device cuda --overlay params/gpu-qwen3.6-27b.yaml --skip-packing \
        --backends sdpa flex flex-compiled --repeats 5 --json out.json          # what benchmarks/gpu_check.sh runs
    python benchmarks/train.py --device cpu --smoke --json out.json             # tiny sizes: checks the code path
Prints one table per part; --json PATH also writes the attention figures as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dflash.core.loader import load_params  # noqa: E402
from dflash.core.target_config import as_target_arch, load_target_arch  # noqa: E402
from dflash.drafter.geometry import build_drafter_config, parameter_counts  # noqa: E402
from dflash.drafter.masks import build_masks  # noqa: E402
from dflash.drafter.model import block_input_ids, block_labels, build_drafter  # noqa: E402
from dflash.plan.inputs import load_hardware  # noqa: E402
from dflash.plan.training_costs import training_flops_per_sequence  # noqa: E402
from dflash.train.data import pack_best_fit  # noqa: E402
from dflash.train.loss import LMHead, block_loss, slot_weights  # noqa: E402

BACKENDS = ("sdpa", "flex", "flex-compiled")
SPEEDUP_GOAL = 3.0  # flex step vs dense-mask step at seq 4096 / 512 anchors (issue 17)


def packing(window: int) -> None:
    rng = np.random.default_rng(0)
    cases = {
        "demo-like 50-130": rng.integers(50, 131, 4000),
        "demo-like 400 docs": rng.integers(50, 131, 400),
        "27B case ~2070 (lognormal)": np.clip(rng.lognormal(np.log(1700), 0.6, 4000).astype(int), 16, 4096),
    }
    print(f"\n== packing efficiency (best-fit decreasing over windows of {window} documents)")
    print(f"{'lengths':<26}{'row capacity':>14}{'rows':>8}{'efficiency':>12}")
    for name, lengths in cases.items():
        caps = (4096, 8192) if "27B case" in name else (256, 512, 1024, 2048)
        for cap in caps:
            rows = 0
            for s in range(0, len(lengths), window):
                rows += len(pack_best_fit(lengths[s : s + window], cap))
            print(f"{name:<26}{cap:>14}{rows:>8}{lengths.sum() / (rows * cap):>12.3f}")


def _time(fn, device: torch.device, repeats: int, warmup: int = 1) -> tuple[float, float, float]:
    """(median, min, warm-up seconds): warm-up calls first (compilation on CUDA)."""
    t0 = time.perf_counter()
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    warm = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times), min(times), warm


def gpu_peak_tflops(device_name: str, hardware_file: Path = REPO / "params/hardware.yaml") -> tuple[float, str]:
    """Dense bf16 peak of the params/hardware.yaml profile whose key names this device (h200 in "NVIDIA H200",
    rtx-pro-6000 in "NVIDIA RTX PRO 6000 Blackwell ..."): (tflops, profile key); (nan, "") when none matches."""
    dev = re.sub(r"[^A-Z0-9]", "", device_name.upper())
    for key, prof in load_hardware(hardware_file).items():
        token = re.sub(r"[^A-Z0-9]", "", key.upper().replace("-SXM", ""))
        if token and token in dev:
            return float(prof.bf16_tflops), key
    return float("nan"), ""


def step_flops(target, cfg, seq: int, anchors: int, prompt: int) -> dict[str, float]:
    """FLOPs of one drafter training step on a row of `seq` tokens (`prompt` of them outside the loss) with
    `anchors` blocks: the planner's model (dflash/plan/training.py) without the target forward."""
    ta = SimpleNamespace(max_length=seq, num_anchors=anchors, loss_target="tokens")
    flops = training_flops_per_sequence(as_target_arch(target), cfg, ta, seq_tokens=seq, loss_tokens=seq - prompt)
    parts = dataclasses.asdict(flops)
    drafter = {k: v for k, v in parts.items() if k.startswith(("drafter_", "lm_head"))}
    return {**drafter, "total": sum(drafter.values()), "simple_6PN": flops.simple_6PN}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--params", default=str(REPO / "params.yaml"))
    p.add_argument("--overlay", action="append", default=[], help="e.g. params/gpu-qwen3.6-27b.yaml")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--backends", nargs="+", default=["sdpa", "flex"], choices=BACKENDS)
    p.add_argument("--backward", action=argparse.BooleanOptionalAction, default=None, help="time a full step")
    p.add_argument("--hidden", type=int, default=256, help="target hidden size without --overlay (demo: 256)")
    p.add_argument("--vocab", type=int, default=151936, help="target vocabulary without --overlay")
    p.add_argument("--target-layers", type=int, default=4, help="target layers without --overlay")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="dense bf16 peak for MFU (0: params/hardware.yaml)")
    p.add_argument("--pack-window", type=int, default=1024)
    p.add_argument("--skip-packing", action="store_true")
    p.add_argument(
        "--smoke", action="store_true", help="tiny sizes (demo drafter, hidden 64, seq 256, 16 anchors, no overlay)"
    )
    p.add_argument("--json", type=Path, default=None, help="write the attention figures here")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.smoke:
        args.overlay, args.seq, args.anchors, args.repeats = [], 256, 16, 1
        args.hidden, args.target_layers, args.skip_packing = 64, 4, True  # the real vocab: mask_token_id
    return args


def attention(args: argparse.Namespace) -> dict:
    """Time each backend; print the table and return the figures (also what --json writes)."""
    device = torch.device(args.device)
    params = load_params(args.params, overlays=args.overlay)
    tiny = params.target.tiny  # only hidden size, vocabulary and layer count shape the drafter; the rest as the demo's
    target_cfg = {
        "hidden_size": args.hidden,
        "vocab_size": args.vocab,
        "num_hidden_layers": args.target_layers,
        "num_attention_heads": tiny.num_attention_heads,
        "intermediate_size": tiny.intermediate_size,
    }
    if args.overlay:  # the overlay names a real target config (params/targets/...)
        target_cfg = load_target_arch(params.plan.target_config)
    cfg = build_drafter_config(params.drafter, target_cfg)
    hid, vocab, b = cfg.hidden_size, cfg.vocab_size, cfg.block_size
    bf16 = device.type == "cuda"
    torch.manual_seed(0)
    model = build_drafter(cfg, device=device)
    g = torch.Generator(device="cpu").manual_seed(0)
    s, n = args.seq, args.anchors
    feats = torch.randn(s, cfg.num_target_features * hid, generator=g).to(device, torch.bfloat16 if bf16 else None)
    ids = torch.randint(0, min(vocab, 100_000), (s,), generator=g).to(device)
    loss_mask = torch.ones(s, dtype=torch.bool, device=device)
    loss_mask[: s // 8] = False  # a prompt
    anchors = torch.sort(torch.randperm(s - 1 - s // 8, generator=g)[:n] + s // 8).values.to(device)
    embed = torch.nn.Embedding(vocab, hid, device=device, dtype=torch.bfloat16 if bf16 else torch.float32)
    block_embeds = embed(block_input_ids(ids, anchors, b, cfg.mask_token_id)).detach()
    labels, valid = block_labels(ids, loss_mask, anchors, b)
    w = slot_weights(b, params.train.loss_gamma).to(device)
    backward = args.backward if args.backward is not None else (device.type == "cuda" or args.smoke)
    head = None
    if backward:
        lin = torch.nn.Linear(hid, vocab, bias=False, device=device, dtype=embed.weight.dtype)
        head = LMHead.from_linear(lin)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
    flops = step_flops(target_cfg, cfg, s, n, s // 8)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak, peak_src = (args.peak_tflops, "--peak-tflops") if args.peak_tflops else gpu_peak_tflops(name)
    out = {
        "device": name,
        "seq": s,
        "anchors": n,
        "train_step": backward,
        "dtype": "bf16 autocast, fp32 master weights" if bf16 else "fp32",
        "geometry": {
            "layers": cfg.num_hidden_layers,
            "layer_types": list(cfg.layer_types),
            "hidden": hid,
            "heads": cfg.num_attention_heads,
            "kv_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim,
            "block": b,
            "vocab": vocab,
            "parameters": parameter_counts(cfg)["total"],
        },
        "flops_per_step": flops,
        "peak_tflops": peak if peak == peak else None,
        "peak_source": f"params/hardware.yaml profile {peak_src}" if peak_src and not args.peak_tflops else peak_src,
        "backends": {},
    }
    print(
        f"\n== drafter step: {name}, layers {cfg.num_hidden_layers}, hidden {hid}, heads "
        f"{cfg.num_attention_heads}x{cfg.head_dim} (kv {cfg.num_key_value_heads}), block {b}, vocab {vocab}, "
        f"{out['geometry']['parameters'] / 1e9:.3f} B params, seq {s}, anchors {n} ({n * b} queries, {s + n * b} "
        f"keys), {'train step' if backward else 'forward only'}, {flops['total'] / 1e12:.2f} TFLOP a step"
    )
    print(
        f"{'backend':<14}{'mask ms':>9}{'forward ms':>12}{'step ms':>10}{'warm-up s':>11}{'drafter tok/s':>15}"
        f"{'peak GiB':>10}{'TFLOP/s':>9}{'MFU':>7}"
    )
    for backend in args.backends:
        row = out["backends"][backend] = {}
        if backend == "flex-compiled" and device.type != "cuda":
            row["skipped"] = "torch.compile of the drafter: CUDA only in this benchmark"
            print(f"{backend:<14}skipped: {row['skipped']}")
            continue
        try:
            fwd, ctx = _forward_figures(
                backend, model, autocast, device, cfg, feats, block_embeds, anchors, s, args, backward
            )
            row.update(fwd)
            if backward and backend != "sdpa" and device.type == "cpu":
                row["step_skipped"] = "flex_attention has no CPU backward"
            elif backward:
                row.update(_step_figures(ctx, opt, labels, valid, head, w, params.train.logits_chunk_blocks * b))
        except Exception as exc:  # an OOM or a compile error in one backend must not hide the others' figures
            lines = str(exc).strip().splitlines()
            row["error"] = f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]
            traceback.print_exc()
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        per = row.get("step_ms") if backward else row.get("forward_ms")
        if per:
            row["tokens_per_s"] = s / (per / 1e3)
            if backward:
                row["tflops_per_s"] = flops["total"] / (per / 1e3) / 1e12
                row["mfu"] = row["tflops_per_s"] / peak if peak == peak else None
        _print_row(backend, row)
        _save(args.json, out)  # after every backend: a run killed by its time budget keeps what it measured
    for basis in ("step", "forward") if backward else ("forward",):  # CPU: flex has no backward: compare forwards
        times = {k: v.get(f"{basis}_ms") for k, v in out["backends"].items()}
        flex = [v for k, v in times.items() if k.startswith("flex") and v]
        if times.get("sdpa") and flex:
            out["speedup_flex_vs_dense"] = times["sdpa"] / min(flex)
            out["speedup_basis"] = basis
            out["goal_speedup"] = SPEEDUP_GOAL
            out["goal_met"] = out["speedup_flex_vs_dense"] >= SPEEDUP_GOAL if basis == "step" else None
            print(f"flex vs dense {basis}: {out['speedup_flex_vs_dense']:.2f}x (goal >= 3x on the training step)")
            break
    _save(args.json, out)
    return out


def _save(path: Path | None, figures: dict) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(figures, indent=2, default=str) + "\n")


def _forward_figures(backend, model, autocast, device, cfg, feats, block_embeds, anchors, s, args, backward):
    """Mask and forward timings of one backend, and what the step timing needs (module, inputs, warm-up).
    flex-compiled with a training step times no separate forward (it would compile a second, no-grad graph)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    kind = "flex" if backend.startswith("flex") else "sdpa"
    module = torch.compile(model, dynamic=True) if backend == "flex-compiled" else model
    warmup = 2 if backend == "flex-compiled" else 1  # a dynamic recompile can follow the first call

    def make():
        return build_masks(cfg.layer_types, anchors, s, cfg.block_size, cfg.sliding_window, None, kind)

    mask_t, _, _ = _time(make, device, args.repeats)
    inputs = (feats, block_embeds, anchors, None, None, kind, make())

    def forward():
        with torch.no_grad(), autocast:
            return module(*inputs)

    row = {"mask_ms": mask_t * 1e3}
    if not (backward and backend == "flex-compiled"):
        fwd_t, _, fwd_warm = _time(forward, device, args.repeats, warmup)
        row.update(forward_ms=fwd_t * 1e3, forward_warmup_s=fwd_warm)
    return row, (module, autocast, device, inputs, args.repeats, warmup)


def _step_figures(ctx, opt, labels, valid, head, w, chunk: int) -> dict:
    """One training step: forward, chunked decayed CE through the lm_head, backward, AdamW."""
    module, autocast, device, inputs, repeats, warmup = ctx

    def step():
        opt.zero_grad(set_to_none=True)
        with autocast:
            hidden = module(*inputs)
        out = block_loss(hidden, labels, valid, head, slot_w=w, normaliser=1.0, chunk_rows=chunk)
        out.loss.backward()
        opt.step()

    step_t, step_min, warm = _time(step, device, repeats, warmup)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return {"step_ms": step_t * 1e3, "step_min_ms": step_min * 1e3, "step_warmup_s": warm, "peak_gib": peak}


def _print_row(backend: str, row: dict) -> None:
    if "error" in row:
        print(f"{backend:<14}error: {row['error']}")
        return

    def f(key, scale=1.0, fmt=".1f"):
        v = row.get(key)
        return format(v * scale, fmt) if isinstance(v, (int, float)) and v == v else "-"

    print(
        f"{backend:<14}{f('mask_ms'):>9}{f('forward_ms'):>12}{f('step_ms'):>10}{f('step_warmup_s'):>11}"
        f"{f('tokens_per_s', fmt='.0f'):>15}{f('peak_gib'):>10}{f('tflops_per_s'):>9}{f('mfu', fmt='.3f'):>7}"
    )


def main(argv=None) -> None:
    args = parse_args(argv)
    if not args.skip_packing:
        packing(args.pack_window)
    attention(args)


if __name__ == "__main__":
    main()
