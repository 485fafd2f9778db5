"""The trainer's parts, one named set-up step each, in the order of dflash/train/loop.py's docstring (bad params fail
before anything heavy): the devices, the checkpoint folder of the run's configuration, the target's frozen parts, the
drafter with its optimizer and schedule.

Inputs: params `train`, `drafter`, `base`; the drafter config and the data's index (built by the trainer); this
process's place (distributed.py). Outputs: typed parts the trainer keeps (`Devices`, `TargetParts`, `DrafterParts`)
and the checkpoint folder (checkpoint.py). Nothing here trains.

Devices: `target_device` / `drafter_device` (auto = cuda:0 or cpu). The same GPU for both is the simple layout;
different GPUs is the split layout (target on one, drafter on another; features, the embedding and the lm_head are
copied to the drafter's GPU). With torchrun, the process of LOCAL_RANK l owns GPUs l*gpus_per_process ... of its node
(cuda:N counts from there); the global RANK decides the data and who writes (distributed.py). Mixed precision: target
weights in the compute dtype (bf16 on GPU), the drafter keeps fp32 master weights and runs under bf16 autocast; fp32
everywhere on CPU.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash.core.errors import UserError
from dflash.core.hf import load_target_model
from dflash.core.loader import as_dict
from dflash.core.params import Params, TrainParams
from dflash.drafter.build import build_drafter
from dflash.drafter.geometry import DrafterConfig, config_dict, kind_cost
from dflash.drafter.kinds import KINDS
from dflash.train import checkpoint, draft_vocab, parallel
from dflash.train import distributed as dist
from dflash.train.data import DocIndex
from dflash.train.draft_vocab import DraftVocabRun
from dflash.train.features import TargetFeatures, target_identity
from dflash.train.loss import LMHead, slot_weights
from dflash.train.loss_dspark import (
    explicit_rows,
    init_markov_from_counts,
    previous_token_counts,
    supervised_tokens,
    zero_rows_tied,
)

# train keys that do not change the trained weights: outside the checkpoint hash (see TrainParams)
OPERATIONAL = (
    "out",
    "live_dir",
    "checkpoint_every",
    "keep_checkpoints",
    "log_every",
    "max_steps",
    "export_dtype",
    "target_batch_tokens",
    "compile",
    "activation_checkpointing",  # recomputes the same layers in backward: the same maths, less memory
    "target_device",
    "drafter_device",
    "gpus_per_process",
    "batch_size",
    "grad_accum_steps",
    "parallel",  # ddp | fsdp: the same maths (float summation order aside); a run resumes across modes
    "global_batch",  # these three enter the hash only as rows_per_step (the global batch)
    "pilot_warmup_steps",  # the pilot's (dflash/train/pilot.py), not the run's
    "pilot_steps",
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def lr_factor(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Linear warmup over `warmup` steps, then cosine from 1 to min_ratio at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class Devices:
    """Where the target and the drafter run, in which dtype, with which attention path."""

    target: torch.device
    drafter: torch.device
    dtype: torch.dtype  # target weights and the drafter's autocast (its master weights stay fp32)
    attention: str  # sdpa | flex


def resolve_devices(tp: TrainParams, place: dist.Dist) -> Devices:
    """train.target_device / drafter_device / dtype / attention resolved (auto: the GPU when there is one)."""
    target = dist.resolve_device(tp.target_device, "target_device", place, tp.gpus_per_process)
    drafter = dist.resolve_device(tp.drafter_device, "drafter_device", place, tp.gpus_per_process)
    on_gpu = drafter.type == "cuda"
    dtype = DTYPES[tp.dtype] if tp.dtype != "auto" else (torch.bfloat16 if on_gpu else torch.float32)
    attention = tp.attention if tp.attention != "auto" else ("flex" if on_gpu else "sdpa")
    if attention == "flex" and not on_gpu:
        raise UserError("train.attention: flex_attention has no backward pass on CPU; use sdpa (or auto)")
    return Devices(target=target, drafter=drafter, dtype=dtype, attention=attention)


def checkpoint_key(
    params: Params,
    cfg: DrafterConfig,
    *,
    rows_per_step: int,
    devices: Devices,
    target_config: dict[str, Any],
    index: DocIndex,
) -> dict[str, Any]:
    """Everything that changes the trained weights (the checkpoint folder's hash): the train params but the
    OPERATIONAL ones and the other kinds' losses, the global batch, the drafter (and how a Markov head starts), the
    seed, the compute path, the target and the data."""
    tp = params.train
    idle_losses = {s.loss_params for s in KINDS.values() if s.loss_params and s.name != cfg.kind}  # the others'
    return {
        "train": {k: v for k, v in as_dict(tp).items() if k not in OPERATIONAL and k not in idle_losses},
        "rows_per_step": rows_per_step,
        "drafter": config_dict(cfg),
        **({"markov_init": params.drafter.dspark.markov_init} if cfg.markov_rank else {}),  # the export omits it
        "seed": params.base.seed,
        "compute": {"device": devices.drafter.type, "dtype": str(devices.dtype), "attention": devices.attention},
        "target": target_identity(params.base.target_dir, target_config),
        "data": index.fingerprint(),
    }


def open_checkpoint_folder(place: dist.Dist, out: str, key: dict[str, Any], *, accum: int) -> Path:
    """The configuration's checkpoint folder under `out`/checkpoints, the same on every rank (agreed, on a shared
    filesystem); a new folder beside one of another batch split without train.global_batch is refused (rank 0
    decides for all)."""
    root = Path(out) / "checkpoints"
    folder = checkpoint.config_folder(root, key, write=place.is_main)
    dist.agree(place, folder.name, "the training configuration hash (params, data, target)")
    dist.barrier(place)
    dist.check_shared(place, folder / checkpoint.CONFIG, "train.out")
    problem = None
    if place.is_main and checkpoint.latest(folder) is None:
        try:
            checkpoint.refuse_other_batch(root, key, f"batch_size x {accum} micro-steps x {place.world} procs")
        except UserError as exc:
            problem = str(exc)
    problem = dist.broadcast_str(place, problem)
    if problem:
        raise UserError(problem)
    return folder


@dataclass
class TargetParts:
    """The target's frozen parts the training step uses."""

    features: TargetFeatures  # hooked target forward: the feature layers (and the final hidden states)
    embed: torch.nn.Module  # its input embedding, on the drafter's device
    vocab: DraftVocabRun  # the loss head: the target's lm_head, or the drafter's pruned vocabulary
    slot_w: torch.Tensor  # (block_size,) loss weights of the block slots


