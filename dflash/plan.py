"""Plan: time, memory and cost of generation and training, before any GPU time is spent.

Pure arithmetic on configs and measurements (no torch, no model download):
- the target's config.json (`plan.target_config`, default `${base.target_dir}/config.json`),
  counted by dflash.sizing; the drafter from the `drafter` params;
- a GPU profile (`plan.hardware` in `plan.hardware_file`) and a GPU count;
- the dataset: `audit.json` (num_conversations, mean prompt tokens) and `tokenize.json`
  (num_samples, total_tokens, loss_tokens) when they exist, else the `plan.dataset` fallbacks;
- the generate pilot (`pilot.json`) when it exists: estimate vs measured, and the measured mean
  output length and rate drive the wall time.

Models (every knob a param, every assumption printed in the report):
- generation: one vLLM engine per `tensor_parallel_size` GPUs. Decode is a roofline per engine:
  a step at batch b reads the weights once plus each sequence's KV cache and Gated DeltaNet state
  (bytes / (bandwidth x efficiency)) and does 2 x params FLOPs per token (/ (peak x decode_mfu));
  the slower of the two is the step time. b = min(max_num_seqs, sequences that fit in the cache).
  In continuous batching long sequences stay resident longer, so the mean resident length is
  prompt + mean_output x (1 + cv^2) / 2 (cv: coefficient of variation of output lengths).
- training: FLOPs per sequence (target forward up to the last feature layer, drafter forward +
  backward with KV injection and its attention, the frozen lm_head on drafted slots) at an MFU;
  per-GPU memory for three device layouts with a fits / does-not-fit verdict and the margin.

Command: python -m stages.plan --params params.yaml [--overlay params/gpu-qwen3.6-27b.yaml]
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace
from typing import Any

from dflash import sizing
from dflash.config import as_dict
from dflash.plan_inputs import (
    GpuProfile,
    dataset_inputs,
    load_hardware,
    load_target,
    number,
    resolve_paths,
    select_gpu,
)

GB = 1e9


# --------------------------------------------------------------------------------------------
# The seeds' arithmetic, as small named functions (tested against their numbers)
# --------------------------------------------------------------------------------------------


def batch1_tokens_per_s(weight_bytes: float, bandwidth_bytes_per_s: float) -> float:
    """Decode at batch 1 reads every weight once per token: tokens/s <= bandwidth / weight bytes."""
    return bandwidth_bytes_per_s / weight_bytes


def wall_seconds(tokens: float, tokens_per_s: float) -> float:
    return tokens / tokens_per_s if tokens_per_s > 0 else math.inf


def headroom_bytes(memory_bytes: float, weight_bytes: float, utilization: float = 1.0, reserve_bytes: float = 0.0):
    """Memory left for the KV cache / GDN state once the weights (and a reserve) are in."""
    return memory_bytes * utilization - weight_bytes - reserve_bytes


# --------------------------------------------------------------------------------------------
# Generation
# --------------------------------------------------------------------------------------------


def decode_step(t, hw, gp, weight_read_bytes, batch, context, tp):
    """One decode step of one engine at `batch` sequences of `context` cached tokens each."""
    kv = sizing.kv_bytes_per_token(t, gp.kv_cache_dtype, context) * context
    state = sizing.linear_state_bytes(t, gp.ssm_state_dtype)
    step_bytes = weight_read_bytes + batch * (kv + 2 * state)  # the GDN state is read and written back
    mem_s = step_bytes / (tp * hw.bandwidth_tbps * 1e12 * gp.bandwidth_efficiency)
    flops = batch * sizing.decode_flops_per_token(t, context)
    compute_s = flops / (tp * hw.bf16_tflops * 1e12 * gp.decode_mfu)
    step = max(mem_s, compute_s)
    return {
        "batch": batch,
        "step_ms": step * 1e3,
        "memory_ms": mem_s * 1e3,
        "compute_ms": compute_s * 1e3,
        "tokens_per_s": batch / step,
        "bound": "bandwidth" if mem_s >= compute_s else "compute",
    }


def generation_capacity(t, hw, gp, weight_dtype, context):
    """Per-engine memory budget: weights, reserve, cache headroom and the sequences that fit."""
    tp = gp.tensor_parallel_size
    w = sizing.target_weight_bytes(t, weight_dtype)
    free = headroom_bytes(hw.memory_gb * GB, w["loaded"] / tp, gp.gpu_memory_utilization, gp.activation_reserve_gb * GB)
    per_seq = sizing.kv_bytes_per_token(t, gp.kv_cache_dtype, context) * context + sizing.linear_state_bytes(
        t, gp.ssm_state_dtype
    )
    longest = sizing.kv_bytes_per_token(t, gp.kv_cache_dtype, gp.max_model_len) * gp.max_model_len
    longest += sizing.linear_state_bytes(t, gp.ssm_state_dtype)
    capacity = int(free * tp // per_seq) if free > 0 else 0
    return {
        "weights_gb_per_gpu": w["loaded"] / tp / GB,
        "budget_gb_per_gpu": hw.memory_gb * gp.gpu_memory_utilization,
        "reserve_gb_per_gpu": gp.activation_reserve_gb,
        "cache_gb_per_gpu": free / GB,
        "headroom_gb_full_card": headroom_bytes(hw.memory_gb * GB, w["loaded"] / tp) / GB,
        "resident_context_tokens": context,
        "kv_kb_per_token": sizing.kv_bytes_per_token(t, gp.kv_cache_dtype, context) / 1e3,
        "state_mb_per_seq": sizing.linear_state_bytes(t, gp.ssm_state_dtype) / 1e6,
        "cache_mb_per_seq": per_seq / 1e6,
        "max_seqs_in_cache": capacity,
        "batch": min(gp.max_num_seqs, capacity),
        "fits": free > 0,
        "max_model_len_fits": free > 0 and longest <= free * tp,
    }


def generation_rate(t, hw, gp, weight_dtype, num_gpus, prompt_tokens, output_tokens):
    """Aggregate decode tokens/s over all engines at a given mean output length."""
    context = prompt_tokens + output_tokens * (1 + gp.output_length_cv**2) / 2
    cap = generation_capacity(t, hw, gp, weight_dtype, context)
    engines = num_gpus // gp.tensor_parallel_size
    if not cap["fits"] or cap["batch"] < 1 or engines < 1:
        return cap, None, 0.0
    read = sizing.target_weight_bytes(t, weight_dtype)["read_per_step"]
    step = decode_step(t, hw, gp, read, cap["batch"], context, gp.tensor_parallel_size)
    return cap, step, engines * step["tokens_per_s"]


def generation_estimate(t, hw, gp, weight_dtype, num_gpus, data, price) -> dict:
    ds_low, ds_high = data["low"], data["high"]
    prompts, prompt_tokens, mean_out = data["num_prompts"], data["mean_prompt_tokens"], data["mean_output_tokens"]
    tp = gp.tensor_parallel_size
    engines = num_gpus // tp
    if engines < 1:
        raise ValueError(f"plan.num_gpus: {num_gpus} GPUs cannot hold one engine of generate.tensor_parallel_size={tp}")
    w = sizing.target_weight_bytes(t, weight_dtype)
    cap, step, rate = generation_rate(t, hw, gp, weight_dtype, num_gpus, prompt_tokens, mean_out)
    prefill_per_prompt = sizing.prefill_flops(t, prompt_tokens, with_head=False) + 2 * t.vocab_size * t.hidden_size
    prefill_s = prompts * prefill_per_prompt / (num_gpus * hw.bf16_tflops * 1e12 * gp.prefill_mfu)

    def wall_h(out_tokens):  # None when the model does not fit (no rate): JSON has no infinity
        _, _, r = generation_rate(t, hw, gp, weight_dtype, num_gpus, prompt_tokens, out_tokens)
        return (wall_seconds(prompts * out_tokens, r) + prefill_s) / 3600 if r > 0 else None

    curve = []
    if cap["fits"]:
        sizes = sorted({b for b in (1, 8, 16, 32, 64, 128, 256, 512, 1024) if b <= max(1, cap["max_seqs_in_cache"])})
        for b in sorted(set(sizes) | ({cap["batch"]} if cap["batch"] else set())):
            curve.append(decode_step(t, hw, gp, w["read_per_step"], b, cap["resident_context_tokens"], tp))
    out = {
        "engines": engines,
        "tensor_parallel_size": tp,
        "weights_gb": w["loaded"] / GB,
        "weights_read_per_step_gb": w["read_per_step"] / GB,
        "batch1_bound_tokens_per_s": batch1_tokens_per_s(w["read_per_step"] / tp, hw.bandwidth_tbps * 1e12 * tp),
        "memory": cap,
        "decode_curve": curve,
        "step": step,
        "model_tokens_per_s": rate,
        "output_tokens": prompts * mean_out,
        "prompt_tokens": prompts * prompt_tokens,
        "prefill_hours": prefill_s / 3600,
        "model_wall_hours": {"low": wall_h(ds_low), "mid": wall_h(mean_out), "high": wall_h(ds_high)},
    }
    out["wall_hours"] = dict(out["model_wall_hours"])
    out["wall_source"] = "model (output length range from params)"
    pilot = data.get("pilot")
    if pilot:
        measured = number(pilot, ("output_tokens_per_s",))
        if not measured:
            raise ValueError("pilot.json: missing output_tokens_per_s (needed when a pilot file exists)")
        pilot_engines = number(pilot, ("num_engines",)) or engines
        per_engine_model = rate / engines if engines else 0.0
        per_engine_measured = measured / pilot_engines
        calibrated = (out["output_tokens"] / (per_engine_measured * engines)) / 3600
        model_mid = out["model_wall_hours"]["mid"]
        out["pilot"] = {
            "measured_tokens_per_s": measured,
            "pilot_engines": pilot_engines,
            "measured_per_engine": per_engine_measured,
            "model_per_engine": per_engine_model,
            "measured_over_model": per_engine_measured / per_engine_model if per_engine_model else None,
            "mean_output_tokens": number(pilot, ("mean_output_tokens",)),
            "p10_output_tokens": number(pilot, ("p10_output_tokens",)),
            "p90_output_tokens": number(pilot, ("p90_output_tokens",)),
            "pilot_estimated_total_hours": number(pilot, ("estimated_total_hours",)),
            "calibrated_wall_hours": calibrated,
        }
        both = [h for h in (model_mid, calibrated) if h is not None]
        out["wall_hours"] = {"low": min(both), "mid": calibrated, "high": max(both)}
        out["wall_source"] = "pilot-measured rate per engine x engines (range: model vs measured)"
    mid = out["wall_hours"]["mid"]
    out["gpu_hours"] = mid * num_gpus if mid is not None else None
    out["cost_usd"] = out["gpu_hours"] * price if price > 0 and mid is not None else None
    return out


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


TRAIN_KEYS = ("max_length", "num_anchors", "epochs", "batch_size", "grad_accum_steps")


def train_inputs(params: Any) -> SimpleNamespace:
    """The plan's training knobs: plan.train_assumptions plus max_length, num_anchors, epochs, batch_size and
    grad_accum_steps from the `train` section, so the plan estimates the run the train stage will do. The train
    stage packs several documents into a row of train.max_tokens_per_row tokens; the plan counts sequences."""
    return SimpleNamespace(
        **as_dict(params.plan.train_assumptions), **{k: getattr(params.train, k) for k in TRAIN_KEYS}
    )


def training_flops_per_sequence(t, d, seq_tokens, loss_tokens, ta) -> dict[str, float]:
    """FLOPs to train on one sequence: target forward, drafter forward + backward, frozen lm_head on drafted slots."""
    s = min(seq_tokens, ta.max_length)
    anchors = max(0.0, min(ta.num_anchors, loss_tokens - 1, s - 1))
    nb = anchors * d.block_size
    p = sizing.drafter_params(d)
    q_dim, h = d.num_heads * d.head_dim, d.hidden_size
    # anchors sit in the response (the sequence's tail): mean visible context ~ everything before the response
    # plus half of it; sliding layers see at most their window.
    mean_ctx = max(1.0, s - min(loss_tokens, s) / 2)
    attn = 0.0
    for kind in d.layer_types:
        ctx = min(mean_ctx, d.sliding_window) if kind == "sliding_attention" else mean_ctx
        in_block = (d.block_size + 1) / 2 if kind == "sliding_attention" else d.block_size  # causal vs bidirectional
        attn += 12.0 * nb * (ctx + in_block) * q_dim  # QK^T + AV, forward (4) + backward (8)
    parts = {
        "target_forward": sizing.prefill_flops(t, s, layers=d.last_feature_layer + 1, with_head=False),
        "drafter_q_o_mlp": 6.0 * (p["attn_q_o"] + p["mlp"] + p["norms"]) * nb,
        "drafter_kv_projection": 6.0 * p["attn_kv"] * (s + nb),  # context features AND block tokens (KV injection)
        "drafter_fc": 6.0 * p["fc"] * s,
        "drafter_attention": attn,
        # frozen lm_head on drafted slots: logits forward (2VH) + gradient w.r.t. its input (2VH); no weight grad
        "lm_head": 4.0 * t.vocab_size * h * anchors * (d.block_size - 1),
    }
    parts["total"] = sum(parts.values())
    parts["simple_6PN"] = 6.0 * p["total"] * nb  # the rule of thumb, for comparison
    parts["seq_tokens"] = s
    parts["anchors"] = anchors
    parts["block_tokens"] = nb
    return parts


def training_memory(t, d, ta, weight_dtype, seq_tokens, anchors) -> dict[str, float]:
    """Per-GPU memory parts (bytes) of online training; combined per layout by training_estimate."""
    s = min(seq_tokens, ta.max_length)
    nb = anchors * d.block_size
    b = ta.batch_size
    h, f = d.hidden_size, d.intermediate_size
    q, kv = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
    p = sizing.drafter_params(d)["total"]
    w = sizing.target_weight_bytes(t, weight_dtype)
    tp = sizing.target_params(t)
    # Saved per block token per drafter layer: input, norm, q, k, v, attention out, o_proj out, post-norm,
    # gate, up, activation (bf16). Context K/V per layer (pre- and post-norm/RoPE). Logits of one chunk:
    # bf16 logits + fp32 log-softmax + fp32 gradient = 10 bytes per vocab entry.
    per_token_layer = 2 * (4 * h + 2 * q + 2 * kv + 3 * f)
    act = d.num_layers * nb * per_token_layer + d.num_layers * s * 2 * kv * 2 * 2 + s * h * 2 * 2
    logits = min(anchors, ta.logits_chunk_blocks) * d.block_size * t.vocab_size * 10
    return {
        "target_weights": w["loaded"],
        "target_activations": b * s * (4 * t.hidden_size + 3 * t.intermediate_size) * 2,  # one layer's temporaries
        "features": b * s * d.num_features * h * 2,  # K concatenated hidden states (bf16)
        "embed_and_head": (tp["embed_tokens"] + (tp["lm_head"] or 0)) * 2,  # drafter-side copy in the split layout
        "drafter_weights": p * 2,
        "drafter_states": p * (ta.state_bytes_per_param - 2),  # grads + fp32 master + AdamW moments
        "drafter_activations": b * act + logits,
        "reserve": ta.runtime_reserve_gb * GB,
    }


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
            raise ValueError(f"plan.train_assumptions.split_target_gpus: need 1 <= {n_t} < {num_gpus} GPUs")
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
        raise ValueError(f"plan.train_assumptions.layout: {choice!r} needs at least 2 GPUs (plan has {num_gpus})")
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


# --------------------------------------------------------------------------------------------
# Whole plan
# --------------------------------------------------------------------------------------------


def make_plan(params: Any) -> dict:
    """Everything the report shows, as one JSON-able dict."""
    plan = params.plan
    paths = resolve_paths(plan, params.base)
    target = load_target(paths["target_config"])
    drafter = sizing.drafter_arch(params.drafter, target)
    hw_file = plan.hardware_file
    hw = select_gpu(load_hardware(hw_file), plan.hardware, hw_file)
    if plan.num_gpus < 1:
        raise ValueError("plan.num_gpus: must be >= 1")
    price = plan.price_per_gpu_hour or hw.price_per_gpu_hour
    signature = sizing.target_signature(paths["target_config"])
    data = dataset_inputs(plan, paths, signature)
    data["low"], data["high"] = plan.dataset.output_tokens_low, plan.dataset.output_tokens_high
    if data["pilot"]:  # the measured mean replaces the assumed one; keep the range around it
        data["low"] = min(data["low"], data["mean_output_tokens"])
        data["high"] = max(data["high"], data["mean_output_tokens"])
    ta = train_inputs(params)
    train_gpus = ta.num_gpus or plan.num_gpus
    gs = generation_settings(params)
    gen = generation_estimate(target, hw, gs, plan.weight_dtype, plan.num_gpus, data, price)
    train = training_estimate(target, drafter, hw, ta, plan.weight_dtype, train_gpus, data)
    train["num_gpus"] = train_gpus
    train["cost_usd"] = train["headline"]["gpu_hours"] * price if price > 0 else None
    scaling = []
    for g in plan.gpu_counts:
        row: dict[str, Any] = {"gpus": g}
        row["generation_hours"] = (
            generation_estimate(target, hw, gs, plan.weight_dtype, g, data, price)["wall_hours"]["mid"]
            if g >= gs.tensor_parallel_size
            else None
        )
        # same share of target GPUs in the split layout; a layout that needs more GPUs than g falls back to auto
        n_t = min(g - 1, max(1, round(g * ta.split_target_gpus / train_gpus))) if g > 1 else None
        tr = training_estimate(target, drafter, hw, ta, plan.weight_dtype, g, data, n_t, ta.layout if g > 1 else "auto")
        row["train_hours"] = tr["headline"]["total_hours"]
        row["train_layout"] = tr["layout"]
        row["train_fits"] = tr["headline"]["fits"]
        scaling.append(row)
    tparams = sizing.target_params(target)
    dparams = sizing.drafter_params(drafter)
    summary = {  # the few numbers worth diffing between experiments (dvc metrics diff)
        "generation_hours": gen["wall_hours"]["mid"],
        "generation_tokens_per_s": gen["model_tokens_per_s"],
        "generation_batch_per_engine": gen["memory"]["batch"],
        "train_hours": train["headline"]["total_hours"],
        "train_layout": train["layout"],
        "train_fits": train["headline"]["fits"],
        "train_margin_gb": train["headline"]["margin_gb"],
        "target_weights_gb": gen["weights_gb"],
        "drafter_params": dparams["total"],
    }
    return {
        "summary": summary,
        "inputs": {
            "target_config": str(paths["target_config"]),
            "audit_json": str(paths["audit"]) if data["audit"] else None,
            "tokenize_json": str(paths["tokenize"]) if data["tokenize"] else None,
            "pilot_json": str(paths["pilot"]) if data["pilot"] else None,
            "sources": data["sources"],
            "ignored": data["ignored"],
        },
        "hardware": {**hw.__dict__, "count": plan.num_gpus, "price_used": price or None},
        "target": {
            "architecture": target.architecture,
            "layers": target.num_layers,
            "full_attention_layers": target.n_attention,
            "linear_attention_layers": target.n_linear,
            "hidden_size": target.hidden_size,
            "vocab_size": target.vocab_size,
            "params": tparams,
            "weight_dtype": plan.weight_dtype,
        },
        "drafter": {"params": dparams, **drafter.__dict__},
        "dataset": {k: data[k] for k in ("num_prompts", "mean_prompt_tokens", "mean_output_tokens", "low", "high")}
        | {k: data[k] for k in ("train_samples", "seq_tokens", "loss_tokens")},
        "generation": gen,
        "training": train,
        "scaling": scaling,
        "assumptions": assumptions(params, target, hw),
    }


def generation_settings(params: Any) -> SimpleNamespace:
    """The engine settings of the generate stage (what will really run) + the plan's efficiency assumptions."""
    gen, eff = params.generate, params.plan.generation
    return SimpleNamespace(
        tensor_parallel_size=gen.tensor_parallel_size,
        gpu_memory_utilization=gen.gpu_memory_utilization,
        max_num_seqs=gen.max_num_seqs,
        max_model_len=gen.max_model_len,
        **{f.name: getattr(eff, f.name) for f in dataclasses.fields(eff)},
    )


