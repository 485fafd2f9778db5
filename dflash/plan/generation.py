"""Generation estimate: one vLLM engine per `tensor_parallel_size` GPUs, decode as a roofline per engine.

A decode step at batch b reads the weights once plus each sequence's KV cache and Gated DeltaNet state
(bytes / (bandwidth x efficiency)) and does 2 x params FLOPs per token (/ (peak x decode_mfu)); the slower
of the two is the step time. b = min(max_num_seqs, sequences that fit in the cache). In continuous batching
long sequences stay resident longer, so the mean resident length is prompt + mean_output x (1 + cv^2) / 2
(cv: coefficient of variation of output lengths). A pilot's measured rate, when there is one, replaces the
model's and the model stays beside it for comparison.
"""

from __future__ import annotations

import math

from dflash.core import target_counts
from dflash.core.errors import UserError
from dflash.plan import sizing
from dflash.plan.inputs import number

GB = 1e9


# --------------------------------------------------------------------------------------------
# The 27B regeneration case's arithmetic, as small named functions (tested against its numbers)
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


def sweep_level(pilot: dict, max_num_seqs: int) -> dict | None:
    """The pilot sweep's measurement at `max_num_seqs` in flight (None when the sweep did not measure it)."""
    for row in pilot.get("sweep") or []:
        if isinstance(row, dict) and row.get("max_num_seqs") == max_num_seqs and row.get("output_tokens_per_s"):
            return row
    return None


def generation_estimate(t, hw, gp, weight_dtype, num_gpus, data, price) -> dict:
    ds_low, ds_high = data["low"], data["high"]
    prompts, prompt_tokens, mean_out = data["num_prompts"], data["mean_prompt_tokens"], data["mean_output_tokens"]
    tp = gp.tensor_parallel_size
    engines = num_gpus // tp
    if engines < 1:
        raise UserError(f"plan.num_gpus: {num_gpus} GPUs cannot hold one engine of generate.tensor_parallel_size={tp}")
    w = sizing.target_weight_bytes(t, weight_dtype)
    cap, step, rate = generation_rate(t, hw, gp, weight_dtype, num_gpus, prompt_tokens, mean_out)
    prefill_per_prompt = (
        target_counts.prefill_flops(t, prompt_tokens, with_head=False) + 2 * t.vocab_size * t.hidden_size
    )
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
            raise UserError("pilot.json: missing output_tokens_per_s (needed when a pilot file exists)")
        pilot_engines = number(pilot, ("num_engines",)) or engines
        level = sweep_level(pilot, gp.max_num_seqs)
        if level is not None:  # the sweep measured one engine at the concurrency generate will run at
            measured, pilot_engines = level["output_tokens_per_s"], 1
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
            "rate_source": f"sweep level max_num_seqs {level['max_num_seqs']} (one engine)"
            if level
            else "the pilot run's own rate",
            "chosen_max_num_seqs": pilot.get("chosen_max_num_seqs"),
            "sweep_vs_model": [  # per level: measured tok/s of one engine vs the roofline model at that batch
                {
                    "max_num_seqs": row["max_num_seqs"],
                    "measured": row["output_tokens_per_s"],
                    "model": decode_step(
                        t,
                        hw,
                        gp,
                        w["read_per_step"],
                        min(row["max_num_seqs"], cap["max_seqs_in_cache"]),
                        cap["resident_context_tokens"],
                        tp,
                    )["tokens_per_s"]
                    if cap["fits"] and cap["max_seqs_in_cache"] >= 1
                    else None,
                }
                for row in pilot.get("sweep") or []
                if isinstance(row, dict) and row.get("output_tokens_per_s")
            ],
        }
        both = [h for h in (model_mid, calibrated) if h is not None]
        out["wall_hours"] = {"low": min(both), "mid": calibrated, "high": max(both)}
        out["wall_source"] = "pilot-measured rate per engine x engines (range: model vs measured)"
    mid = out["wall_hours"]["mid"]
    out["gpu_hours"] = mid * num_gpus if mid is not None else None
    out["cost_usd"] = out["gpu_hours"] * price if price > 0 and mid is not None else None
    return out
