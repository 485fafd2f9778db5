"""One entry point for every drafter kind: the module class of `drafter.kind` and its construction.

dflash   DFlashDrafter (dflash/drafter/model.py)
dspark   DSparkDrafter (dflash/drafter/dspark.py): + Markov head + confidence head
dflash2  DFlash2Drafter (dflash/drafter/dflash2.py): + grouped causal convs + candidate selector
lilicorr LiLiCorrDrafter (dflash/drafter/lilicorr.py): + candidate-lattice correlator (+ optional grouped convs)
"""

from __future__ import annotations

import torch

from dflash.drafter.dflash2 import DFlash2Drafter
from dflash.drafter.dspark import DSparkDrafter
from dflash.drafter.geometry import DFLASH, DFLASH2, DSPARK, DrafterConfig
from dflash.drafter.lilicorr import LiLiCorrDrafter
from dflash.drafter.lilicorr_spec import LILICORR
from dflash.drafter.model import DFlashDrafter

CLASSES: dict[str, type[DFlashDrafter]] = {DFLASH: DFlashDrafter, DSPARK: DSparkDrafter, DFLASH2: DFlash2Drafter}
CLASSES[LILICORR] = LiLiCorrDrafter


def build_drafter(config: DrafterConfig, device: str | torch.device = "cpu", dtype=torch.float32) -> DFlashDrafter:
    """The config's kind on `device` ("meta" allocates nothing), initialised from torch's global RNG: under one
    seed every kind's DFlash body gets the same weights (the kind's own parts are initialised after it)."""
    with torch.device(device):
        model = CLASSES[config.kind](config)
    return model.to(dtype=dtype)


__all__ = ["CLASSES", "build_drafter"]
