"""Deadline sizing: the smallest cluster of the planned GPU profile that finishes generation + training in
`plan.deadline_hours` (0 = off).

Inputs: the plan's target, drafter, GPU profile, training knobs and dataset (its `PlanContext`,
dflash/plan/context.py), `plan.gpus_per_node`, `plan.internode_gbps`, `plan.allreduce_overlap`. Output: a
`Deadline`, under "deadline" in plan_details.json, its `summary()` in plan.json. With a training pilot measured on
the planned hardware its step times replace the FLOPs model's at every size (dflash/plan/training.py).

The cluster runs generation on every GPU (`G // tensor_parallel_size` engines, data parallel, no traffic
between engines), then training on every GPU in the planned layout scaled to G (dflash/plan/training.py
`training_at`). Sizes searched: 1 .. gpus_per_node GPUs in one node, then whole nodes, up to MAX_GPUS.

Communication: after each optimizer step the drafter's data-parallel ranks all-reduce its gradients,
GRAD_BYTES_PER_PARAM x drafter params (the train stage keeps fp32 master weights under bf16 autocast, so DDP
reduces fp32 gradients once per optimizer step; earlier micro-steps run under no_sync). A ring all-reduce
sends and receives 2 (n - 1) / n x bytes per rank and every link carries that much, so the slowest link sets
the time: the GPU profile's `interconnect_gbps` inside one node, min(that, `plan.internode_gbps`) once the
ranks span nodes. DDP overlaps the all-reduce with the backward pass: `allreduce_overlap` x the last
micro-step's drafter backward (2/3 of its drafter compute) is hidden, the rest adds to the drafter's step.
In the split layout the drafter side and the target side form a pipeline: the step is the slower side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dflash.core.errors import UserError
from dflash.drafter.geometry import parameter_counts
from dflash.plan.context import PlanContext
from dflash.plan.settings import TrainSettings
from dflash.plan.training import Layout, TrainingEstimate

GB = 1e9
GRAD_BYTES_PER_PARAM = 4  # fp32 gradients of the fp32 master weights (dflash/train/loop.py)
MAX_GPUS = 1024
BACKWARD_SHARE = 2.0 / 3.0  # forward + backward = 3 x forward: the backward is two thirds of the drafter's compute


def ring_allreduce_seconds(nbytes: float, ranks: int, link_gbps: float) -> float:
    """Ring all-reduce of `nbytes` over `ranks` ranks: 2 (n - 1) / n x bytes over the slowest link (GB/s)."""
    if ranks <= 1:
        return 0.0
    return 2.0 * (ranks - 1) / ranks * nbytes / (link_gbps * GB)


def cluster_sizes(gpus_per_node: int, max_gpus: int = MAX_GPUS) -> list[int]:
    """Candidate GPU counts, smallest first: every count inside one node, then whole nodes."""
    inside = list(range(1, min(gpus_per_node, max_gpus) + 1))
    return inside + [k * gpus_per_node for k in range(2, max_gpus // gpus_per_node + 1)]


@dataclass
class SizeRow:
    """One cluster size: its generation and training hours, the chosen layout with its all-reduce."""

    gpus: int
    nodes: int
    link_gbps: float
    generation_hours: float | None
    layout: str
    ranks: int
    allreduce_s: float
    exposed_s: float
    compute_step_s: float
    step_s: float
    compute_hours: float
    train_hours: float
    fits: bool
    margin_gb: float
    need_gb: dict[str, float]
    total_hours: float | None = None


def data_parallel_ranks(name: str, lay: Layout) -> int:
    """Processes holding a drafter replica (they all-reduce its gradients)."""
    if name == "single":
        return 1
    if name == "split":
        return lay.gpus - lay.target_gpus
    return lay.gpus


def grad_bytes(ctx: PlanContext) -> float:
    """Gradient bytes all-reduced per optimizer step (module docstring)."""
    return parameter_counts(ctx.drafter)["total"] * GRAD_BYTES_PER_PARAM


def train_with_allreduce(
    est: TrainingEstimate,
    name: str,
    ta: TrainSettings,
    *,
    grad_bytes: float,
    link_gbps: float,
    overlap: float,
    gpus: int,
) -> SizeRow:
    """One layout of a training estimate with the exposed gradient all-reduce added to each step."""
    lay = est.layouts[name]
    k = ta.batch_size * ta.grad_accum_steps  # sequences per rank per optimizer step
    t_s, d_s = est.target_seconds_per_sequence, est.drafter_seconds_per_sequence
    ranks = data_parallel_ranks(name, lay)
    allreduce = ring_allreduce_seconds(grad_bytes, ranks, link_gbps)
    hidden = overlap * BACKWARD_SHARE * d_s * ta.batch_size  # only the last micro-step's backward overlaps
    exposed = max(0.0, allreduce - hidden)
    if name == "split":
        target_side = k * ranks * t_s / lay.target_gpus  # the target GPUs feed every drafter rank
        compute = max(k * d_s, target_side)
        step = max(k * d_s + exposed, target_side)
    else:
        compute = step = k * (t_s + d_s)
        step += exposed
    return SizeRow(
        gpus=gpus,
        nodes=0,
        link_gbps=link_gbps,
        generation_hours=None,
        layout=name,
        ranks=ranks,
        allreduce_s=allreduce,
        exposed_s=exposed,
        compute_step_s=compute,
        step_s=step,
        compute_hours=lay.total_hours,
        train_hours=lay.total_hours * step / compute,
        fits=lay.fits,
        margin_gb=lay.margin_gb,
        need_gb={role: c.need_gb for role, c in lay.per_gpu.items()},
    )


def size_row(ctx: PlanContext, gpus: int) -> SizeRow:
    """Generation + training hours of one cluster size (None hours where the model does not fit)."""
    per_node = ctx.plan.gpus_per_node
    nodes = math.ceil(gpus / per_node)
    gen = ctx.generation_on(gpus).wall_hours.mid if gpus >= ctx.gs.tensor_parallel_size else None
    est = ctx.training_on(gpus)
    link = ctx.hw.interconnect_gbps if nodes == 1 else min(ctx.hw.interconnect_gbps, ctx.plan.internode_gbps)
    nbytes = grad_bytes(ctx)
    options = {
        n: train_with_allreduce(
            est, n, ctx.ta, grad_bytes=nbytes, link_gbps=link, overlap=ctx.plan.allreduce_overlap, gpus=gpus
        )
        for n in est.layouts
    }
    if ctx.ta.layout == "auto" or gpus == 1:  # auto: the fastest fitting layout, communication included
        fitting = [o for o in options.values() if o.fits]
        row = min(fitting, key=lambda o: o.train_hours) if fitting else options["single"]
    else:
        row = options[ctx.ta.layout]
    row.nodes, row.generation_hours = nodes, gen
    row.total_hours = gen + row.train_hours if gen is not None and row.fits else None
    return row


@dataclass(frozen=True)
class SlowerStep:
    """Two consecutive sizes where more GPUs train slower."""

    from_gpus: int
    to_gpus: int
    from_train_hours: float
    to_train_hours: float
    allreduce_s: float
    link_gbps: float


def slower_steps(rows: list[SizeRow]) -> list[SlowerStep]:
    """Consecutive sizes where more GPUs train slower: the all-reduce costs more than the compute it splits."""
    out, prev = [], None
    for r in rows:
        if r.total_hours is None:
            continue
        if prev is not None and r.train_hours > prev.train_hours:
            out.append(SlowerStep(prev.gpus, r.gpus, prev.train_hours, r.train_hours, r.allreduce_s, r.link_gbps))
        prev = r
    return out


@dataclass
class Deadline:
    """The smallest cluster that meets plan.deadline_hours (or the fastest one), and the curve around it."""

    hours: float
    met: bool
    gpus: int
    nodes: int
    gpus_per_node: int
    layout: str
    train_hours: float
    generation_hours: float | None
    total_hours: float
    best_hours: float
    chosen: SizeRow
    previous: SizeRow | None  # the next smaller size: misses the deadline when met
    grad_gb_per_step: float
    internode_gbps: float
    intranode_gbps: float
    allreduce_overlap: float
    communication_dominates: list[SlowerStep]
    curve: list[SizeRow]
    max_gpus: int
    train_source: str = "model"  # model | pilot: where the training step times came from

    def summary(self) -> dict:
        """The plan.json (DVC metrics) part: the cluster and its hours."""
        c = self.chosen
        keys = ("hours", "met", "gpus", "nodes", "gpus_per_node", "layout", "train_hours", "generation_hours")
        return {k: getattr(self, k) for k in keys} | {
            "total_hours": self.total_hours,
            "best_hours": self.best_hours,
            "train_fits": c.fits,
            "train_margin_gb": c.margin_gb,
            "allreduce_s_per_step": c.allreduce_s,
            "communication_dominates": bool(self.communication_dominates),
        }


def deadline_plan(ctx: PlanContext) -> Deadline:
    """The smallest size meeting plan.deadline_hours, or the fastest size with met = False."""
    p, hours = ctx.plan, ctx.plan.deadline_hours
    per_node, tp = p.gpus_per_node, ctx.gs.tensor_parallel_size
    if tp > per_node:
        raise UserError(
            f"plan.gpus_per_node: {per_node} GPUs cannot hold one engine of generate.tensor_parallel_size={tp} "
            "(the deadline plan keeps each engine inside a node): raise plan.gpus_per_node or lower the TP size"
        )
    linked = ctx.hw.interconnect_gbps > 0  # without a link figure only one device can be priced (no all-reduce)
    rows = [size_row(ctx, n) for n in (cluster_sizes(per_node) if linked else [1])]
    feasible = [r for r in rows if r.total_hours is not None]
    if not linked and not any(r.total_hours <= hours for r in feasible):
        raise UserError(
            f"{p.hardware_file}: profiles.{p.hardware}.interconnect_gbps is 0 (unknown): one device misses "
            "plan.deadline_hours, and more need the device-to-device bandwidth for the gradient all-reduce; set it "
            "in the profile"
        )
    if not feasible:
        raise UserError(
            f"plan.deadline_hours: no cluster of up to {MAX_GPUS} x {ctx.hw.name} fits generation and training "
            "in memory (see the plan's memory verdicts)"
        )
    met = [r for r in feasible if r.total_hours <= hours]
    chosen = met[0] if met else min(feasible, key=lambda r: r.total_hours)
    i = rows.index(chosen)
    shown = {r.gpus for r in rows if r.gpus in (1, per_node) or (r.gpus % per_node == 0 and _pow2(r.gpus // per_node))}
    shown |= {chosen.gpus} | ({rows[i - 1].gpus} if i else set())
    return Deadline(
        hours=hours,
        met=bool(met),
        gpus=chosen.gpus,
        nodes=chosen.nodes,
        gpus_per_node=per_node,
        layout=chosen.layout,
        train_hours=chosen.train_hours,
        generation_hours=chosen.generation_hours,
        total_hours=chosen.total_hours,
        best_hours=min(r.total_hours for r in feasible),
        chosen=chosen,
        previous=rows[i - 1] if i else None,
        grad_gb_per_step=grad_bytes(ctx) / GB,
        internode_gbps=p.internode_gbps,
        intranode_gbps=ctx.hw.interconnect_gbps,
        allreduce_overlap=p.allreduce_overlap,
        communication_dominates=slower_steps(rows),
        curve=[r for r in rows if r.gpus in shown],
        max_gpus=MAX_GPUS,
        train_source="pilot" if ctx.pilot is not None and ctx.pilot.ran_on(ctx.hw) else "model",
    )


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def deadline_assumptions(d: Deadline) -> list[str]:
    return [
        f"Deadline: the cluster runs generation on all its GPUs, then training on all of them; sizes 1 .. "
        f"{d.gpus_per_node} GPUs in one node, then whole nodes of plan.gpus_per_node {d.gpus_per_node}, up to "
        f"{d.max_gpus}. Generation scales with engines (no traffic between them); an engine stays in one node. "
        f"Training step times: {'the training pilot' if d.train_source == 'pilot' else 'the FLOPs model'}.",
        f"Gradient all-reduce once per optimizer step: {d.grad_gb_per_step:.2f} GB (fp32 gradients of the drafter), "
        f"ring 2 (n - 1) / n x bytes over the slowest link: {d.intranode_gbps:.0f} GB/s inside a node "
        f"(interconnect_gbps), min(that, plan.internode_gbps {d.internode_gbps:g}) across nodes. DDP hides "
        f"{d.allreduce_overlap:.0%} of the last micro-step's drafter backward (plan.allreduce_overlap); the rest "
        "adds to the drafter's step. Latency, stragglers, congestion and hierarchical (tree / NVLS) algorithms are "
        "not modelled.",
        "Data parallel training grows the global batch with the ranks (batch_size x grad_accum_steps x ranks): the "
        "plan counts time per epoch, not whether the larger batch needs another learning rate or more epochs.",
    ]
