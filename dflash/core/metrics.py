"""Metrics people can read: a stage's headline numbers apart from its full report.

Each stage writes two JSON files into `base.reports_dir`:
  NAME.json          its DVC metrics: the headline numbers only (at most ~20 values as DVC shows them), so
                     `dvc metrics show` / `dvc metrics diff` stay readable and comparable across runs;
  NAME_details.json  everything it measured (lists, per-engine tables, gates, notes): a plain output.
DVC shows numbers, booleans and strings, flattens nested mappings into dotted keys (`acceptance.pos_1`)
and leaves out lists and nulls: `shown_values` counts the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dflash.core.io import write_json

MAX_SHOWN = 25  # what "headline" means here (eval: 15 + 3 per prompt set); tests/integration/test_repro.py checks every stage's metrics file against it


def headline(metrics: dict[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    """The named keys of a stage's full metrics, in that order (a missing key is a bug in the stage)."""
    missing = [k for k in keys if k not in metrics]
    if missing:
        raise KeyError(f"headline keys {missing} are not in the stage's metrics")
    return {k: metrics[k] for k in keys}


def shown_values(obj: Any) -> int:
    """How many values `dvc metrics show` prints for this JSON object."""
    if isinstance(obj, dict):
        return sum(shown_values(v) for v in obj.values())
    return int(isinstance(obj, (bool, int, float, str)))


def write_metrics(reports_dir: str | Path, name: str, metrics: dict[str, Any], keys: Sequence[str]) -> dict:
    """Write NAME.json (the headline `keys`) and NAME_details.json (all of `metrics`); return the headline."""
    top = headline(metrics, keys)
    write_json(Path(reports_dir) / f"{name}_details.json", metrics)
    write_json(Path(reports_dir) / f"{name}.json", top)
    return top
