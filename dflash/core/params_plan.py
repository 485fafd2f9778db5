"""The plan's section of the params schema (`params.yaml` `plan`): the planner's own knobs, split from
dflash/core/params.py by concept (one schema, two files; each field documented once, as params.py's are).

Imports nothing of ours.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class PlanDatasetParams:
    """Dataset fallbacks for the plan, used until the audit / tokenize / pilot metrics exist."""

    num_prompts: int  # prompts to complete (audit.json num_conversations replaces it when present)
    mean_prompt_tokens: float  # mean prompt length in target tokens (audit.json mean_prompt_tokens replaces it)
    mean_output_tokens: float  # assumed mean completion length in tokens (pilot.json mean_output_tokens replaces it)
    output_tokens_low: float  # low end of the assumed mean completion length (the estimate's range)
    output_tokens_high: float  # high end of the assumed mean completion length (the estimate's range)


@dataclass(frozen=True)
class PlanGenerationParams:
    """How close generation gets to the hardware peaks, and cache types. The engine settings themselves
    (tensor_parallel_size, gpu_memory_utilization, max_num_seqs, max_model_len) are read from `generate`,
    so the plan always models the engines the generate stage will really start."""

    kv_cache_dtype: Literal["bf16", "fp8"]  # KV cache element type of full-attention layers
    ssm_state_dtype: Literal[
        "auto", "bf16", "fp32"
    ]  # Gated DeltaNet recurrent state type in the engine's cache; auto = the target config's mamba_ssm_dtype as vLLM reads it (fp32 for Qwen3.6), else bf16
    activation_reserve_gb: float  # per GPU, inside gpu_memory_utilization: activations, CUDA graphs, sampler
    bandwidth_efficiency: float  # share of peak memory bandwidth a decode step reaches (H200 copy: 0.89 measured)
    decode_mfu: float  # share of dense BF16 peak a compute-bound decode step reaches
    prefill_mfu: float  # share of dense BF16 peak prefill reaches
    output_length_cv: float  # coefficient of variation of output lengths (long ones stay resident longer)


@dataclass(frozen=True)
class PlanTrainParams:
    """Training assumptions only the plan needs. The plan reads max_length, num_anchors, epochs, batch_size
    and grad_accum_steps from the `train` section (what the train stage runs)."""

    num_gpus: int  # GPUs for training; 0 = plan.num_gpus
    layout: Literal["auto", "single", "split", "data_parallel"]  # headline device layout; auto = fastest that fits
    split_target_gpus: int  # split layout: GPUs holding the target (the others hold the drafter)
    mfu: float  # share of dense BF16 peak training reaches
    state_bytes_per_param: int  # drafter bytes/param: bf16 weight 2 + bf16 grad 2 + fp32 master 4 + AdamW 4 + 4
    shard_optimizer: bool  # shard grads + optimizer states over the drafter's data-parallel ranks (ZeRO-2 / FSDP)
    logits_chunk_blocks: int  # blocks whose logits exist at once (chunked loss)
    runtime_reserve_gb: float  # per GPU: CUDA context, allocator slack, kernels' workspace


@dataclass(frozen=True)
class PlanServingParams:
    """Serving speed the plan predicts (dflash/plan/serving.py): speculative decoding against plain decoding on the
    planned hardware, with the whole vocabulary and with a pruned draft vocabulary."""

    acceptance: list[
        float
    ]  # acceptance per drafted position (P(position k accepted)); [] = assumed_tau, or eval.json's when assumed_tau is 0
    assumed_tau: float  # tau assumed when no acceptance is given (spread geometrically over the drafted positions); 0 = eval.json's acceptance
    draft_vocab_size: int  # the pruned draft vocabulary compared with the whole one (rows of the drafter's lm_head); 0 = no comparison
    draft_vocab_coverage: (
        float  # share of target tokens inside that vocabulary (position k is accepted with coverage^k of its rate)
    )
    batch_sizes: list[int]  # concurrent sequences per engine the prediction is made at (1 = latency)


@dataclass(frozen=True)
class PlanParams:
    """Stage `plan`: time, memory and cost estimates from configs, a GPU profile and measurements."""

    target_config: str  # target config.json to plan for; "" = ${base.target_dir}/config.json
    hardware_file: str  # hardware profiles file (memory, bandwidth, dense matmul peaks, interconnect, source)
    hardware: str  # profile name in hardware_file (a GPU, or the CPU host benchmarks/hw_probe.py measured)
    num_gpus: int  # GPUs of that profile
    price_per_gpu_hour: float  # USD per GPU-hour for the cost lines; 0 = the profile's price (0 there = no cost)
    weight_dtype: Literal[
        "bf16", "fp8", "fp32"
    ]  # target weights: bf16, fp8 matmul weights (embeddings stay bf16), or fp32 (a CPU demo engine)
    audit_json: str  # audit metrics read when present; "" = ${base.reports_dir}/audit.json
    tokenize_json: str  # tokenize metrics read when present; "" = ${base.reports_dir}/tokenize.json
    pilot_json: str  # generate pilot metrics read when present; "" = ${base.reports_dir}/pilot.json
    train_pilot_json: str  # training pilot metrics read when present; "" = ${base.reports_dir}/train_pilot.json
    generate_json: (
        str  # the generate stage's metrics, compared with the plan when present; "" = ${base.reports_dir}/generate.json
    )
    train_json: (
        str  # the train stage's metrics, compared with the plan when present; "" = ${base.reports_dir}/train.json
    )
    gpu_counts: list[int]  # GPU counts for the time-vs-GPUs table and plots
    deadline_hours: float  # wall-clock deadline for generation + training: the plan sizes the smallest cluster that meets it; 0 = off
    gpus_per_node: int  # GPUs per node of the deadline's cluster (engines and split processes stay inside a node)
    internode_gbps: float  # GB/s per direction between nodes (all NICs of a node: 400 Gb/s = 50), gradient all-reduce
    allreduce_overlap: float  # share of the last micro-step's drafter backward that hides the gradient all-reduce (DDP buckets); 0 = none
    dataset: PlanDatasetParams
    generation: PlanGenerationParams
    train_assumptions: PlanTrainParams
    serving: PlanServingParams


__all__ = ["PlanDatasetParams", "PlanGenerationParams", "PlanParams", "PlanServingParams", "PlanTrainParams"]
