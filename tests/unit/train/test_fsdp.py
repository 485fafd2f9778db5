"""FSDP with one process is the plain module (no wrapping, a log line says so). The two-process FSDP vs DDP
runs: tests/integration/test_train_fsdp.py.
"""

from __future__ import annotations

from dflash.train import parallel
from dflash.train.loop import Trainer
from tests.helpers.train import train_params


def test_fsdp_with_one_process_is_the_plain_module(caplog, train_target, train_data, tmp_path):  # noqa: F811
    with caplog.at_level("INFO", logger="dflash.train.parallel"):
        trainer = Trainer(train_params(train_target, tmp_path / "one", "train.parallel=fsdp"), train_data)
    assert not parallel.is_sharded(trainer.model) and trainer.ddp is None
    assert "nothing to shard" in caplog.text
