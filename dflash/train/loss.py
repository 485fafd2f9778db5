"""DFlash training loss: weighted per-slot losses over block slots through the target's frozen lm_head, in chunks.

What slot k of a block learns (`train.loss_target`, docs/design/training.md):
  tokens         CE against the dataset token at anchor + k (the paper's loss).
  target_argmax  CE against the target's own greedy choice for that position: argmax of the target's logits at
                 anchor + k - 1. What greedy verification accepts; identical to `tokens` on greedy data.
  target_kl      forward KL(p_target || q_drafter) of the target's full distribution at anchor + k - 1: the
                 whole distribution, not one sample of it (data generated at temperature > 0).
The target-side logits are made only for the rows the blocks need (valid slots), from the target's final hidden
state (its last layer after its final norm, dflash/train/features.py), chunk by chunk beside the drafter's.

How much each slot weighs (`train.position_weighting`), slot 0 (the given anchor) always 0:
  decay  w_k = exp(-(k-1)/gamma) (the paper). The sum is divided by the sum of the weights of ALL valid slots of
         the optimizer step (every micro-step and process): the gradient does not depend on how a step is split.
  dpace  confidence-aware weights (D-PACE, arXiv 2605.18810), per block: the drafter's confidence at slot i is
         c_i = exp(-CE_i) against the slot's label, smoothed c~_i = (1 - alpha) c_i + alpha (alpha = 0.5); an
         invalid slot ends the chain (c~ = 0). Slot j weighs w_j = sum_{m >= j} prod_{i <= m} c~_i: the expected
         number of accepted tokens that need slot j right, so early slots, on which every later one depends,
         weigh most, and blocks the drafter already gets right weigh more than hopeless ones. Detached (no
         gradient through the weights). The sum is divided by the number of valid slots of the optimizer step
         (the weights are only known after the forward), again independent of the split.

Chunking. Only valid slots get logits, `chunk_rows` at a time. `_SlotLoss` computes per chunk the logits, their
log-sum-exp, each row's loss and its weighted gradient with respect to the drafter's hidden state (w (q - p) @ W,
with p the one-hot label for CE, the target's softmax for KL), then frees the logits: no (M, V) tensor ever
exists, and backward is a multiply by the stored (M, H) gradient (no second pass over the vocabulary). D-PACE
weights need every slot's CE first: the unweighted gradient is stored and scaled after the last chunk (same
memory). KL holds up to four (chunk, R) float tensors at once instead of two (the plan's memory model counts it).

Exact zero-row optimisation. A row of the lm_head that is exactly zero gives logit exactly 0 for every input
(the demo's tiny target zeroes the rows of tokens it never saw: 151,563 of 151,936). With R kept rows and
Z zero rows, the full-vocabulary log-partition is logaddexp(logsumexp(kept logits), log Z): the same number,
computed over R rows instead of V. A label in a zero row has logit 0; its gradient terms from zero rows vanish
(they multiply W_i = 0); in the KL the Z zero rows share one probability each side and add
Z exp(-lse_p) (lse_q - lse_p). The argmax over the full vocabulary is the kept argmax if its logit is > 0, else the
smallest zero-row id (torch's first-index tie rule). Rows are checked once at start; on real targets no row is
all zero and this is a no-op. tests/unit/train/test_train.py and tests/unit/train/test_loss_targets.py check against the full vocabulary.

Draft vocabulary (drafter.draft_vocab_size, LMHead.draft_vocab): the logits are the drafter's own D rows (the
target's rows of those tokens, frozen). tokens: a label outside the vocabulary is masked (and counted by the
loop); target_argmax: the target's argmax among the D tokens; target_kl: KL to the target's distribution restricted
to the D tokens and renormalised (the mass outside, which no draft can win, is dropped).

Metrics. acc_k = share of valid slot-k labels (the dataset token, or the target's argmax for the target_* losses)
equal to the drafter's full-vocabulary argmax. The expected acceptance length implied by them, assuming slot k is
right independently of slots before it given they were right:
  tau_hat = 1 + sum_{k=1}^{B-1} prod_{j=1}^{k} acc_j

Legend: M valid slots, H hidden, R kept lm_head rows, V vocabulary rows, B block size, N blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LOSS_TARGETS = ("tokens", "target_argmax", "target_kl")
WEIGHTINGS = ("decay", "dpace")
DPACE_ALPHA = 0.5  # D-PACE's smoothing of the confidence toward 1


def slot_weights(block_size: int, gamma: float) -> torch.Tensor:
    """(B,) float: 0 for slot 0, exp(-(k-1)/gamma) for k >= 1."""
    if gamma <= 0:
        raise ValueError(f"train.loss_gamma: must be > 0, got {gamma}")
    k = torch.arange(block_size, dtype=torch.float64)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w.to(torch.float32)


def dpace_weights(ce: torch.Tensor, valid: torch.Tensor, alpha: float = DPACE_ALPHA) -> torch.Tensor:
    """ce, valid (N, B) -> D-PACE weights (N, B) float64 (module docstring); 0 at slot 0 and at invalid slots."""
    conf = torch.where(valid, (1 - alpha) * torch.exp(-ce.double()) + alpha, torch.zeros_like(ce, dtype=torch.float64))
    conf[:, 0] = 1.0  # the anchor is given: it neither weighs nor breaks the chain
    reach = torch.cumprod(conf, dim=1)  # prod_{i <= m} c~_i
    w = torch.flip(torch.cumsum(torch.flip(reach, [1]), dim=1), [1])  # sum_{m >= j}
    return torch.where(valid, w, torch.zeros_like(w))


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

    @classmethod
    def draft_vocab(cls, weight: torch.Tensor, token_ids: torch.Tensor, vocab_size: int) -> LMHead:
        """The drafter's own head over a pruned vocabulary (dflash/drafter/vocab.py DraftHead): the softmax runs over
        its D rows only, so the target_* losses see the target's distribution restricted to them and renormalised,
        and its argmax inside them; a `tokens` label outside them is masked before the loss (train/micro.py)."""
        remap = torch.full((vocab_size,), -1, dtype=torch.long, device=weight.device)
        remap[token_ids] = torch.arange(len(token_ids), device=weight.device)
        return cls(weight, None, vocab_size, 0, -1, token_ids.to(weight.device), remap)

    @property
    def log_zero(self) -> float | None:
        return math.log(self.num_zero) if self.num_zero else None

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """(c, H) -> (c, R) float32 logits of the kept rows."""
        return torch.nn.functional.linear(h.to(self.weight.dtype), self.weight, self.bias).float()

    def lse_and_argmax(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Kept logits (c, R) -> full-vocabulary log-partition (c,) and argmax vocabulary ids (c,)."""
        best, arg = logits.max(dim=1)
        ids = self.token_ids[arg] if self.token_ids is not None else arg
        lse = torch.logsumexp(logits, dim=1)
        if self.num_zero:
            lse = torch.logaddexp(lse, torch.full_like(lse, self.log_zero))
            fz = self.first_zero
            ids = torch.where(best > 0, ids, torch.where(best < 0, fz, torch.minimum(ids, ids.new_tensor(fz))))
        return lse, ids

    def full_logits(self, h: torch.Tensor) -> torch.Tensor:
        """(M, H) -> (M, V) logits over the whole vocabulary (tests and small evaluations only)."""
        kept = self.logits(h)
        if self.token_ids is None:
            return kept
        fill = 0.0 if self.num_zero else float("-inf")  # zero rows: logit 0; a pruned vocabulary: nothing else exists
        out = kept.new_full((h.shape[0], self.vocab_size), fill)
        out[:, self.token_ids] = kept
        return out

    def kept_index(self, ids: torch.Tensor) -> torch.Tensor:
        """Vocabulary ids -> kept-row index (-1 for a zero row)."""
        return self.remap[ids] if self.remap is not None else ids


