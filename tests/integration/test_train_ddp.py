"""DDP on CPU / gloo (two spawned processes with torchrun's environment): step 0's gradients equal one process
on the same global batch, and differ from one process on half of it. Target and shards: tests/helpers/train.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflash.train.loop import Trainer
from tests.helpers.train import free_port, one_thread, rank_env, train_params

# ------------------------------------------------------------------------------------------------ DDP


def _ddp_worker(rank, world, port, train_target, train_data, out, result):
    rank_env(rank, world, port)
    torch.set_num_threads(1)
    trainer = Trainer(train_params(Path(train_target), Path(out)), train_data)
    metrics = trainer.compute_gradients(0)
    if rank == 0:
        torch.save({"grads": [p.grad.clone() for p in trainer.model.parameters()], "metrics": metrics}, result)
    torch.distributed.destroy_process_group()


def test_ddp_gradients_equal_one_process_on_the_same_global_batch(tmp_path, train_target, train_data):
    import torch.multiprocessing as mp

    port = free_port()
    result = tmp_path / "ddp.pt"
    mp.spawn(
        _ddp_worker, args=(2, port, str(train_target), str(train_data), str(tmp_path / "ddp"), str(result)), nprocs=2
    )
    ddp = torch.load(result, weights_only=True)
    with one_thread():
        single = Trainer(train_params(train_target, tmp_path / "single", "train.batch_size=2"), train_data)
        metrics = single.compute_gradients(0)
    assert single.data.rows_per_step == 2 and ddp["metrics"]["tokens"] == metrics["tokens"]
    assert ddp["metrics"]["correct"] == metrics["correct"] and ddp["metrics"]["counted"] == metrics["counted"]
    assert ddp["metrics"]["loss"] == pytest.approx(metrics["loss"], rel=1e-6)

    def close(a, b) -> bool:
        # Two ranks sum their halves and all-reduce; one process sums all rows at once: the float32 sums differ by
        # a few units in the last place of the tensor's largest entries (up to 5 ulps of max |grad| seen on an
        # AVX-512 Xeon), so the absolute tolerance is 16 ulps of that scale.
        return torch.allclose(a, b, rtol=1e-5, atol=16 * torch.finfo(torch.float32).eps * b.abs().max().item())

    assert all(close(g, p.grad) for g, p in zip(ddp["grads"], single.model.parameters(), strict=True))
    half = Trainer(train_params(train_target, tmp_path / "half"), train_data)  # one process, batch 1: another batch
    half.compute_gradients(0)
    assert not all(close(g, p.grad) for g, p in zip(ddp["grads"], half.model.parameters(), strict=True))
