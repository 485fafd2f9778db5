"""DFlash training loss: decayed cross-entropy over block slots through the target's frozen lm_head, in chunks.

Loss (docs/design.md section 5). Slot k >= 1 of a block whose label is valid (model.block_labels) contributes
w_k * CE(lm_head(h), label) with w_k = exp(-(k-1)/gamma); slot 0 (the given anchor) weighs 0. The sum is
divided by the sum of the weights of ALL valid slots of the optimizer step (every micro-step and process), so
the gradient does not depend on how a step is split over micro-steps or processes (train.py passes that sum).

Chunking. Only valid slots get logits, `chunk_rows` at a time. `_DecayedCE` computes, per chunk, the logits,
their log-sum-exp, the loss and the gradient with respect to the hidden states ((softmax - onehot) * w @ W),
then frees the logits: the (M, V) logits tensor never exists, and backward is a multiply by the stored (M, H)
gradient (no second pass over the vocabulary, unlike activation checkpointing).

Exact zero-row optimisation. A row of the lm_head that is exactly zero gives logit exactly 0 for every input
(the demo's tiny target zeroes the rows of tokens it never saw: 151,563 of 151,936). With R kept rows and
Z zero rows, the full-vocabulary log-partition is logaddexp(logsumexp(kept logits), log Z): the same number,
computed over R rows instead of V. A label in a zero row has logit 0; its gradient terms from zero rows vanish
(they multiply W_i = 0). The argmax over the full vocabulary is the kept argmax if its logit is > 0, else the
smallest zero-row id (torch's first-index tie rule). Rows are checked once at start; on real targets no row is
all zero and this is a no-op. tests/test_train.py checks loss, gradients and argmax against the full vocabulary.

Metrics. acc_k = share of valid slot-k labels equal to the full-vocabulary argmax. The expected acceptance
length implied by them, assuming slot k is right independently of slots before it given they were right:
  tau_hat = 1 + sum_{k=1}^{B-1} prod_{j=1}^{k} acc_j
(1 for the bonus token the target always adds, plus the chance that the first k drafts are all accepted).

Legend: M valid slots, H hidden, R kept lm_head rows, V vocabulary rows, B block size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def slot_weights(block_size: int, gamma: float) -> torch.Tensor:
    """(B,) float: 0 for slot 0, exp(-(k-1)/gamma) for k >= 1."""
    if gamma <= 0:
        raise ValueError(f"train.loss_gamma: must be > 0, got {gamma}")
    k = torch.arange(block_size, dtype=torch.float64)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w.to(torch.float32)


@dataclass
class LMHead:
    """The target's frozen output projection, reduced to its non-zero rows (module docstring)."""

    weight: torch.Tensor  # (R, H) kept rows
    bias: torch.Tensor | None  # (R,) or None
    vocab_size: int  # V
    num_zero: int  # Z rows that are exactly zero (0 on real targets)
    first_zero: int  # smallest zero-row id; -1 when Z = 0
    token_ids: torch.Tensor | None  # (R,) long: vocabulary id of each kept row (None: all rows, in order)
    remap: torch.Tensor | None  # (V,) long: kept row of each id, -1 for zero rows (None: identity)

    @classmethod
    def from_linear(cls, linear: torch.nn.Module, device: torch.device | str | None = None) -> LMHead:
        w = linear.weight.detach()
        b = linear.bias.detach() if getattr(linear, "bias", None) is not None else None
        if device is not None:
            w = w.to(device)
            b = b.to(device) if b is not None else None
        vocab = w.shape[0]
        zero = torch.zeros(vocab, dtype=torch.bool, device=w.device)
        for s in range(0, vocab, 16384):  # (rows x H) bool temporaries stay small
            zero[s : s + 16384] = (w[s : s + 16384] == 0).all(dim=1)
        if b is not None:
            zero &= b == 0
        n_zero = int(zero.sum())
        if n_zero == 0:
            return cls(w, b, vocab, 0, -1, None, None)
        if n_zero == vocab:
            raise ValueError("the target's lm_head is all zeros")
        keep = torch.nonzero(~zero).squeeze(1)
        remap = torch.full((vocab,), -1, dtype=torch.long, device=w.device)
        remap[keep] = torch.arange(len(keep), device=w.device)
        first_zero = int(torch.nonzero(zero)[0, 0])
        return cls(w[keep].contiguous(), b[keep] if b is not None else None, vocab, n_zero, first_zero, keep, remap)

    def full_logits(self, h: torch.Tensor) -> torch.Tensor:
        """(M, H) -> (M, V) logits over the whole vocabulary (tests and small evaluations only)."""
        kept = torch.nn.functional.linear(h.to(self.weight.dtype), self.weight, self.bias).float()
        if self.token_ids is None:
            return kept
        out = kept.new_zeros(h.shape[0], self.vocab_size)
        out[:, self.token_ids] = kept
        return out


