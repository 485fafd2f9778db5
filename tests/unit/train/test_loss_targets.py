"""The loss targets (`train.loss_target`) and slot weightings (`train.position_weighting`) of dflash/train/loss.py
against direct full-vocabulary computations: the target's argmax and distribution taken from its own full logits
on a tiny model, the chunked KL against torch's KL over the whole vocabulary, D-PACE on a hand-computed block."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3ForCausalLM

from dflash.train.features import TargetFeatures
from dflash.train.loss import LMHead, block_loss, dpace_weights, normaliser_share, slot_weights, target_rows
from tests.helpers.models import small_qwen3_config

B = 4


def _tiny(vocab=300, hidden=32):
    torch.manual_seed(0)
    return Qwen3ForCausalLM(small_qwen3_config(layers=3, hidden=hidden, vocab=vocab, tie_word_embeddings=False)).eval()


def _blocks(seq_len: int, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    anchors = torch.randperm(seq_len - 1, generator=g)[:n].sort().values
    pos = anchors[:, None] + torch.arange(B)
    valid = (pos < seq_len) & (torch.rand(n, B, generator=g) > 0.15)
    valid[:, 0] = False
    return anchors, valid.flatten()


def test_target_rows_are_the_positions_before_each_label():
    anchors = torch.tensor([3, 10])
    idx = torch.tensor([1, 2, 3, 5, 7])  # block 0 slots 1-3, block 1 slots 1 and 3
    assert target_rows(anchors, B, idx).tolist() == [3, 4, 5, 10, 12]


@pytest.mark.parametrize("loss_target", ["target_argmax", "target_kl"])
def test_target_losses_equal_a_direct_computation_from_the_full_logits(loss_target):
    model = _tiny()
    docs = [torch.randint(0, 300, (23,), generator=torch.Generator().manual_seed(1)), torch.randint(0, 300, (17,))]
    ids = torch.cat(docs)
    feats = TargetFeatures(model, [0, 1], 3, batch_tokens=64, final=True)
    _, final = feats(ids, [0, 23], [23, 17])
    with torch.no_grad():  # each document alone, the full model: its logits over the whole vocabulary
        full = torch.cat([model(d[None]).logits[0] for d in docs])
    head = LMHead.from_linear(model.lm_head)
    torch.testing.assert_close(head.full_logits(final), full, rtol=1e-5, atol=1e-5)

    anchors, valid = _blocks(23, 8)  # blocks of the first document
    n = anchors.numel()
    labels = torch.randint(0, 300, (n * B,))  # dataset tokens: ignored by the target losses
    h = torch.randn(n * B, 32, requires_grad=True)
    w = slot_weights(B, 4.0)
    out = block_loss(
        h,
        labels,
        valid,
        head,
        slot_w=w,
        normaliser=2.5,
        chunk_rows=3,
        loss_target=loss_target,
        target_hidden=final,
        anchors=anchors,
    )
    out.loss.backward()
    grad, h.grad = h.grad.clone(), None

    idx = torch.nonzero(valid).squeeze(1)
    rows = anchors[idx // B] + idx % B - 1
    p_logits = full[rows]
    q_logits = h[idx] @ model.lm_head.weight.T
    if loss_target == "target_argmax":
        per_row = torch.nn.functional.cross_entropy(q_logits, p_logits.argmax(1), reduction="none")
    else:
        per_row = torch.nn.functional.kl_div(
            q_logits.log_softmax(1), p_logits.log_softmax(1), log_target=True, reduction="none"
        ).sum(1)
    ref = (per_row * w[idx % B]).sum() / 2.5
    ref.backward()
    torch.testing.assert_close(out.loss, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, h.grad, rtol=1e-4, atol=1e-6)
    hits = q_logits.argmax(1) == p_logits.argmax(1)  # accuracy is against the target's greedy choice
    assert torch.equal(out.correct, torch.bincount((idx % B)[hits], minlength=B))


def _zero_row_head(vocab=300, hidden=16):
    torch.manual_seed(3)
    lin = torch.nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        lin.weight[90:260] = 0  # zero rows, as the demo's tiny target has for tokens it never saw
    return lin


@pytest.mark.parametrize("zero_rows", [False, True])
def test_chunked_kl_equals_the_unchunked_full_vocabulary_kl(zero_rows):
    lin = _zero_row_head() if zero_rows else torch.nn.Linear(16, 300, bias=False)
    head = LMHead.from_linear(lin)
    assert (head.num_zero > 0) == zero_rows
    n = 12
    anchors = torch.arange(n) * 2
    target_h = torch.randn(n * 2 + B, 16) * 3
    valid = torch.ones(n * B, dtype=torch.bool)
    valid.view(n, B)[:, 0] = False
    labels = torch.zeros(n * B, dtype=torch.long)
    h = torch.randn(n * B, 16) * 3
    w = slot_weights(B, 4.0)
    losses, grads = [], []
    for chunk in (1, 5, 10_000):
        x = h.clone().requires_grad_()
        out = block_loss(
            x,
            labels,
            valid,
            head,
            slot_w=w,
            normaliser=1.0,
            chunk_rows=chunk,
            loss_target="target_kl",
            target_hidden=target_h,
            anchors=anchors,
        )
        out.loss.backward()
        losses.append(out.loss.detach())
        grads.append(x.grad)
    x = h.clone().requires_grad_()
    idx = torch.nonzero(valid).squeeze(1)
    p = target_h[anchors[idx // B] + idx % B - 1] @ lin.weight.T
    q = x[idx] @ lin.weight.T
    ref = (
        torch.nn.functional.kl_div(q.log_softmax(1), p.log_softmax(1), log_target=True, reduction="none").sum(1)
        * w[idx % B]
    ).sum()
    ref.backward()
    for loss, grad in zip(losses, grads, strict=True):
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad, x.grad, rtol=1e-4, atol=1e-6)


def test_dpace_weights_match_the_hand_example():
    # Block of 4 (anchor + 3 slots). CE = ln 2, ln 4, 0 -> confidence 1/2, 1/4, 1 -> smoothed (alpha 0.5)
    # 0.75, 0.625, 1.0; reach products 0.75, 0.46875, 0.46875; w_j = sum of the reach products from j on.
    ce = torch.tensor([[0.0, torch.log(torch.tensor(2.0)), torch.log(torch.tensor(4.0)), 0.0]])
    valid = torch.tensor([[False, True, True, True]])
    w = dpace_weights(ce, valid)
    assert w[0].tolist() == pytest.approx([0.0, 1.6875, 0.9375, 0.46875])
    # an invalid slot ends the chain: the slots after it weigh 0, those before it lose its terms
    w = dpace_weights(ce, torch.tensor([[False, True, False, True]]))
    assert w[0].tolist() == pytest.approx([0.0, 0.75, 0.0, 0.0])


def test_dpace_loss_uses_detached_weights_normalised_by_the_valid_slots():
    lin = torch.nn.Linear(16, 300, bias=False)
    head = LMHead.from_linear(lin)
    n = 10
    valid = torch.rand(n * B, generator=torch.Generator().manual_seed(5)) > 0.1
    valid.view(n, B)[:, 0] = False
    labels = torch.randint(0, 300, (n * B,))
    h = torch.randn(n * B, 16, requires_grad=True)
    norm = normaliser_share(valid, slot_weights(B, 4.0), "dpace")
    assert norm == float(valid.sum())
    out = block_loss(
        h, labels, valid, head, slot_w=slot_weights(B, 4.0), normaliser=norm, chunk_rows=7, weighting="dpace"
    )
    out.loss.backward()
    grad, h.grad = h.grad.clone(), None
    ce = torch.nn.functional.cross_entropy(h @ lin.weight.T, labels, reduction="none")
    w = dpace_weights(ce.detach().view(n, B), valid.view(n, B)).flatten().float()
    ref = (ce * w * valid).sum() / norm
    ref.backward()
    torch.testing.assert_close(out.loss, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, h.grad, rtol=1e-4, atol=1e-7)
    assert out.weight_sum == pytest.approx(float((w * valid).sum()), rel=1e-5)
