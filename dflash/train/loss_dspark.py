"""DSpark's training loss (arXiv 2607.05147), chunked through the target's frozen lm_head like dflash/train/loss.py.

Slots and labels. The labels and valid flags are DFlash's (model.block_labels): draft position d = 1..B-1 of the
block at anchor a is the token at a + d. DSpark drafts position d from query slot d - 1 (the anchor's slot drafts
position 1), so the hidden state of draft d is row d - 1 of its block (B - 1 rows a block). Everything below is
per valid draft position, with weight w_d = exp(-(d-1)/gamma) / normaliser (dflash/train/loss.py's decay weights:
the paper's exp(-k/gamma) for slot k = d - 1).

The Markov-corrected draft distribution q_d = softmax(lm_head(h) + W2 W1[prev]) with the predecessor teacher-forced:
prev = the token at a + d - 1 (the anchor for d = 1), the context the target's own distribution p_d conditions on
(p_d: softmax of the target's logits at row a + d - 1, made chunk by chunk from its final hidden states, never
as full logits). Per position:
    loss_d = ce x CE(q_d, label) + l1 x ||q_d - p_d||_1 + confidence x BCE(sigmoid(c_d), 1 - TV_d)
with TV_d = ||q_d - p_d||_1 / 2, so 1 - TV_d = sum_x min(q_d, p_d), the probability that a draft from q_d is
accepted by rejection sampling against p_d (the confidence head's target, detached). CE's label follows
train.loss_target (tokens: the data token; target_argmax: the target's argmax; target_kl: the CE term becomes
KL(p_d || q_d)). The weights ce / l1 / confidence are train.dspark_loss.

Chunking and zero rows. `_DSparkSlots` makes both sides' logits `chunk_rows` rows at a time and keeps only the
(M, H) / (M, r) input gradients and the (V, r) W2 gradient. The lm_head's exactly-zero rows (the demo's tiny
target) have drafter logit W2[z] . e and target logit 0. W2 starts at zero, and a zero row that is never a label
receives exactly the gradient of every other such row, so those rows stay one shared row and enter as one term
with multiplicity Z (loss.py's exact reduction, generalised to a non-zero shared logit). Zero rows that ARE labels
(a data token, or the target's argmax falling to the first zero row) get their own gradient: `explicit_rows`
moves them into the kept rows (lm_head row 0, W2 row their own) before training, found by one scan of the data's
supervised tokens. The trainer checks the remaining zero rows are tied before training, the tests after.

Gradients with respect to the drafter logits z (kept rows) and the shared zero-row logit z0 (s = sign(q - p),
S = sum_x s_x q_x over the full vocabulary):
    CE: q - onehot(label)          L1: q (s - S)          KL: q - p          (z0: Z q0 (...) the same way)

Legend: M valid draft positions, H hidden, R kept lm_head rows, Z zero rows, V vocabulary, r markov_rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash.core.params import DSparkLossParams
from dflash.train.loss import LMHead, LossOut, target_rows


@dataclass
class DSparkRows:
    """The valid draft positions of a micro-step, gathered (M rows)."""

    idx: torch.Tensor  # (M,) flat index into the (N, B) label grid
    slot: torch.Tensor  # (M,) draft position d (1..B-1)
    hidden_row: torch.Tensor  # (M,) row of the drafter's (N * (B-1), H) output drafting it
    target_row: torch.Tensor  # (M,) row a + d - 1 of the packed row: the target's prediction and the predecessor


def dspark_rows(valid: torch.Tensor, anchors: torch.Tensor, block_size: int) -> DSparkRows:
    idx = torch.nonzero(valid).squeeze(1)
    block, slot = idx // block_size, idx % block_size
    return DSparkRows(idx, slot, block * (block_size - 1) + slot - 1, target_rows(anchors, block_size, idx))


def _lse_argmax(head: LMHead, z: torch.Tensor, z0: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept logits (c, R) and the shared zero-row logit (c,) (None: 0) -> full-vocabulary log-partition and argmax
    ids, with torch's first-index rule between a kept row and the first zero row."""
    if z0 is None or not head.num_zero:
        return head.lse_and_argmax(z)
    best, arg = z.max(dim=1)
    ids = head.token_ids[arg]
    lse = torch.logaddexp(torch.logsumexp(z, dim=1), z0 + head.log_zero)
    fz = head.first_zero
    ids = torch.where(best > z0, ids, torch.where(best < z0, fz, torch.minimum(ids, ids.new_tensor(fz))))
    return lse, ids


