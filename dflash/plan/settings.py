"""The runs the plan prices, as typed settings: the generate stage's engines and the train stage's knobs (what will
really run), each beside the plan's own efficiency assumptions (`plan.generation`, `plan.train_assumptions`).

    generation_settings(params, paths)   engines: TP, memory share, concurrency (max_num_seqs: auto resolved as
                                         generate will resolve it), context limit; cache dtypes; efficiencies
    train_settings(params, hw)           train: lengths, anchors, epochs, batch, loss target, checkpointing;
                                         layout, MFU, optimizer bytes and sharding, reserves
The compute dtype of each (which matmul peak of the hardware profile applies) follows the stage's own dtype:
`generate.dtype`, and `train.dtype` (auto = bf16 on a GPU profile, fp32 on a CPU host, as the trainer picks).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dflash.core.concurrency import chosen_from_pilot, resolve_max_num_seqs
from dflash.core.hardware import GpuProfile
from dflash.core.params import Params
from dflash.core.target_config import read_config, target_signature
from dflash.plan.inputs import PlanPaths

_DTYPES = {"bfloat16": "bf16", "float16": "bf16", "float32": "fp32", "auto": ""}


@dataclass(frozen=True)
class GenerationSettings:
    """One vLLM engine of the generate stage and how close it gets to the hardware's peaks."""

    tensor_parallel_size: int  # GPUs per engine
    gpu_memory_utilization: float  # share of device memory the engine reserves
    kv_cache_memory_gb: float  # explicit KV cache size per GPU (generate.kv_cache_memory_gb); 0 = the share above
    max_num_seqs: int  # concurrent sequences per engine (auto resolved)
    max_num_seqs_source: str  # where max_num_seqs came from, in words
    max_model_len: int  # context limit
    compute_dtype: str  # bf16 | fp32: the matmul peak decode and prefill run at
    kv_cache_dtype: str  # KV cache element type of full-attention layers
    ssm_state_dtype: str  # Gated DeltaNet recurrent state type (auto resolved)
    ssm_state_dtype_source: str  # where ssm_state_dtype came from
    activation_reserve_gb: float  # per GPU, inside gpu_memory_utilization
    bandwidth_efficiency: float  # share of peak bandwidth a decode step reaches
    decode_mfu: float  # share of the matmul peak a compute-bound decode step reaches
    prefill_mfu: float  # share of the matmul peak prefill reaches
    output_length_cv: float  # coefficient of variation of output lengths


@dataclass(frozen=True)
class TrainSettings:
    """The train stage's run (its own params) and the plan's training assumptions."""

    num_gpus: int  # GPUs for training (plan.train_assumptions.num_gpus, 0 = plan.num_gpus)
    layout: str  # auto | single | split | data_parallel
    split_target_gpus: int  # split layout: GPUs holding the target
    mfu: float  # share of the matmul peak training reaches
    state_bytes_per_param: int  # drafter bytes per parameter (weights, grads, master copy, AdamW)
    shard_optimizer: bool  # grads + optimizer states sharded over data-parallel ranks
    logits_chunk_blocks: int  # blocks whose logits exist at once
    runtime_reserve_gb: float  # per GPU
    compute_dtype: str  # bf16 | fp32 (train.dtype; auto = bf16 on a GPU profile, fp32 on a CPU host)
    max_length: int  # tokens per training document
    num_anchors: int  # blocks per document
    epochs: int
    batch_size: int  # packed rows per process per micro-step
    grad_accum_steps: int
    loss_target: str  # tokens | target_argmax | target_kl
    activation_checkpointing: bool  # drafter layers recomputed in backward


