"""The generation concurrency: the pilot sweep's knee rule and what `generate.max_num_seqs: auto` means.

Shared by the generate stage (which runs at the resolved value) and the plan (which models it), so both
read the same number from the same file.

    knee(sweep)                       the smallest level whose rate is within 5% of the best level's
    resolve_max_num_seqs(g, pilot)    an integer stays; auto -> pilot.json chosen_max_num_seqs
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from dflash.core.errors import UserError
from dflash.core.target_config import read_config

KNEE_TOLERANCE = 0.05  # a level within 5% of the best rate is as good: the smallest such level wins


def knee(sweep: list[dict]) -> int | None:
    """The chosen level of a sweep [{"max_num_seqs": n, "output_tokens_per_s": r}, ...]: the smallest n with
    r >= (1 - 5%) x the best r (more concurrency beyond it buys < 5% and costs latency and memory)."""
    rated = [s for s in sweep if s.get("output_tokens_per_s")]
    if not rated:
        return None
    best = max(s["output_tokens_per_s"] for s in rated)
    return min(s["max_num_seqs"] for s in rated if s["output_tokens_per_s"] >= (1 - KNEE_TOLERANCE) * best)


def chosen_from_pilot(path: str | Path, signature: str = "") -> int | None:
    """chosen_max_num_seqs of a pilot.json (None when the file or the key is absent, or when `signature` is
    given and the pilot ran on another target: the tiny demo's knee says nothing about a 27B engine)."""
    path = Path(path)
    if not path.exists():
        return None
    data = read_config(path)  # a JSON object, errors naming the file
    if signature and data.get("target_signature") and data["target_signature"] != signature:
        return None
    value = data.get("chosen_max_num_seqs")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def resolve_max_num_seqs(g: Any, pilot_json: str | Path, pilot: bool = False, signature: str = "") -> Any:
    """`g` (GenerateParams) with an integer max_num_seqs. An integer wins; `auto` takes the pilot sweep's
    chosen_max_num_seqs from `pilot_json` (measured on the target `signature` names, when given); the pilot itself runs at the sweep's largest level (the capacity
    its engine is started with). auto without a sweep result is a UserError saying to run the pilot."""
    if g.max_num_seqs != "auto":
        return g
    if pilot:
        if not g.pilot_sweep:
            raise UserError("generate.max_num_seqs: auto needs generate.pilot_sweep levels for the pilot to measure")
        return dataclasses.replace(g, max_num_seqs=max(g.pilot_sweep))
    chosen = chosen_from_pilot(pilot_json, signature)
    if chosen is None:
        raise UserError(
            f"generate.max_num_seqs: auto, but {pilot_json} holds no chosen_max_num_seqs for this target; run the "
            "pilot with a sweep first (generate.pilot_sweep non-empty: dvc repro pilot), or set an integer"
        )
    return dataclasses.replace(g, max_num_seqs=chosen)
