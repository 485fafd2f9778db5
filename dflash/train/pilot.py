"""Training pilot: a few real training steps on the worst rows the data holds and on ordinary rows, before the
long run, so that an out-of-memory, a kernel fallback or all-zero target features are found in minutes.

Inputs: `${tokenize.out}/train/shard-*.arrow`, the target in `${base.target_dir}`, params `train` (the run's own
settings + `pilot_warmup_steps`, `pilot_steps`), `drafter`, `base`, and `plan.hardware_file` / `plan.hardware` (the
peak the MFU is measured against). Outputs (written by stages/train.py): `${base.reports_dir}/train_pilot.json`
(the headline the plan reads) and `train_pilot_details.json` (every step of every phase). Nothing is trained for
keeps: the trainer's config folder goes to `${train.out}/pilot/`, no checkpoint, no export.

    python -m stages.train --params params.yaml --pilot
    torchrun --nproc_per_node 2 -m stages.train --overlay params/gpu-qwen3.6-27b.yaml --pilot   # the real layout

The real trainer (dflash/train/loop.py `Trainer`: same devices, layout, dtype, attention path, compile, activation
checkpointing, loss), its data plan replaced by the pilot's (dflash/train/pilot_data.py `PilotData`), runs three
phases of W warm-up + M measured optimizer steps, each step a full global batch:
  longest   the longest documents packed best-fit into rows of train.max_tokens_per_row (the first row holds the
            longest document): the target forward and the drafter's context at their largest;
  anchors   the documents with the most anchors per token packed the same way: the most blocks (drafter
            activations, logits) a row can carry;
  ordinary  a seeded sample of epoch 0's packed rows: the step time the run will see. A few rows carry more or
            fewer blocks than the epoch's average, so `epoch_step_seconds` (what the plan uses) scales the drafter's
            part by the epoch's anchors per row over the measured rows'.
Rates are time-weighted (tokens of the measured steps / their seconds), never a mean of per-step rates. Each step is
split into data wait (packing + reading shards), target forward, drafter forward + backward, optimizer. The plan
scales the ordinary step time by the epoch's packed rows (the same data, packed by the same code) to the planned
GPUs and layout, split into the target's share and the rest. Peak memory
per phase and device (dflash/train/probes.py). MFU = the planner's FLOPs of the documents and anchors the step
really fed (dflash/drafter/flops.py, the count the plan uses) / seconds / the device's profile peak for the
compute dtype. Sanity: every hooked layer's features finite and not all zero (RMS per layer in the report), the
first loss near ln(vocab) (a randomly initialised drafter predicts about uniformly; the first step's loss is the plain
mean over the drafted slots, whatever the weighting, and KL is not held to it).

Verdicts: ok; out_of_memory (one line: the rows, the row length, the memory at the failure and the knobs to turn);
bad_features (the layer named). The stage writes the report, then exits 1 on anything but ok.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from dflash.core.errors import UserError
from dflash.core.hardware import load_hardware, profile_for_device
from dflash.core.hf import target_config_dict
from dflash.core.params import Params
from dflash.core.target_config import TargetArch, as_target_arch, target_signature
from dflash.drafter.flops import DocumentWork, document_flops
from dflash.drafter.geometry import DrafterConfig
from dflash.train import distributed as dist
from dflash.train.data import Batch
from dflash.train.loop import Trainer
from dflash.train.pilot_data import (
    PHASES,
    AnchorMix,
    PilotData,
    anchor_mix,
    epoch_step_seconds,
    phase_steps,
    row_anchors,
)
from dflash.train.probes import (
    FeatureProblem,
    PeakMemory,
    TimedFeatures,
    attention_path,
    device_name,
    host_memory_gb,
    linear_attention_kernels,
    memory_in_use,
    out_of_memory,
    peak_gb,
)

log = logging.getLogger(__name__)

FIRST_LOSS_TOLERANCE = 0.25  # |first loss - ln V| / ln V above this is reported as suspicious
PILOT_HEADLINE = (  # reports/train_pilot.json, what the plan reads (everything: train_pilot_details.json)
    "verdict",
    "device",
    "world_size",
    "layout",
    "step_seconds",
    "epoch_step_seconds",
    "tokens_per_s",
    "samples_per_s",
    "target_share",
    "worst_step_seconds",
    "peak_memory_gb",
    "device_memory_gb",
    "peak_phase",
    "longest_document",
    "max_row_anchors",
    "lm_head_rows",
    "achieved_tflops",
    "mfu",
    "first_loss",
    "ln_vocab",
    "min_feature_rms",
    "steps_per_epoch",
    "epochs",
    "train_seconds_estimate",
    "target_signature",
)


# --------------------------------------------------------------------------------------------------- trainer


@contextlib.contextmanager
def _plain_mean_loss(trainer: Trainer, active: bool) -> Iterator[None]:
    """The very first step reports the plain mean loss over the valid slots (every drafted slot weighted 1, normalised
    by their count): a randomly initialised drafter then sits at about ln(vocab) whatever train.position_weighting
    the run uses (D-PACE normalises by the slot count with weights below 1, decay by the weight sum)."""
    if not active:
        yield
        return
    saved = trainer.tp, trainer.slot_w
    flat = torch.ones_like(trainer.slot_w)
    flat[0] = 0.0
    trainer.tp, trainer.slot_w = dataclasses.replace(trainer.tp, position_weighting="decay"), flat
    try:
        yield
    finally:
        trainer.tp, trainer.slot_w = saved


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def batch_flops(
    target: TargetArch, cfg: DrafterConfig, batches: list[Batch], *, loss_target: str, vocab_rows: int | None = None
) -> float:
    """The planner's FLOPs (dflash/drafter/flops.py) of the documents and anchors these micro-batches fed, with the
    lm_head rows the loss really computes."""
    total = 0.0
    for b in batches:
        anchors = b.anchors.numpy()
        for start, n in zip(b.doc_starts, b.doc_lengths, strict=True):
            offsets = anchors[(anchors >= start) & (anchors < start + n)] - start  # context before each anchor
            if not len(offsets):
                continue
            work = DocumentWork(
                tokens=n,
                anchors=len(offsets),
                mean_context=float(offsets.mean()),
                mean_context_sliding=float(np.minimum(offsets, cfg.sliding_window).mean()),
                vocab_rows=vocab_rows,
            )
            total += document_flops(target, cfg, work, loss_target)["total"]
    return total


@dataclasses.dataclass
class StepRecord:
    """One optimizer step of the pilot (this process's view; tokens and loss over all processes)."""

    phase: str
    warmup: bool
    seconds: float  # the whole step: data + target + drafter + optimizer
    data_s: float
    target_s: float
    drafter_s: float  # drafter forward + backward (+ loss), the rest of the gradient computation
    optimizer_s: float
    tokens: int  # real tokens of the global batch
    documents: int  # documents of this process's micro-batches
    row_tokens: int  # tokens of this process's longest row
    longest_document: int
    anchors: int  # blocks of this process's micro-batches
    loss: float
    flops: float  # this process's FLOPs (planner's count)


def _step(
    trainer: Trainer,
    data: PilotData,
    features: TimedFeatures,
    *,
    step: int,
    phase: str,
    warmup: bool,
    target: TargetArch,
) -> StepRecord:
    """One optimizer step of the pilot, timed: data wait, target forward, the rest of the gradients, optimizer."""
    data.data_seconds, features.seconds = 0.0, 0.0
    t0 = time.perf_counter()
    metrics = trainer.compute_gradients(step)
    _sync(trainer.device)
    t1 = time.perf_counter()
    trainer.optimizer_step()
    _sync(trainer.device)
    t2 = time.perf_counter()
    batches = data.last_batches
    return StepRecord(
        phase=phase,
        warmup=warmup,
        seconds=t2 - t0,
        data_s=data.data_seconds,
        target_s=features.seconds,
        drafter_s=max(0.0, t1 - t0 - data.data_seconds - features.seconds),
        optimizer_s=t2 - t1,
        tokens=metrics["tokens"],
        documents=sum(len(b.doc_lengths) for b in batches),
        row_tokens=max(max(b.row_tokens or [b.num_tokens]) for b in batches),
        longest_document=max(max(b.doc_lengths) for b in batches),
        anchors=sum(int(b.anchors.numel()) for b in batches),
        loss=metrics["loss"],
        flops=batch_flops(
            target, trainer.cfg, batches, loss_target=trainer.tp.loss_target, vocab_rows=trainer.head.weight.shape[0]
        ),
    )


def summarize_phase(records: list[StepRecord], memory: dict, world: int) -> dict:
    """Time-weighted rates of a phase's measured steps (tokens and seconds summed first), its parts, its peak."""
    measured = [r for r in records if not r.warmup] or records
    seconds = sum(r.seconds for r in measured)
    docs = sum(r.documents for r in measured) * world  # every process feeds its own documents
    parts = {k: sum(getattr(r, k) for r in measured) for k in ("data_s", "target_s", "drafter_s", "optimizer_s")}
    return {
        "steps": len(measured),
        "step_seconds": seconds / len(measured),
        "tokens_per_s": sum(r.tokens for r in measured) / seconds,
        "samples_per_s": docs / seconds,
        "seconds_per_sample": {k.removesuffix("_s"): v * world / docs for k, v in parts.items()},
        # per token of one process: packed rows are full, so a step's cost follows its tokens, not its documents
        "seconds_per_token": {
            k.removesuffix("_s"): v * world / sum(r.tokens for r in measured) for k, v in parts.items()
        },
        "share": {k.removesuffix("_s"): v / seconds for k, v in parts.items()},
        "achieved_tflops": sum(r.flops for r in measured) / seconds / 1e12,
        "row_tokens": max(r.row_tokens for r in records),
        "longest_document": max(r.longest_document for r in records),
        "anchors": max(r.anchors for r in records),
        "memory": memory,
        "peak_memory_gb": peak_gb(memory),
        "records": [dataclasses.asdict(r) for r in records],
    }


# --------------------------------------------------------------------------------------------------- run


def pilot_params(params: Params) -> Params:
    """The run's own params, but the trainer's config folder under ${train.out}/pilot and no dvclive."""
    tp = dataclasses.replace(params.train, out=str(Path(params.train.out) / "pilot"), live_dir="")
    return dataclasses.replace(params, train=tp)


def _peak_for(params: Params, device: torch.device, dtype: torch.dtype) -> tuple[float | None, str]:
    """(TFLOP/s, where it came from) of the profile of the device the pilot ran on, for its compute dtype."""
    plan = params.plan
    try:
        profiles = load_hardware(plan.hardware_file)
    except UserError as exc:  # the MFU is a side figure: a missing or bad profiles file must not stop the pilot
        return None, str(exc)
    prof = profile_for_device(profiles, plan.hardware, device.type, device_name(device))
    if prof is None:
        return None, f"no profile in {plan.hardware_file} matches {device_name(device)}"
    rate = prof.bf16_tflops if dtype in (torch.bfloat16, torch.float16) else prof.fp32_tflops
    if rate <= 0:
        return None, f"{plan.hardware_file} profile {prof.key} has no {str(dtype).removeprefix('torch.')} rate"
    return rate, f"{plan.hardware_file} profile {prof.key} ({str(dtype).removeprefix('torch.')})"


def _oom_message(phase: str, steps: list[list[np.ndarray]], trainer: Trainer, *, where: str, exc: BaseException) -> str:
    index, tp = trainer.index, trainer.tp
    rows = steps[0]
    tokens = max(int(index.length[r].sum()) for r in rows)
    longest = max(int(index.length[r].max()) for r in rows)
    anchors = max(row_anchors(index, r, tp.num_anchors) for r in rows)
    first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
    return (
        f"train pilot: out of memory on the {phase} rows (rows of up to {tokens} tokens, longest document {longest}, "
        f"{anchors} anchors, {trainer.data.rows_per_step} rows a step) with {where} ({first}); lower "
        f"train.max_tokens_per_row ({tp.max_tokens_per_row}) or train.num_anchors ({tp.num_anchors}), set "
        f"train.activation_checkpointing: true (now {str(tp.activation_checkpointing).lower()}), or shard the "
        f"drafter with train.parallel: fsdp (now {tp.parallel})"
    )


def run_pilot(params: Params, data_dir: str | Path) -> dict | None:
    """Run the pilot (module docstring); the report on global rank 0, None on the other ranks."""
    tp = params.train
    trainer = Trainer(pilot_params(params), data_dir)
    try:
        return _run(trainer, params, tp.pilot_warmup_steps, tp.pilot_steps)
    finally:
        trainer.close()


def _run(trainer: Trainer, params: Params, warmup: int, measured: int) -> dict | None:
    cfg = trainer.cfg
    target = as_target_arch(target_config_dict(params.base.target_dir, params.base.trust_remote_code))
    features = TimedFeatures(trainer.features, list(cfg.target_layer_ids), cfg.hidden_size, trainer.target_device)
    trainer.features = features
    devices = [trainer.target_device, trainer.device]
    by_phase = phase_steps(trainer.data, warmup + measured)
    mix = anchor_mix(trainer.data, by_phase["ordinary"][warmup:])
    data = PilotData.replacing(trainer.data, [step for name in PHASES for step in by_phase[name]])
    trainer.data = data  # the real trainer, fed the pilot's rows
    phases, verdict, problem, s = {}, "ok", None, 0
    for name in PHASES:
        peak = PeakMemory(devices)
        peak.start()
        records: list[StepRecord] = []
        features.where = name
        try:
            for i in range(warmup + measured):
                with _plain_mean_loss(trainer, s == 0):
                    records.append(_step(trainer, data, features, step=s, phase=name, warmup=i < warmup, target=target))
                s += 1
        except FeatureProblem as exc:
            verdict, problem = "bad_features", str(exc)
        except Exception as exc:
            if not out_of_memory(exc):
                raise
            where = memory_in_use(devices)
            verdict, problem = "out_of_memory", _oom_message(name, by_phase[name], trainer, where=where, exc=exc)
            log.error("%s", problem)
        if records:
            phases[name] = summarize_phase(records, peak.read(), trainer.world)
        if problem:
            break
    gathered = dist.gather(trainer.dist, {n: (p["peak_memory_gb"], p["achieved_tflops"]) for n, p in phases.items()})
    if not trainer.dist.is_main:
        return None
    measured_run = PilotRun(phases=phases, verdict=verdict, problem=problem, gathered=gathered, mix=mix)
    return report(trainer, params, measured_run, target=target, features=features)


@dataclasses.dataclass(frozen=True)
class PilotRun:
    """What the pilot's phases measured: per phase its summary (summarize_phase), the verdict and its problem, every
    process's (peak memory, TFLOP/s) per phase, and the ordinary rows' anchor mix."""

    phases: dict[str, dict]
    verdict: str  # ok | out_of_memory | bad_features
    problem: str | None
    gathered: list[dict[str, tuple[float, float]]]
    mix: AnchorMix


def report(trainer: Trainer, params: Params, run: PilotRun, *, target: TargetArch, features: TimedFeatures) -> dict:
    """Everything the pilot measured; the headline keys are PILOT_HEADLINE."""
    cfg, tp = trainer.cfg, trainer.tp
    phases, verdict, problem, gathered, mix = run.phases, run.verdict, run.problem, run.gathered, run.mix
    ordinary = phases.get("ordinary", {})
    first = next((p["records"][0]["loss"] for p in phases.values() if p["records"]), None)
    ln_v = math.log(cfg.vocab_size)
    peak_tflops, peak_source = _peak_for(params, trainer.device, trainer.dtype)
    peaks = {n: max(g[n][0] for g in gathered if n in g) for n in phases}
    norms = np.asarray(features.norms) if features.norms else np.zeros((0, len(cfg.target_layer_ids)))
    steps_per_epoch = trainer.data.steps_per_epoch[0]
    step_s = ordinary.get("step_seconds")
    epoch_step_s = epoch_step_seconds(ordinary, mix) if ordinary else None
    dev = trainer.device
    mem_total = torch.cuda.get_device_properties(dev).total_memory / 1e9 if dev.type == "cuda" else host_memory_gb()
    per_token = ordinary.get("seconds_per_token", {})
    out = {
        "verdict": verdict,
        "problem": problem,
        "device": device_name(dev),
        "device_type": dev.type,
        "target_device": str(trainer.target_device),
        "drafter_device": str(dev),
        "world_size": trainer.world,
        "gpus_per_process": tp.gpus_per_process,
        "layout": "split" if trainer.target_device != dev else ("data_parallel" if trainer.world > 1 else "single"),
        "dtype": str(trainer.dtype).removeprefix("torch."),
        "parallel": tp.parallel,
        "activation_checkpointing": tp.activation_checkpointing,
        "attention_path": attention_path(trainer.backend, tp.compile),
        "linear_attention": linear_attention_kernels(trainer.features.inner.model),
        "rows_per_step": trainer.data.rows_per_step,
        "lm_head_rows": int(trainer.head.weight.shape[0]),  # computed by the loss (exactly-zero rows folded)
        "max_tokens_per_row": tp.max_tokens_per_row,
        "num_anchors": tp.num_anchors,
        "warmup_steps": tp.pilot_warmup_steps,
        "measured_steps": tp.pilot_steps,
        "step_seconds": step_s,
        "epoch_step_seconds": epoch_step_s,
        "anchors_per_row": {"measured": mix.sample_per_row, "epoch": mix.epoch_per_row},
        "tokens_per_s": ordinary.get("tokens_per_s"),
        "samples_per_s": ordinary.get("samples_per_s"),
        "target_share": ordinary["share"]["target"] if ordinary else None,  # of the ordinary step: the target forward
        "target_seconds_per_token": per_token.get("target"),
        "drafter_seconds_per_token": (  # everything but the target forward: data, drafter, optimizer
            sum(v for k, v in per_token.items() if k != "target") if per_token else None
        ),
        "worst_step_seconds": max(
            (phases[n]["step_seconds"] for n in ("longest", "anchors") if n in phases), default=None
        ),
        "peak_memory_gb": max(peaks.values(), default=None),
        "device_memory_gb": mem_total,
        "peak_phase": max(peaks, key=peaks.get) if peaks else None,
        "peak_memory_by_phase": peaks,
        "longest_document": max((p["longest_document"] for p in phases.values()), default=None),
        "max_row_anchors": max((p["anchors"] for p in phases.values()), default=None),
        "achieved_tflops": ordinary.get("achieved_tflops"),
        "peak_tflops": peak_tflops,
        "peak_source": peak_source,
        "mfu": ordinary["achieved_tflops"] / peak_tflops if peak_tflops and ordinary else None,
        "first_loss": first,
        "ln_vocab": ln_v,
        # KL starts at ln V minus the target's entropy: only the cross-entropy targets must start near ln V
        "first_loss_ok": None
        if tp.loss_target == "target_kl" or first is None
        else abs(first - ln_v) <= FIRST_LOSS_TOLERANCE * ln_v,
        "feature_layers": list(cfg.target_layer_ids),
        "feature_rms": [float(x) for x in norms.min(axis=0)] if len(norms) else None,
        "min_feature_rms": float(norms.min()) if len(norms) else None,
        "rows_per_epoch": len(trainer.data.rows(0)),
        "tokens_per_epoch": int(trainer.index.length[trainer.index.usable].sum()),
        "documents_per_epoch": int(len(trainer.index.usable)),
        "steps_per_epoch": steps_per_epoch,
        "epochs": tp.epochs,
        "train_seconds_estimate": epoch_step_s * trainer.data.total_steps if epoch_step_s else None,
        "phases": phases,
        "target_signature": target_signature(Path(params.base.target_dir) / "config.json"),
    }
    if out["first_loss_ok"] is False:
        log.warning("train pilot: first loss %.3f is far from ln(vocab) %.3f", first, ln_v)
    return out
