"""Eval's progress bar is honest about the engine start: it says "starting engine" with no ETA while the engine
loads, and its clock (rate, ETA, elapsed) starts only when the worker says the engine is up. A fake worker stands
in for vLLM (the real one runs in tests/integration/test_eval_stage.py): it "starts" for STARTUP_S, then finishes
its prompts quickly, through the same parent loop (dflash.eval.engines.run_engine) and messages."""

from __future__ import annotations

import io
import time

from dflash.eval import engines
from dflash.eval.progress import EngineProgress

STARTUP_S = 2.0
PROMPTS = 6


def _fake_worker(cfg: dict, outbox) -> None:
    time.sleep(STARTUP_S)  # the engine start
    outbox.put(("started", STARTUP_S))
    for _ in range(PROMPTS):
        time.sleep(0.02)
        outbox.put(("finished", 1))
    outbox.put(("done", {"tokens": [], "counters": {"tau": None}}))


class _Recorder(EngineProgress):
    """The real bar, printing into a buffer; keeps what it showed at each step."""

    instances: list[_Recorder] = []

    def __init__(self, name: str, total: int):
        super().__init__(name, total)
        self.bar.fp = io.StringIO()
        self.bar.mininterval = 0
        self.shown: list[str] = []
        self.at_started: float | None = None
        _Recorder.instances.append(self)

    def tick(self) -> None:
        super().tick()
        self.shown.append(str(self.bar))

    def started(self, seconds: float) -> None:
        self.at_started = time.monotonic()
        super().started(seconds)

    def close(self) -> None:
        self.elapsed = self.bar.format_dict["elapsed"]
        self.final = str(self.bar)
        super().close()


def test_clock_starts_when_the_engine_is_up(monkeypatch):
    monkeypatch.setattr(engines, "EngineProgress", _Recorder)
    cfg = {"prompt_sets": [["heldout", [[1]] * 4], ["tasks", [[1]] * 2]]}
    t0 = time.monotonic()
    result = engines.run_engine("dflash", cfg, timeout_s=120, worker=_fake_worker)
    wall = time.monotonic() - t0
    bar = _Recorder.instances[-1]
    assert result["counters"]["tau"] is None
    # while the engine starts: it says so, counts nothing and promises no ETA
    assert bar.shown, "the bar refreshes while the engine starts"
    assert all("starting engine" in s and f"0/{PROMPTS}" in s and "<?" in s for s in bar.shown), bar.shown
    # afterwards: every prompt counted, the engine's start named, and a clock that excludes the start
    assert f"{PROMPTS}/{PROMPTS}" in bar.final and "engine up in 2 s" in bar.final, bar.final
    assert wall > STARTUP_S
    assert bar.elapsed < STARTUP_S / 2, f"the clock ran {bar.elapsed:.2f} s: it counted the engine start"
