"""LiLiCorr's training loss: DFlash's lm_head loss (dflash/train/loss.py block_loss, which makes the candidates the
correlator ranks) plus the correlator's transition loss, teacher-forced along the target's own greedy path.

For every block (anchor a) the lattice is built as at inference (dflash/drafter/lilicorr.py): drafted slot s
(k = s + 1 in the block) gets the K ids with the largest drafter logits over the whole vocabulary (no gradient
through the choice, chunk by chunk like the lm_head loss) and their full-vocabulary log-probabilities, the target's
input embedding of those ids, and the drafter's hidden state; the anchor is the drafter's fused context feature
(fc -> hidden_norm) at a - 1, in the anchor's document (else none).
  label   the target's greedy choice at a + k (its argmax at row a + k - 1): what greedy verification accepts.
          A slot whose label is not among its K candidates has no CE term: the walk cannot draft it whatever the
          scores (the lm_head loss is what brings it into the top-K). Injecting it in the K-th place, as our DFlash2
          loss does, taught the correlator "prefer the last candidate" while the lm_head was weak (3.5% teacher-forced
          accuracy, below the lm_head's top-1 at 8%, on tests/integration/test_train_lilicorr.py's data).
  slot 0  CE over the K start scores (anchor -> candidate) toward the label's index;
  slot s  CE over the K transition scores after the LABEL's index at slot s-1 (teacher forcing: the walk's
          predecessor when the draft so far was accepted) toward the label's index; the slot counts when slot
          s-1 was a valid slot whose label was a candidate (a draftable prefix).
  loss    correlator x sum_s w_k CE_s / normaliser, w_k the decay weights of the lm_head loss.
Gradients reach the drafter through its hidden states (the pass projection) and its fused context feature (the
anchor), and the correlator's own weights; the candidate log-probabilities and embeddings are inputs (no gradient:
the lm_head loss trains the logits they come from). Accuracy per slot (the trainer's acc_k and tau_hat): over the
counted slots, the label is a candidate and the row's argmax is its index: what the walk drafts after a correct
prefix (a label outside the candidates counts as wrong).

Legend: N blocks, B block size, n = B-1 drafted slots, K candidate_top_k, H hidden, S row positions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dflash.core.params import LiLiCorrLossParams
from dflash.train.loss import LMHead, LossOut, block_loss
from dflash.train.loss_dflash2 import candidates_and_labels


@torch.no_grad()
def candidate_log_probs(hidden: torch.Tensor, head: LMHead, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """hidden (M, H), ids (M, K) -> the full-vocabulary log-softmax of the drafter's logits at ids (M, K) float32
    (an exactly-zero lm_head row has logit 0)."""
    out = torch.empty(ids.shape, dtype=torch.float32, device=hidden.device)
    for s in range(0, hidden.shape[0], chunk):
        t = min(hidden.shape[0], s + chunk)
        z = head.logits(hidden[s:t])  # (c, R)
        lse = head.lse_and_argmax(z)[0]
        rows = head.kept_index(ids[s:t])
        picked = z.gather(1, rows.clamp(min=0))
        out[s:t] = torch.where(rows >= 0, picked, torch.zeros_like(picked)) - lse[:, None]
    return out


def anchor_context(
    drafter: torch.nn.Module, features: torch.Tensor, anchors: torch.Tensor, doc_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused context feature at a - 1 (N, H) and whether it exists in the anchor's document (N,) bool."""
    before = (anchors - 1).clamp(min=0)
    valid = (anchors >= 1) & (doc_ids[before] == doc_ids[anchors])
    return drafter.context(features[before]), valid


def correlator_loss(
    hidden: torch.Tensor,
    valid: torch.Tensor,
    head: LMHead,
    *,
    drafter: torch.nn.Module,
    embed: Callable[[torch.Tensor], torch.Tensor],
    features: torch.Tensor,
    doc_ids: torch.Tensor,
    anchors: torch.Tensor,
    chunk_rows: int,
    target_hidden: torch.Tensor,
    slot_w: torch.Tensor,
    normaliser: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden (N*B, H) of the blocks at `anchors` -> the transition term (module docstring) summed with the slot
    weights / normaliser, and per block slot the rows it got right and the rows it counted ((B,) long each)."""
    cor = drafter.lilicorr
    b, k, n_blocks = slot_w.numel(), cor.top_k, anchors.numel()
    h = hidden.view(n_blocks, b, -1)[:, 1:]  # (N, n, H)
    flat = h.reshape(-1, h.shape[-1])
    ok = valid.view(n_blocks, b)[:, 1:]  # (N, n)
    rows = (anchors[:, None] + torch.arange(b - 1, device=anchors.device)).clamp(max=target_hidden.shape[0] - 1)
    chunk = max(1, chunk_rows)
    cand, label = candidates_and_labels(flat.detach(), target_hidden[rows.flatten()], head, k, chunk)
    cand, label = cand.view(n_blocks, b - 1, k), label.view(n_blocks, b - 1)
    hit = cand == label[..., None]
    present = hit.any(dim=-1) & ok  # the label is one of the slot's candidates
    target = hit.float().argmax(dim=-1)  # its index there (0 where absent: never read then)
    log_probs = candidate_log_probs(flat.detach(), head, cand.view(-1, k), chunk).view(n_blocks, b - 1, k)
    with torch.no_grad():
        token_embeds = embed(cand)
    anchor, anchor_ok = anchor_context(drafter, features, anchors, doc_ids)
    start, pairs = cor(token_embeds, log_probs, h, anchor, anchor_ok)
    # the logits of slot s given its teacher-forced predecessor: start for s = 0, pairs[s-1, target[s-1]] after
    prev = target[:, :-1, None, None].expand(-1, -1, 1, k)
    logits = torch.cat([start[:, None], pairs.gather(2, prev)[:, :, 0]], dim=1).float()  # (N, n, K)
    counted_rows = ok & torch.cat([torch.ones_like(ok[:, :1]), present[:, :-1]], dim=1)  # the prefix was draftable
    ce = torch.logsumexp(logits, dim=-1) - logits.gather(-1, target[..., None])[..., 0]
    w = slot_w.to(h.device)[1:].expand_as(ce) / normaliser
    slot = torch.arange(1, b, device=h.device).expand_as(ce)
    loss = (ce * w)[counted_rows & present].sum()
    right = counted_rows & present & (logits.argmax(dim=-1) == target)
    return loss, torch.bincount(slot[right], minlength=b), torch.bincount(slot[counted_rows], minlength=b)


def lilicorr_loss(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor,
    head: LMHead,
    *,
    weights: LiLiCorrLossParams,
    loss_target: str = "tokens",
    **inputs: Any,
) -> LossOut:
    """The lm_head loss (block_loss, decay weights) + weights.correlator x the transition loss; accuracy = the
    correlator's (module docstring). `inputs`: correlator_loss's keyword arguments, passed on as they are (the
    lm_head loss reads its slot_w, normaliser, chunk_rows, target_hidden and anchors)."""
    shared = {k: inputs[k] for k in ("slot_w", "normaliser", "chunk_rows", "target_hidden", "anchors")}
    unary = block_loss(hidden, labels, valid, head, **shared, loss_target=loss_target)
    term, correct, counted = correlator_loss(hidden, valid, head, **inputs)
    return LossOut(unary.loss + weights.correlator * term.to(unary.loss.dtype), unary.weight_sum, correct, counted)


__all__ = ["anchor_context", "candidate_log_probs", "correlator_loss", "lilicorr_loss"]
