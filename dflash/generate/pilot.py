"""The pilot's report: throughput and the output-length distribution of a seeded sample of prompts,
extrapolated to the full input (with a bootstrap p10-p90 range of the mean output length).

The plan stage reads its headline (`reports/pilot.json`) and replaces its modelled generation rate by this
measured one, rescaled to the planned hardware.
"""

from __future__ import annotations

import math
import random

from dflash.core.params import GenerateParams
from dflash.generate.contract import DispatchResult

PILOT_HEADLINE = (  # reports/pilot.json, the DVC metrics the plan reads (everything: reports/pilot_details.json)
    "pilot_prompts",
    "num_engines",
    "output_tokens_per_s",
    "mean_output_tokens",
    "p10_output_tokens",
    "p50_output_tokens",
    "p90_output_tokens",
    "finish_length_frac",
    "missing_think_end_frac",
    "estimated_total_hours",
    "chosen_max_num_seqs",
    "sweep",
    "target_signature",
)


def percentile(values: list[int], q: float) -> float:
    if not values:
        return 0.0
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def pilot_report(
    metrics: dict, stats: DispatchResult, lengths: list[int], num_input_prompts: int, g: GenerateParams, seed: int
) -> dict:
    """Throughput + output-length distribution of the pilot, extrapolated to the full input."""
    rng = random.Random(seed)
    n = len(lengths)
    means = sorted(sum(rng.choice(lengths) for _ in range(n)) / n for _ in range(1000)) if n else [0.0]
    tok_s = metrics["output_tokens_per_s"] or 0.0
    mean = sum(lengths) / max(1, n)
    total_tokens = mean * num_input_prompts
    per_engine = {}
    for i, e in stats.per_engine.items():
        span = (e.last_done or 0) - (e.ready_at or 0)
        per_engine[str(i)] = {
            "prompts": e.prompts,
            "output_tokens": e.output_tokens,
            "output_tokens_per_s": round(e.output_tokens / span, 2) if span > 0 else None,
        }
    prompt_tok_s = metrics["prompt_tokens"] / metrics["generation_wall_s"] if metrics["generation_wall_s"] else None

    def hours(tokens: float) -> float | None:
        return round(tokens / tok_s / 3600, 4) if tok_s else None

    notes = []
    engines = metrics["num_engines"]  # engines, or servers (generate.server_urls)
    capacity = g.max_num_seqs * engines
    if metrics["num_prompts"] < 2 * capacity:
        notes.append(
            f"the pilot's {metrics['num_prompts']} prompts never fill {engines} engine(s) x max_num_seqs "
            f"{g.max_num_seqs} for long: its tok/s is a lower bound and the hours an upper bound; use "
            f"generate.pilot_samples >= {2 * capacity} for a rate the full run will see"
        )

    return {
        "target_signature": metrics["target_signature"],
        "pilot_prompts": metrics["num_prompts"],
        "num_completed": metrics["num_completed"],
        "num_skipped": metrics["num_skipped"],
        "num_failed": metrics["num_failed"],
        "failed_by_reason": metrics["failed_by_reason"],
        "failed_turns": metrics["failed_turns"],
        "units_failed": metrics["units_failed"],
        "num_engines": engines,
        "backend": g.backend,
        "max_num_seqs": g.max_num_seqs,
        "output_tokens_per_s": tok_s,
        "prompt_tokens_per_s": round(prompt_tok_s, 2) if prompt_tok_s else None,
        "per_engine": per_engine,
        "mean_output_tokens": round(mean, 2),
        "p10_output_tokens": percentile(lengths, 0.1),
        "p50_output_tokens": metrics["p50_output_tokens"],
        "p90_output_tokens": metrics["p90_output_tokens"],
        "p99_output_tokens": metrics["p99_output_tokens"],
        "finish_length_frac": metrics["finish_length_frac"],
        "missing_think_end_frac": metrics["missing_think_end_frac"],
        "full_run_prompts": num_input_prompts,
        "estimated_total_output_tokens": round(total_tokens),
        "estimated_total_output_tokens_p10_p90": [
            round(means[100] * num_input_prompts),
            round(means[900] * num_input_prompts),
        ],
        "estimated_total_hours": hours(total_tokens),
        "estimated_total_hours_p10_p90": [hours(means[100] * num_input_prompts), hours(means[900] * num_input_prompts)],
        "notes": [
            "wall time assumes the full run uses the same engines and hardware as the pilot; "
            "the plan stage rescales it to other hardware",
            *notes,
        ],
        "engine_start_s": metrics["engine_start_s"],
        "generation_wall_s": metrics["generation_wall_s"],
        "sampling_max_tokens": g.sampling.max_tokens,
    }
