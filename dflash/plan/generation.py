"""Generation estimate: one vLLM engine per `tensor_parallel_size` GPUs, decode as a roofline per engine.

A decode step at batch b reads the weights once plus each sequence's KV cache and Gated DeltaNet state
(bytes / (bandwidth x efficiency)) and does 2 x params FLOPs per token (/ (matmul peak x decode_mfu)); the slower
of the two is the step time. b = min(max_num_seqs, sequences that fit in the cache). In continuous batching
long sequences stay resident longer, so the mean resident length is prompt + mean_output x (1 + cv^2) / 2
(cv: coefficient of variation of output lengths). A pilot's measured rate, when there is one, replaces the
model's and the model stays beside it for comparison.

Which measured rate, and the drain a pilot run includes: dflash/plan/generation_pilot.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dflash.core import target_counts
from dflash.core.errors import UserError
from dflash.core.hardware import GpuProfile
from dflash.core.target_config import TargetArch
from dflash.plan import sizing
from dflash.plan.generation_pilot import (
    PilotRate,
    SweepPoint,
    drain_step_cost,
    drained_seconds,
    steady_rate,
    sweep_level,
)
from dflash.plan.inputs import Dataset, GeneratePilot
from dflash.plan.settings import GenerationSettings

GB = 1e9


# --------------------------------------------------------------------------------------------
# The 27B regeneration case's arithmetic, as small named functions (tested against its numbers)
# --------------------------------------------------------------------------------------------


def batch1_tokens_per_s(weight_bytes: float, bandwidth_bytes_per_s: float) -> float:
    """Decode at batch 1 reads every weight once per token: tokens/s <= bandwidth / weight bytes."""
    return bandwidth_bytes_per_s / weight_bytes


def wall_seconds(tokens: float, tokens_per_s: float) -> float:
    return tokens / tokens_per_s if tokens_per_s > 0 else math.inf


def headroom_bytes(
    memory_bytes: float, weight_bytes: float, *, utilization: float = 1.0, reserve_bytes: float = 0.0
) -> float:
    """Memory left for the KV cache / GDN state once the weights (and a reserve) are in."""
    return memory_bytes * utilization - weight_bytes - reserve_bytes


# --------------------------------------------------------------------------------------------
# Generation
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeStep:
    """One decode step of one engine."""

    batch: int
    step_ms: float
    memory_ms: float
    compute_ms: float
    tokens_per_s: float
    bound: str  # bandwidth | compute


@dataclass(frozen=True)
class CacheCapacity:
    """Per-engine memory budget: weights, reserve, cache headroom and the sequences that fit."""

    weights_gb_per_gpu: float
    budget_gb_per_gpu: float
    reserve_gb_per_gpu: float
    cache_gb_per_gpu: float
    headroom_gb_full_card: float
    resident_context_tokens: float
    kv_kb_per_token: float
    state_mb_per_seq: float
    cache_mb_per_seq: float
    max_seqs_in_cache: int
    batch: int
    fits: bool
    max_model_len_fits: bool


@dataclass(frozen=True)
class WallHours:
    low: float | None
    mid: float | None
    high: float | None


@dataclass
class GenerationEstimate:
    engines: int
    tensor_parallel_size: int
    weights_gb: float
    weights_read_per_step_gb: float
    batch1_bound_tokens_per_s: float
    memory: CacheCapacity
    decode_curve: list[DecodeStep]
    step: DecodeStep | None
    model_tokens_per_s: float
    output_tokens: float
    prompt_tokens: float
    prefill_hours: float
    model_wall_hours: WallHours
    wall_hours: WallHours
    wall_source: str
    max_num_seqs_source: str
    compute_tflops: float  # the matmul peak used (the settings' compute dtype)
    pilot: PilotRate | None = None
    gpu_hours: float | None = None
    cost_usd: float | None = None


def decode_step(
    t: TargetArch,
    hw: GpuProfile,
    gp: GenerationSettings,
    *,
    weight_read_bytes: float,
    batch: int,
    context: float,
    tp: int,
    tokens_per_seq: int = 1,
) -> DecodeStep:
    """One decode step of one engine at `batch` sequences of `context` cached tokens each, each sequence feeding
    `tokens_per_seq` tokens (1: plain decoding; 1 + drafted tokens: a speculative verification step)."""
    kv = sizing.kv_bytes_per_token(t, gp.kv_cache_dtype, context) * context
    state = sizing.linear_state_bytes(t, gp.ssm_state_dtype)
    step_bytes = weight_read_bytes + batch * (kv + 2 * state)  # the GDN state is read and written back
    mem_s = step_bytes / (tp * hw.bandwidth_tbps * 1e12 * gp.bandwidth_efficiency)
    flops = batch * tokens_per_seq * sizing.decode_flops_per_token(t, context)
    peak = hw.matmul_tflops(gp.compute_dtype, "generate.dtype")
    compute_s = flops / (tp * peak * 1e12 * gp.decode_mfu)
    return roofline_step(batch, mem_s, compute_s)


def roofline_step(batch: int, memory_s: float, compute_s: float) -> DecodeStep:
    """A step that takes the slower of its memory time and its compute time."""
    step = max(memory_s, compute_s)
    return DecodeStep(
        batch=batch,
        step_ms=step * 1e3,
        memory_ms=memory_s * 1e3,
        compute_ms=compute_s * 1e3,
        tokens_per_s=batch / step,
        bound="bandwidth" if memory_s >= compute_s else "compute",
    )


def generation_capacity(
    t: TargetArch, hw: GpuProfile, gp: GenerationSettings, *, weight_dtype: str, context: float
) -> CacheCapacity:
    """Per-engine memory budget: weights, reserve, cache headroom and the sequences that fit."""
    tp = gp.tensor_parallel_size
    w = sizing.target_weight_bytes(t, weight_dtype)
    if gp.kv_cache_memory_gb > 0:  # an explicit KV cache size, as vLLM is given it (per GPU)
        free = gp.kv_cache_memory_gb * GB
    else:
        free = headroom_bytes(
            hw.memory_gb * GB,
            w["loaded"] / tp,
            utilization=gp.gpu_memory_utilization,
            reserve_bytes=gp.activation_reserve_gb * GB,
        )
    state = sizing.linear_state_bytes(t, gp.ssm_state_dtype)
    per_seq = sizing.kv_bytes_per_token(t, gp.kv_cache_dtype, context) * context + state
    longest = sizing.kv_bytes_per_token(t, gp.kv_cache_dtype, gp.max_model_len) * gp.max_model_len + state
    capacity = int(free * tp // per_seq) if free > 0 else 0
    return CacheCapacity(
        weights_gb_per_gpu=w["loaded"] / tp / GB,
        budget_gb_per_gpu=hw.memory_gb * gp.gpu_memory_utilization,
        reserve_gb_per_gpu=gp.activation_reserve_gb,
        cache_gb_per_gpu=free / GB,
        headroom_gb_full_card=headroom_bytes(hw.memory_gb * GB, w["loaded"] / tp) / GB,
        resident_context_tokens=context,
        kv_kb_per_token=sizing.kv_bytes_per_token(t, gp.kv_cache_dtype, context) / 1e3,
        state_mb_per_seq=state / 1e6,
        cache_mb_per_seq=per_seq / 1e6,
        max_seqs_in_cache=capacity,
        batch=min(gp.max_num_seqs, capacity),
        fits=free > 0,
        max_model_len_fits=free > 0 and longest <= free * tp,
    )


@dataclass(frozen=True)
class Rate:
    """Aggregate decode over all engines at one mean output length."""

    capacity: CacheCapacity
    step: DecodeStep | None  # None: the model does not fit (no step, no rate)
    tokens_per_s: float


def generation_rate(
    t: TargetArch,
    hw: GpuProfile,
    gp: GenerationSettings,
    *,
    weight_dtype: str,
    num_gpus: int,
    prompt_tokens: float,
    output_tokens: float,
) -> Rate:
    """Aggregate decode tokens/s over all engines at a given mean output length."""
    context = prompt_tokens + output_tokens * (1 + gp.output_length_cv**2) / 2
    cap = generation_capacity(t, hw, gp, weight_dtype=weight_dtype, context=context)
    engines = num_gpus // gp.tensor_parallel_size
    if not cap.fits or cap.batch < 1 or engines < 1:
        return Rate(capacity=cap, step=None, tokens_per_s=0.0)
    read = sizing.target_weight_bytes(t, weight_dtype)["read_per_step"]
    step = decode_step(t, hw, gp, weight_read_bytes=read, batch=cap.batch, context=context, tp=gp.tensor_parallel_size)
    return Rate(capacity=cap, step=step, tokens_per_s=engines * step.tokens_per_s)


def pilot_rate(
    t: TargetArch,
    hw: GpuProfile,
    gp: GenerationSettings,
    *,
    pilot: GeneratePilot,
    backend: str,
    est: GenerationEstimate,
    weight_dtype: str,
) -> PilotRate:
    """The measured per-engine rate the plan uses (module docstring) and the model beside it."""
    engines = est.engines
    pilot_engines = pilot.num_engines or engines
    measured, source, drain = pilot.output_tokens_per_s, "the pilot run's own rate", None
    per_engine = measured / pilot_engines
    level = sweep_level(pilot, gp.max_num_seqs)
    same_run = pilot.max_num_seqs == gp.max_num_seqs and (pilot.backend or backend) == backend
    if level is not None and not same_run:  # the sweep measured one engine at the concurrency generate will run at
        measured = per_engine = level["output_tokens_per_s"]
        pilot_engines = 1
        source = f"sweep level max_num_seqs {level['max_num_seqs']} (one engine)"
    elif pilot.p99_output_tokens and pilot.max_num_seqs and pilot.prompts:
        cost = drain_step_cost(pilot.sweep, pilot.max_num_seqs)
        drain = pilot.p99_output_tokens * cost  # in full-batch steps
        per_engine = steady_rate(
            per_engine,
            pilot.prompts / pilot_engines,
            pilot.mean_output_tokens,
            concurrency=pilot.max_num_seqs,
            tail_tokens=drain,
        )
        source = (
            f"the pilot run's own rate at max_num_seqs {pilot.max_num_seqs} ({pilot.backend or backend}), steady once "
            f"its drain of ~{pilot.p99_output_tokens:.0f} steps (p99 output) is taken out"
            + (f", a drain step costing {cost:.2f} of a full-batch one (the sweep's step times)" if cost < 1 else "")
        )
    if drain is not None:
        seconds = drained_seconds(est.output_tokens, engines, gp.max_num_seqs, rate=per_engine, tail_tokens=drain)
    else:
        seconds = est.output_tokens / (per_engine * engines)
    model_per_engine = est.model_tokens_per_s / engines if engines else 0.0
    cap = est.memory
    read = sizing.target_weight_bytes(t, weight_dtype)["read_per_step"]
    points = []
    for row in pilot.sweep:
        model = None
        if cap.fits and cap.max_seqs_in_cache >= 1:
            b = min(row["max_num_seqs"], cap.max_seqs_in_cache)
            step = decode_step(
                t,
                hw,
                gp,
                weight_read_bytes=read,
                batch=b,
                context=cap.resident_context_tokens,
                tp=gp.tensor_parallel_size,
            )
            model = step.tokens_per_s
        points.append(SweepPoint(max_num_seqs=row["max_num_seqs"], measured=row["output_tokens_per_s"], model=model))
    return PilotRate(
        measured_tokens_per_s=measured,
        pilot_engines=pilot_engines,
        measured_per_engine=per_engine,
        model_per_engine=model_per_engine,
        measured_over_model=per_engine / model_per_engine if model_per_engine else None,
        mean_output_tokens=pilot.mean_output_tokens,
        p10_output_tokens=pilot.p10_output_tokens,
        p90_output_tokens=pilot.p90_output_tokens,
        pilot_estimated_total_hours=pilot.estimated_total_hours,
        calibrated_wall_hours=seconds / 3600,
        rate_source=source,
        drain_tokens=drain,
        sweep_at_concurrency=level["output_tokens_per_s"] if level else None,
        chosen_max_num_seqs=pilot.chosen_max_num_seqs,
        sweep_vs_model=points,
    )


def generation_estimate(
    t: TargetArch,
    hw: GpuProfile,
    gp: GenerationSettings,
    *,
    weight_dtype: str,
    num_gpus: int,
    data: Dataset,
    price: float,
    backend: str = "engines",
) -> GenerationEstimate:
    prompts, prompt_tokens, mean_out = data.num_prompts, data.mean_prompt_tokens, data.mean_output_tokens
    tp = gp.tensor_parallel_size
    engines = num_gpus // tp
    if engines < 1:
        raise UserError(f"plan.num_gpus: {num_gpus} GPUs cannot hold one engine of generate.tensor_parallel_size={tp}")
    w = sizing.target_weight_bytes(t, weight_dtype)
    at_mean = generation_rate(
        t, hw, gp, weight_dtype=weight_dtype, num_gpus=num_gpus, prompt_tokens=prompt_tokens, output_tokens=mean_out
    )
    cap = at_mean.capacity
    peak = hw.matmul_tflops(gp.compute_dtype, "generate.dtype")
    prefill_per_prompt = (
        target_counts.prefill_flops(t, prompt_tokens, with_head=False) + 2 * t.vocab_size * t.hidden_size
    )
    prefill_s = prompts * prefill_per_prompt / (num_gpus * peak * 1e12 * gp.prefill_mfu)

    def wall_h(out_tokens: float) -> float | None:  # None when the model does not fit (no rate): JSON has no infinity
        r = generation_rate(
            t,
            hw,
            gp,
            weight_dtype=weight_dtype,
            num_gpus=num_gpus,
            prompt_tokens=prompt_tokens,
            output_tokens=out_tokens,
        ).tokens_per_s
        return (wall_seconds(prompts * out_tokens, r) + prefill_s) / 3600 if r > 0 else None

    curve = []
    if cap.fits:
        sizes = sorted({b for b in (1, 8, 16, 32, 64, 128, 256, 512, 1024) if b <= max(1, cap.max_seqs_in_cache)})
        for b in sorted(set(sizes) | ({cap.batch} if cap.batch else set())):
            read = w["read_per_step"]
            curve.append(
                decode_step(t, hw, gp, weight_read_bytes=read, batch=b, context=cap.resident_context_tokens, tp=tp)
            )
    model_wall = WallHours(low=wall_h(data.low), mid=wall_h(mean_out), high=wall_h(data.high))
    est = GenerationEstimate(
        engines=engines,
        tensor_parallel_size=tp,
        weights_gb=w["loaded"] / GB,
        weights_read_per_step_gb=w["read_per_step"] / GB,
        batch1_bound_tokens_per_s=batch1_tokens_per_s(w["read_per_step"] / tp, hw.bandwidth_tbps * 1e12 * tp),
        memory=cap,
        decode_curve=curve,
        step=at_mean.step,
        model_tokens_per_s=at_mean.tokens_per_s,
        output_tokens=prompts * mean_out,
        prompt_tokens=prompts * prompt_tokens,
        prefill_hours=prefill_s / 3600,
        model_wall_hours=model_wall,
        wall_hours=model_wall,
        wall_source="model (output length range from params)",
        max_num_seqs_source=gp.max_num_seqs_source,
        compute_tflops=peak,
    )
    if data.pilot:
        pr = pilot_rate(t, hw, gp, pilot=data.pilot, backend=backend, est=est, weight_dtype=weight_dtype)
        est.pilot = pr
        both = [h for h in (model_wall.mid, pr.calibrated_wall_hours) if h is not None]
        est.wall_hours = WallHours(low=min(both), mid=pr.calibrated_wall_hours, high=max(both))
        est.wall_source = "pilot-measured rate per engine x engines (range: model vs measured)"
    mid = est.wall_hours.mid
    est.gpu_hours = mid * num_gpus if mid is not None else None
    est.cost_usd = est.gpu_hours * price if price > 0 and mid is not None else None
    return est
