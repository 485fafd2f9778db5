"""Training estimate: FLOPs per sequence of online DFlash training and per-GPU memory for three device
layouts (one GPU, split target / drafter GPUs, data parallel), each with a fits / does-not-fit verdict.

FLOPs (dflash/drafter/flops.py, the count the training pilot's MFU uses too): the target forward up to the deepest
feature layer (every layer when the loss learns the target's own predictions, `train.loss_target: target_argmax |
target_kl`, plus the target's lm_head forward on the drafted slots), the drafter's forward + backward with KV
injection and its attention, the frozen lm_head on every drafted slot; time = FLOPs / (matmul peak x MFU), with one
more drafter-layer forward under `train.activation_checkpointing` (the recompute). Memory: the target_* losses add
the final hidden states and the target's logits chunk beside the drafter's (KL: its log-probabilities and
probabilities too); activation checkpointing keeps each drafter layer's input and one layer's activations at a time.

With a training pilot measured on the planned hardware (dflash/plan/measured.py), its per-sample target and drafter
seconds replace FLOPs / (peak x MFU) in the same layout formulas (the time scales to the planned GPU count and
layout by the model's rules), the MFU it implies is shown beside the assumed one, and its peak memory at the worst
rows gives a measured memory verdict beside the model's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dflash.core.errors import ParamsError, UserError
from dflash.core.hardware import GpuProfile
from dflash.core.target_config import TargetArch
from dflash.drafter.geometry import DrafterConfig
from dflash.plan.inputs import Dataset
from dflash.plan.measured import TrainPilot
from dflash.plan.settings import TrainSettings
from dflash.plan.training_costs import TrainingFlops, TrainingMemory, training_flops_per_sequence, training_memory

GB = 1e9


@dataclass(frozen=True)
class MemoryVerdict:
    parts_gb: dict[str, float]
    need_gb: float
    margin_gb: float


@dataclass
class Layout:
    """One device layout on `gpus` GPUs: memory per GPU role and time."""

    gpus: int
    per_gpu: dict[str, MemoryVerdict]
    fits: bool
    margin_gb: float
    steps_per_epoch: int
    step_s: float
    epoch_hours: float
    total_hours: float
    gpu_hours: float
    target_gpus: int | None = None  # split: GPUs holding the target
    feature_transfer_ms_per_seq: float | None = None  # split: features copied to the drafter's GPU


@dataclass(frozen=True)
class PilotView:
    """The training pilot beside the model (module docstring)."""

    path: str
    device: str
    layout: str  # the layout the pilot ran
    world_size: int
    step_seconds: float
    seconds_per_sample: float  # per process: the pilot's epoch (its packed rows x its step time) / the plan's samples
    model_seconds_per_sample: float  # the model's, on one GPU at the assumed MFU
    implied_mfu: float | None  # the planner's FLOPs per sample / measured seconds / matmul peak
    assumed_mfu: float
    measured_mfu: float | None  # the pilot's own (the documents it really fed)
    peak_memory_gb: float  # at its worst rows
    peak_phase: str | None
    device_memory_gb: float
    memory_margin_gb: float
    memory_fits: bool
    worst_step_seconds: float | None


@dataclass
class TrainingEstimate:
    flops_per_sequence: TrainingFlops
    seconds_per_sequence_one_gpu: float
    target_seconds_per_sequence: float
    drafter_seconds_per_sequence: float
    memory_parts_gb: TrainingMemory  # in GB
    layouts: dict[str, Layout]
    layout: str
    headline: Layout
    source: str  # model | pilot: where the seconds per sequence came from
    compute_tflops: float  # the matmul peak of the compute dtype
    model_seconds_per_sequence: float  # FLOPs / (peak x MFU), also when the pilot replaced it
    pilot: PilotView | None = None
    num_gpus: int = 0
    cost_usd: float | None = None
    recompute_flops: float = 0.0  # activation checkpointing: the drafter layers' forward again
    notes: list[str] = field(default_factory=list)


def training_at(
    t: TargetArch,
    d: DrafterConfig,
    hw: GpuProfile,
    *,
    ta: TrainSettings,
    weight_dtype: str,
    num_gpus: int,
    data: Dataset,
    planned_gpus: int,
    pilot: TrainPilot | None = None,
) -> TrainingEstimate:
    """training_estimate on `num_gpus` GPUs with the planned layout scaled to them: the split keeps the planned
    share of target GPUs (split_target_gpus of `planned_gpus`, at least one of each kind); one GPU is `single`."""
    n_t = None if num_gpus < 2 else min(num_gpus - 1, max(1, round(num_gpus * ta.split_target_gpus / planned_gpus)))
    return training_estimate(
        t,
        d,
        hw,
        ta=ta,
        weight_dtype=weight_dtype,
        num_gpus=num_gpus,
        data=data,
        split_target_gpus=n_t,
        layout="auto" if num_gpus < 2 else ta.layout,
        pilot=pilot,
    )


def pilot_view(
    pilot: TrainPilot,
    ta: TrainSettings,
    *,
    flops_total: float,
    peak_tflops: float,
    model_s: float,
    per_sample: float,
) -> PilotView:
    device_gb = pilot.device_memory_gb or 0.0
    return PilotView(
        path=pilot.path,
        device=pilot.device,
        layout=pilot.layout,
        world_size=pilot.world_size,
        step_seconds=pilot.step_seconds,
        seconds_per_sample=per_sample,
        model_seconds_per_sample=model_s,
        implied_mfu=flops_total / per_sample / (peak_tflops * 1e12) if per_sample else None,
        assumed_mfu=ta.mfu,
        measured_mfu=pilot.mfu,
        peak_memory_gb=pilot.peak_memory_gb,
        peak_phase=pilot.peak_phase,
        device_memory_gb=device_gb,
        memory_margin_gb=device_gb - pilot.peak_memory_gb,
        memory_fits=device_gb >= pilot.peak_memory_gb,
        worst_step_seconds=pilot.worst_step_seconds,
    )


def device_layouts(
    mem: TrainingMemory,
    hw: GpuProfile,
    ta: TrainSettings,
    *,
    num_gpus: int,
    split_target_gpus: int | None,
    target_s: float,
    drafter_s: float,
    samples: float,
) -> dict[str, Layout]:
    """Each device layout on `num_gpus` GPUs (module docstring): its memory per GPU role with the verdict, and its
    hours for `samples` sequences an epoch at `target_s` + `drafter_s` seconds per sequence on one GPU."""
    seqs_per_gpu_step = ta.batch_size * ta.grad_accum_steps
    layouts: dict[str, Layout] = {}

    def verdict(parts: dict[str, float]) -> MemoryVerdict:
        need = sum(parts.values()) / GB
        return MemoryVerdict({k: v / GB for k, v in parts.items()}, need, hw.memory_gb - need)

    def add(name: str, gpus: int, per_gpu: dict[str, dict[str, float]], *, seq_per_s: float, ranks: int) -> Layout:
        checks = {role: verdict(parts) for role, parts in per_gpu.items()}
        epoch_s = samples / seq_per_s
        steps = math.ceil(samples / (seqs_per_gpu_step * ranks))
        layouts[name] = Layout(
            gpus=gpus,
            per_gpu=checks,
            fits=all(c.margin_gb >= 0 for c in checks.values()),
            margin_gb=min(c.margin_gb for c in checks.values()),
            steps_per_epoch=steps,
            step_s=epoch_s / steps,
            epoch_hours=epoch_s / 3600,
            total_hours=ta.epochs * epoch_s / 3600,
            gpu_hours=ta.epochs * epoch_s / 3600 * gpus,
        )
        return layouts[name]

    both = {
        "target_weights": mem.target_weights,
        "target_activations": mem.target_activations,
        "features": mem.features,
        "drafter_weights": mem.drafter_weights,
    }
    tail = {"drafter_activations": mem.drafter_activations, "reserve": mem.reserve}
    single = {"gpu": {**both, "drafter_states": mem.drafter_states, **tail}}
    add("single", 1, single, seq_per_s=1 / (target_s + drafter_s), ranks=1)
    if num_gpus >= 2:
        shard = num_gpus if ta.shard_optimizer else 1
        dp = {**both, "drafter_states": mem.drafter_states / shard, **tail}
        add("data_parallel", num_gpus, {"gpu": dp}, seq_per_s=num_gpus / (target_s + drafter_s), ranks=num_gpus)
        n_t = split_target_gpus or ta.split_target_gpus
        if not 1 <= n_t < num_gpus:
            raise ParamsError(f"plan.train_assumptions.split_target_gpus: need 1 <= {n_t} < {num_gpus} GPUs")
        n_d = num_gpus - n_t
        shard_d = n_d if ta.shard_optimizer else 1
        target_gpu = {
            "target_weights": mem.target_weights,
            "target_activations": mem.target_activations,
            "features": mem.features,
            "reserve": mem.reserve,
        }
        drafter_gpu = {
            "embed_and_head": mem.embed_and_head,
            "features": mem.features,
            "drafter_weights": mem.drafter_weights,
            "drafter_states": mem.drafter_states / shard_d,
            **tail,
        }
        # target and drafter GPUs work as a pipeline: the slower side sets the rate
        split = add(
            "split",
            num_gpus,
            {"target_gpu": target_gpu, "drafter_gpu": drafter_gpu},
            seq_per_s=min(n_t / target_s, n_d / drafter_s),
            ranks=n_d,
        )
        split.target_gpus = n_t
        split.feature_transfer_ms_per_seq = (
            mem.features / ta.batch_size / (hw.interconnect_gbps * GB) * 1e3 if hw.interconnect_gbps > 0 else None
        )
    return layouts


def training_estimate(
    t: TargetArch,
    d: DrafterConfig,
    hw: GpuProfile,
    *,
    ta: TrainSettings,
    weight_dtype: str,
    num_gpus: int,
    data: Dataset,
    split_target_gpus: int | None = None,
    layout: str | None = None,
    pilot: TrainPilot | None = None,
    draft_vocab_rows: int | None = None,
) -> TrainingEstimate:
    """Time and per-GPU memory of each device layout on `num_gpus` GPUs; the headline is `layout` (default
    plan.train_assumptions.layout; "auto" = the fastest layout that fits). A pilot measured on this hardware
    replaces the model's seconds per sequence. `draft_vocab_rows`: price a pruned draft vocabulary
    (training_flops_per_sequence)."""
    # a pilot of this target knows the lm_head rows the loss computes (the tiny demo target's zero rows fold away)
    rows = pilot.lm_head_rows if pilot is not None else None
    flops = training_flops_per_sequence(
        t,
        d,
        ta,
        seq_tokens=data.seq_tokens,
        loss_tokens=data.loss_tokens,
        vocab_rows=rows,
        draft_vocab_rows=draft_vocab_rows,
    )
    mem = training_memory(t, d, ta, weight_dtype=weight_dtype, seq_tokens=data.seq_tokens, anchors=flops.anchors)
    peak = hw.matmul_tflops(ta.compute_dtype, "train.dtype")
    rate = peak * 1e12 * ta.mfu
    recompute = (flops.drafter_q_o_mlp + flops.drafter_attention) / 3 if ta.activation_checkpointing else 0.0
    target_s = flops.target_forward / rate
    drafter_s = (flops.total - flops.target_forward + recompute) / rate
    model_s = target_s + drafter_s
    view, source = None, "model"
    if pilot is not None and pilot.ran_on(hw):
        # the pilot ran on the data the plan prices: its epoch of packed rows at its step time, per planned sample
        per_sample = pilot.epoch_seconds_one_process() / data.train_samples
        view = pilot_view(pilot, ta, flops_total=flops.total, peak_tflops=peak, model_s=model_s, per_sample=per_sample)
        target_s, drafter_s = per_sample * pilot.target_share, per_sample * (1 - pilot.target_share)
        source = "pilot"
    layouts = device_layouts(
        mem,
        hw,
        ta,
        num_gpus=num_gpus,
        split_target_gpus=split_target_gpus,
        target_s=target_s,
        drafter_s=drafter_s,
        samples=data.train_samples,
    )
    choice = layout or ta.layout
    if choice == "auto":
        fitting = [k for k, v in layouts.items() if v.fits]
        choice = min(fitting, key=lambda k: layouts[k].total_hours) if fitting else "single"
    elif choice not in layouts:
        raise UserError(f"plan.train_assumptions.layout: {choice!r} needs at least 2 GPUs (plan has {num_gpus})")
    return TrainingEstimate(
        flops_per_sequence=flops,
        seconds_per_sequence_one_gpu=target_s + drafter_s,
        target_seconds_per_sequence=target_s,
        drafter_seconds_per_sequence=drafter_s,
        memory_parts_gb=mem.in_gb(),
        layouts=layouts,
        layout=choice,
        headline=layouts[choice],
        source=source,
        compute_tflops=peak,
        model_seconds_per_sequence=model_s,
        pilot=view,
        recompute_flops=recompute,
    )
