"""DSpark: its slot layout, its chunked loss against a direct full-vocabulary computation (zero lm_head rows
included) and the Markov walk. Training through the trainer: tests/integration/test_train_kinds.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash.core.params import DSparkLossParams
from dflash.drafter.dspark import ConfidenceHead, MarkovHead, markov_walk
from dflash.drafter.model import block_labels
from dflash.train.loss import LMHead, normaliser_share, slot_weights
from dflash.train.loss_dspark import dspark_loss, dspark_rows, explicit_rows, zero_rows_tied

V, H, R, B, FIRST_ZERO = 40, 16, 4, 4, 25


def test_draft_position_d_comes_from_query_slot_d_minus_1():
    anchors = torch.tensor([2, 9])
    valid = torch.zeros(2 * B, dtype=torch.bool)
    valid[[1, 2, 3, 5, 7]] = True  # block 0: d = 1, 2, 3; block 1: d = 1, 3
    rows = dspark_rows(valid, anchors, B)
    assert rows.slot.tolist() == [1, 2, 3, 1, 3]
    assert rows.hidden_row.tolist() == [0, 1, 2, 3, 5]  # B - 1 = 3 query rows a block
    assert rows.target_row.tolist() == [2, 3, 4, 9, 11]  # a + d - 1: the target's prediction and the predecessor


class _Heads(torch.nn.Module):
    """What dspark_loss reads of a DSpark drafter: its Markov and confidence heads."""

    def __init__(self):
        super().__init__()
        self.markov_head = MarkovHead(V, R)
        self.confidence_head = ConfidenceHead(H, R)


def _setup(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lm = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        lm.weight.copy_(torch.randn(V, H, generator=g))
        lm.weight[FIRST_ZERO:] = 0  # exactly-zero rows: the reduced softmax path
    heads = _Heads()
    with torch.no_grad():
        heads.markov_head.markov_w1.weight.copy_(torch.randn(V, R, generator=g))
        w2 = torch.randn(V, R, generator=g)
        w2[FIRST_ZERO:] = w2[FIRST_ZERO]  # tied, as training keeps them (module docstring of loss_dspark)
        heads.markov_head.markov_w2.weight.copy_(w2)
        heads.confidence_head.proj.weight.copy_(torch.randn(1, H + R, generator=g) * 0.3)
        heads.confidence_head.proj.bias.fill_(0.1)
    n_blocks, s = 5, 30
    ids = torch.randint(0, FIRST_ZERO, (s,), generator=g)
    ids[7] = FIRST_ZERO + 3  # a label in a zero row
    mask = torch.ones(s, dtype=torch.bool)
    mask[:3] = False
    anchors = torch.tensor([3, 5, 11, 20, 27])
    labels, valid = block_labels(ids, mask, anchors, B)
    hidden = torch.randn(n_blocks * (B - 1), H, generator=g, requires_grad=True)
    final = torch.randn(s, H, generator=g)
    return lm, heads, ids, anchors, labels, valid, hidden, final


def _direct(lm, heads, ids, anchors, labels, valid, hidden, final, w, mode):
    """The DSpark loss written plainly over the full vocabulary (autograd does the gradients)."""
    rows = dspark_rows(valid, anchors, B)
    h = hidden[rows.hidden_row]
    e = heads.markov_head.embed(ids[rows.target_row])
    z = h @ lm.weight.T + e @ heads.markov_head.markov_w2.weight.T
    zp = final[rows.target_row] @ lm.weight.T
    logq, logp = F.log_softmax(z, -1), F.log_softmax(zp, -1)
    q, p = logq.exp(), logp.exp()
    label = labels[rows.idx] if mode == "tokens" else zp.argmax(-1)
    first = (p * (logp - logq)).sum(-1) if mode == "target_kl" else -logq.gather(1, label[:, None])[:, 0]
    l1 = (q - p).abs().sum(-1)
    accept = (1 - l1 / 2).detach()
    bce = F.binary_cross_entropy_with_logits(heads.confidence_head(h, e), accept, reduction="none")
    row_w = w[rows.slot]
    return ((0.1 * first + 0.9 * l1 + 1.0 * bce) * row_w).sum(), (q.argmax(-1) == label), rows.slot


def _run_loss(setup: tuple, head, w, norm, *, chunk: int, weights: DSparkLossParams, mode: str = "tokens"):
    """dspark_loss over _setup()'s tensors with the given head, slot weights, normaliser, chunk and weights."""
    _, heads, ids, anchors, labels, valid, hidden, final = setup
    return dspark_loss(
        hidden,
        labels,
        valid,
        head,
        drafter=heads,
        input_ids=ids,
        anchors=anchors,
        target_hidden=final,
        slot_w=w,
        normaliser=norm,
        chunk_rows=chunk,
        weights=weights,
        loss_target=mode,
    )