def load_target(params: Params, cfg: DrafterConfig, devices: Devices, data_dir: str | Path) -> TargetParts:
    """The target's weights and its shared frozen modules (module docstring)."""
    tp, base = params.train, params.base
    target = load_target_model(base.target_dir, devices.dtype, devices.target, base.trust_remote_code)
    features = TargetFeatures(
        target,
        cfg.target_layer_ids,
        cfg.num_target_layers,
        tp.target_batch_tokens,
        # the target's own predictions need its final hidden states (dspark / dflash2: always)
        final=tp.loss_target != "tokens" or kind_cost(cfg).target_logits,
    )
    embed = target.get_input_embeddings()
    embed = embed if devices.target == devices.drafter else copy.deepcopy(embed).to(devices.drafter)
    # the target's frozen lm_head (exact zero-row softmax), or the drafter's own rows of a pruned vocabulary
    vocab = draft_vocab.setup(cfg, target.get_output_embeddings(), data_dir, devices.drafter, tp.loss_target)
    slot_w = slot_weights(cfg.block_size, tp.loss_gamma).to(devices.drafter)
    return TargetParts(features=features, embed=embed, vocab=vocab, slot_w=slot_w)


@dataclass
class DrafterParts:
    """The drafter being trained, the module that runs it, its optimizer and learning-rate schedule."""

    model: torch.nn.Module  # fp32 master weights
    loss_head: LMHead  # DSpark: zero lm_head rows that are labels get their own W2 row (loss_dspark.py)
    ddp: torch.nn.parallel.DistributedDataParallel | None
    forward: Any  # the wrapped (ddp | fsdp) module, compiled when train.compile
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    warmup: int  # warmup steps of the schedule


def build_training(
    params: Params, cfg: DrafterConfig, devices: Devices, *, head: LMHead, index: DocIndex, total_steps: int, world: int
) -> DrafterParts:
    """The drafter (seeded by base.seed; DSpark's Markov head from the data's previous-token counts when
    drafter.dspark.markov_init is counts), wrapped for train.parallel, its AdamW and warmup + cosine schedule."""
    tp = params.train
    torch.manual_seed(params.base.seed)
    model = build_drafter(cfg, device=devices.drafter, dtype=torch.float32)
    markov = getattr(model, "markov_head", None)
    if markov is not None and params.drafter.dspark.markov_init == "counts":
        table = previous_token_counts(index.paths, cfg.vocab_size)
        init_markov_from_counts(markov.markov_w1.weight, markov.markov_w2.weight, table)
    loss_head = head
    if model.label_row_weight() is not None and head.num_zero:
        loss_head = explicit_rows(head, supervised_tokens(index.paths, cfg.vocab_size))
        if not zero_rows_tied(loss_head, model.label_row_weight()):
            raise RuntimeError("DSpark markov_w2: the W2 rows of the zero lm_head rows differ (the loss ties them)")
    model.activation_checkpointing = tp.activation_checkpointing
    module = parallel.wrap_drafter(model, tp.parallel, devices.drafter, world, devices.dtype)  # ddp | fsdp
    ddp = module if isinstance(module, torch.nn.parallel.DistributedDataParallel) else None
    forward = torch.compile(module, dynamic=True) if tp.compile else module
    opt = torch.optim.AdamW(model.parameters(), lr=tp.lr, betas=tuple(tp.adam_betas), weight_decay=tp.weight_decay)
    warmup = math.ceil(tp.warmup_ratio * total_steps)
    floor = tp.min_lr_ratio
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, total_steps, warmup, floor))
    return DrafterParts(model=model, loss_head=loss_head, ddp=ddp, forward=forward, opt=opt, sched=sched, warmup=warmup)


__all__ = [
    "DTYPES",
    "OPERATIONAL",
    "Devices",
    "DrafterParts",
    "TargetParts",
    "build_training",
    "checkpoint_key",
    "load_target",
    "lr_factor",
    "open_checkpoint_folder",
    "resolve_devices",
]
