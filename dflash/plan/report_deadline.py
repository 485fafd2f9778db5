"""The plan report's deadline section: the cluster that meets plan.deadline_hours, its memory verdict and
all-reduce, and hours vs GPUs (rendered from its Deadline, dflash/plan/deadline.py)."""

from __future__ import annotations

from dflash.plan.deadline import Deadline
from dflash.plan.report_format import hours, table


def deadline_lines(d: Deadline, gpu_name: str) -> list[str]:
    """The deadline section (dflash/plan/deadline.py): the cluster, its memory verdict, hours vs GPUs."""
    c, per_node = d.chosen, d.gpus_per_node
    lines = ["", f"## Deadline: {hours(d.hours)} for generation + training", ""]
    if d.met:
        lines.append(
            f"Smallest cluster that meets it: **{d.gpus} x {gpu_name}** = {d.nodes} node(s) x {per_node} GPUs "
            f"({hours(d.total_hours)})."
            + (f" {d.previous.gpus} GPUs take {hours(d.previous.total_hours)}." if d.previous else "")
        )
    else:
        lines.append(
            f"**NOT MET** by any cluster of up to {d.max_gpus} GPUs: the best achievable is "
            f"{hours(d.best_hours)} on {d.gpus} GPUs ({d.nodes} node(s) x {per_node})."
        )
    need = ", ".join(f"{role} {gb:.1f} GB" for role, gb in c.need_gb.items())
    lines += [""] + table(
        ["", "value"],
        [
            ["GPUs / nodes x GPUs per node", f"{d.gpus} / {d.nodes} x {per_node}"],
            ["generation", hours(d.generation_hours)],
            ["training", f"{hours(d.train_hours)} ({c.layout}, {c.ranks} data-parallel drafter rank(s))"],
            ["total", hours(d.total_hours)],
            [
                "per-GPU memory (training)",
                f"{need}: {'fits' if c.fits else 'DOES NOT FIT'} (margin {c.margin_gb:.1f} GB)",
            ],
            [
                "gradient all-reduce per step",
                f"{d.grad_gb_per_step:.2f} GB: {c.allreduce_s:.3f} s at {c.link_gbps:g} GB/s, "
                f"{c.exposed_s:.3f} s not hidden (step {c.step_s:.3f} s, compute {c.compute_step_s:.3f} s)",
            ],
        ],
    )
    for s in d.communication_dominates:
        lines += [
            "",
            f"Communication dominates from {s.from_gpus} to {s.to_gpus} GPUs: training takes "
            f"{hours(s.to_train_hours)} instead of {hours(s.from_train_hours)} (all-reduce {s.allreduce_s:.2f} s a "
            f"step over {s.link_gbps:g} GB/s).",
        ]
    lines += ["", "Hours vs GPUs (communication included):", ""]
    lines += table(
        ["GPUs", "nodes", "generation", "training", "total", "all-reduce s/step (exposed)", "meets"],
        [
            [
                r.gpus,
                r.nodes,
                hours(r.generation_hours),
                hours(r.train_hours) + ("" if r.fits else " (DOES NOT FIT)"),
                hours(r.total_hours),
                f"{r.allreduce_s:.3f} ({r.exposed_s:.3f})",
                "yes" if r.total_hours is not None and r.total_hours <= d.hours else "no",
            ]
            for r in d.curve
        ],
    )
    return lines