@pytest.mark.parametrize("mode", ["tokens", "target_argmax", "target_kl"])
def test_chunked_loss_equals_the_direct_full_vocabulary_loss(mode):
    setup = _setup()
    lm, heads, ids, anchors, labels, valid, hidden, final = setup
    full = LMHead.from_linear(lm)
    head = explicit_rows(full, labels[valid])  # label 28 is a zero row: it gets its own W2 row
    assert full.num_zero == V - FIRST_ZERO and head.num_zero == V - FIRST_ZERO - 2  # 28 and the first zero row
    assert head.first_zero == FIRST_ZERO + 1 and zero_rows_tied(head, heads.markov_head.markov_w2.weight)
    w = slot_weights(B, 4.0)
    norm = normaliser_share(valid, w)
    params = [hidden, *heads.parameters()]
    want, hits, slot = _direct(lm, heads, ids, anchors, labels, valid, hidden, final, w / norm, mode)
    want_grads = torch.autograd.grad(want, params)
    weights = DSparkLossParams(ce=0.1, l1=0.9, confidence=1.0, confidence_to_markov=True)
    for chunk in (1, 4, 1000):
        out = _run_loss(setup, head, w, norm, chunk=chunk, weights=weights, mode=mode)
        grads = torch.autograd.grad(out.loss, params)
        torch.testing.assert_close(out.loss, want, rtol=1e-5, atol=1e-6)
        for a, b in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        assert out.correct.tolist() == torch.bincount(slot[hits], minlength=B).tolist()
        assert out.counted.tolist() == torch.bincount(slot, minlength=B).tolist()
        assert out.weight_sum == pytest.approx(norm)
    w2_grad = want_grads[2]  # markov_w2: the zero rows that are no label get one gradient, so they stay tied
    tied = [t for t in range(FIRST_ZERO, V) if t not in (FIRST_ZERO, 28)]
    assert torch.equal(w2_grad[tied], w2_grad[tied[:1]].expand(len(tied), -1))
    # the label's row (a data token in mode tokens; the other modes' labels are the target's argmaxes, all kept)
    assert torch.equal(w2_grad[28], w2_grad[tied[0]]) == (mode != "tokens")  # why a label's row is explicit


def test_without_confidence_to_markov_the_confidence_term_leaves_w1_to_the_ce_and_l1_terms():
    """confidence_to_markov false: the same loss, and the BCE's gradient reaches the body's hidden state and its own
    projection as before but not the Markov embedding W1 (which then learns what CE + L1 alone teach it)."""
    setup = _setup()
    lm, heads, ids, anchors, labels, valid, hidden, final = setup
    head = explicit_rows(LMHead.from_linear(lm), labels[valid])
    w = slot_weights(B, 4.0)
    params = [hidden, *heads.parameters()]  # hidden, w1, w2, proj.weight, proj.bias

    def run(confidence: float, to_markov: bool):
        weights = DSparkLossParams(ce=0.1, l1=0.9, confidence=confidence, confidence_to_markov=to_markov)
        out = _run_loss(setup, head, w, normaliser_share(valid, w), chunk=4, weights=weights)
        return out.loss, torch.autograd.grad(out.loss, params, allow_unused=True)

    loss_in, into = run(1.0, True)
    loss_cut, cut = run(1.0, False)
    _, without = run(0.0, True)
    assert torch.equal(loss_cut, loss_in)
    torch.testing.assert_close(cut[1], without[1], rtol=0, atol=0)  # W1: the CE and L1 terms only
    assert not torch.allclose(into[1], without[1])  # the BCE does reach W1 when allowed
    for i in (0, 3, 4):  # the body's hidden state and the confidence projection: as before
        torch.testing.assert_close(cut[i], into[i], rtol=0, atol=0)


