"""DFlash2: an untrained DFlash2 equals the DFlash it starts from (same seed: same body, identity convs, zero
successor codebook), the grouped causal conv against its definition, and the selector loss against a direct
computation over the full vocabulary (zero lm_head rows included)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash.drafter.build import build_drafter
from dflash.drafter.dflash2 import grouped_causal_conv, selector_walk
from dflash.drafter.geometry import build_drafter_config
from dflash.drafter.model import block_labels
from dflash.drafter.session import DraftSession
from dflash.train.loss import LMHead, normaliser_share, slot_weights
from dflash.train.loss_dflash2 import candidates_and_labels, selector_loss
from tests.helpers.models import kind_drafter_params, small_qwen3_config


def _config(kind: str):
    changes = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6}
    return build_drafter_config(kind_drafter_params(kind, **changes), small_qwen3_config(4))


def test_an_untrained_dflash2_is_the_dflash_it_starts_from():
    torch.manual_seed(0)
    dflash = build_drafter(_config("dflash")).eval()
    torch.manual_seed(0)
    dflash2 = build_drafter(_config("dflash2")).eval()
    body = dflash.state_dict()
    assert all(torch.equal(dflash2.state_dict()[k], v) for k, v in body.items())  # the same body, same seed
    g = torch.Generator().manual_seed(1)
    S, anchors = 40, torch.tensor([3, 11, 20, 33])
    feats = torch.randn(S, 2 * 64, generator=g)
    embeds = torch.randn(anchors.numel() * 4, 64, generator=g)
    docs = torch.tensor([0] * 15 + [1] * 25)
    with torch.no_grad():
        assert torch.equal(dflash2(feats, embeds, anchors, docs), dflash(feats, embeds, anchors, docs))
    embed, head = torch.nn.Embedding(512, 64), torch.nn.Linear(64, 512, bias=False)
    torch.nn.init.normal_(head.weight, std=0.5)
    sessions = [DraftSession(m, embed, head) for m in (dflash, dflash2)]
    for s in sessions:
        s.extend(feats[:17])
    plain = sessions[0].draft(7, 17)
    hidden = sessions[1].draft_hidden(7, 17)[1:]
    walked, _ = selector_walk(dflash2, hidden, head(hidden), 7, lambda row, j: int(row.argmax()))
    assert walked == plain  # the zero successor codebook: the walk takes every slot's top-1, DFlash's draft


def test_the_grouped_causal_conv_is_its_definition():
    g = torch.Generator().manual_seed(0)
    rows, h, taps, gs, block = 12, 8, 3, 4, 4
    x = torch.randn(rows, h, generator=g, dtype=torch.float64)
    delta = torch.randn(rows, taps, h // gs, generator=g, dtype=torch.float64)
    base = torch.randn(taps, h, generator=g, dtype=torch.float64)
    want = torch.zeros_like(x)
    for i in range(rows):
        for c in range(h):
            for t in range(taps):
                if i % block >= t:  # never across a block start
                    want[i, c] += (base[t, c] + delta[i, t, c // gs]) * x[i - t, c]
    torch.testing.assert_close(grouped_causal_conv(x, delta, base, block, gs), want, rtol=1e-12, atol=1e-12)


V, H, K, B = 40, 16, 5, 4


def test_candidates_are_the_full_vocabulary_top_k_with_zero_rows_merged():
    g = torch.Generator().manual_seed(0)
    lm = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        lm.weight.copy_(torch.randn(V, H, generator=g))
        lm.weight[:, 0] = 3.0
        lm.weight[25:] = 0
    head = LMHead.from_linear(lm)
    h = torch.randn(30, H, generator=g) * 0.2
    h[::2, 0] = -1.0  # every other row: all kept logits far below 0, so the zero rows (logit 0) fill its top-K
    cand, labels = candidates_and_labels(h, h.flip(0), head, K, chunk=7)
    full = h @ lm.weight.T
    want = full.topk(K, dim=1)
    torch.testing.assert_close(full.gather(1, cand), want.values)  # the same K values, largest first
    assert (cand >= 25).any()  # the zero rows competed
    assert labels.tolist() == (h.flip(0) @ lm.weight.T).argmax(1).tolist()


class _Selector(torch.nn.Module):
    """What selector_loss reads of a DFlash2 drafter."""

    def __init__(self):
        super().__init__()
        from dflash.drafter.dflash2 import CandidateSelector

        self.sel = CandidateSelector(H, V, 4, K)
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in self.sel.parameters():
                p.copy_(torch.randn(p.shape, generator=g))


def test_selector_loss_equals_a_direct_top_k_cross_entropy():
    g = torch.Generator().manual_seed(0)
    lm = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        lm.weight.copy_(torch.randn(V, H, generator=g))
        lm.weight[30:] = 0
    head = LMHead.from_linear(lm)
    sel = _Selector().sel
    s, anchors = 30, torch.tensor([2, 8, 15, 24])
    ids = torch.randint(0, V, (s,), generator=g)
    mask = torch.ones(s, dtype=torch.bool)
    labels, valid = block_labels(ids, mask, anchors, B)
    hidden = torch.randn(anchors.numel() * B, H, generator=g, requires_grad=True)
    final = torch.randn(s, H, generator=g)
    w = slot_weights(B, 4.0)
    norm = normaliser_share(valid, w)
    loss, correct, counted = selector_loss(
        hidden,
        valid,
        head,
        selector=sel,
        input_ids=ids,
        anchors=anchors,
        target_hidden=final,
        slot_w=w,
        normaliser=norm,
        chunk_rows=3,
    )
    params = [hidden, *sel.parameters()]
    grads = torch.autograd.grad(loss, params)
    # direct: full logits, torch.topk, the label (the target's argmax) injected at rank K when missing
    idx = torch.nonzero(valid).squeeze(1)
    slot, rows = idx % B, anchors[idx // B] + idx % B - 1
    logits = hidden[idx] @ lm.weight.T
    cand = logits.detach().topk(K, dim=1).indices
    target = (final[rows] @ lm.weight.T).argmax(1)
    present = (cand == target[:, None]).any(1)
    cand[~present, -1] = target[~present]
    pos = (cand == target[:, None]).float().argmax(1)
    unary = logits.gather(1, cand)
    proj = hidden[idx] @ sel.hidden_projection.weight.T
    edge = ((sel.predecessor_codebook[ids[rows]] * proj)[:, None, :] * sel.successor_codebook[cand]).sum(-1)
    scores = unary + edge
    want = (F.cross_entropy(scores, pos, reduction="none") * w[slot] / norm).sum()
    want_grads = torch.autograd.grad(want, params)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    hit = (scores.argmax(1) == pos) & present
    assert correct.tolist() == torch.bincount(slot[hit], minlength=B).tolist()
    assert counted.tolist() == torch.bincount(slot, minlength=B).tolist()
    assert 0 < int(present.sum()) < len(present)  # both cases (label in the top-K or injected) occurred


@pytest.mark.parametrize("taps", [1, 2, 4])
def test_identity_convs_for_any_taps(taps):
    from dflash.drafter.dflash2 import GroupedCausalConv

    conv = GroupedCausalConv(16, taps, 4, 4)
    x = torch.randn(8, 16)
    y, coef = conv.prepare(x)
    assert torch.equal(y, x) and torch.equal(conv.finish(x, coef), x)
