"""Progress bars of generate (both backends) and of the pilot's concurrency sweep, with honest ETAs.

The bars open while the engines or servers start, say so in their description, and show no rate and no ETA
then; their clock starts when the first engine / server is up (`started()`), so the ETA counts generation only
(the ~2-hour ETA that opened every demo run was the engine start-up divided into the first prompts).
Non-interactive (a log file, DVC): a line every 10 s instead of 0.5 s.
"""

from __future__ import annotations

import sys


class Progress:
    """The total bar (prompts, tok/s, ETA) and one bar per engine or server (`labels`)."""

    def __init__(self, name: str, total: int, initial: int, labels: list[str], starting: str, unit: str = "prompt"):
        from tqdm import tqdm

        self.name = name
        interactive = sys.stderr.isatty()
        kw = {"mininterval": 0.5 if interactive else 10.0, "dynamic_ncols": True, "unit": unit}
        self.bar = tqdm(total=total, initial=initial, desc=f"{name} ({starting})", position=0, **kw)
        self.labels = list(labels)
        self.engines = [
            tqdm(total=None, desc=f"  {label} (starting)", position=i + 1, leave=False, **kw)
            for i, label in enumerate(self.labels)
        ]
        self.tokens = 0
        self.clock_started = False

    def add(self, label: str) -> int:
        """A bar for one more server (one that joined from the registry, starting); returns its index."""
        from tqdm import tqdm

        b = self.bar
        kw = {"mininterval": b.mininterval, "dynamic_ncols": True, "unit": b.unit, "leave": False}
        self.labels.append(label)
        self.engines.append(tqdm(total=None, desc=f"  {label} (starting)", position=len(self.labels), **kw))
        return len(self.labels) - 1

    def started(self) -> None:
        """The first engine / server is up: the rate and the ETA count from now (once)."""
        if self.clock_started:
            return
        self.clock_started = True
        initial = self.bar.n
        self.bar.reset(total=self.bar.total)  # start time, rate averages and n back to zero ...
        self.bar.n = self.bar.last_print_n = self.bar.initial = initial  # ... the prompts done before stay done
        self.bar.set_description_str(self.name, refresh=False)
        self.bar.refresh()

    def tick(self) -> None:
        """Redraw while waiting (the elapsed time moves while engines start)."""
        self.bar.refresh()

    def engine_up(self, i: int) -> None:
        """Engine / server i is up: its bar's clock starts now, and the total's if it has not yet."""
        bar = self.engines[i]
        n = bar.n
        bar.reset()
        bar.n = bar.last_print_n = bar.initial = n
        self.label(i)
        self.started()

    def label(self, i: int, note: str = "") -> None:
        """Engine / server i's bar: its label, and a note such as DOWN (why) or (restarting)."""
        self.engines[i].set_description_str(f"  {self.labels[i]}" + (f" {note}" if note else ""))

    def update(self, prompts: int, engine: int | None = None, tokens: int = 0) -> None:
        self.bar.update(prompts)
        if engine is not None:
            self.engines[engine].update(prompts)
        self.tokens += tokens
        if self.clock_started:
            elapsed = max(1e-9, self.bar.format_dict["elapsed"])
            self.bar.set_postfix_str(f"{self.tokens / elapsed:.0f} tok/s", refresh=False)

    def close(self) -> None:
        # The per-engine bars first (they clear their lines), then the total (it leaves its final line and a
        # newline): a message printed after the bars starts on a line of its own.
        for b in reversed(self.engines):
            b.close()
        self.bar.close()
