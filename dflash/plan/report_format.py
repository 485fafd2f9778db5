"""Number formatting and markdown tables of the plan report (dflash/plan/report.py and its sections)."""

from __future__ import annotations

from typing import Any


def num(x: float | None, digits: int = 1) -> str:
    """Human number: 1.73 B, 902.0 K, 12.3."""
    if x is None:
        return "n/a"
    for scale, unit in ((1e12, " T"), (1e9, " B"), (1e6, " M"), (1e3, " K")):
        if abs(x) >= scale:
            return f"{x / scale:.{digits + 1}f}{unit}"
    return f"{x:.{digits}f}"


def hours(h: float | None) -> str:
    """Hours in the unit that reads best: days, hours, minutes or seconds."""
    if h is None or h != h or h == float("inf"):
        return "n/a"
    if h >= 24:
        return f"{h:,.1f} h ({h / 24:.1f} d)"
    if h >= 1:
        return f"{h:.2f} h"
    return f"{h * 60:.1f} min" if h * 60 >= 1 else f"{h * 3600:.2g} s"


def count(x: float | None) -> str:
    return "n/a" if x is None else f"{x:,.0f}"


def usd(x: float | None) -> str:
    return "n/a (no price: set plan.price_per_gpu_hour)" if x is None else f"${x:,.0f}"


def table(header: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out


def pct(x: float | None) -> str:
    """A signed share: +12%, -40%."""
    return "n/a" if x is None or x != x else f"{x:+.0%}"


def seconds(s: float | None) -> str:
    """Seconds in the unit that reads best (a stage of the demo takes seconds, the 27B's days)."""
    return "n/a" if s is None or s != s else hours(s / 3600)
