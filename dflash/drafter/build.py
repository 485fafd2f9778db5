"""build_drafter: a drafter of any kind, its module class found through the kind's spec (dflash/drafter/kinds.py).

The torch side of the registry: it imports every kind's module, so whatever builds a drafter or runs a kind's
decode step (train, eval, export) imports them, and `resolve` finds each spec's "module:attribute" loaded.
"""

from __future__ import annotations

import torch

import dflash.drafter.dflash2
import dflash.drafter.dspark
import dflash.drafter.lilicorr
import dflash.drafter.model  # noqa: F401  (with the three above: every kind's module, named by its KindSpec)
from dflash.drafter.geometry import DrafterConfig
from dflash.drafter.kinds import resolve, spec_for
from dflash.drafter.model import DFlashDrafter


def build_drafter(config: DrafterConfig, device: str | torch.device = "cpu", dtype=torch.float32) -> DFlashDrafter:
    """The config's kind on `device` ("meta" allocates nothing), initialised from torch's global RNG: under one
    seed every kind's DFlash body gets the same weights (the kind's own parts are initialised after it)."""
    return resolve(spec_for(config.kind).drafter_class).build(config, device, dtype)


__all__ = ["build_drafter"]
