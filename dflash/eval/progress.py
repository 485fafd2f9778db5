"""Eval's progress bars, honest about the engine start: an engine configuration's bar says "starting engine" (no
rate, no ETA) while vLLM loads, compiles and warms up, and starts its clock only when the engine is up, so its
rate and ETA are those of the prompts alone (an engine start of ~15-35 s on a CPU would otherwise make the first
ETA minutes too long). One bar per engine configuration over the prompts of every set; the reference evaluator's
bar counts prompts after its models are loaded.
"""

from __future__ import annotations

import sys
import time
from typing import Any


def _bar(total: int, desc: str) -> Any:
    from tqdm import tqdm

    interactive = sys.stderr.isatty()  # a pipe (dvc repro into a log) gets a line every 10 s, not a flood
    return tqdm(total=total, desc=desc, unit="prompt", mininterval=0.5 if interactive else 10.0, dynamic_ncols=True)


class EngineProgress:
    def __init__(self, name: str, total: int):
        self.name, self.total = name, total
        self.bar = _bar(total, f"eval {name}: starting engine")
        self.clock_started: float | None = None  # time.monotonic() when the engine was up

    def tick(self) -> None:
        """While the engine starts: show the time spent so far (no ETA: nothing is measured yet)."""
        if self.clock_started is None:
            self.bar.refresh()

    def started(self, seconds: float) -> None:
        self.bar.set_description(f"eval {self.name} (engine up in {seconds:.0f} s)", refresh=False)
        self.bar.reset(total=self.total)  # the clock, rate and ETA start now
        self.clock_started = time.monotonic()

    def advance(self, n: int) -> None:
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()


def reference_bar(total: int, sets: int) -> Any:
    """The reference evaluator's bar over every set's prompts (created once its models are loaded)."""
    return _bar(total, f"eval reference ({sets} prompt sets)")


__all__ = ["EngineProgress", "reference_bar"]
