"""The plan report's checks of itself: "how good was this plan" (calibration: planned vs what the stages measured)
and the model against published runs (rendered from the plan's Calibration and PublishedCheck rows, dflash/plan/calibration.py and published.py)."""

from __future__ import annotations

from dflash.plan.calibration import Calibration
from dflash.plan.published import PublishedCheck
from dflash.plan.report_format import pct, seconds, table


def calibration_lines(rows: list[Calibration]) -> list[str]:
    if not rows:
        return []
    lines = ["", "## How good was this plan (calibration)", ""]
    lines += [
        "Planned beside what the stages measured when they ran; error = planned / measured - 1. The headline uses the "
        "pilots when they ran; the model alone is shown beside them.",
        "",
    ]
    lines += table(
        [
            "stage",
            "setup",
            "planned (from)",
            "measured",
            "error",
            "model alone (error)",
            "pilot (error)",
            "rate planned / measured",
        ],
        [
            [
                c.stage,
                c.setup,
                f"{seconds(c.planned_s)} ({c.planned_from})",
                seconds(c.measured_s) + (f" (stage {seconds(c.stage_seconds)})" if c.stage_seconds else ""),
                pct(c.error),
                f"{seconds(c.model_s)} ({pct(c.model_error)})",
                f"{seconds(c.pilot_s)} ({pct(c.pilot_error)})" if c.pilot_s is not None else "no pilot",
                f"{c.planned_rate:,.0f} / {c.measured_rate:,.0f} tok/s",
            ]
            for c in rows
        ],
    )
    lines += ["", "Measured from: " + "; ".join(f"{c.stage} {c.measured_from}" for c in rows) + "."]
    return lines


def published_lines(rows: list[PublishedCheck]) -> list[str]:
    if not rows:
        return []
    lines = ["", "## The model against published runs", ""]
    lines += table(
        ["run", "measured", "model (no pilot)", "error", "model's batch, bound", "setup"],
        [
            [
                r.what,
                f"{r.value:,.4g} {r.unit}",
                f"{r.model:,.4g} {r.unit}",
                pct(r.error) + (" (optimistic)" if r.optimistic else " (pessimistic)"),
                f"{r.batch}, {r.bound}",
                r.overlay,
            ]
            for r in rows
        ],
    )
    lines += ["", "Sources: " + " ".join(f"[{r.key}] {r.source}" for r in rows)]
    return lines
