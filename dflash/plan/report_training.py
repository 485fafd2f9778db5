"""The plan report's training section: FLOPs per sequence, the device layouts with their memory verdicts and hours,
and the training pilot beside the model ("model vs measured"; rendered from its TrainingEstimate,
dflash/plan/training.py)."""

from __future__ import annotations

import dataclasses

from dflash.plan.report_format import hours, num, table
from dflash.plan.training import TrainingEstimate

FLOP_PARTS = (
    "target_forward",
    "target_lm_head",
    "drafter_q_o_mlp",
    "drafter_kv_projection",
    "drafter_fc",
    "drafter_attention",
    "lm_head",
    "total",
)


def training_lines(tr: TrainingEstimate, block_size: int) -> list[str]:
    f = tr.flops_per_sequence
    lines = ["", "## Training", ""]
    lines += [
        f"Per sequence: {f.seq_tokens:.0f} tokens, {f.anchors:.0f} anchors x block {block_size} = "
        f"{f.block_tokens:.0f} block tokens; loss target {f.loss_target}.",
        "",
    ]
    lines += table(
        ["FLOPs per sequence", "value"],
        [[k, num(getattr(f, k), 2)] for k in FLOP_PARTS]
        + [["(rule of thumb 6 x drafter params x block tokens)", num(f.simple_6PN, 2)]],
    )
    basis = (
        "measured by the training pilot"
        if tr.source == "pilot"
        else f"at the MFU assumed, {tr.compute_tflops:g} TFLOP/s peak"
    )
    lines += [
        "",
        f"One GPU: {tr.seconds_per_sequence_one_gpu:.3g} s per sequence {basis} (target "
        f"{tr.target_seconds_per_sequence:.3g} s + drafter {tr.drafter_seconds_per_sequence:.3g} s).",
        "",
    ]
    rows = []
    for name, lay in tr.layouts.items():
        need = ", ".join(f"{role} {c.need_gb:.1f} GB" for role, c in lay.per_gpu.items())
        rows.append(
            [
                name + (" (headline)" if name == tr.layout else ""),
                lay.gpus,
                need,
                f"{lay.margin_gb:.1f} GB",
                "fits" if lay.fits else "DOES NOT FIT",
                f"{lay.step_s:.3g}",
                f"{lay.steps_per_epoch:,}",
                hours(lay.epoch_hours),
                hours(lay.total_hours),
            ]
        )
    lines += table(
        ["layout", "GPUs", "per-GPU memory", "margin", "verdict", "step s", "steps/epoch", "epoch", "all epochs"], rows
    )
    lines += ["", "Memory parts (GB, per GPU before sharding):", ""]
    lines += table(["part", "GB"], [[k, f"{v:.3g}"] for k, v in dataclasses.asdict(tr.memory_parts_gb).items()])
    if tr.pilot:
        lines += pilot_lines(tr)
    return lines


def pilot_lines(tr: TrainingEstimate) -> list[str]:
    """Model vs measured for training: what the FLOPs model assumed beside what the training pilot measured."""
    pv, head = tr.pilot, tr.headline
    need = max(c.need_gb for c in head.per_gpu.values())
    implied = pv.implied_mfu
    lines = ["", "### Training pilot: model vs measured", ""]
    lines += [
        f"The pilot ({pv.path}) ran the real trainer on {pv.device} ({pv.layout}, {pv.world_size} "
        f"process(es)); its times replace the model's above.",
        "",
    ]
    lines += table(
        ["", "model", "measured", "measured / model"],
        [
            [
                "seconds per sequence (one process)",
                f"{pv.model_seconds_per_sample:.3g}",
                f"{pv.seconds_per_sample:.3g}",
                f"{pv.seconds_per_sample / pv.model_seconds_per_sample:.2f}",
            ],
            [
                "MFU (the planner's FLOPs)",
                f"{pv.assumed_mfu:.3g} assumed",
                f"{implied:.3g} implied"
                + (f" ({pv.measured_mfu:.3g} on the pilot's own rows)" if pv.measured_mfu else "")
                if implied
                else "n/a",
                f"{implied / pv.assumed_mfu:.2f}" if implied else "n/a",
            ],
            [
                "peak memory per GPU",
                f"{need:.3g} GB ({tr.layout}, mean sequence)",
                f"{pv.peak_memory_gb:.3g} GB ({pv.peak_phase} rows, {pv.layout})",
                f"{pv.peak_memory_gb / need:.2f}" if need else "n/a",
            ],
            [
                "memory verdict",
                "fits" if head.fits else "DOES NOT FIT",
                f"{'fits' if pv.memory_fits else 'DOES NOT FIT'} ({pv.memory_margin_gb:.3g} GB left of "
                f"{pv.device_memory_gb:.3g} GB)",
                "",
            ],
            [
                "step seconds (ordinary / worst rows)",
                "",
                f"{pv.step_seconds:.3g} / {pv.worst_step_seconds or 0:.3g}",
                "",
            ],
        ],
    )
    return lines
