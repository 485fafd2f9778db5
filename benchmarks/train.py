"""Training benchmarks: packing efficiency, flex BlockMask vs dense SDPA mask, drafter tokens/s.

1. Packing: real tokens / row capacity of the packer (dflash.train.data.pack_best_fit over windows of
   train.pack_window documents) on demo-like lengths (prompt ~30 + completion 50-100 tokens: 50-130 in all)
   and at the 27B regeneration case's scale (~2,070-token samples, 4096-token rows). Goal on demo-like data: >= 95%.
2. Attention: one packed row of --seq context tokens (one document) with --anchors sorted random anchors, the
   drafter geometry of a params file (+ overlay). Times mask construction, the drafter forward and (with
   --backward, the default on CUDA) a full training step: forward, chunked decayed CE through a random lm_head
   of the target's vocabulary, backward, AdamW step, under bf16 autocast with fp32 master weights on CUDA.
   Backends: flex (BlockMask; create_block_mask and flex_attention compiled on CUDA, eager on CPU, where it
   materialises the scores) and sdpa (dense bool mask).
   On CPU the default is forward-only (a training step at seq 4096 / 512 anchors takes minutes there).
3. Drafter tokens/s = context tokens of the row / step time (the drafter side only: no target forward).

    python benchmarks/train.py                                                  # CPU, demo drafter, forward only
    python benchmarks/train.py --device cuda --overlay params/gpu-qwen3.6-27b.yaml  # H200: the 1.7B drafter
    python benchmarks/train.py --device cuda --seq 4096 --anchors 512 --repeats 10
Prints one table per part; nothing is written.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash.core.loader import load_params  # noqa: E402
from dflash.core.target_config import load_target_arch  # noqa: E402
from dflash.drafter.geometry import build_drafter_config  # noqa: E402
from dflash.drafter.masks import build_masks  # noqa: E402
from dflash.drafter.model import block_input_ids, block_labels, build_drafter  # noqa: E402
from dflash.train.data import pack_best_fit  # noqa: E402
from dflash.train.loss import LMHead, decayed_ce, slot_weights  # noqa: E402


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


def _time(fn, device: torch.device, repeats: int) -> tuple[float, float]:
    fn()  # warm-up (compilation on CUDA)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times), min(times)


def attention(args: argparse.Namespace) -> None:
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
    backward = args.backward if args.backward is not None else device.type == "cuda"
    head = None
    if backward:
        lin = torch.nn.Linear(hid, vocab, bias=False, device=device, dtype=embed.weight.dtype)
        head = LMHead.from_linear(lin)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
    print(
        f"\n== drafter step: {args.device}, layers {cfg.num_hidden_layers}, hidden {hid}, heads "
        f"{cfg.num_attention_heads}x{cfg.head_dim} (kv {cfg.num_key_value_heads}), block {b}, vocab {vocab}, "
        f"seq {s}, anchors {n} ({n * b} queries, {s + n * b} keys), {'train step' if backward else 'forward only'}"
    )
    print(f"{'backend':<8}{'mask ms':>10}{'forward ms':>12}{'step ms':>10}{'drafter tok/s':>15}{'peak GiB':>10}")
    for backend in args.backends:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        mask_t, masks = _time_masks(cfg, anchors, s, backend, device, args.repeats)
        inputs = (feats, block_embeds, anchors, None, None, backend, masks)

        def forward(inputs=inputs):
            with torch.no_grad(), autocast:
                return model(*inputs)

        fwd_t, _ = _time(forward, device, args.repeats)
        step_t = float("nan")
        if backward and not (backend == "flex" and device.type == "cpu"):  # flex has no CPU backward

            def step(inputs=inputs):
                opt.zero_grad(set_to_none=True)
                with autocast:
                    hidden = model(*inputs)
                out = decayed_ce(hidden, labels, valid, head, w, 1.0, params.train.logits_chunk_blocks * b)
                out.loss.backward()
                opt.step()

            step_t, _ = _time(step, device, args.repeats)
        per = step_t if backward else fwd_t
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
        print(
            f"{backend:<8}{mask_t * 1e3:>10.1f}{fwd_t * 1e3:>12.1f}{step_t * 1e3:>10.1f}{s / per:>15.0f}{peak:>10.1f}"
        )


def _time_masks(cfg, anchors, s, backend, device, repeats):
    def make():
        return build_masks(cfg.layer_types, anchors, s, cfg.block_size, cfg.sliding_window, None, backend)

    seconds, _ = _time(make, device, repeats)
    return seconds, make()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--params", default="params.yaml")
    p.add_argument("--overlay", action="append", default=[], help="e.g. params/gpu-qwen3.6-27b.yaml")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--backends", nargs="+", default=["sdpa", "flex"])
    p.add_argument("--backward", action=argparse.BooleanOptionalAction, default=None, help="time a full step")
    p.add_argument("--hidden", type=int, default=256, help="target hidden size without --overlay (demo: 256)")
    p.add_argument("--vocab", type=int, default=151936, help="target vocabulary without --overlay")
    p.add_argument("--target-layers", type=int, default=4, help="target layers without --overlay")
    p.add_argument("--pack-window", type=int, default=1024)
    p.add_argument("--skip-packing", action="store_true")
    args = p.parse_args()
    if not args.skip_packing:
        packing(args.pack_window)
    attention(args)


if __name__ == "__main__":
    main()