class _SlotLoss(torch.autograd.Function):
    """sum_i w_i * loss_i over rows of h (CE, or KL when target rows are given), chunked (module docstring).
    Weights known beforehand (`row_w`: decay) scale each chunk's gradient as it is made; weights that depend on
    the losses (`weights_fn(ce) -> w`: dpace) scale the stored gradient after the last chunk. Returns (loss,
    ce (M,), drafter argmax (M,), labels (M,), w (M,)); only the loss has a gradient."""

    @staticmethod
    def forward(ctx, h, head, labels, target_h, kl, chunk, row_w, weights_fn):
        m = h.shape[0]
        grad_h = torch.empty_like(h)
        loss_rows = torch.empty(m, dtype=torch.float32, device=h.device)
        ce_all = torch.empty_like(loss_rows)
        pred = torch.empty(m, dtype=torch.long, device=h.device)
        out_labels = torch.empty(m, dtype=torch.long, device=h.device)
        w_t = head.weight
        for s in range(0, m, chunk):
            e = min(m, s + chunk)
            zq = head.logits(h[s:e])  # (c, R)
            lse_q, ids = head.lse_and_argmax(zq)
            if target_h is not None:
                zp = head.logits(target_h[s:e])
                lse_p, lab = head.lse_and_argmax(zp)  # the target's greedy choice
            else:
                lab = labels[s:e]
            t = head.kept_index(lab)
            has = t >= 0  # False: the label is a zero row, whose logit is exactly 0
            tc = t.clamp(min=0)[:, None]
            ce = lse_q - torch.where(has, zq.gather(1, tc)[:, 0], torch.zeros_like(lse_q))
            if kl:
                logq = zq - lse_q[:, None]
                logp = zp.sub_(lse_p[:, None])  # (c, R) target log-probabilities
                p = logp.exp()
                row = (p * (logp - logq)).sum(dim=1)
                if head.num_zero:  # the zero rows: logit 0 on both sides
                    row = row + head.num_zero * torch.exp(-lse_p) * (lse_q - lse_p)
                probs = logq.exp_().sub_(p)  # d KL / d logits = q - p
            else:
                row = ce
                probs = zq.sub_(lse_q[:, None]).exp_()  # (c, R) softmax over the full vocabulary, kept rows
                probs.scatter_add_(1, tc, -has.to(probs.dtype)[:, None])  # d CE / d logits = q - onehot
            if row_w is not None:
                probs.mul_(row_w[s:e, None])
            loss_rows[s:e], ce_all[s:e], pred[s:e], out_labels[s:e] = row, ce, ids, lab
            grad_h[s:e] = (probs.to(w_t.dtype) @ w_t).to(h.dtype)
        if row_w is None:
            row_w = weights_fn(ce_all)
            grad_h.mul_(row_w[:, None].to(grad_h.dtype))
        ctx.save_for_backward(grad_h)
        ctx.mark_non_differentiable(ce_all, pred, out_labels, row_w)
        return (loss_rows * row_w).sum(), ce_all, pred, out_labels, row_w

    @staticmethod
    def backward(ctx, g_loss, *_):
        (grad_h,) = ctx.saved_tensors
        return grad_h * g_loss.to(grad_h.dtype), None, None, None, None, None, None, None


