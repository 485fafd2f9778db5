"""Training estimate: FLOPs per sequence of online DFlash training and per-GPU memory for three device
layouts (one GPU, split target / drafter GPUs, data parallel), each with a fits / does-not-fit verdict.

FLOPs: the target forward up to the deepest feature layer (every layer when the loss learns the target's own
predictions, `train.loss_target: target_argmax | target_kl`, plus the target's lm_head forward on the drafted
slots), the drafter's forward + backward with KV injection and its attention, the frozen lm_head on every
drafted slot, at an MFU. Memory: the target_* losses add the final hidden states and the target's logits chunk
beside the drafter's (KL: its log-probabilities and probabilities too).
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

from dflash.core import target_counts
from dflash.core.errors import ParamsError, UserError
from dflash.core.loader import as_dict
from dflash.drafter.flops import DocumentWork, document_flops
from dflash.drafter.geometry import parameter_counts
from dflash.plan import sizing

GB = 1e9


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


TRAIN_KEYS = ("max_length", "num_anchors", "epochs", "batch_size", "grad_accum_steps", "loss_target")
# bytes per vocabulary entry of one logits chunk, by loss target (dflash/train/loss.py): tokens = bf16 logits +
# fp32 log-softmax + fp32 gradient; target_argmax adds the target's fp32 logits; target_kl also its
# log-probabilities, probabilities and the KL's product term.
LOGITS_BYTES = {"tokens": 10, "target_argmax": 14, "target_kl": 22}


def train_inputs(params: Any) -> SimpleNamespace:
    """The plan's training knobs: plan.train_assumptions plus max_length, num_anchors, epochs, batch_size and
    grad_accum_steps from the `train` section, so the plan estimates the run the train stage will do. The train
    stage packs several documents into a row of train.max_tokens_per_row tokens; the plan counts sequences."""
    return SimpleNamespace(
        **as_dict(params.plan.train_assumptions), **{k: getattr(params.train, k) for k in TRAIN_KEYS}
    )


def training_flops_per_sequence(t, d, seq_tokens, loss_tokens, ta) -> dict[str, float]:
    """FLOPs to train on one mean sequence (dflash/drafter/flops.py counts them): target forward, drafter forward +
    backward, frozen lm_head on drafted slots."""
    s = min(seq_tokens, ta.max_length)
    anchors = max(0.0, min(ta.num_anchors, loss_tokens - 1, s - 1))
    # anchors sit in the response (the sequence's tail): mean visible context ~ everything before the response
    # plus half of it; sliding layers see at most their window.
    mean_ctx = max(1.0, s - min(loss_tokens, s) / 2)
    loss_target = getattr(ta, "loss_target", "tokens")
    parts = document_flops(t, d, DocumentWork(tokens=s, anchors=anchors, mean_context=mean_ctx), loss_target)
    nb = anchors * d.block_size
    parts["seq_tokens"] = s
    parts["anchors"] = anchors
    parts["block_tokens"] = nb
    parts["loss_target"] = loss_target
    return parts


def training_memory(t, d, ta, weight_dtype, seq_tokens, anchors) -> dict[str, float]:
    """Per-GPU memory parts (bytes) of online training; combined per layout by training_estimate."""
    s = min(seq_tokens, ta.max_length)
    nb = anchors * d.block_size
    b = ta.batch_size
    h, f = d.hidden_size, d.intermediate_size
    q, kv = d.num_attention_heads * d.head_dim, d.num_key_value_heads * d.head_dim
    p = parameter_counts(d)["total"]
    w = sizing.target_weight_bytes(t, weight_dtype)
    tp = target_counts.target_params(t)
    # Saved per block token per drafter layer: input, norm, q, k, v, attention out, o_proj out, post-norm,
    # gate, up, activation (bf16). Context K/V per layer (pre- and post-norm/RoPE). Logits of one chunk:
    # LOGITS_BYTES per vocab entry.
    per_token_layer = 2 * (4 * h + 2 * q + 2 * kv + 3 * f)
    act = d.num_hidden_layers * nb * per_token_layer + d.num_hidden_layers * s * 2 * kv * 2 * 2 + s * h * 2 * 2
    loss_target = getattr(ta, "loss_target", "tokens")
    logits = min(anchors, ta.logits_chunk_blocks) * d.block_size * t.vocab_size * LOGITS_BYTES[loss_target]
    final = b * s * t.hidden_size * 2 if loss_target != "tokens" else 0  # the target's final hidden states
    return {
        "target_weights": w["loaded"],
        "target_activations": b * s * (4 * t.hidden_size + 3 * t.intermediate_size) * 2,  # one layer's temporaries
        "features": b * s * d.num_target_features * h * 2 + final,  # K concatenated hidden states (bf16)
        "embed_and_head": (tp["embed_tokens"] + (tp["lm_head"] or 0)) * 2,  # drafter-side copy in the split layout
        "drafter_weights": p * 2,
        "drafter_states": p * (ta.state_bytes_per_param - 2),  # grads + fp32 master + AdamW moments
        "drafter_activations": b * act + logits,
        "reserve": ta.runtime_reserve_gb * GB,
    }


def training_at(t, d, hw, ta, weight_dtype, num_gpus, data, planned_gpus) -> dict:
    """training_estimate on `num_gpus` GPUs with the planned layout scaled to them: the split keeps the planned
    share of target GPUs (split_target_gpus of `planned_gpus`, at least one of each kind); one GPU is `single`."""
    if num_gpus < 2:
        return training_estimate(t, d, hw, ta, weight_dtype, num_gpus, data, None, "auto")
    n_t = min(num_gpus - 1, max(1, round(num_gpus * ta.split_target_gpus / planned_gpus)))
    return training_estimate(t, d, hw, ta, weight_dtype, num_gpus, data, n_t, ta.layout)


def training_estimate(t, d, hw, ta, weight_dtype, num_gpus, data, split_target_gpus=None, layout=None) -> dict:
    """Time and per-GPU memory of each device layout on `num_gpus` GPUs; the headline is `layout` (default
    plan.train_assumptions.layout; "auto" = the fastest layout that fits)."""
    flops = training_flops_per_sequence(t, d, data["seq_tokens"], data["loss_tokens"], ta)
    mem = training_memory(t, d, ta, weight_dtype, data["seq_tokens"], flops["anchors"])
    rate = hw.bf16_tflops * 1e12 * ta.mfu
    target_s = flops["target_forward"] / rate
    drafter_s = (flops["total"] - flops["target_forward"]) / rate
    samples = data["train_samples"]
    seqs_per_gpu_step = ta.batch_size * ta.grad_accum_steps
    layouts = {}

    def verdict(parts: dict[str, float]) -> dict:
        need = sum(parts.values()) / GB
        return {"parts_gb": {k: v / GB for k, v in parts.items()}, "need_gb": need, "margin_gb": hw.memory_gb - need}

    def add(name, gpus, per_gpu: dict[str, dict], seq_per_s, ranks):
        checks = {role: verdict(parts) for role, parts in per_gpu.items()}
        epoch_s = samples / seq_per_s
        steps = math.ceil(samples / (seqs_per_gpu_step * ranks))
        layouts[name] = {
            "gpus": gpus,
            "per_gpu": checks,
            "fits": all(c["margin_gb"] >= 0 for c in checks.values()),
            "margin_gb": min(c["margin_gb"] for c in checks.values()),
            "steps_per_epoch": steps,
            "step_s": epoch_s / steps,
            "epoch_hours": epoch_s / 3600,
            "total_hours": ta.epochs * epoch_s / 3600,
            "gpu_hours": ta.epochs * epoch_s / 3600 * gpus,
        }

    both = {k: mem[k] for k in ("target_weights", "target_activations", "features", "drafter_weights")}
    tail = {"drafter_activations": mem["drafter_activations"], "reserve": mem["reserve"]}
    add("single", 1, {"gpu": {**both, "drafter_states": mem["drafter_states"], **tail}}, 1 / (target_s + drafter_s), 1)
    if num_gpus >= 2:
        shard = num_gpus if ta.shard_optimizer else 1
        dp = {**both, "drafter_states": mem["drafter_states"] / shard, **tail}
        add("data_parallel", num_gpus, {"gpu": dp}, num_gpus / (target_s + drafter_s), num_gpus)
        n_t = split_target_gpus or ta.split_target_gpus
        if not 1 <= n_t < num_gpus:
            raise ParamsError(f"plan.train_assumptions.split_target_gpus: need 1 <= {n_t} < {num_gpus} GPUs")
        n_d = num_gpus - n_t
        shard_d = n_d if ta.shard_optimizer else 1
        target_gpu = {k: mem[k] for k in ("target_weights", "target_activations", "features", "reserve")}
        drafter_gpu = {
            "embed_and_head": mem["embed_and_head"],
            "features": mem["features"],
            "drafter_weights": mem["drafter_weights"],
            "drafter_states": mem["drafter_states"] / shard_d,
            **tail,
        }
        # target and drafter GPUs work as a pipeline: the slower side sets the rate
        add(
            "split",
            num_gpus,
            {"target_gpu": target_gpu, "drafter_gpu": drafter_gpu},
            min(n_t / target_s, n_d / drafter_s),
            n_d,
        )
        layouts["split"]["target_gpus"] = n_t
        layouts["split"]["feature_transfer_ms_per_seq"] = (
            mem["features"] / ta.batch_size / (hw.interconnect_gbps * GB) * 1e3 if hw.interconnect_gbps > 0 else None
        )
    choice = layout or ta.layout
    if choice == "auto":
        fitting = [k for k, v in layouts.items() if v["fits"]]
        choice = min(fitting, key=lambda k: layouts[k]["total_hours"]) if fitting else "single"
    elif choice not in layouts:
        raise UserError(f"plan.train_assumptions.layout: {choice!r} needs at least 2 GPUs (plan has {num_gpus})")
    return {
        "flops_per_sequence": flops,
        "seconds_per_sequence_one_gpu": target_s + drafter_s,
        "target_seconds_per_sequence": target_s,
        "drafter_seconds_per_sequence": drafter_s,
        "memory_parts_gb": {k: v / GB for k, v in mem.items()},
        "layouts": layouts,
        "layout": choice,
        "headline": layouts[choice],
    }