class _DecayedCE(torch.autograd.Function):
    """sum_i w_i * CE_i over rows of h; forward also returns per-row CE and full-vocabulary argmax (no grad)."""

    @staticmethod
    def forward(ctx, h, head_w, head_b, targets, weights, log_zero, first_zero, token_ids, chunk):
        m = h.shape[0]
        grad_h = torch.empty_like(h)
        ce_all = torch.empty(m, dtype=torch.float32, device=h.device)
        pred = torch.empty(m, dtype=torch.long, device=h.device)
        for s in range(0, m, chunk):
            e = min(m, s + chunk)
            logits = torch.nn.functional.linear(h[s:e].to(head_w.dtype), head_w, head_b).float()  # (c, R)
            t = targets[s:e]
            has = t >= 0  # False: the label is a zero row, whose logit is exactly 0
            tc = t.clamp(min=0)[:, None]
            best, arg = logits.max(dim=1)
            ids = token_ids[arg] if token_ids is not None else arg
            lse = torch.logsumexp(logits, dim=1)
            if log_zero is not None:
                lse = torch.logaddexp(lse, torch.full_like(lse, log_zero))
                ids = torch.where(
                    best > 0, ids, torch.where(best < 0, first_zero, torch.minimum(ids, ids.new_tensor(first_zero)))
                )
            ce = lse - torch.where(has, logits.gather(1, tc)[:, 0], torch.zeros_like(lse))
            ce_all[s:e] = ce
            pred[s:e] = ids
            probs = logits.sub_(lse[:, None]).exp_()  # (c, R) softmax over the full vocabulary, kept rows
            probs.scatter_add_(1, tc, -has.to(probs.dtype)[:, None])
            probs.mul_(weights[s:e, None])
            grad_h[s:e] = (probs.to(head_w.dtype) @ head_w).to(h.dtype)
        ctx.save_for_backward(grad_h)
        ctx.mark_non_differentiable(ce_all, pred)
        return (ce_all * weights).sum(), ce_all, pred

    @staticmethod
    def backward(ctx, g_loss, _g_ce, _g_pred):
        (grad_h,) = ctx.saved_tensors
        return grad_h * g_loss.to(grad_h.dtype), None, None, None, None, None, None, None, None


@dataclass
class LossOut:
    loss: torch.Tensor  # scalar: sum of w * CE over this call's valid slots / normaliser (differentiable)
    weight_sum: float  # sum of w over this call's valid slots
    correct: torch.Tensor  # (B,) long: valid slots whose full-vocabulary argmax equals the label, per slot
    counted: torch.Tensor  # (B,) long: valid slots per slot


def valid_weight_sum(valid: torch.Tensor, slot_w: torch.Tensor) -> float:
    """Sum of slot weights over valid (N*B,) slots: the normaliser's share of one micro-step."""
    b = slot_w.numel()
    per_slot = valid.view(-1, b).sum(dim=0).to(torch.float64)
    return float((per_slot * slot_w.to(per_slot.device, torch.float64)).sum())


def decayed_ce(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor,
    head: LMHead,
    slot_w: torch.Tensor,
    normaliser: float,
    chunk_rows: int,
) -> LossOut:
    """hidden (N*B, H), labels / valid (N*B,) from model.block_labels, slot_w (B,) -> LossOut (module docstring)."""
    b = slot_w.numel()
    idx = torch.nonzero(valid).squeeze(1)  # (M,)
    slot = idx % b
    w = slot_w.to(hidden.device)[slot] / normaliser  # (M,)
    lab = labels[idx]
    targets = head.remap[lab] if head.remap is not None else lab
    log_zero = math.log(head.num_zero) if head.num_zero else None
    loss, _ce, pred = _DecayedCE.apply(
        hidden[idx], head.weight, head.bias, targets, w, log_zero, head.first_zero, head.token_ids, max(1, chunk_rows)
    )
    counted = torch.bincount(slot, minlength=b)
    correct = torch.bincount(slot[pred == lab], minlength=b)
    return LossOut(loss, float(w.sum()) * normaliser, correct, counted)


def tau_hat(acc: list[float]) -> float:
    """1 + sum_k prod_{j<=k} acc_j over slots 1..B-1 (module docstring)."""
    total, run = 1.0, 1.0
    for a in acc:
        run *= a
        total += run
    return total


__all__ = ["LMHead", "LossOut", "decayed_ce", "slot_weights", "tau_hat", "valid_weight_sum"]