class _DSparkSlots(torch.autograd.Function):
    """sum_i w_i (ce CE_i + l1 L1_i) over M draft positions, chunked (module docstring). Returns (loss, acceptance
    1 - TV (M,), drafter argmax (M,), CE labels (M,)); only the loss has a gradient (to h, e and W2)."""

    @staticmethod
    def forward(ctx, h, e, w2, head, labels, target_h, row_w, chunk, coef_ce, coef_l1, mode):
        m, z = h.shape[0], head.num_zero
        grad_h, grad_e, grad_w2 = torch.empty_like(h), torch.empty_like(e), torch.zeros_like(w2)
        kept_w2 = w2[head.token_ids] if head.token_ids is not None else w2  # (R, r)
        zero_w2 = w2[head.first_zero] if z else None  # (r,) the shared row of every zero lm_head row
        g_zero_w2 = torch.zeros_like(w2[0])
        total = torch.zeros((), dtype=torch.float64, device=h.device)
        accept = torch.empty(m, dtype=torch.float32, device=h.device)
        pred = torch.empty(m, dtype=torch.long, device=h.device)
        out_labels = torch.empty(m, dtype=torch.long, device=h.device)
        w_lm = head.weight
        for s in range(0, m, chunk):
            t = min(m, s + chunk)
            e_c = e[s:t].to(kept_w2.dtype)
            zq = head.logits(h[s:t]) + (e_c @ kept_w2.T).float()  # (c, R)
            zq0 = (e_c @ zero_w2).float() if z else None  # (c,)
            lse_q, ids = _lse_argmax(head, zq, zq0)
            zp = head.logits(target_h[s:t])
            lse_p, target_ids = head.lse_and_argmax(zp)
            lab = labels[s:t] if mode == "tokens" else target_ids  # the CE label / the accuracy label
            q = torch.exp(zq - lse_q[:, None])
            p = torch.exp(zp - lse_p[:, None])
            sign = torch.sign(q - p)
            l1 = (q - p).abs().sum(dim=1)
            big_s = (sign * q).sum(dim=1)
            if z:
                q0, p0 = torch.exp(zq0 - lse_q), torch.exp(-lse_p)
                sign0 = torch.sign(q0 - p0)
                l1 = l1 + z * (q0 - p0).abs()
                big_s = big_s + z * sign0 * q0
            kept = head.kept_index(lab)
            has = kept >= 0
            if mode == "target_kl":
                first = (p * (zp - lse_p[:, None] - zq + lse_q[:, None])).sum(dim=1)
                if z:
                    first = first + z * p0 * (-lse_p + lse_q - zq0)
                g = q - p
                g0 = z * (q0 - p0) if z else None
            else:
                zy = torch.where(has, zq.gather(1, kept.clamp(min=0)[:, None])[:, 0], zq0 if z else 0.0)
                first = lse_q - zy
                g = q.clone()
                g.scatter_add_(1, kept.clamp(min=0)[:, None], -has.to(g.dtype)[:, None])
                g0 = z * q0 - (~has).to(q0.dtype) if z else None
            w = row_w[s:t]
            g = (coef_ce * g + coef_l1 * q * (sign - big_s[:, None])) * w[:, None]
            if z:
                g0 = (coef_ce * g0 + coef_l1 * z * q0 * (sign0 - big_s)) * w
            total += ((coef_ce * first + coef_l1 * l1) * w).double().sum()
            accept[s:t] = (1 - l1 / 2).clamp(0, 1)
            pred[s:t], out_labels[s:t] = ids, lab
            grad_h[s:t] = (g.to(w_lm.dtype) @ w_lm).to(h.dtype)
            ge = g.to(kept_w2.dtype) @ kept_w2
            gw = g.T.to(e_c.dtype) @ e_c  # (R, r)
            if head.token_ids is not None:
                grad_w2.index_add_(0, head.token_ids, gw.to(grad_w2.dtype))
            else:
                grad_w2 += gw.to(grad_w2.dtype)
            if z:
                ge = ge + g0[:, None].to(ge.dtype) * zero_w2[None, :]
                g_zero_w2 += (g0.to(e_c.dtype) @ e_c).to(g_zero_w2.dtype) / z  # each of the Z rows: 1/Z of it
            grad_e[s:t] = ge.to(e.dtype)
        if z:
            grad_w2[head.remap < 0] = g_zero_w2
        ctx.save_for_backward(grad_h, grad_e, grad_w2)
        ctx.mark_non_differentiable(accept, pred, out_labels)
        return total.to(h.dtype if h.dtype == torch.float64 else torch.float32), accept, pred, out_labels

    @staticmethod
    def backward(ctx, g_loss, *_):
        grad_h, grad_e, grad_w2 = ctx.saved_tensors
        g = g_loss.to(grad_h.dtype)
        return grad_h * g, grad_e * g, grad_w2 * g, None, None, None, None, None, None, None, None