def test_the_markov_walk_feeds_each_draft_back_and_starts_at_the_anchor():
    heads = _Heads()
    with torch.no_grad():
        heads.markov_head.markov_w1.weight.copy_(torch.eye(V, R))  # prev t (< R) -> unit vector t
        heads.markov_head.markov_w2.weight.zero_()
        for t in range(R):  # after token t the bias favours token t + 1 strongly
            heads.markov_head.markov_w2.weight[t + 1, t] = 100.0
    base = torch.zeros(3, V)
    drafts, logits = markov_walk(heads, base, 0, lambda row, j: int(row.argmax()))
    assert drafts == [1, 2, 3]  # anchor 0 -> 1 -> 2 -> 3: each step conditioned on the previous draft
    assert logits.shape == (3, V) and float(logits[0, 1]) == 100.0
    untrained = MarkovHead(V, R)
    untrained.reset_parameters(0.02)  # W2 = 0: the walk is the backbone's argmax
    base = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    heads.markov_head = untrained
    assert markov_walk(heads, base, 5, lambda row, j: int(row.argmax()))[0] == base.argmax(-1).tolist()


def test_previous_token_counts_pair_supervised_neighbours_within_a_document(tmp_path):
    """Pairs need both tokens under the loss mask and in one document; the limit keeps the most frequent tokens."""
    from dflash.train.data import write_shard
    from dflash.train.loss_dspark import previous_token_counts

    docs = [
        ([1, 2, 3, 4, 3, 4], [0, 0, 1, 1, 1, 1], 2),  # 3->4 twice, 4->3 once; 2->3 crosses the mask
        ([4, 3, 4, 5], [1, 1, 1, 1], 0),  # 4->3, 3->4, 4->5; its 4 does not follow the 4 that ends the first
    ]
    write_shard(tmp_path / "shard-00000.arrow", docs[:1], "a")
    write_shard(tmp_path / "shard-00001.arrow", docs[1:], "b")
    paths = sorted(tmp_path.glob("*.arrow"))
    table = previous_token_counts(paths, vocab_size=10)
    assert table.tokens.tolist() == [3, 4, 5]
    assert table.counts.tolist() == [[0, 3, 0], [2, 0, 1], [0, 0, 0]]
    top = previous_token_counts(paths, vocab_size=10, limit=2)  # 5 is the least frequent: its pair goes
    assert top.tokens.tolist() == [3, 4] and top.counts.tolist() == [[0, 3], [2, 0]]


def test_the_count_initialised_markov_head_picks_each_tokens_most_frequent_successor():
    """At a rank that holds the table, argmax W2 W1[prev] is the table's choice; other rows keep their init."""
    from dflash.train.loss_dspark import PreviousTokenCounts, init_markov_from_counts

    counts = torch.tensor([[0, 5, 1, 0], [2, 0, 0, 7], [0, 0, 0, 3], [4, 1, 1, 0]], dtype=torch.float64)
    tokens = torch.tensor([3, 5, 6, 9])
    head = MarkovHead(vocab=12, rank=4)
    head.reset_parameters(0.02)
    before = head.markov_w1.weight.detach().clone()
    init_markov_from_counts(head.markov_w1.weight, head.markov_w2.weight, PreviousTokenCounts(tokens, counts))
    with torch.no_grad():
        best = head.bias(head.embed(tokens)).argmax(1)
    assert best.tolist() == tokens[counts.argmax(1)].tolist()
    others = [i for i in range(12) if i not in tokens.tolist()]
    assert torch.equal(head.markov_w1.weight[others], before[others])
    assert not head.markov_w2.weight[others].any()  # W2 = 0 outside: the zero lm_head rows stay tied
    low = MarkovHead(vocab=12, rank=1)  # rank 1 cannot hold this table: one direction for every row
    init_markov_from_counts(low.markov_w1.weight, low.markov_w2.weight, PreviousTokenCounts(tokens, counts))
    with torch.no_grad():
        assert low.bias(low.embed(tokens)).argmax(1).unique().numel() == 1