def assumptions(params: Any, t: sizing.TargetArch, hw: GpuProfile) -> list[str]:
    """The modelling choices behind the numbers, in words (the report's last section)."""
    g, ta = generation_settings(params), train_inputs(params)
    out = [
        f"Generation: one vLLM engine per {g.tensor_parallel_size} GPU(s). A decode step takes max(bytes read / "
        f"(bandwidth x {g.bandwidth_efficiency}), FLOPs / (dense BF16 peak x {g.decode_mfu})); bytes = weights (minus "
        "the embedding table, of which only b rows are read) + each sequence's KV cache + its GDN state read and written.",
        f"Batch = min(max_num_seqs {g.max_num_seqs}, sequences that fit in memory x {g.gpu_memory_utilization} minus "
        f"weights minus a {g.activation_reserve_gb} GB reserve). Mean resident context = prompt + mean output x "
        f"(1 + cv^2) / 2 with cv = {g.output_length_cv}: in continuous batching long outputs stay resident longer.",
        f"KV cache {g.kv_cache_dtype}; GDN recurrent state {g.ssm_state_dtype} (value heads x key dim x value dim per "
        "linear layer) plus its causal-conv window (kernel - 1 rows, bf16); both constant per sequence.",
        f"Weights: the text model only, {params.plan.weight_dtype} (fp8 quantizes decoder matmuls; embeddings, lm_head "
        "and norms stay bf16). MTP layers and the vision tower are counted but not loaded.",
        f"Prefill: 2 x params x prompt tokens + causal attention at {g.prefill_mfu} MFU, added to decode time "
        "(continuous batching overlaps part of it: a slight overestimate).",
        "Attention and memory use mean lengths; sequences longer than the mean cost more than linearly in attention, "
        "so attention terms are a low estimate for long-tailed data.",
        f"Training: the target forward stops after the last feature layer; drafter forward + backward = 3 x forward "
        f"(6 x params per token); the frozen lm_head costs 4 x V x H per drafted slot (logits + input gradient); "
        f"MFU {ta.mfu}. Anchors per sequence = min(num_anchors {ta.num_anchors}, loss tokens - 1).",
        f"Training memory: target weights + one layer's temporaries + the K concatenated features; drafter "
        f"{ta.state_bytes_per_param} bytes/param (bf16 weight and grad, fp32 master, AdamW m and v; grads and states "
        f"{'sharded' if ta.shard_optimizer else 'not sharded'} over data-parallel ranks); saved activations of every "
        f"block token in every drafter layer; one logits chunk of {ta.logits_chunk_blocks} blocks (10 bytes per vocab "
        f"entry); {ta.runtime_reserve_gb} GB runtime reserve per GPU. Verdict against the full {hw.memory_gb:.0f} GB.",
        "Split layout: target GPUs and drafter GPUs form a pipeline; the slower side sets the rate. The drafter GPUs "
        "also hold the target's embedding and lm_head (frozen, shared by the drafter).",
        "Inputs that exist are read (audit / tokenize / pilot metrics); the DVC stage does not list them as deps yet.",
    ]
    if t.n_linear:
        out.append(
            "Hybrid target: vLLM pads each attention KV block to the size of one layer's GDN state and needs one such "
            "block per linear-layer group per running sequence; it refuses to start when max_num_seqs exceeds the "
            "blocks available (vLLM PR #38270). The vLLM recipe runs BF16 Qwen3.6-27B on an RTX PRO 6000 with "
            "--max-num-seqs 8. Run the generate pilot: its measured rate replaces this model's."
        )
    return out
