"""What one mean training sequence costs: its FLOPs by part (dflash/drafter/flops.py counts them, the training pilot's
MFU uses the same count) and its per-GPU memory by part, before dflash/plan/training.py combines them per device layout
(the module docstring there says what each part holds).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dflash.core import target_counts
from dflash.core.target_config import TargetArch
from dflash.drafter.flops import DocumentWork, document_flops
from dflash.drafter.geometry import DrafterConfig, kind_cost, parameter_counts
from dflash.plan import sizing
from dflash.plan.settings import TrainSettings

GB = 1e9
# bytes per vocabulary entry of one logits chunk, by loss target (dflash/train/loss.py): tokens = bf16 logits +
# fp32 log-softmax + fp32 gradient; target_argmax adds the target's fp32 logits; target_kl also its
# log-probabilities, probabilities and the KL's product term.
LOGITS_BYTES = {"tokens": 10, "target_argmax": 14, "target_kl": 22}


@dataclass
class TrainingFlops:
    """FLOPs to train on one mean sequence, by part (dflash/drafter/flops.py `document_flops`), and the sequence they
    price."""

    target_forward: float
    target_lm_head: float  # the target's lm_head on the drafted slots (the loss targets that learn its predictions)
    drafter_q_o_mlp: float
    drafter_kv_projection: float  # context AND block tokens (KV injection)
    drafter_fc: float
    drafter_attention: float
    drafter_kind_extra: float  # forward + backward of the kind's additions (heads, convs, selector)
    lm_head: float  # the drafter's frozen lm_head: logits forward + input gradient
    total: float
    simple_6PN: float  # the rule of thumb 6 x drafter params x block tokens, for comparison
    seq_tokens: float
    anchors: float
    block_tokens: float  # anchors x query slots
    loss_target: str


def training_flops_per_sequence(
    t: TargetArch,
    d: DrafterConfig,
    ta: TrainSettings,
    *,
    seq_tokens: float,
    loss_tokens: float,
    vocab_rows: int | None = None,
    draft_vocab_rows: int | None = None,
) -> TrainingFlops:
    """FLOPs to train on one mean sequence (dflash/drafter/flops.py counts them): target forward, drafter forward +
    backward, frozen lm_head on drafted slots (`vocab_rows` of it: the rows the loss computes, all by default).
    `draft_vocab_rows`: a pruned draft vocabulary; the drafter's lm_head term scales to its rows, the target's
    lm_head stays whole (its argmax over the full vocabulary says whether a target token is inside)."""
    s = min(seq_tokens, ta.max_length)
    anchors = max(0.0, min(ta.num_anchors, loss_tokens - 1, s - 1))
    # anchors sit in the response (the sequence's tail): mean visible context ~ everything before the response
    # plus half of it; sliding layers see at most their window.
    mean_ctx = max(1.0, s - min(loss_tokens, s) / 2)
    work = DocumentWork(tokens=s, anchors=anchors, mean_context=mean_ctx, vocab_rows=vocab_rows)
    parts = document_flops(t, d, work, ta.loss_target)
    if draft_vocab_rows:
        parts["total"] -= parts["lm_head"]
        parts["lm_head"] *= draft_vocab_rows / (vocab_rows if vocab_rows is not None else d.vocab_size)
        parts["total"] += parts["lm_head"]
    return TrainingFlops(
        **parts, seq_tokens=s, anchors=anchors, block_tokens=anchors * d.query_slots, loss_target=ta.loss_target
    )


@dataclass
class TrainingMemory:
    """Per-GPU memory of online training by part (bytes, or GB once `in_gb`); training_estimate combines them per
    device layout."""

    target_weights: float
    target_activations: float  # one layer's temporaries
    features: float  # K concatenated hidden states (+ the target's final hidden states for the target_* losses)
    embed_and_head: float  # the drafter-side copy in the split layout
    drafter_weights: float
    drafter_states: float  # grads + fp32 master + AdamW moments
    drafter_activations: float
    reserve: float

    def in_gb(self) -> TrainingMemory:
        return TrainingMemory(**{k: v / GB for k, v in dataclasses.asdict(self).items()})


def training_memory(
    t: TargetArch, d: DrafterConfig, ta: TrainSettings, *, weight_dtype: str, seq_tokens: float, anchors: float
) -> TrainingMemory:
    """Per-GPU memory parts (bytes) of online training; combined per layout by training_estimate."""
    s = min(seq_tokens, ta.max_length)
    nb = anchors * d.query_slots
    b = ta.batch_size
    e = 2 if ta.compute_dtype == "bf16" else 4  # bytes of an activation
    h, f = d.hidden_size, d.intermediate_size
    q, kv = d.num_attention_heads * d.head_dim, d.num_key_value_heads * d.head_dim
    p = parameter_counts(d)["total"]
    w = sizing.target_weight_bytes(t, weight_dtype)
    counts = target_counts.target_params(t)
    # Saved per block token per drafter layer: input, norm, q, k, v, attention out, o_proj out, post-norm,
    # gate, up, activation. Context K/V per layer (pre- and post-norm/RoPE; computed outside the layer, so kept
    # under activation checkpointing too). Logits of one chunk: LOGITS_BYTES per vocab entry.
    per_token_layer = e * (4 * h + 2 * q + 2 * kv + 3 * f)
    layers = d.num_hidden_layers
    saved = layers * nb * e * h + nb * per_token_layer if ta.activation_checkpointing else layers * nb * per_token_layer
    act = saved + layers * s * 2 * kv * 2 * e + s * h * 2 * e
    # dspark / dflash2 hold the target's logits beside the drafter's, as the KL loss target does
    loss_target = "target_kl" if kind_cost(d).target_logits else ta.loss_target
    logits = min(anchors, ta.logits_chunk_blocks) * d.block_size * t.vocab_size * LOGITS_BYTES[loss_target]
    final = b * s * t.hidden_size * e if loss_target != "tokens" else 0  # the target's final hidden states
    return TrainingMemory(
        target_weights=w["loaded"],
        target_activations=b * s * (4 * t.hidden_size + 3 * t.intermediate_size) * e,
        features=b * s * d.num_target_features * h * e + final,
        embed_and_head=(counts["embed_tokens"] + (counts["lm_head"] or 0)) * 2,
        drafter_weights=p * 2,
        drafter_states=p * (ta.state_bytes_per_param - 2),
        drafter_activations=b * act + logits,
        reserve=ta.runtime_reserve_gb * GB,
    )
