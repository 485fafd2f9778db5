"""Distributed plumbing for training: who this process is (global rank vs local rank), its devices, the
global batch over any world size, the process group, and the checks that every node sees the same run.

Inputs: the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK; absent = one
process), params `train` (devices, gpus_per_process, batch_size, grad_accum_steps, global_batch).
Outputs: a `Dist` (rank, local_rank, world, local_world, nodes, node_rank, host, is_main), devices, the
gradient-accumulation count, and collective helpers (barrier, all_reduce, agree, broadcast_str, check_shared).

Which rank means what (the rule the multi-node code follows, tests/integration/test_train_multinode.py checks it):
  LOCAL_RANK  -> device indices only: process l of a node owns GPUs l*gpus_per_process ... (per node)
  RANK, WORLD -> everything global: the data shard, the loss normaliser, who writes (is_main = RANK 0: the
                 checkpoints, the export, dvclive, the stage's metrics), which checkpoint every rank loads
Global batch: `train.global_batch` rows per optimizer step on any world size (0 = batch_size x grad_accum_steps
x WORLD, the old meaning, which changes with the world size). When set, each process runs
global_batch / (batch_size x WORLD) micro-steps (grad_accum_steps is then ignored); a world size that does not
divide it is refused (UserError naming the numbers) rather than silently changing the schedule.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash.core.errors import ParamsError, UserError


@dataclass(frozen=True)
class Dist:
    """This process's place in the job (module docstring)."""

    rank: int = 0  # global rank: data shard, writer
    local_rank: int = 0  # rank on this node: devices
    world: int = 1
    local_world: int = 1  # processes on this node (torchrun --nproc-per-node)
    node_rank: int = 0
    host: str = "localhost"

    @property
    def is_main(self) -> bool:
        """The one process that writes (checkpoints, export, dvclive, metrics): global rank 0, never LOCAL_RANK."""
        return self.rank == 0

    @property
    def nodes(self) -> int:
        return max(1, self.world // max(1, self.local_world))

    def describe(self) -> str:
        return f"rank {self.rank}/{self.world} (node {self.node_rank} of {self.nodes} on {self.host}, local {self.local_rank})"


def from_env(env: dict[str, str] | None = None) -> Dist:
    """The torchrun variables -> Dist; inconsistent values are refused (a launcher mistake, not a training one)."""
    env = os.environ if env is None else env

    def get(name: str, default: int) -> int:
        value = env.get(name, "")
        if value == "":
            return default
        if not value.lstrip("-").isdigit():
            raise UserError(f"environment {name}={value!r}: expected an integer (set by torchrun)")
        return int(value)

    world = get("WORLD_SIZE", 1)
    rank = get("RANK", 0)
    local_rank = get("LOCAL_RANK", 0)
    local_world = get("LOCAL_WORLD_SIZE", 1 if world == 1 else 0)
    if local_world == 0:  # launched without torchrun's LOCAL_WORLD_SIZE: assume one node
        local_world = world
    node_rank = get("GROUP_RANK", rank // max(1, local_world))
    if not (world >= 1 and 0 <= rank < world and 0 <= local_rank < local_world <= world):
        raise UserError(
            f"environment RANK={rank} LOCAL_RANK={local_rank} WORLD_SIZE={world} LOCAL_WORLD_SIZE={local_world}: "
            "inconsistent (launch with torchrun)"
        )
    return Dist(rank, local_rank, world, local_world, node_rank, socket.gethostname())


def resolve_device(spec: str, key: str, dist: Dist, gpus_per_process: int) -> torch.device:
    """auto | cpu | cuda | cuda:N -> a device; N counts from this process's first GPU on its node
    (LOCAL_RANK x gpus_per_process: the global rank never indexes a device)."""
    if spec == "auto":
        spec = "cuda:0" if torch.cuda.is_available() else "cpu"
    if spec == "cpu":
        return torch.device("cpu")
    if spec != "cuda" and not (spec.startswith("cuda:") and spec[5:].isdigit()):
        raise UserError(f"train.{key}: expected auto, cpu, cuda or cuda:N, got {spec!r}")
    n = int(spec[5:]) if spec.startswith("cuda:") else 0
    if not torch.cuda.is_available():
        raise UserError(f"train.{key}: {spec} requested but CUDA is not available")
    if n >= gpus_per_process:
        raise UserError(f"train.{key}: {spec} is outside this process's {gpus_per_process} GPU(s)")
    gpu = dist.local_rank * gpus_per_process + n
    if gpu >= torch.cuda.device_count():
        raise UserError(
            f"train.{key}: local rank {dist.local_rank} on {dist.host} needs GPU {gpu} (LOCAL_RANK x "
            f"train.gpus_per_process + {n}), only {torch.cuda.device_count()} exist: run at most "
            f"{torch.cuda.device_count() // gpus_per_process} processes per node (torchrun --nproc-per-node)"
        )
    return torch.device("cuda", gpu)


def accumulation(batch_size: int, grad_accum_steps: int, global_batch: int, world: int) -> tuple[int, int]:
    """(micro-steps per process, rows per optimizer step) for this world size (module docstring)."""
    if global_batch < 0:
        raise ParamsError(f"train.global_batch: must be >= 0, got {global_batch}")
    if not global_batch:
        return grad_accum_steps, batch_size * grad_accum_steps * world
    per_micro = batch_size * world
    if global_batch % per_micro:
        raise UserError(
            f"train.global_batch: {global_batch} rows per optimizer step cannot be split over {world} processes x "
            f"train.batch_size {batch_size} (= {per_micro} rows per micro-step): use a world size or batch_size "
            f"whose product divides {global_batch}"
        )
    return global_batch // per_micro, global_batch


# ------------------------------------------------------------------------------------------- process group


def init(dist: Dist, device: torch.device) -> None:
    """Join the process group (nccl on CUDA, bound to this process's drafter GPU; gloo on CPU)."""
    if dist.world == 1 or torch.distributed.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)  # collectives without device_id would pick GPU (RANK % count): wrong
        torch.distributed.init_process_group("nccl", device_id=device)
    else:
        torch.distributed.init_process_group("gloo")


def close(dist: Dist) -> None:
    if dist.world > 1 and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def barrier(dist: Dist) -> None:
    if dist.world > 1:
        torch.distributed.barrier()


def all_reduce(dist: Dist, t: torch.Tensor) -> torch.Tensor:
    if dist.world > 1:
        torch.distributed.all_reduce(t)
    return t


def gather(dist: Dist, value: object) -> list:
    """Every rank's `value` (picklable), in rank order."""
    if dist.world == 1:
        return [value]
    out: list = [None] * dist.world
    torch.distributed.all_gather_object(out, value)
    return out


def broadcast_str(dist: Dist, value: str | None) -> str | None:
    """Rank 0's value on every rank (one decision, e.g. which checkpoint all ranks load)."""
    if dist.world == 1:
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def agree(dist: Dist, value: str, what: str) -> None:
    """UserError unless every rank computed the same `value` (e.g. the config hash over params, data, target)."""
    values = gather(dist, (value, dist.host))
    odd = [f"rank {r} on {h}: {v}" for r, (v, h) in enumerate(values) if v != values[0][0]]
    if odd:
        raise UserError(
            f"{what} differs between processes (rank 0 on {values[0][1]}: {values[0][0]}; {'; '.join(odd)}): every "
            "node needs the same repo checkout, params, tokenize shards and target"
        )


def check_shared(dist: Dist, path: Path, key: str) -> None:
    """After rank 0 wrote `path` (and a barrier): UserError unless every rank sees it (a shared filesystem)."""
    seen = gather(dist, (Path(path).exists(), dist.host))
    blind = sorted({h for ok, h in seen if not ok})
    if blind:
        raise UserError(
            f"{key}: {path} written by rank 0 on {seen[0][1]} is not visible on {', '.join(blind)}: put {key} on a "
            "filesystem shared by all nodes (only rank 0 writes checkpoints; every rank reads them to resume)"
        )


__all__ = [
    "Dist",
    "accumulation",
    "agree",
    "all_reduce",
    "barrier",
    "broadcast_str",
    "check_shared",
    "close",
    "from_env",
    "gather",
    "init",
    "resolve_device",
]
