"""The modelling choices behind the plan's numbers, in words (the report's last section): what each model counts,
what it leaves out, and how far it was from the published runs it is held against (dflash/plan/published.py)."""

from __future__ import annotations

from dflash.core.hardware import GpuProfile
from dflash.core.params import Params
from dflash.plan.context import PlanContext
from dflash.plan.result import Plan
from dflash.plan.settings import GenerationSettings, TrainSettings

LEFT_OUT = (  # what the roofline decode model does not count; the published runs' remaining error is about these
    "the engine's per-step scheduling, sampling and output processing (CPU time between GPU kernels)",
    "kernels below the bandwidth roofline (Gated DeltaNet decode, attention at the real head sizes)",
    "prefill steps interleaved with decode (chunked prefill slows the decode steps they share)",
    "the long tail of thinking outputs (a few very long sequences hold memory and set the end of the run)",
)


def generation_lines(params: Params, gs: GenerationSettings, hw: GpuProfile) -> list[str]:
    return [
        f"Generation: one vLLM engine per {gs.tensor_parallel_size} GPU(s). A decode step takes max(bytes read / "
        f"(bandwidth x {gs.bandwidth_efficiency}), FLOPs / ({gs.compute_dtype} matmul peak x {gs.decode_mfu})); bytes = "
        "weights (minus the embedding table, of which only b rows are read) + each sequence's KV cache + its GDN state "
        "read and written.",
        f"Batch = min(max_num_seqs {gs.max_num_seqs}, sequences that fit in "
        + (
            f"the {gs.kv_cache_memory_gb} GB KV cache of generate.kv_cache_memory_gb). "
            if gs.kv_cache_memory_gb > 0
            else f"memory x {gs.gpu_memory_utilization} minus weights minus a {gs.activation_reserve_gb} GB reserve). "
        )
        + "Mean resident context = prompt + mean output x "
        f"(1 + cv^2) / 2 with cv = {gs.output_length_cv}: in continuous batching long outputs stay resident longer.",
        f"KV cache {gs.kv_cache_dtype}; GDN recurrent state {gs.ssm_state_dtype} ({gs.ssm_state_dtype_source}; value "
        "heads x key dim x value dim per linear layer) plus its causal-conv window (kernel - 1 rows, bf16); both "
        "constant per sequence.",
        f"Weights: the text model only, {params.plan.weight_dtype} (fp8 quantizes decoder matmuls; embeddings, lm_head "
        "and norms stay bf16). MTP layers and the vision tower are counted but not loaded.",
        f"Prefill: 2 x params x prompt tokens + causal attention at {gs.prefill_mfu} MFU, added to decode time "
        "(continuous batching overlaps part of it: a slight overestimate).",
        "Attention and memory use mean lengths; sequences longer than the mean cost more than linearly in attention, "
        "so attention terms are a low estimate for long-tailed data.",
        "A generate pilot replaces the model's rate (dflash/plan/generation.py): the pilot run's own rate when it ran "
        "at the planned concurrency and backend, its drain (the last sequences finishing at a shrinking batch, about "
        "p99 output tokens of steps) taken out and added back once for the full run; else the sweep's level.",
        f"Compute peaks: {hw.key} ({hw.kind}) {hw.bf16_tflops:g} TFLOP/s bf16, {hw.fp32_tflops:g} fp32 (0 = unknown), "
        f"{hw.bandwidth_tbps:g} TB/s; generation computes in {gs.compute_dtype} (generate.dtype).",
    ]


def training_lines(ta: TrainSettings, hw: GpuProfile) -> list[str]:
    ckpt = (
        "each drafter layer's input and one layer's activations at a time (train.activation_checkpointing; the "
        "recompute adds one drafter-layer forward to the time)"
        if ta.activation_checkpointing
        else "saved activations of every block token in every drafter layer"
    )
    return [
        f"Training: the target forward stops after the last feature layer; drafter forward + backward = 3 x forward "
        f"(6 x params per token); the frozen lm_head costs 4 x V x H per drafted slot (logits + input gradient); "
        f"MFU {ta.mfu} of the {ta.compute_dtype} matmul peak. Anchors per sequence = min(num_anchors "
        f"{ta.num_anchors}, loss tokens - 1).",
        f"Training memory: target weights + one layer's temporaries + the K concatenated features; drafter "
        f"{ta.state_bytes_per_param} bytes/param (bf16 weight and grad, fp32 master, AdamW m and v; grads and states "
        f"{'sharded' if ta.shard_optimizer else 'not sharded'} over data-parallel ranks); {ckpt}; one logits chunk of "
        f"{ta.logits_chunk_blocks} blocks (10 bytes per vocab entry); {ta.runtime_reserve_gb} GB runtime reserve per "
        f"GPU. Verdict against the full {hw.memory_gb:.0f} GB.",
        "Split layout: target GPUs and drafter GPUs form a pipeline; the slower side sets the rate. The drafter GPUs "
        "also hold the target's embedding and lm_head (frozen, shared by the drafter). The train stage's split runs "
        "the two sides one after the other inside each process: its pilot measures that, and its measured seconds "
        "enter the pipeline formula.",
        "A training pilot on the planned hardware (python -m stages.train --pilot) replaces FLOPs / (peak x MFU) by "
        "its measured step time (ordinary rows, time-weighted) x the epoch's packed rows (the same data, packed by the "
        "same code), split into the target's share and the rest, scaled to the planned GPUs and layout by the "
        "formulas above; its peak memory at the worst rows is the measured memory verdict.",
    ]


def published_lines(p: Plan) -> list[str]:
    if not p.published:
        return []
    runs = "; ".join(
        f"{c.what}: model {c.model:,.4g} vs measured {c.value:,.4g} {c.unit} ({c.error:+.0%}, "
        f"{'optimistic' if c.optimistic else 'pessimistic'}; batch {c.batch}, {c.bound}-bound)"
        for c in p.published
    )
    return [
        "Held against published runs (params/published/runs.yaml, the model alone, before any pilot): " + runs + ". "
        "What the model leaves out, and what these errors are made of: " + "; ".join(LEFT_OUT) + ". The pilots "
        "measure all of it on the real engine and hardware, and replace the model when they run.",
    ]


def assumptions(ctx: PlanContext, p: Plan) -> list[str]:
    """The modelling choices behind the numbers, in words (the report's last section)."""
    out = generation_lines(ctx.params, ctx.gs, ctx.hw) + training_lines(ctx.ta, ctx.hw)
    out.append(
        "Inputs that exist are read (audit / tokenize / pilot metrics, the training pilot, the stages' own reports "
        "for the calibration); measurements of another target or hardware are set aside and listed."
    )
    if ctx.target.n_linear:
        out.append(
            "Hybrid target: vLLM pads each attention KV block to the size of one layer's GDN state and needs one such "
            "block per linear-layer group per running sequence; it refuses to start when max_num_seqs exceeds the "
            "blocks available (vLLM PR #38270). The vLLM recipe runs BF16 Qwen3.6-27B on an RTX PRO 6000 with "
            "--max-num-seqs 8 (a serving-latency setting). Run the generate pilot: its sweep measures each concurrency "
            "level on the real engine, and the rate at the chosen level replaces this model's."
        )
    return out + published_lines(p)
