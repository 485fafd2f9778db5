"""The plan report's serving section (rendered from its ServingEstimate, dflash/plan/serving.py): the predicted speedup of speculative
decoding at each batch size, with the whole and the pruned draft vocabulary, and the training the pruned
vocabulary saves. Pure formatting."""

from __future__ import annotations

from dflash.plan.report_format import count, hours, table
from dflash.plan.serving import ServingEstimate


def serving_lines(s: ServingEstimate | None) -> list[str]:
    if s is None:
        return []
    pruned = s.draft_vocab_size
    lines = [
        "",
        "## Serving: predicted speedup of speculative decoding",
        "",
        f"Acceptance: {s.acceptance_source}, tau {s.tau:.3f} with the whole vocabulary ({count(s.vocab_size)} "
        "rows)"
        + (
            f", {s.tau_pruned:.3f} with a {count(pruned)}-row draft vocabulary (coverage {s.draft_vocab_coverage:.3f})"
            if pruned
            else ""
        )
        + f"; sequences of {count(s.context_tokens)} resident tokens. Roofline per step (dflash/plan/serving.py): "
        "speedup = tau x plain step / (draft step + verification).",
        "",
    ]
    rows = [
        [
            r.batch,
            count(r.vocab_rows),
            f"{r.tau:.2f}",
            f"{r.plain_ms:.2f}",
            f"{r.draft_ms:.2f} ({r.draft_bound})",
            f"{r.draft_head_ms:.2f}",
            f"{r.verify_ms:.2f} ({r.verify_bound})",
            f"{r.plain_tokens_per_s:,.0f}",
            f"{r.spec_tokens_per_s:,.0f}",
            f"**{r.speedup:.2f}x**",
        ]
        for r in s.rows
    ]
    lines += table(
        [
            "batch",
            "draft lm_head rows",
            "tau",
            "plain step ms",
            "draft step ms",
            "of it lm_head ms",
            "verification ms",
            "plain tok/s",
            "speculative tok/s",
            "speedup",
        ],
        rows,
    )
    if s.measured_note:
        lines += ["", f"Measured beside it: {s.measured_note}."]
    if s.train_total_tflops is not None:
        lines += ["", "Training with the draft vocabulary (the drafter's lm_head term scaled to its rows):", ""]
        body = [
            [
                "whole vocabulary",
                f"{s.train_lm_head_tflops:.1f}",
                f"{s.train_total_tflops:.1f}",
                hours(s.train_hours),
            ]
        ]
        if s.train_total_tflops_pruned is not None:
            body.append(
                [
                    f"{count(pruned)} rows",
                    f"{s.train_lm_head_tflops_pruned:.1f}",
                    f"{s.train_total_tflops_pruned:.1f}",
                    hours(s.train_hours_pruned),
                ]
            )
        lines += table(
            ["drafter lm_head", "lm_head TFLOPs / sequence", "total TFLOPs / sequence", "training time"], body
        )
    lines += [f"- {n}" for n in s.notes]
    return lines
