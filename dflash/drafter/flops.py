"""FLOPs of training the drafter on one document: the target's forward, the drafter's forward + backward with KV
injection and its attention, and the frozen lm_head on every drafted slot.

One count for two readers, so that a measured MFU and an assumed one are the same quantity: the plan
(dflash/plan/training.py: time at an assumed MFU, from mean lengths) and the training pilot
(dflash/train/pilot.py: the MFU a measured step reached, from the documents and anchors it really fed).
`drafter_flops` is the drafter's one FLOP count (beside `geometry.parameter_counts`, its one parameter count);
the target's side comes from dflash/core/target_counts.py. Torch-free.

Conventions: model FLOPs (a recomputed forward under activation checkpointing is not counted); a matmul of
m x n by n x k is 2mnk; backward = 2 x forward for the drafter's trainable matmuls; the frozen lm_head costs its
logits (2VH per slot) and the gradient with respect to its input (2VH), never a weight gradient.
Legend: S context tokens of the document, N anchors (blocks), B block size, V vocabulary, H hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash.core.target_config import TargetArch
from dflash.core.target_counts import prefill_flops
from dflash.drafter.geometry import SLIDING, DrafterConfig, kind_cost, parameter_counts

OWN_PREDICTION_TARGETS = ("target_argmax", "target_kl")  # loss targets that need the target's final layer + lm_head


@dataclass(frozen=True)
class DocumentWork:
    """What one document asks of a training step."""

    tokens: float  # S: context tokens of the document
    anchors: float  # N: blocks drawn in it
    mean_context: float  # mean context positions a block sees (those before its anchor), full-attention layers
    mean_context_sliding: float | None = None  # the same in sliding layers (at most the window); None = derived
    vocab_rows: float | None = None  # lm_head rows the loss computes (None = the whole vocabulary; the tiny demo
    # target's exactly-zero rows fold into one term, dflash/train/loss.py, so the trainer computes only the others)


def drafter_flops(d: DrafterConfig, work: DocumentWork) -> dict[str, float]:
    """The drafter's forward + backward over one document (with its kind's heads / convs / selector), and the frozen
    lm_head on its drafted slots."""
    nb = work.anchors * d.query_slots
    p = parameter_counts(d)
    q_dim = d.num_attention_heads * d.head_dim
    sliding = work.mean_context_sliding
    if sliding is None:
        sliding = min(work.mean_context, d.sliding_window)
    attn = 0.0
    for kind in d.layer_types:
        ctx = sliding if kind == SLIDING else work.mean_context
        in_block = (d.block_size + 1) / 2 if kind == SLIDING else d.block_size  # causal vs bidirectional in-block
        attn += 12.0 * nb * (ctx + in_block) * q_dim  # QK^T + AV: forward (4) + backward (8)
    slots = work.anchors * (d.block_size - 1)
    rows = work.vocab_rows if work.vocab_rows is not None else d.vocab_size
    return {
        "drafter_q_o_mlp": 6.0 * (p["attn_q_o"] + p["mlp"] + p["norms"]) * nb,
        "drafter_kv_projection": 6.0 * p["attn_kv"] * (work.tokens + nb),  # context AND block tokens (KV injection)
        "drafter_fc": 6.0 * p["fc"] * work.tokens,
        "drafter_attention": attn,
        "drafter_kind_extra": 3.0 * kind_cost(d).flops_per_slot * nb,  # forward + backward of the kind's additions
        "lm_head": 4.0 * rows * d.hidden_size * slots,  # logits forward + input gradient, frozen weight
    }


def document_flops(t: TargetArch, d: DrafterConfig, work: DocumentWork, loss_target: str) -> dict[str, float]:
    """Every FLOP of training on one document, by part, and their `total` (plus `simple_6PN`, the rule of thumb
    6 x drafter params x block tokens, for comparison). The target runs to its deepest feature layer, or to its
    last layer (and its lm_head at the drafted slots) for the loss targets that learn its own predictions."""
    own = loss_target in OWN_PREDICTION_TARGETS or kind_cost(d).target_logits  # dspark / dflash2 learn from them
    slots = work.anchors * (d.block_size - 1)
    rows = work.vocab_rows if work.vocab_rows is not None else t.vocab_size
    parts = {
        "target_forward": prefill_flops(
            t, work.tokens, layers=None if own else d.deepest_target_layer + 1, with_head=False
        ),
        "target_lm_head": 2.0 * rows * t.hidden_size * slots if own else 0.0,
        **drafter_flops(d, work),
    }
    parts["total"] = sum(parts.values())
    parts["simple_6PN"] = 6.0 * parameter_counts(d)["total"] * work.anchors * d.query_slots
    return parts
