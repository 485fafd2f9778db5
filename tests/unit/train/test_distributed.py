"""Rank and world rules of dflash/train/distributed.py without starting processes: ranks come from torchrun's
environment and only global rank 0 writes, devices follow the local rank, the global batch is kept or refused on
another world size. The torchrun runs themselves: tests/integration/test_train_multinode.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from dflash.core.errors import UserError
from dflash.train import distributed
from dflash.train.data import shard_step
from dflash.train.loop import Trainer, train
from tests.helpers import repo_params
from tests.helpers.train import train_overrides

# ------------------------------------------------------------------------------------------------ units


def test_ranks_come_from_torchrun_and_only_global_rank_0_writes():
    env = {"RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}
    d = distributed.from_env(env)
    assert (d.rank, d.local_rank, d.world, d.nodes, d.node_rank) == (2, 0, 4, 2, 1)
    assert not d.is_main  # local rank 0 of node 1 is not the writer
    assert distributed.from_env({**env, "RANK": "0", "GROUP_RANK": "0"}).is_main
    assert distributed.from_env({}).world == 1 and distributed.from_env({}).is_main
    with pytest.raises(UserError, match="RANK=4 .* inconsistent"):
        distributed.from_env({**env, "RANK": "4"})


def test_devices_come_from_the_local_rank(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    second_node = distributed.Dist(rank=3, local_rank=1, world=4, local_world=2, node_rank=1)
    # the split layout: 2 GPUs per process, target cuda:0 + drafter cuda:1 of this process's pair
    assert distributed.resolve_device("cuda:0", "target_device", second_node, 2) == torch.device("cuda", 2)
    assert distributed.resolve_device("cuda:1", "drafter_device", second_node, 2) == torch.device("cuda", 3)
    crowded = dataclasses.replace(second_node, local_rank=2, local_world=3)
    with pytest.raises(UserError, match=r"local rank 2 .* needs GPU 4 .* at most 2 processes per node"):
        distributed.resolve_device("cuda:0", "target_device", crowded, 2)


def test_the_global_batch_is_kept_or_refused_on_another_world_size():
    assert distributed.accumulation(1, 3, 0, 2) == (3, 6)  # 0: the old meaning, grows with the world
    assert distributed.accumulation(1, 3, 4, 4) == (1, 4)  # set: grad_accum_steps is derived
    assert distributed.accumulation(1, 3, 4, 2) == (2, 4)
    assert distributed.accumulation(2, 1, 4, 1) == (2, 4)
    with pytest.raises(UserError, match=r"train\.global_batch: 4 rows .* over 3 processes x train\.batch_size 1"):
        distributed.accumulation(1, 1, 4, 3)
    rows = [[i] for i in range(8)]
    for b, world in ((1, 1), (1, 2), (1, 4), (2, 2), (2, 4), (4, 2)):
        accum = 8 // (b * world)
        shards = [shard_step(rows, b, accum, world, r) for r in range(world)]
        slots = sorted((s, tuple(map(tuple, rs))) for sh in shards for s, rs in sh)
        assert [r for _, rs in slots for r in rs] == [tuple(r) for r in rows]  # each row once, slot by slot
        assert all(s % world == r for r, sh in enumerate(shards) for s, _ in sh)  # slot s -> global rank s % world


def test_a_world_change_without_global_batch_is_refused(tmp_path, train_target, train_data):
    out = tmp_path / "out"
    first = train(repo_params(train_overrides(train_target, out, "train.max_steps=1")), train_data)
    assert first["steps"] == 1 and first["global_batch_rows"] == 1
    bigger = train_overrides(
        train_target, out, "train.grad_accum_steps=2"
    )  # what 2 processes would take: another batch
    with pytest.raises(UserError, match=r"1 rows per optimizer step; this run takes 2 .* train\.global_batch=1"):
        Trainer(repo_params(bigger), train_data)
    same = Trainer(repo_params([*bigger, "train.global_batch=1"]), train_data)
    assert same.ckpt_dir == Path(first["checkpoint_dir"]) and same.data.accum == 1
