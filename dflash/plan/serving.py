"""Serving estimate: the speedup speculative decoding should give over plain decoding on the planned hardware, at
batch 1 and a few batch sizes, with the drafter's whole vocabulary and with a pruned draft vocabulary; and what the
pruned vocabulary saves in training.

The roofline of the generation estimate (dflash/plan/generation.py `decode_step`) prices each step of one engine:
  plain step     every sequence feeds 1 token: the target's weights read once + each sequence's KV cache and
                 Gated DeltaNet state; 2 x params FLOPs a token
  verification   every sequence feeds block_size tokens (the last accepted one + block_size - 1 drafts): the same
                 bytes, block_size x the FLOPs
  draft step     one parallel forward of the drafter over its query slots: its body's weights + the lm_head rows it
                 scores (the whole vocabulary, or the draft vocabulary) + its context K/V per sequence; FLOPs of the
                 body on every slot, of the KV injection of the tokens the last step accepted (fc + K/V
                 projections), attention over the context, and of the logits on the block_size - 1 drafted slots
Each step takes the slower of bytes / (bandwidth x efficiency) and FLOPs / (matmul peak x decode MFU). One
speculative step commits tau tokens a sequence, so speedup = tau x plain step / (draft step + verification).
Acceptance: per drafted position k, the probability that position k is accepted (tau = 1 + their sum): the
`plan.serving.acceptance` given, else spread geometrically from `plan.serving.assumed_tau`, else eval.json's
(measured on the eval stage's target). With a draft vocabulary of coverage c (the share of target tokens inside
it), position k is accepted with c^k of its rate: a target token outside the vocabulary ends the accepted run.
Acceptance is assumed not to change with the batch size.

Training (dflash/plan/training.py): the same estimate with the drafter's lm_head term scaled to the draft
vocabulary's rows (the target's lm_head stays whole).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from dflash.core.errors import UserError
from dflash.core.hardware import GpuProfile
from dflash.core.target_config import TargetArch
from dflash.drafter.geometry import SLIDING, DrafterConfig, kind_cost, parameter_counts
from dflash.plan import sizing
from dflash.plan.context import PlanContext
from dflash.plan.generation import DecodeStep, decode_step, roofline_step
from dflash.plan.settings import GenerationSettings
from dflash.plan.training import TrainingEstimate, training_estimate


@dataclass(frozen=True)
class Acceptance:
    per_position: list[float]  # P(drafted position k accepted), k = 1..block_size - 1
    source: str  # where it came from, in words

    @property
    def tau(self) -> float:
        return 1.0 + sum(self.per_position)


def geometric_acceptance(tau: float, positions: int) -> list[float]:
    """a, a^2, ..., a^positions with 1 + their sum = tau (bisection on a in [0, 1])."""
    if not 1.0 <= tau <= 1.0 + positions:
        raise UserError(f"plan.serving.assumed_tau: {tau:g} outside 1..{1 + positions} (block_size - 1 drafts)")
    lo, hi = 0.0, 1.0
    for _ in range(100):
        a = (lo + hi) / 2
        if 1.0 + sum(a**k for k in range(1, positions + 1)) < tau:
            lo = a
        else:
            hi = a
    a = (lo + hi) / 2
    return [a**k for k in range(1, positions + 1)]


def with_coverage(acceptance: list[float], coverage: float) -> list[float]:
    """Position k needs the k target tokens up to it inside the draft vocabulary: c^k of its rate."""
    if not 0.0 < coverage <= 1.0:
        raise UserError(f"plan.serving.draft_vocab_coverage: {coverage:g} outside (0, 1]")
    return [p * coverage ** (k + 1) for k, p in enumerate(acceptance)]


def choose_acceptance(
    given: list[float], assumed_tau: float, measured: list[float] | None, *, positions: int
) -> Acceptance | None:
    """The acceptance the estimate uses (module docstring: given, else assumed tau, else eval.json's)."""
    if given:
        return Acceptance(list(given[:positions]), "plan.serving.acceptance")
    if assumed_tau > 0:
        return Acceptance(
            geometric_acceptance(assumed_tau, positions), f"assumed tau {assumed_tau:g} (plan.serving.assumed_tau)"
        )
    if measured:
        return Acceptance(list(measured[:positions]), "eval.json (the eval stage's engine counters)")
    return None


def drafter_weight_bytes(weight_dtype: str) -> int:
    """The drafter is served in the target's dtype; an fp8 target keeps its drafter bf16."""
    return 4 if sizing.dtype_bytes(weight_dtype, "plan.weight_dtype") == 4 else 2


def draft_step(
    d: DrafterConfig,
    hw: GpuProfile,
    gp: GenerationSettings,
    *,
    weight_dtype: str,
    batch: int,
    context: float,
    vocab_rows: int,
    accepted: float,
) -> DecodeStep:
    """One draft step of one engine at `batch` sequences of `context` tokens, scoring `vocab_rows` lm_head rows on
    each drafted slot, after a step that accepted `accepted` tokens a sequence (their features are injected)."""
    p = parameter_counts(d)
    wb = drafter_weight_bytes(weight_dtype)
    kv_per_token = 2 * d.num_key_value_heads * d.head_dim * sizing.dtype_bytes(gp.kv_cache_dtype, "kv_cache_dtype")
    seen = [min(context, d.sliding_window) if kind == SLIDING else context for kind in d.layer_types]
    cache = kv_per_token * sum(seen)
    weights = (p["total"] + vocab_rows * d.hidden_size) * wb
    step_bytes = weights + batch * cache
    q_dim = d.num_attention_heads * d.head_dim
    slots = d.query_slots
    per_seq = (
        2.0 * (p["attn_q_o"] + p["attn_kv"] + p["mlp"]) * slots
        + 2.0 * (p["fc"] + p["attn_kv"]) * accepted
        + sum(4.0 * slots * (ctx + d.block_size) * q_dim for ctx in seen)
        + kind_cost(d).flops_per_slot * slots
        + 2.0 * vocab_rows * d.hidden_size * (d.block_size - 1)
    )
    tp = gp.tensor_parallel_size
    mem_s = step_bytes / (tp * hw.bandwidth_tbps * 1e12 * gp.bandwidth_efficiency)
    compute_s = batch * per_seq / (tp * hw.matmul_tflops(gp.compute_dtype, "generate.dtype") * 1e12 * gp.decode_mfu)
    return roofline_step(batch, mem_s, compute_s)


@dataclass(frozen=True)
class ServingRow:
    """One batch size with one drafter vocabulary."""

    batch: int
    vocab_rows: int
    tau: float
    plain_ms: float
    draft_ms: float
    draft_head_ms: float  # of the draft step: reading and scoring its lm_head rows (bandwidth share at the bound)
    verify_ms: float
    draft_bound: str
    verify_bound: str
    plain_tokens_per_s: float  # per engine
    spec_tokens_per_s: float
    speedup: float


@dataclass
class ServingEstimate:
    acceptance_source: str
    acceptance: list[float]
    tau: float
    vocab_size: int  # the drafter's whole vocabulary
    draft_vocab_size: int  # 0 = no comparison
    draft_vocab_coverage: float
    tau_pruned: float | None
    context_tokens: float
    rows: list[ServingRow] = field(default_factory=list)
    measured_speedup: float | None = None  # eval.json's, when eval ran on this kind of hardware
    measured_note: str = ""
    train_hours: float | None = None  # the plan's headline training time, the whole vocabulary
    train_hours_pruned: float | None = None
    train_lm_head_tflops: float | None = None  # the drafter's lm_head term per sequence
    train_lm_head_tflops_pruned: float | None = None
    train_total_tflops: float | None = None
    train_total_tflops_pruned: float | None = None
    notes: list[str] = field(default_factory=list)


def serving_rows(
    d: DrafterConfig,
    hw: GpuProfile,
    gp: GenerationSettings,
    *,
    t: TargetArch,
    weight_dtype: str,
    acceptance: list[float],
    vocab_rows: int,
    batches: list[int],
    context: float,
) -> list[ServingRow]:
    """Plain and speculative step times and the speedup at each batch size."""
    tau = 1.0 + sum(acceptance)
    read = sizing.target_weight_bytes(t, weight_dtype)["read_per_step"]
    tp = gp.tensor_parallel_size
    rows = []
    for b in batches:
        plain = decode_step(t, hw, gp, weight_read_bytes=read, batch=b, context=context, tp=tp)
        verify = decode_step(
            t, hw, gp, weight_read_bytes=read, batch=b, context=context, tp=tp, tokens_per_seq=d.block_size
        )
        draft = draft_step(
            d, hw, gp, weight_dtype=weight_dtype, batch=b, context=context, vocab_rows=vocab_rows, accepted=tau
        )
        headless = draft_step(
            d, hw, gp, weight_dtype=weight_dtype, batch=b, context=context, vocab_rows=0, accepted=tau
        )
        spec_s = (draft.step_ms + verify.step_ms) / 1e3
        rows.append(
            ServingRow(
                batch=b,
                vocab_rows=vocab_rows,
                tau=tau,
                plain_ms=plain.step_ms,
                draft_ms=draft.step_ms,
                draft_head_ms=draft.step_ms - headless.step_ms,
                verify_ms=verify.step_ms,
                draft_bound=draft.bound,
                verify_bound=verify.bound,
                plain_tokens_per_s=plain.tokens_per_s,
                spec_tokens_per_s=b * tau / spec_s,
                speedup=tau * plain.step_ms / (draft.step_ms + verify.step_ms),
            )
        )
    return rows


def serving_estimate(
    d: DrafterConfig,
    hw: GpuProfile,
    gp: GenerationSettings,
    *,
    t: TargetArch,
    weight_dtype: str,
    acceptance: Acceptance,
    batches: list[int],
    context: float,
    draft_vocab_size: int = 0,
    coverage: float = 1.0,
) -> ServingEstimate:
    """The speedup table with the whole vocabulary and (draft_vocab_size > 0) with the pruned one."""
    if any(b < 1 for b in batches) or not batches:
        raise UserError(f"plan.serving.batch_sizes: need sizes >= 1, got {batches}")
    if draft_vocab_size and not 0 < draft_vocab_size <= d.vocab_size:
        raise UserError(f"plan.serving.draft_vocab_size: {draft_vocab_size} outside 1..{d.vocab_size} (the vocabulary)")
    positions = d.block_size - 1
    if len(acceptance.per_position) > positions:
        raise UserError(f"{acceptance.source}: {len(acceptance.per_position)} positions, block_size drafts {positions}")
    est = ServingEstimate(
        acceptance_source=acceptance.source,
        acceptance=acceptance.per_position,
        tau=acceptance.tau,
        vocab_size=d.vocab_size,
        draft_vocab_size=draft_vocab_size,
        draft_vocab_coverage=coverage,
        tau_pruned=None,
        context_tokens=context,
    )

    def rows(accepted: list[float], vocab_rows: int) -> list[ServingRow]:
        return serving_rows(
            d,
            hw,
            gp,
            t=t,
            weight_dtype=weight_dtype,
            acceptance=accepted,
            vocab_rows=vocab_rows,
            batches=batches,
            context=context,
        )

    est.rows = rows(acceptance.per_position, d.vocab_size)
    if draft_vocab_size:
        pruned = with_coverage(acceptance.per_position, coverage)
        est.tau_pruned = 1.0 + sum(pruned)
        est.rows += rows(pruned, draft_vocab_size)
    return est


@dataclass(frozen=True)
class EvalFacts:
    """What the plan reads of the eval stage's report."""

    acceptance: list[float]
    speedup: float | None
    platform: str


def read_eval(path: Path) -> EvalFacts | None:
    """eval.json's acceptance per position and speedup, its platform from eval_details.json (None: no eval)."""
    if not path.exists():
        return None
    report = json.loads(path.read_text())
    acc = report.get("acceptance") or {}
    per_pos = [float(acc[k]) for k in sorted(acc, key=lambda k: int(k.removeprefix("pos_")))]
    details = path.with_name(path.stem + "_details.json")
    platform = report.get("platform") or (
        json.loads(details.read_text()).get("platform", "") if details.exists() else ""
    )
    return EvalFacts(acceptance=per_pos, speedup=report.get("speedup"), platform=platform or "")


def plan_serving(ctx: PlanContext, context: float) -> ServingEstimate | None:
    """The plan's serving section at sequences of `context` resident tokens (None when no acceptance is given,
    assumed or measured)."""
    params, d, hw = ctx.params, ctx.drafter, ctx.hw
    sp = params.plan.serving
    facts = read_eval(Path(params.base.reports_dir) / "eval.json")
    measured = facts.acceptance if facts else None
    acc = choose_acceptance(sp.acceptance, sp.assumed_tau, measured, positions=d.block_size - 1)
    if acc is None:
        return None
    est = serving_estimate(
        d,
        hw,
        ctx.gs,
        t=ctx.target,
        weight_dtype=ctx.weight_dtype,
        acceptance=acc,
        batches=sp.batch_sizes,
        context=context,
        draft_vocab_size=sp.draft_vocab_size,
        coverage=sp.draft_vocab_coverage,
    )
    if facts is not None and facts.speedup is not None:
        est.measured_speedup = facts.speedup
        same = (hw.kind == "cpu") == (facts.platform == "cpu")
        est.measured_note = (
            f"eval measured {facts.speedup:g} on {facts.platform or 'an unnamed platform'} at eval.max_num_seqs "
            f"{params.eval.max_num_seqs}" + ("" if same else " (not this hardware: not comparable)")
        )

    def training(draft_vocab_rows: int | None) -> TrainingEstimate:
        return training_estimate(
            ctx.target,
            d,
            hw,
            ta=ctx.ta,
            weight_dtype=ctx.weight_dtype,
            num_gpus=ctx.ta.num_gpus,
            data=ctx.data,
            pilot=ctx.pilot,
            draft_vocab_rows=draft_vocab_rows,
        )

    full = training(None)
    est.train_hours = full.headline.total_hours
    est.train_lm_head_tflops = full.flops_per_sequence.lm_head / 1e12
    est.train_total_tflops = full.flops_per_sequence.total / 1e12
    if sp.draft_vocab_size:
        pruned = training(sp.draft_vocab_size)
        est.train_hours_pruned = pruned.headline.total_hours
        est.train_lm_head_tflops_pruned = pruned.flops_per_sequence.lm_head / 1e12
        est.train_total_tflops_pruned = pruned.flops_per_sequence.total / 1e12
        if pruned.source == "pilot":
            est.notes.append("training time from the training pilot: the pruned vocabulary's hours are the pilot's too")
    return est
