"""DFlash2's training loss: DFlash's lm_head loss (dflash/train/loss.py block_loss, the "unary" scores) plus the
candidate selector's top-K cross-entropy, as the public DFlash2 trainers define it.

Per valid drafted slot k of the block at anchor a (labels and valid flags: model.block_labels):
  candidates  the K tokens with the largest drafter logits over the whole vocabulary (lm_head's top-K, no
              gradient through the choice), found chunk by chunk like the lm_head loss (no (M, V) tensor);
  label       the target's own greedy choice at a + k (its argmax at row a + k - 1): what greedy verification
              accepts. When it is not among the K candidates it replaces the K-th (the walk could never pick it,
              but the selector still learns to score it);
  predecessor teacher-forced: the token at a + k - 1 (the anchor for k = 1), the context of that argmax;
  scores      s_c = u_c + < P[prev] * (W h), S[c] >  (dflash/drafter/dflash2.py), u_c = the drafter's logit of c;
  loss        selector x w_k x CE_K(s, label), w_k the decay weights / normaliser of the lm_head loss.
Accuracy per slot (the trainer's acc_k and tau_hat): the selector's teacher-forced argmax is the label AND the
label was a real candidate: what the walk would draft given a correct prefix.

The unary logits u_c are gathered rows of the frozen lm_head (`_CandidateLogits`: h . W[c] + b[c], computed in
chunks and recomputed in backward, so no (M, K, H) tensor is kept); an exactly-zero lm_head row has logit 0.

Legend: M valid slots, K selector_top_k, H hidden, R kept lm_head rows, r selector_rank.
"""

from __future__ import annotations

import torch

from dflash.core.params import DFlash2LossParams
from dflash.train.loss import LMHead, LossOut, block_loss, target_rows


def _zero_ids(head: LMHead, k: int) -> torch.Tensor:
    """The k smallest ids of exactly-zero lm_head rows (logit 0): candidates when kept logits are below 0."""
    return torch.nonzero(head.remap < 0).squeeze(1)[:k]


