"""The drafter's data-parallel wrapper (`train.parallel`: ddp | fsdp), its checkpoint state and its export copy.

Inputs: the drafter built by loop.py (fp32 master weights on its device), the process group (torchrun), the
compute dtype. Outputs: the module to train (`wrap_drafter`), full state dicts for rank 0 to save
(`full_state`), loading one back into a replicated or sharded drafter (`load_full_state`), a plain full-weight
copy for the export (`unsharded`), the clipped global gradient norm (`clip_grad_norm`).

ddp: every process holds the whole drafter, its gradients and its AdamW state (DistributedDataParallel, as
  before). fsdp: FSDP2 (`torch.distributed.fsdp.fully_shard`): weights, gradients and AdamW state are sharded
  over the processes (each holds 1/world of them); weights are all-gathered per unit just before it runs and
  freed after, gradients reduce-scattered after each micro-step's backward. Units: each decoder layer's SwiGLU
  `mlp` (83% of a layer at the Qwen3.6-27B geometry), then the root (attention, fc, norms). NOT the whole
  decoder layer: the drafter's forward calls `layer.self_attn.project_kv` on the context before the layer
  runs, outside the layer's forward hooks, so a per-layer unit would see sharded weights there (torch raises
  "mixed torch.Tensor and DTensor") and would reduce-scatter before the context path's gradient arrives.
  On GPU with bf16 compute, the all-gathered weights are bf16 (MixedPrecisionPolicy param_dtype) and the
  gradient reduction is fp32 (reduce_dtype), the shards stay fp32 master weights; on CPU (gloo) all fp32.
  One process: no wrapper in either mode (logged).

Checkpoints are the same in both modes (interchangeable: a ddp checkpoint resumes under fsdp and back):
  full, unsharded fp32 weights (safetensors) and the optimizer state in torch's own format
  (`Optimizer.state_dict()`: params numbered in optimizer order), readable with torch.load(weights_only=True).
  Under fsdp they are gathered with torch.distributed.checkpoint.state_dict.get_state_dict
  (full_state_dict=True, cpu_offload=True: the full tensors exist on rank 0's CPU only) and loaded back with
  set_state_dict, which cuts each process's shard out of the full tensors.
"""

from __future__ import annotations

import copy
import logging

import torch
from torch import nn

from dflash.core.errors import UserError

log = logging.getLogger(__name__)

MODES = ("ddp", "fsdp")


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The FSDP units below the root: each decoder layer's `mlp` (see the module docstring for why not the layer)."""
    return [layer.mlp for layer in model.layers]


def wrap_drafter(
    model: nn.Module, mode: str, device: torch.device, world: int, dtype: torch.dtype = torch.float32
) -> nn.Module:
    """The module to train: `model` itself (one process), DDP around it, or `model` sharded in place (fsdp).

    Under fsdp the parameters are replaced by DTensor shards: build the optimizer on `model.parameters()` after
    this call. `dtype` is the compute dtype (bf16 -> bf16 all-gathers, fp32 gradient reduction)."""
    if mode not in MODES:
        raise UserError(f"train.parallel: expected one of {MODES}, got {mode!r}")
    if world == 1:
        if mode == "fsdp":
            log.info("train.parallel=fsdp with one process: nothing to shard, the drafter trains as a plain module")
        return model
    if mode == "ddp":
        ids = [device.index] if device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)
    return shard(model, device, world, dtype)


def shard(model: nn.Module, device: torch.device, world: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    """FSDP2 in place over all `world` processes: the units, then the root (module docstring). Also with one
    process (tests: the same hooks and DTensors without a peer)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if device.type == "cuda":
        torch.cuda.set_device(device)  # FSDP2 allocates its all-gather buffers on the current device
    mesh = init_device_mesh(device.type, (world,))
    policy = MixedPrecisionPolicy()
    if device.type == "cuda" and dtype != torch.float32:
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for unit in fsdp_units(model):
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if device.type == "cpu":  # gloo has no ReduceOp.AVG: reduce-scatter with SUM, then divide by the world size
        for m in (*fsdp_units(model), model):
            m.set_force_sum_reduction_for_comms(True)
    n = sum(p.numel() for p in model.parameters())
    log.info("FSDP2: %d parameters sharded over %d processes (%d units + root)", n, world, len(fsdp_units(model)))
    return model


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """Clip the global gradient norm (over all processes under fsdp: DTensor grads) and return it, pre-clip."""
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if hasattr(norm, "full_tensor"):  # a DTensor: the norm over every shard, reduced
        norm = norm.full_tensor()
    return float(norm)


def _options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def _fqns(model: nn.Module, opt: torch.optim.Optimizer) -> list[str]:
    """Parameter names in the optimizer's numbering (torch's state_dict numbers params in param_groups order)."""
    names = {p: n for n, p in model.named_parameters()}
    return [names[p] for group in opt.param_groups for p in group["params"]]


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(model state dict, optimizer state dict in torch's numbered format), full and unsharded, for rank 0 to
    save. Under fsdp a collective (every process calls it; only rank 0 gets the tensors, on CPU)."""
    if not is_sharded(model):
        return model.state_dict(), opt.state_dict()
    from torch.distributed.checkpoint.state_dict import get_state_dict

    weights, named = get_state_dict(model, opt, options=_options())
    if not weights:  # ranks > 0: nothing gathered
        return {}, {}
    number = {name: i for i, name in enumerate(_fqns(model, opt))}
    optim = {
        "state": {number[name]: value for name, value in named["state"].items()},
        "param_groups": [{**g, "params": [number[name] for name in g["params"]]} for g in named["param_groups"]],
    }
    return weights, optim


def load_full_state(model: nn.Module, opt: torch.optim.Optimizer, weights: dict, optim: dict) -> None:
    """Load a full checkpoint (full_state's format, from either mode) into a plain, DDP-wrapped or sharded drafter.
    Under fsdp every process passes the full tensors and keeps its own shard."""
    if not is_sharded(model):
        model.load_state_dict(weights, strict=True)
        opt.load_state_dict(optim)
        return
    from torch.distributed.checkpoint.state_dict import set_state_dict

    names = _fqns(model, opt)
    named = {
        "state": {names[int(i)]: dict(value) for i, value in optim["state"].items()},
        "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in optim["param_groups"]],
    }
    # set_state_dict replaces the dicts' tensors by shards in place: give it copies, never the caller's
    set_state_dict(model, opt, model_state_dict=dict(weights), optim_state_dict=named, options=_options())


def unsharded(model: nn.Module, rank: int) -> nn.Module | None:
    """A plain copy of the drafter with its full weights for the export, on rank 0 (None elsewhere). Under fsdp a
    collective: the full weights are gathered to rank 0's CPU and loaded into a freshly built drafter."""
    if not is_sharded(model):
        return copy.deepcopy(model) if rank == 0 else None
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from dflash.drafter.model import build_drafter

    weights = get_model_state_dict(model, options=_options())
    if rank != 0:
        return None
    plain = build_drafter(model.config, device="meta")  # no random init (and no draw from the global RNG)
    plain.load_state_dict(weights, strict=True, assign=True)  # the gathered fp32 CPU tensors become its weights
    return plain


__all__ = [
    "MODES",
    "clip_grad_norm",
    "fsdp_units",
    "full_state",
    "is_sharded",
    "load_full_state",
    "shard",
    "unsharded",
    "wrap_drafter",
]