def planned_max_num_seqs(params: Params, paths: PlanPaths) -> tuple[int, str]:
    """The concurrency generate will run at, and where it came from: an integer param; auto -> the pilot
    sweep's chosen_max_num_seqs (dflash/core/concurrency.py); auto before any sweep -> its largest level."""
    gen = params.generate
    if gen.max_num_seqs != "auto":
        return gen.max_num_seqs, "param generate.max_num_seqs"
    chosen = chosen_from_pilot(paths.pilot, target_signature(paths.target_config))
    if chosen is not None:
        return chosen, f"{paths.pilot} chosen_max_num_seqs (generate.max_num_seqs: auto)"
    if not gen.pilot_sweep:
        resolve_max_num_seqs(gen, paths.pilot)  # the UserError generate would raise: run the pilot
    return max(gen.pilot_sweep), "largest generate.pilot_sweep level (auto, no sweep measured yet)"


def ssm_state_dtype(param: str, target_config: Path) -> tuple[str, str]:
    """The Gated DeltaNet state type vLLM keeps: the param, or with auto the target config's `mamba_ssm_dtype`
    (vLLM reads it for Qwen3.5 / 3.6: float32 for Qwen3.6-27B), else bf16 (the model's dtype)."""
    if param != "auto":
        return param, "param plan.generation.ssm_state_dtype"
    raw = read_config(target_config) if Path(target_config).exists() else {}
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    value = text.get("mamba_ssm_dtype")
    mapped = {"float32": "fp32", "bfloat16": "bf16", "float16": "bf16"}.get(value) if isinstance(value, str) else None
    if mapped:
        return mapped, f"{target_config} mamba_ssm_dtype ({value}), as vLLM reads it"
    return "bf16", "the model dtype (auto; the config names no mamba_ssm_dtype)"


def generation_settings(params: Params, paths: PlanPaths) -> GenerationSettings:
    """The generate stage's engine as the plan models it (module docstring)."""
    gen, eff = params.generate, params.plan.generation
    seqs, seqs_source = planned_max_num_seqs(params, paths)
    ssm, ssm_source = ssm_state_dtype(eff.ssm_state_dtype, paths.target_config)
    return GenerationSettings(
        tensor_parallel_size=gen.tensor_parallel_size,
        gpu_memory_utilization=gen.gpu_memory_utilization,
        kv_cache_memory_gb=gen.kv_cache_memory_gb,
        max_num_seqs=seqs,
        max_num_seqs_source=seqs_source,
        max_model_len=gen.max_model_len,
        compute_dtype=_DTYPES.get(gen.dtype, "bf16") or "bf16",
        kv_cache_dtype=eff.kv_cache_dtype,
        ssm_state_dtype=ssm,
        ssm_state_dtype_source=ssm_source,
        activation_reserve_gb=eff.activation_reserve_gb,
        bandwidth_efficiency=eff.bandwidth_efficiency,
        decode_mfu=eff.decode_mfu,
        prefill_mfu=eff.prefill_mfu,
        output_length_cv=eff.output_length_cv,
    )


def train_settings(params: Params, hw: GpuProfile) -> TrainSettings:
    """The train stage's run as the plan models it (module docstring)."""
    ta, tr = params.plan.train_assumptions, params.train
    dtype = _DTYPES[tr.dtype] or ("bf16" if hw.kind == "gpu" else "fp32")
    return TrainSettings(
        num_gpus=ta.num_gpus or params.plan.num_gpus,
        layout=ta.layout,
        split_target_gpus=ta.split_target_gpus,
        mfu=ta.mfu,
        state_bytes_per_param=ta.state_bytes_per_param,
        shard_optimizer=ta.shard_optimizer,
        logits_chunk_blocks=ta.logits_chunk_blocks,
        runtime_reserve_gb=ta.runtime_reserve_gb,
        compute_dtype=dtype,
        max_length=tr.max_length,
        num_anchors=tr.num_anchors,
        epochs=tr.epochs,
        batch_size=tr.batch_size,
        grad_accum_steps=tr.grad_accum_steps,
        loss_target=tr.loss_target,
        activation_checkpointing=tr.activation_checkpointing,
    )