def dspark_loss(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor,
    head: LMHead,
    *,
    drafter: torch.nn.Module,
    input_ids: torch.Tensor,
    anchors: torch.Tensor,
    target_hidden: torch.Tensor,
    slot_w: torch.Tensor,
    normaliser: float,
    chunk_rows: int,
    weights: DSparkLossParams,
    loss_target: str = "tokens",
) -> LossOut:
    """hidden (N*(B-1), H) from the DSpark drafter's forward; labels / valid (N*B,) from model.block_labels;
    target_hidden (S, H) the target's final hidden states of the row; slot_w (B,) decay weights -> LossOut
    (correct / counted per draft position, index 0 unused, like DFlash's)."""
    b = slot_w.numel()
    rows = dspark_rows(valid, anchors.to(valid.device), b)
    h = hidden[rows.hidden_row]  # (M, H)
    prev = input_ids[rows.target_row]  # teacher-forced predecessor: the token at a + d - 1
    markov = drafter.markov_head
    e = markov.embed(prev)  # (M, r)
    row_w = slot_w.to(h.device)[rows.slot] / normaliser
    loss, accept, pred, lab = _DSparkSlots.apply(
        h,
        e,
        markov.markov_w2.weight,
        head,
        labels[rows.idx],
        target_hidden[rows.target_row],
        row_w,
        max(1, chunk_rows),
        weights.ce,
        weights.l1,
        loss_target,
    )
    if drafter.confidence_head is not None and weights.confidence > 0:
        # W1[prev] detached: the confidence term trains its projection and the body, not the Markov embedding
        logit = drafter.confidence_head(h, e if weights.confidence_to_markov else e.detach())
        bce = F.binary_cross_entropy_with_logits(logit, accept.to(logit.dtype), reduction="none")
        loss = loss + weights.confidence * (bce * row_w.to(bce.dtype)).sum()
    counted = torch.bincount(rows.slot, minlength=b)
    correct = torch.bincount(rows.slot[pred == lab], minlength=b)
    return LossOut(loss, float(row_w.double().sum()) * normaliser, correct, counted)


def explicit_rows(head: LMHead, ids: torch.Tensor) -> LMHead:
    """`head` with the zero lm_head rows among `ids` (and the first zero row, the target's argmax when every kept
    logit is negative) kept explicitly: weight row 0, exact logit 0, their own W2 row (module docstring)."""
    if not head.num_zero:
        return head
    ids = ids.to(head.remap.device)
    zero_ids = ids[head.remap[ids] < 0]
    extra = torch.unique(torch.cat([zero_ids, zero_ids.new_tensor([head.first_zero])]))
    keep = torch.unique(torch.cat([head.token_ids, extra]))  # sorted: torch's first-index rule among kept rows
    weight = head.weight.new_zeros(len(keep), head.weight.shape[1])
    bias = head.bias.new_zeros(len(keep)) if head.bias is not None else None
    old = head.remap[keep]
    weight[old >= 0] = head.weight[old[old >= 0]]
    if bias is not None:
        bias[old >= 0] = head.bias[old[old >= 0]]
    remap = torch.full_like(head.remap, -1)
    remap[keep] = torch.arange(len(keep), device=keep.device)
    zeros = torch.nonzero(remap < 0).squeeze(1)
    if not len(zeros):
        return LMHead(weight, bias, head.vocab_size, 0, -1, None, None)
    return LMHead(weight, bias, head.vocab_size, len(zeros), int(zeros[0]), keep, remap)


def supervised_tokens(paths: list, vocab_size: int) -> torch.Tensor:
    """The distinct token ids under the loss mask of the training shards (the labels DSpark's W2 rows can see)."""
    import numpy as np

    from dflash.core.io import iter_arrow_batches

    seen = np.zeros(vocab_size, dtype=bool)
    for path in paths:
        for batch in iter_arrow_batches(path):
            names = batch.schema.names
            ids = batch.column(names.index("input_ids")).flatten().to_numpy(zero_copy_only=False)
            mask = batch.column(names.index("loss_mask")).flatten().to_numpy(zero_copy_only=False) != 0
            seen[ids[mask & (ids >= 0) & (ids < vocab_size)]] = True
    return torch.from_numpy(np.flatnonzero(seen))


