"""Data-quality gates, shared by the audit and tokenize stages: a measured share compared with a threshold.

Each gate is a `GateParams` (max, action) in params. A gate is crossed when the measured value is above
`max`; a crossed `fail` gate makes the stage exit non-zero after it has written everything, with a
message naming the gate, the value, the threshold and the fix. Also the loss-mask spike: the most common
value of per-sample supervised-token counts and its share (the placeholder-response signature).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from dflash.core.errors import ParamsError
from dflash.core.params import GateParams


def loss_mask_spike(loss_mask_sums: Any) -> tuple[int, float]:
    """(most common value, share of samples at it) of per-sample loss-mask sums (or any lengths).
    The 27B case's placeholder data: (6, 0.87). Empty input -> (0, 0.0)."""
    values = np.asarray(loss_mask_sums, dtype=np.int64)
    if values.size == 0:
        return 0, 0.0
    uniq, counts = np.unique(values, return_counts=True)
    k = int(np.argmax(counts))
    return int(uniq[k]), float(counts[k] / values.size)


def check_gates(gates: Any, section: str) -> None:
    """ParamsError for a gate whose `max` is not a share in [0, 1] (NaN included)."""
    for f in dataclasses.fields(gates):
        gate = getattr(gates, f.name)
        if not 0.0 <= gate.max <= 1.0:
            raise ParamsError(f"{section}.{f.name}.max: must be a share in [0, 1], got {gate.max!r}")


AUTO_MEANS_FAIL = "auto: fail (this gate does not depend on where the responses come from)"


def evaluate_gates(
    values: Mapping[str, float | None],
    gates: Any,
    fixes: Mapping[str, str] | None = None,
    auto: Mapping[str, tuple[str, str]] | None = None,
) -> list[dict]:
    """Compare measured shares with gates (a dataclass whose fields are GateParams, or a mapping
    name -> GateParams). A gate is crossed when value > max. Returns one dict per gate.

    `auto`: gate name -> (action, why) for the gates whose `action: auto` depends on the stage's situation
    (the audit: where the responses come from); every other `auto` gate fails. Each result keeps what was
    configured (`configured`), the action that applied (`action`) and, for auto, why (`why`)."""
    items = (
        {f.name: getattr(gates, f.name) for f in dataclasses.fields(gates)}
        if dataclasses.is_dataclass(gates)
        else dict(gates)
    )
    results = []
    for name, gate in items.items():
        assert isinstance(gate, GateParams), f"gate {name} is not GateParams"
        if name not in values:  # a gate without its metric is a bug here, not bad input: no UserError
            raise ValueError(f"gate {name!r}: no measured value of that name (have: {', '.join(sorted(values))})")
        value = values[name]
        crossed = value is not None and value > gate.max
        action, why = gate.action, ""
        if action == "auto":
            action, why = (auto or {}).get(name, ("fail", AUTO_MEANS_FAIL))
        assert action in ("fail", "report"), f"gate {name}: action {action!r} after resolving auto"
        results.append(
            {
                "name": name,
                "value": value,
                "max": gate.max,
                "configured": gate.action,
                "action": action,
                "why": why,
                "crossed": crossed,
                "fix": (fixes or {}).get(name, ""),
            }
        )
    return results


def failed_gates(results: list[dict]) -> list[str]:
    return [r["name"] for r in results if r["crossed"] and r["action"] == "fail"]


def gate_failure_message(results: list[dict], section: str) -> str | None:
    """One message naming every failed gate, its measured value, the threshold and the fix; None if none."""
    lines = [
        f"gate {section}.{r['name']} failed: measured {r['value']:.4f} > max {r['max']:.4f}. Fix: {r['fix']}"
        for r in results
        if r["crossed"] and r["action"] == "fail"
    ]
    return "\n".join(lines) if lines else None
