"""The trainer's set-up parts (dflash/train/parts.py): what the checkpoint folder's key covers."""

from __future__ import annotations

import torch

from dflash.core.hf import target_config_dict, target_tokenizer
from dflash.drafter.geometry import build_drafter_config
from dflash.train import parts
from tests.helpers.train import train_params


class _Index:
    """A DocIndex stand-in: the key reads only its fingerprint."""

    def fingerprint(self) -> str:
        return "data"


def _key(target, out, *extra: str) -> dict:
    params = train_params(target, out, *extra)
    config = target_config_dict(str(target), False)
    cfg = build_drafter_config(params.drafter, config, target_tokenizer(str(target), False))
    cpu = torch.device("cpu")
    devices = parts.Devices(target=cpu, drafter=cpu, dtype=torch.float32, attention="sdpa")
    return parts.checkpoint_key(params, cfg, rows_per_step=4, devices=devices, target_config=config, index=_Index())


def test_the_checkpoint_key_covers_how_dsparks_markov_head_starts(train_target, tmp_path):
    """A counts-initialised run must not resume a zeros-initialised checkpoint (the export leaves the init out);
    the other kinds' keys do not read the DSpark field."""
    dspark = ["drafter.kind=dspark", "drafter.dspark.markov_rank=8"]
    zeros = _key(train_target, tmp_path, *dspark, "drafter.dspark.markov_init=zeros")
    counts = _key(train_target, tmp_path, *dspark, "drafter.dspark.markov_init=counts")
    assert zeros != counts and zeros["markov_init"] == "zeros"
    dflash = [_key(train_target, tmp_path, f"drafter.dspark.markov_init={v}") for v in ("zeros", "counts")]
    assert dflash[0] == dflash[1] and "markov_init" not in dflash[0]