MARKOV_INIT_TOKENS = 4096  # the most frequent supervised tokens the count table spans (a dense SVD of its square)


@dataclass(frozen=True)
class PreviousTokenCounts:
    """How often each supervised token follows another in the training shards (adjacent, both under the loss mask,
    in one document), over the MARKOV_INIT_TOKENS most frequent of them."""

    tokens: torch.Tensor  # (n,) token ids, the rows and columns of counts
    counts: torch.Tensor  # (n, n) float64: counts[i, j] = times tokens[j] follows tokens[i]


def previous_token_counts(paths: list, vocab_size: int, limit: int = MARKOV_INIT_TOKENS) -> PreviousTokenCounts:
    """One scan of the training shards' input_ids and loss_mask (the table drafter.dspark.markov_init reads)."""
    import numpy as np

    from dflash.core.io import iter_arrow_batches

    keys = []
    for path in paths:
        for batch in iter_arrow_batches(path):
            names = batch.schema.names
            column = batch.column(names.index("input_ids"))
            ids = column.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
            mask = batch.column(names.index("loss_mask")).flatten().to_numpy(zero_copy_only=False) != 0
            starts = np.zeros(len(ids), dtype=bool)  # the first token of each document has no predecessor
            starts[np.cumsum(column.value_lengths().to_numpy(zero_copy_only=False))[:-1]] = True
            starts[:1] = True
            ok = mask & (ids >= 0) & (ids < vocab_size)
            pair = ok[1:] & ok[:-1] & ~starts[1:]
            keys.append(ids[:-1][pair] * vocab_size + ids[1:][pair])
    pairs, times = np.unique(np.concatenate(keys) if keys else np.zeros(0, np.int64), return_counts=True)
    prev, nxt = pairs // vocab_size, pairs % vocab_size
    frequency = np.bincount(np.concatenate([prev, nxt]), np.concatenate([times, times]), minlength=vocab_size)
    seen = np.flatnonzero(frequency)
    tokens = np.sort(seen[np.argsort(-frequency[seen], kind="stable")[:limit]])
    index = np.full(vocab_size, -1, dtype=np.int64)
    index[tokens] = np.arange(len(tokens))
    keep = (index[prev] >= 0) & (index[nxt] >= 0)
    counts = np.zeros((len(tokens), len(tokens)), dtype=np.float64)
    counts[index[prev[keep]], index[nxt[keep]]] = times[keep]
    return PreviousTokenCounts(tokens=torch.from_numpy(tokens), counts=torch.from_numpy(counts))


def init_markov_from_counts(w1: torch.Tensor, w2: torch.Tensor, table: PreviousTokenCounts) -> None:
    """W1 and W2 rows of the table's tokens such that W2 W1[prev] is the best rank-r approximation of
    log(1 + counts): zero for a successor never seen (what W2 = 0 gives every token), growing with the count, so
    the Markov head starts out knowing the table as far as its rank holds it (docs/results/successors.md). The
    other rows keep their initialisation (W2 = 0 there keeps the zero lm_head rows tied)."""
    if not len(table.tokens):
        return
    u, s, vh = torch.linalg.svd(torch.log1p(table.counts))
    r = min(w1.shape[1], len(s))
    root = s[:r].sqrt()
    with torch.no_grad():
        w1[table.tokens] = 0.0
        w2[table.tokens] = 0.0
        w1[table.tokens, :r] = (u[:, :r] * root).to(w1.dtype)
        w2[table.tokens, :r] = (vh[:r].T * root).to(w2.dtype)


def zero_rows_tied(head: LMHead, w2: torch.Tensor) -> bool:
    """The W2 rows of the zero lm_head rows are one shared row (the chunked loss's assumption; module docstring)."""
    if not head.num_zero:
        return True
    rows = w2.detach()[head.remap < 0]
    return bool((rows == rows[:1]).all())


__all__ = [
    "MARKOV_INIT_TOKENS",
    "DSparkRows",
    "PreviousTokenCounts",
    "dspark_loss",
    "dspark_rows",
    "explicit_rows",
    "init_markov_from_counts",
    "previous_token_counts",
    "supervised_tokens",
    "zero_rows_tied",
]
