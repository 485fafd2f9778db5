"""The generate pilot beside the generation model: which measured rate stands for the planned run, and the drain a
pilot run includes.

Which measured rate: the pilot run's own when it ran at the concurrency and on the backend generate will use, else
the sweep's level at that concurrency (one engine, steady state), else the pilot run's own. A pilot run's rate
includes its drain: once its queue empties, the last sequences finish at a shrinking batch for about as many steps
as the longest outputs (p99) have tokens. A small pilot spends a large share of its time there, a full run almost
none, so its steady rate is rate x (full-batch steps + drain steps) / full-batch steps, and the full run's time is
its full-batch steps plus one drain (`steady_rate`, `drained_seconds`). Without the pilot's p99 and concurrency no
drain is modelled. A drain step costs a full-batch one where decode is bandwidth-bound (a GPU); where the step time
grows with the batch (a CPU host: 24 ms at 4 sequences, 95 ms at 64 in the demo's sweep) it costs less, and the
drain is counted in full-batch steps at the mean cost the sweep's measured step times give (`drain_step_cost`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash.plan.inputs import GeneratePilot


def steady_rate(rate: float, prompts: float, mean_output: float, *, concurrency: int, tail_tokens: float) -> float:
    """A pilot engine's rate with a full batch: its measured `rate` spread its wall over the full-batch steps and a
    drain of `tail_tokens` steps (module docstring)."""
    full_steps = prompts * mean_output / concurrency
    return rate * (full_steps + tail_tokens) / full_steps


def drained_seconds(tokens: float, engines: int, concurrency: int, *, rate: float, tail_tokens: float) -> float:
    """A run of `tokens` over `engines` engines at a steady `rate` each: its full-batch time and one drain."""
    return tokens / (rate * engines) + tail_tokens * concurrency / rate


def drain_step_cost(sweep: list[dict], concurrency: int) -> float:
    """A drain step's mean cost as a share of a full-batch step, from the sweep's measured step times (module
    docstring). A step at batch b takes b / (output tok/s at b); between levels the step time is interpolated, below
    the smallest level it is that level's. The batch shrinks from `concurrency` to 1 over the drain, evenly. 1.0 (a
    drain step costs a full one, as in bandwidth-bound decode) without two levels spanning `concurrency`."""
    levels = sorted(
        (int(r["max_num_seqs"]), r["max_num_seqs"] / r["output_tokens_per_s"])
        for r in sweep
        if r.get("max_num_seqs") and r.get("output_tokens_per_s")
    )
    if len(levels) < 2 or not levels[0][0] <= concurrency <= levels[-1][0]:
        return 1.0

    def step(b: float) -> float:
        if b <= levels[0][0]:
            return levels[0][1]
        for (b0, s0), (b1, s1) in zip(levels, levels[1:], strict=False):
            if b <= b1:
                return s0 + (s1 - s0) * (b - b0) / (b1 - b0)
        return levels[-1][1]

    full = step(concurrency)
    return min(1.0, sum(step(b) for b in range(1, concurrency + 1)) / concurrency / full) if full > 0 else 1.0


@dataclass(frozen=True)
class SweepPoint:
    max_num_seqs: int
    measured: float
    model: float | None


@dataclass(frozen=True)
class PilotRate:
    """The generate pilot beside the model: which rate replaced the model's and how the two compare."""

    measured_tokens_per_s: float
    pilot_engines: float
    measured_per_engine: float  # the per-engine rate the plan uses (steady when drain-corrected)
    model_per_engine: float
    measured_over_model: float | None
    mean_output_tokens: float
    p10_output_tokens: float | None
    p90_output_tokens: float | None
    pilot_estimated_total_hours: float | None
    calibrated_wall_hours: float
    rate_source: str
    drain_tokens: float | None  # the drain modelled, in full-batch steps: p99 output x drain_step_cost (None: none)
    sweep_at_concurrency: float | None  # the sweep's one-engine rate at the planned concurrency, beside the rate used
    chosen_max_num_seqs: int | None
    sweep_vs_model: list[SweepPoint] = field(default_factory=list)


def sweep_level(pilot: GeneratePilot, max_num_seqs: int) -> dict | None:
    """The pilot sweep's measurement at `max_num_seqs` in flight (None when the sweep did not measure it)."""
    return next((row for row in pilot.sweep if row.get("max_num_seqs") == max_num_seqs), None)
