"""The plan report's generation section: the engine's memory budget, the decode curve, and the generate pilot beside
the model (rendered from its GenerationEstimate, dflash/plan/generation.py)."""

from __future__ import annotations

from dflash.plan.generation import GenerationEstimate
from dflash.plan.report_format import hours, num, table


def generation_lines(gen: GenerationEstimate) -> list[str]:
    mem = gen.memory
    lines = ["", "## Generation", ""]
    lines += table(
        ["per GPU", "value"],
        [
            ["memory x gpu_memory_utilization", f"{mem.budget_gb_per_gpu:.1f} GB"],
            ["weights", f"{mem.weights_gb_per_gpu:.1f} GB"],
            ["activation reserve", f"{mem.reserve_gb_per_gpu:.1f} GB"],
            [
                "left for KV cache + GDN state",
                f"{mem.cache_gb_per_gpu:.1f} GB (full card minus weights: {mem.headroom_gb_full_card:.1f} GB)",
            ],
            ["mean resident context", f"{mem.resident_context_tokens:.0f} tokens"],
            ["KV cache per token", f"{mem.kv_kb_per_token:.1f} KB"],
            ["GDN state per sequence", f"{mem.state_mb_per_seq:.1f} MB"],
            ["cache per resident sequence", f"{mem.cache_mb_per_seq:.1f} MB"],
            ["sequences that fit", f"{mem.max_seqs_in_cache}"],
            ["batch (min with max_num_seqs)", f"{mem.batch}"],
            [
                "one max_model_len sequence fits",
                "yes" if mem.max_model_len_fits else "NO (vLLM would refuse to start)",
            ],
        ],
    )
    lines += [
        "",
        f"Batch-1 bound: {gen.batch1_bound_tokens_per_s:.1f} tok/s per engine "
        f"({gen.weights_read_per_step_gb:.1f} GB read per step at peak bandwidth).",
        "",
    ]
    if gen.decode_curve:
        lines += table(
            ["batch", "step ms", "memory ms", "compute ms", "tok/s per engine", "bound"],
            [
                [
                    c.batch,
                    f"{c.step_ms:.1f}",
                    f"{c.memory_ms:.1f}",
                    f"{c.compute_ms:.1f}",
                    f"{c.tokens_per_s:,.0f}",
                    c.bound,
                ]
                for c in gen.decode_curve
            ],
        )
    lines += [
        "",
        f"Output tokens: {num(gen.output_tokens, 2)}; prompt tokens: {num(gen.prompt_tokens, 2)} "
        f"(prefill {hours(gen.prefill_hours)}).",
        f"Model wall time: {hours(gen.model_wall_hours.mid)} (output length range: "
        f"{hours(gen.model_wall_hours.low)} - {hours(gen.model_wall_hours.high)}).",
    ]
    if gen.pilot:
        lines += pilot_lines(gen)
    return lines


def pilot_lines(gen: GenerationEstimate) -> list[str]:
    """The generate pilot: its measured rate beside the model's, and its sweep."""
    pl = gen.pilot
    ratio = pl.measured_over_model
    lines = ["", "### Pilot: estimate vs measured", ""]
    lines += table(
        ["", "value"],
        [
            [
                "measured aggregate tok/s",
                f"{pl.measured_tokens_per_s:,.0f} over {pl.pilot_engines:.0f} engine(s)",
            ],
            ["per engine: model / measured", f"{pl.model_per_engine:,.0f} / {pl.measured_per_engine:,.0f}"],
            ["measured / model", f"{ratio:.2f}" if ratio else "n/a"],
            [
                "output tokens p10 / mean / p90",
                f"{num(pl.p10_output_tokens)} / {num(pl.mean_output_tokens)} / {num(pl.p90_output_tokens)}",
            ],
            ["pilot's own full-run estimate", hours(pl.pilot_estimated_total_hours)],
            ["calibrated wall time (this plan's engines)", hours(pl.calibrated_wall_hours)],
        ],
    )
    lines += ["", "The pilot is assumed to have run on this plan's GPU type; the ratio calibrates the model."]
    lines += [f"Measured rate: {pl.rate_source}; max_num_seqs from {gen.max_num_seqs_source}."]
    sweep = pl.sweep_at_concurrency
    if sweep and not 0.77 <= pl.measured_per_engine / sweep <= 1.3:
        lines += [
            f"The two measurements at this concurrency disagree: {pl.measured_per_engine:,.0f} tok/s per engine "
            f"used vs {sweep:,.0f} from the sweep ({pl.measured_per_engine / sweep:.2f}x); the pilot run and the sweep "
            "ran at different times (a busy or shared host) or on different backends (the sweep goes through a server)."
        ]
    if pl.sweep_vs_model:
        lines += ["", f"Pilot sweep (one engine; chosen max_num_seqs {pl.chosen_max_num_seqs}):", ""]
        lines += table(
            ["max_num_seqs", "measured tok/s", "model tok/s", "measured / model"],
            [
                [
                    str(r.max_num_seqs),
                    f"{r.measured:,.0f}",
                    f"{r.model:,.0f}" if r.model else "n/a",
                    f"{r.measured / r.model:.2f}" if r.model else "n/a",
                ]
                for r in pl.sweep_vs_model
            ],
        )
    return lines
