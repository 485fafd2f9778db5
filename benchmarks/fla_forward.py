"""Hybrid-target forward through fla-core's Gated DeltaNet kernels, timed, and checked against the torch path.

A small Qwen3.5 text decoder from transformers (Qwen3_5ForCausalLM; Qwen3NextForCausalLM with dense MLPs on an
older transformers) with the Qwen3.6-27B target's per-layer geometry (params/targets/qwen3.6-27b.config.json:
hidden 5120, 16 / 48 linear key / value heads of 128, gated full attention 24 x 256, FFN 17408), --layers of
them in the target's 3 linear : 1 full pattern, a small vocabulary, random weights, bf16 on CUDA.

How transformers picks the kernel: on transformers 5.x the modeling module's `torch_chunk_gated_delta_rule`
is a wrapper that imported `fla.ops.gated_delta_rule.chunk_gated_delta_rule` when `fla` imports (fla-core +
triton), else the readable torch reference; on 4.5x each GatedDeltaNet layer holds `chunk_gated_delta_rule`
(fla's, or the torch one). `kernel_in_use` reads which one is active; `force_torch` swaps in the torch
reference (the same function the wrapper falls back to), so the same weights run both paths.

Figures: the kernel in use (`fla_active`: its module is fla's, and the timed forward called it), the forward
time at --tokens (fla and torch), the output difference fla vs torch at --check-tokens (relative L2 of the
logits, max abs difference; PASS under --tolerance).

    python benchmarks/fla_forward.py --device cuda --tokens 4096 --json out.json
    python benchmarks/fla_forward.py --device cpu --smoke --json out.json      # tiny: the torch path only
Needs torch + transformers; fla-core + triton for the kernels (CUDA). Prints a table; --json writes the figures.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
TARGET = REPO / "params/targets/qwen3.6-27b.config.json"


def make_model(layers: int, vocab: int, smoke: bool, device: str, dtype: torch.dtype):
    """(model, modeling module, class name) of a small hybrid decoder with the 27B's layer geometry."""
    text = json.loads(TARGET.read_text())["text_config"]
    geo = {k: text[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")}
    geo.update({k: text[k] for k in ("head_dim", "linear_num_key_heads", "linear_num_value_heads")})
    geo.update({k: text[k] for k in ("linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim")})
    if smoke:
        geo.update(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=32)
        geo.update(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    common = dict(vocab_size=vocab, num_hidden_layers=layers, layer_types=layer_types, rms_norm_eps=1e-6, **geo)
    try:
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        cfg = Qwen3_5TextConfig(**common)
        cls = Qwen3_5ForCausalLM
    except ImportError:  # transformers before Qwen3.5: Qwen3-Next, every layer a dense MLP
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        cfg = Qwen3NextConfig(**common, mlp_only_layers=list(range(layers)), num_experts=0)
        cls = Qwen3NextForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).to(device=device, dtype=dtype).eval()
    return model, sys.modules[cls.__module__], cls.__name__


def _gdn_layers(model) -> list:
    return [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]


def _implementation(fn):
    """What a transformers wrapper calls (its `implementation` closure variable), else fn itself."""
    seen = set()
    while callable(fn) and id(fn) not in seen:
        seen.add(id(fn))
        try:
            inner = inspect.getclosurevars(fn).nonlocals.get("implementation")
        except (TypeError, ValueError):
            inner = None
        if inner is None or inner is fn:
            return fn
        fn = inner
    return fn


def _name(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def kernel_in_use(model, modeling) -> dict:
    """Which chunked delta-rule function the GatedDeltaNet layers call, and the torch reference beside it."""
    layers = _gdn_layers(model)
    if layers and hasattr(layers[0], "chunk_gated_delta_rule"):  # transformers 4.5x: a per-layer attribute
        impl, api = layers[0].chunk_gated_delta_rule, "layer.chunk_gated_delta_rule"
    else:  # transformers 5.x: the module-level wrapper picked fla or the torch reference at import
        impl, api = _implementation(modeling.torch_chunk_gated_delta_rule), "modeling.torch_chunk_gated_delta_rule"
    ref = inspect.unwrap(modeling.torch_chunk_gated_delta_rule)
    conv = _implementation(getattr(modeling, "causal_conv1d_fn", None))
    return {
        "api": api,
        "chunk_gated_delta_rule": _name(impl),
        "fla": _name(impl).startswith("fla."),
        "causal_conv1d": _name(conv) if conv is not None else None,
        "_impl": impl,
        "_ref": ref,
    }


class _Patch:
    """Route every GatedDeltaNet call through `fn` (counting calls) for the duration of a with-block."""

    def __init__(self, model, modeling, info: dict, fn):
        self.model, self.modeling, self.info, self.calls = model, modeling, info, 0
        self.fn = fn

    def _counted(self, *a, **k):
        self.calls += 1
        return self.fn(*a, **k)

    def __enter__(self):
        if self.info["api"].startswith("layer."):
            self.saved = [(m, m.chunk_gated_delta_rule) for m in _gdn_layers(self.model)]
            for m, _ in self.saved:
                m.chunk_gated_delta_rule = self._counted
        else:
            wrapper = self.modeling.torch_chunk_gated_delta_rule
            self.saved = wrapper
            params = set(inspect.signature(self.fn).parameters)

            def call(*a, **k):  # the wrapper drops kwargs the implementation does not take; so do we
                return self._counted(*a, **{n: v for n, v in k.items() if n in params})

            self.modeling.torch_chunk_gated_delta_rule = call
        return self

    def __exit__(self, *exc):
        if self.info["api"].startswith("layer."):
            for m, fn in self.saved:
                m.chunk_gated_delta_rule = fn
        else:
            self.modeling.torch_chunk_gated_delta_rule = self.saved


def _timed_forward(model, ids, device: str, repeats: int) -> tuple[float, float, torch.Tensor]:
    def run():
        with torch.no_grad():
            return model(input_ids=ids, use_cache=False).logits

    t0 = time.perf_counter()
    out = run()  # warm-up: Triton compiles / autotunes the fla kernels here
    if device == "cuda":
        torch.cuda.synchronize()
    warm = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        run()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times), warm, out


def run(args: argparse.Namespace) -> dict:
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model, modeling, cls = make_model(args.layers, args.vocab, args.smoke, device, dtype)
    info = kernel_in_use(model, modeling)
    impl, ref = info.pop("_impl"), info.pop("_ref")
    g = torch.Generator(device="cpu").manual_seed(0)
    long_ids = torch.randint(0, args.vocab, (1, args.tokens), generator=g).to(device)
    short_ids = long_ids[:, : args.check_tokens]
    out = {"model": cls, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", **info}
    out.update(layers=args.layers, tokens=args.tokens, check_tokens=args.check_tokens, dtype=str(dtype))
    out["parameters"] = sum(p.numel() for p in model.parameters())
    paths = {"kernel": impl} if info["fla"] else {}
    paths["torch"] = ref
    logits = {}
    for name, fn in paths.items():
        with _Patch(model, modeling, info, fn) as patch:
            sec, warm, _ = _timed_forward(model, long_ids, device, args.repeats)
            with torch.no_grad():
                logits[name] = model(input_ids=short_ids, use_cache=False).logits.float()
        out[f"{name}_forward_ms"] = sec * 1e3
        out[f"{name}_warmup_s"] = warm
        out[f"{name}_tokens_per_s"] = args.tokens / sec
        out[f"{name}_calls"] = patch.calls
    out["fla_active"] = bool(info["fla"] and out.get("kernel_calls", 0) > 0)
    if "kernel" in logits:
        a, b = logits["kernel"], logits["torch"]
        out["rel_l2_vs_torch"] = float((a - b).norm() / b.norm().clamp_min(1e-12))
        out["max_abs_vs_torch"] = float((a - b).abs().max())
        out["tolerance"] = args.tolerance
        out["matches_torch"] = out["rel_l2_vs_torch"] <= args.tolerance
        out["speedup_vs_torch"] = out["torch_forward_ms"] / out["kernel_forward_ms"]
    if device == "cuda":
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (every 4th full attention)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--tokens", type=int, default=4096, help="tokens of the timed forward")
    p.add_argument("--check-tokens", type=int, default=256, help="tokens of the fla-vs-torch output check")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tolerance", type=float, default=3e-2, help="relative L2 of the logits, fla vs torch")
    p.add_argument("--smoke", action="store_true", help="tiny geometry, 128 tokens (CPU: the torch path only)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.smoke:
        args.tokens, args.check_tokens, args.repeats, args.vocab = 128, 64, 1, 512
    figures = run(args)
    print(
        f"\n== hybrid forward: {figures['model']} x {args.layers} layers on {figures['device']}, {args.tokens} tokens"
    )
    print(f"chunk_gated_delta_rule in use: {figures['chunk_gated_delta_rule']} (fla active: {figures['fla_active']})")
    for name in ("kernel", "torch"):
        if f"{name}_forward_ms" in figures:
            print(
                f"{name:<7} forward {figures[f'{name}_forward_ms']:9.1f} ms  {figures[f'{name}_tokens_per_s']:10.0f} tok/s"
            )
    if "rel_l2_vs_torch" in figures:
        print(
            f"fla vs torch at {args.check_tokens} tokens: rel L2 {figures['rel_l2_vs_torch']:.2e}, max abs "
            f"{figures['max_abs_vs_torch']:.2e} ({'PASS' if figures['matches_torch'] else 'FAIL'} <= {args.tolerance})"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