@dataclass
class LossOut:
    loss: torch.Tensor  # scalar: sum of w * loss over this call's valid slots / normaliser (differentiable)
    weight_sum: float  # sum of w over this call's valid slots
    correct: torch.Tensor  # (B,) long: valid slots whose full-vocabulary argmax equals the label, per slot
    counted: torch.Tensor  # (B,) long: valid slots per slot


def normaliser_share(valid: torch.Tensor, slot_w: torch.Tensor, weighting: str = "decay") -> float:
    """This micro-step's share of the loss normaliser (module docstring): the decay weights of its valid (N*B,)
    slots, or (dpace) their number."""
    if weighting == "dpace":
        return float(valid.sum())
    b = slot_w.numel()
    per_slot = valid.view(-1, b).sum(dim=0).to(torch.float64)
    return float((per_slot * slot_w.to(per_slot.device, torch.float64)).sum())


def valid_weight_sum(valid: torch.Tensor, slot_w: torch.Tensor) -> float:
    """Sum of decay weights over valid (N*B,) slots."""
    return normaliser_share(valid, slot_w, "decay")


def target_rows(anchors: torch.Tensor, block_size: int, idx: torch.Tensor) -> torch.Tensor:
    """Flat slot indices (M,) of valid slots -> the position whose target output predicts each slot's label:
    anchor + k - 1 (slot k >= 1 is always valid there: it lies in the anchor's document)."""
    return anchors[idx // block_size] + idx % block_size - 1


def block_loss(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor,
    head: LMHead,
    *,
    slot_w: torch.Tensor,
    normaliser: float,
    chunk_rows: int,
    loss_target: str = "tokens",
    weighting: str = "decay",
    target_hidden: torch.Tensor | None = None,
    anchors: torch.Tensor | None = None,
) -> LossOut:
    """hidden (N*B, H), labels / valid (N*B,) from model.block_labels, slot_w (B,) -> LossOut (module docstring).
    The target_* losses also need the target's final hidden states (S, H) of the row and the anchors (N,)."""
    if loss_target not in LOSS_TARGETS or weighting not in WEIGHTINGS:
        raise ValueError(
            f"loss target {loss_target!r} / weighting {weighting!r}: expected {LOSS_TARGETS} / {WEIGHTINGS}"
        )
    b = slot_w.numel()
    idx = torch.nonzero(valid).squeeze(1)  # (M,)
    slot = idx % b
    t_h = None
    if loss_target != "tokens":
        if target_hidden is None or anchors is None:
            raise ValueError(f"loss target {loss_target}: needs the target's final hidden states and the anchors")
        t_h = target_hidden[target_rows(anchors.to(idx.device), b, idx)]
    if weighting == "decay":
        row_w, weights_fn = slot_w.to(hidden.device)[slot] / normaliser, None
    else:

        def weights_fn(ce: torch.Tensor) -> torch.Tensor:
            grid = torch.zeros(valid.numel(), dtype=torch.float32, device=hidden.device)
            grid[idx] = ce
            return dpace_weights(grid.view(-1, b), valid.view(-1, b)).flatten()[idx].float() / normaliser

        row_w = None
    loss, _ce, pred, lab, w = _SlotLoss.apply(
        hidden[idx], head, labels[idx], t_h, loss_target == "target_kl", max(1, chunk_rows), row_w, weights_fn
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


__all__ = [
    "LOSS_TARGETS",
    "WEIGHTINGS",
    "LMHead",
    "LossOut",
    "block_loss",
    "dpace_weights",
    "normaliser_share",
    "slot_weights",
    "target_rows",
    "tau_hat",
    "valid_weight_sum",
]
