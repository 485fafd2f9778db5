"""The training pilot at the Qwen3.6-27B drafter's geometry on one GPU (what benchmarks/gpu_check.sh's `pilot` step runs).

The drafter is the real one (params/gpu-qwen3.6-27b.yaml: a DFlash2 on a body of 5 layers, 32 x 128 heads, FFN 17408,
block 16, K = 5 features: 1.92 B parameters, 1.73 B of them the DFlash body); the target is a random-weight Qwen3.5
text decoder of the real width (hidden 5120, vocabulary 248,320, the 27B's gated attention and Gated DeltaNet layer
geometry, params/targets/qwen3.6-27b.config.json) with only --layers decoder layers (3 linear : 1 full, features from
layers 0..4), so its forward is a fraction of the real one while the drafter side, the logits over the real
vocabulary and the memory of the worst rows are at real scale. Data: --docs synthetic documents with the case's
lengths (lognormal around ~2,070 tokens, cut at train.max_length 4096; the first eighth unsupervised). The pilot
itself is dflash/train/pilot.py, in this process, with the overlay's settings on one device (target and drafter on
cuda:0, flex attention, bf16).

    python benchmarks/pilot_27b.py --device cuda --json OUT/pilot.json
    python benchmarks/pilot_27b.py --device cpu --smoke --json OUT/pilot.json   # tiny sizes: the code path only
Writes --json: the pilot's headline, its attention path and kernels, the target's size; prints them. Exit status 1
when the pilot's verdict is not ok (an out-of-memory is a figure: its line is kept).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dflash.core.loader import load_params  # noqa: E402
from dflash.train.data import write_shard  # noqa: E402
from dflash.train.pilot import run_pilot  # noqa: E402

OVERLAY = REPO / "params/gpu-qwen3.6-27b.yaml"
TARGET = REPO / "params/targets/qwen3.6-27b.config.json"
MASK = 248070  # the overlay's drafter.mask_token_id: never in the data


def build_target(folder: Path, layers: int, smoke: bool, device: str) -> dict:
    """A random Qwen3.5 text decoder of the 27B's layer geometry (or a tiny one with --smoke), saved in `folder`."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    text = json.loads(TARGET.read_text())["text_config"]
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    keep += ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
    keep += ("linear_conv_kernel_dim", "vocab_size", "attn_output_gate", "rms_norm_eps", "rope_parameters")
    geo = {k: text[k] for k in keep if k in text}
    if smoke:
        geo.update(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=32)
        geo.update(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
        geo.update(vocab_size=512)
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    cfg = Qwen3_5TextConfig(**geo, num_hidden_layers=layers, layer_types=types, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3_5ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(folder)
    (folder / "target.json").write_text(json.dumps({"source": "random", "model": str(folder), "revision": ""}))
    params = sum(p.numel() for p in model.parameters())
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"layers": layers, "hidden_size": geo["hidden_size"], "vocab_size": geo["vocab_size"], "parameters": params}


def write_data(folder: Path, docs: int, vocab: int, max_length: int, seed: int = 0) -> dict:
    """Synthetic documents with the case's length distribution (module docstring)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(1700), 0.6, docs).astype(int), 64, max_length)
    lengths[0] = max_length  # the data holds a document of the full length: the worst rows must find it
    samples = []
    for n in lengths:
        ids = rng.integers(10, vocab - 300, int(n))
        ids[ids == MASK] = 11
        prompt = int(n) // 8
        samples.append((ids.tolist(), [0] * prompt + [1] * (int(n) - prompt), prompt))
    folder.mkdir(parents=True, exist_ok=True)
    write_shard(folder / "shard-00000.arrow", samples, "p")
    return {"documents": docs, "max_length": int(lengths.max()), "mean_length": float(lengths.mean())}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=6, help="target decoder layers (features from layers 0..4)")
    ap.add_argument("--docs", type=int, default=48)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny target and drafter on CPU: the code path only")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--work", type=Path, default=None, help="folder for the target and data (default: a temp dir)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        root = Path(tmp)
        target = build_target(root / "target", args.layers, args.smoke, args.device)
        max_length = 256 if args.smoke else 4096
        data = write_data(root / "tok" / "train", 16 if args.smoke else args.docs, target["vocab_size"], max_length)
        dev = "cpu" if args.device == "cpu" else "cuda:0"
        overrides = [
            f"base.target_dir={root / 'target'}",
            f"base.reports_dir={root / 'reports'}",
            f"tokenize.out={root / 'tok'}",
            f"train.out={root / 'train'}",
            "drafter.target_layer_ids=[0, 1, 2, 3, 4]",
            f"train.target_device={dev}",
            f"train.drafter_device={dev}",
            "train.gpus_per_process=1",
            f"train.pilot_warmup_steps={args.warmup}",
            f"train.pilot_steps={args.steps}",
            "plan.hardware_file=params/hardware.yaml",
        ]
        if args.smoke:  # the demo's tiny drafter on the tiny target, dense attention, fp32
            overrides += [
                "drafter.num_hidden_layers=2",
                "drafter.num_attention_heads=2",
                "drafter.num_key_value_heads=1",
                "drafter.head_dim=32",
                "drafter.intermediate_size=128",
                "drafter.mask_token_id=511",
                "drafter.block_size=4",
                "drafter.layer_types=[]",
                f"train.max_length={max_length}",
                f"train.max_tokens_per_row={max_length}",
                "train.num_anchors=16",
                "train.attention=sdpa",
                "train.dtype=float32",
                "train.logits_chunk_blocks=8",
                "plan.hardware_file=params/hardware-host.yaml",
                "plan.hardware=cpu-host",
            ]
        params = load_params(REPO / "params.yaml", overrides, [OVERLAY])
        report = run_pilot(params, root / "tok" / "train")
    keys = ("verdict", "problem", "device", "layout", "dtype", "step_seconds", "worst_step_seconds", "tokens_per_s")
    keys += ("samples_per_s", "peak_memory_gb", "peak_phase", "peak_memory_by_phase", "device_memory_gb")
    keys += ("achieved_tflops", "peak_tflops", "peak_source", "mfu", "first_loss", "ln_vocab", "feature_rms")
    keys += ("longest_document", "max_row_anchors", "attention_path", "linear_attention", "activation_checkpointing")
    out = {k: report.get(k) for k in keys}
    out["target"], out["data"], out["seconds"] = target, data, time.perf_counter() - t0
    out["phase_seconds"] = {n: p["share"] for n, p in report["phases"].items()}
    for k, v in out.items():
        print(f"{k:<26}{v}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2, default=str) + "\n")
    if report["verdict"] != "ok":
        raise SystemExit(1)


if __name__ == "__main__":
    main()