@torch.no_grad()
def candidates_and_labels(
    hidden: torch.Tensor, target_hidden: torch.Tensor, head: LMHead, top_k: int, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden (M, H) drafter slots, target_hidden (M, H) the target's final states at their rows -> the drafter's
    top-K vocabulary ids (M, K) (largest first) and the target's argmax (M,), chunk by chunk."""
    m = hidden.shape[0]
    cand = torch.empty(m, top_k, dtype=torch.long, device=hidden.device)
    labels = torch.empty(m, dtype=torch.long, device=hidden.device)
    zeros = _zero_ids(head, top_k) if head.num_zero else None
    for s in range(0, m, chunk):
        t = min(m, s + chunk)
        z = head.logits(hidden[s:t])
        vals, idx = torch.topk(z, min(top_k, z.shape[1]), dim=1)
        ids = head.token_ids[idx] if head.token_ids is not None else idx
        if zeros is not None:  # merge the zero rows (logit exactly 0) into the ranking
            vals = torch.cat([vals, vals.new_zeros(t - s, len(zeros))], dim=1)
            ids = torch.cat([ids, zeros.expand(t - s, -1)], dim=1)
            vals, order = torch.topk(vals, top_k, dim=1)
            ids = ids.gather(1, order)
        cand[s:t] = ids
        labels[s:t] = head.lse_and_argmax(head.logits(target_hidden[s:t]))[1]
    return cand, labels


class _CandidateLogits(torch.autograd.Function):
    """u[i, c] = h_i . W[ids[i, c]] + b[ids[i, c]] (0 for a zero lm_head row), gradient to h only (the head is frozen)."""

    @staticmethod
    def forward(ctx, h, head, ids, chunk):
        rows = head.kept_index(ids)  # (M, K), -1 for zero rows
        out = torch.empty(ids.shape, dtype=torch.float32, device=h.device)
        for s in range(0, h.shape[0], chunk):
            t = min(h.shape[0], s + chunk)
            r = rows[s:t]
            w = head.weight[r.clamp(min=0)]  # (c, K, H)
            u = torch.einsum("ch,ckh->ck", h[s:t].to(w.dtype), w).float()
            if head.bias is not None:
                u = u + head.bias[r.clamp(min=0)].float()
            out[s:t] = torch.where(r >= 0, u, torch.zeros_like(u))
        ctx.head, ctx.chunk = head, chunk
        ctx.save_for_backward(rows)
        ctx.h_dtype = h.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        (rows,) = ctx.saved_tensors
        head, chunk = ctx.head, ctx.chunk
        g = torch.where(rows >= 0, grad, torch.zeros_like(grad))
        out = []
        for s in range(0, rows.shape[0], chunk):
            t = min(rows.shape[0], s + chunk)
            w = head.weight[rows[s:t].clamp(min=0)]
            out.append(torch.einsum("ck,ckh->ch", g[s:t].to(w.dtype), w))
        return torch.cat(out).to(ctx.h_dtype) if out else grad.new_zeros(0), None, None, None


def selector_loss(
    hidden: torch.Tensor,
    valid: torch.Tensor,
    head: LMHead,
    *,
    selector: torch.nn.Module,
    input_ids: torch.Tensor,
    anchors: torch.Tensor,
    target_hidden: torch.Tensor,
    slot_w: torch.Tensor,
    normaliser: float,
    chunk_rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The selector term (module docstring) over hidden (N*B, H) -> (weighted loss sum / normaliser, correct (B,),
    counted (B,))."""
    b = slot_w.numel()
    idx = torch.nonzero(valid).squeeze(1)
    slot = idx % b
    rows = target_rows(anchors.to(idx.device), b, idx)
    h = hidden[idx]
    chunk = max(1, chunk_rows)
    cand, label = candidates_and_labels(h.detach(), target_hidden[rows], head, selector.top_k, chunk)
    hit = cand == label[:, None]
    present = hit.any(dim=1)
    cand[:, -1] = torch.where(present, cand[:, -1], label)  # a missing label takes the K-th place
    target = torch.where(present, hit.float().argmax(dim=1), torch.full_like(label, selector.top_k - 1))
    unary = _CandidateLogits.apply(h, head, cand, chunk)  # (M, K)
    prev = input_ids[rows]  # the token at a + k - 1
    scores = selector.scores(cand, unary, h, prev[:, None])[:, 0].float()  # (M, K)
    ce = torch.logsumexp(scores, dim=1) - scores.gather(1, target[:, None])[:, 0]
    w = slot_w.to(h.device)[slot] / normaliser
    correct = torch.bincount(slot[(scores.argmax(dim=1) == target) & present], minlength=b)
    return (ce * w).sum(), correct, torch.bincount(slot, minlength=b)


def dflash2_loss(
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
    weights: DFlash2LossParams,
    loss_target: str = "tokens",
) -> LossOut:
    """The lm_head loss (block_loss, decay weights) + weights.selector x the selector loss; accuracy = the
    selector's (module docstring)."""
    unary = block_loss(
        hidden,
        labels,
        valid,
        head,
        slot_w=slot_w,
        normaliser=normaliser,
        chunk_rows=chunk_rows,
        loss_target=loss_target,
        target_hidden=target_hidden,
        anchors=anchors,
    )
    sel, correct, counted = selector_loss(
        hidden,
        valid,
        head,
        selector=drafter.candidate_selector,
        input_ids=input_ids,
        anchors=anchors,
        target_hidden=target_hidden,
        slot_w=slot_w,
        normaliser=normaliser,
        chunk_rows=chunk_rows,
    )
    return LossOut(unary.loss + weights.selector * sel.to(unary.loss.dtype), unary.weight_sum, correct, counted)


__all__ = ["candidates_and_labels", "dflash2_loss", "selector_loss"]
