"""The pruned draft vocabulary (dflash/drafter/vocab.py): the build rule, the d2t / t2d tables as vLLM reads them,
coverage, the refusal of kinds without a pruned-vocabulary path, the loss over the draft vocabulary (equal to the
full-vocabulary loss when the vocabulary holds every token, equal to a direct computation over its rows when it
does not), label masking, and the export round trip."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash.core.errors import ParamsError
from dflash.drafter.draft_head import DraftHead
from dflash.drafter.geometry import build_drafter_config
from dflash.drafter.vocab import (
    TokenCounts,
    coverage,
    coverage_table,
    d2t_table,
    ids_from_d2t,
    select,
    t2d_table,
)
from dflash.train.loss import LMHead, block_loss, slot_weights
from tests.helpers import repo_params
from tests.helpers.models import small_qwen3_config

V, H, B = 50, 16, 4


def test_select_takes_the_added_tokens_then_the_most_frequent_then_fills():
    counts = {7: 5, 3: 9, 20: 5, 41: 1}
    ids = select(counts, always_in=[45, 46], size=5, vocab_size=V)
    assert ids.tolist() == [3, 7, 20, 45, 46]  # 3 (9), then 7 / 20 (5 each, smaller id first); sorted
    filled = select(counts, [45], 7, V)
    assert filled.tolist() == [0, 1, 3, 7, 20, 41, 45]  # 5 seen + 45, then the smallest unused ids
    with pytest.raises(ValueError, match="below the tokenizer's 2 added tokens"):
        select(counts, [45, 46], 1, V)


def test_coverage_is_the_share_of_loss_tokens_inside():
    counts = {3: 9, 7: 5, 20: 5, 41: 1}
    assert coverage(counts, np.array([3, 7])) == pytest.approx(14 / 20)
    table = coverage_table(TokenCounts(counts, ()), [1, 2, 3, 4], V)
    assert table == {"1": 0.45, "2": 0.7, "3": 0.95, "4": 1.0}


def test_d2t_and_t2d_round_trip_as_vllm_reads_them():
    ids = select({5: 3, 17: 2, 49: 1}, [0, 2], 6, V)
    d2t, t2d = d2t_table(ids), t2d_table(ids, V)
    assert d2t.dtype == np.int64 and t2d.dtype == bool and t2d.shape == (V,)
    draft = np.arange(len(ids))
    assert (draft + d2t[draft]).tolist() == ids.tolist()  # vLLM: target_id = draft_id + d2t[draft_id]
    assert np.flatnonzero(t2d).tolist() == ids.tolist()
    assert ids_from_d2t(d2t).tolist() == ids.tolist()
    lin = torch.nn.Linear(H, V, bias=False)
    head = DraftHead.from_target(lin, ids)
    back = DraftHead.from_tensors(head.tensors(), V)
    assert torch.equal(back.token_ids, head.token_ids) and torch.equal(back.weight, lin.weight[torch.from_numpy(ids)])
    bad = {**head.tensors(), "t2d": torch.from_numpy(t2d_table(ids[:-1], V))}
    with pytest.raises(ValueError, match="different vocabularies"):
        DraftHead.from_tensors(bad, V)


def test_draft_head_logits_are_the_target_rows_and_minus_inf_elsewhere():
    lin = torch.nn.Linear(H, V, bias=False)
    ids = np.array([1, 4, 9, 30])
    h = torch.randn(3, H)
    out = DraftHead.from_target(lin, ids)(h)
    full = lin(h).detach()
    assert torch.equal(out[:, ids], full[:, ids])
    rest = np.setdiff1d(np.arange(V), ids)
    assert torch.isinf(out[:, rest]).all() and (out[:, rest] < 0).all()


@pytest.mark.parametrize("kind", ["dflash2", "dspark"])
def test_kinds_without_a_pruned_vocabulary_path_are_refused_naming_the_kind(kind):
    params = repo_params([f"drafter.kind={kind}", "drafter.draft_vocab_size=64", "drafter.mask_token_id=999"])
    target = small_qwen3_config(layers=4, hidden=64, vocab=1000)
    with pytest.raises(ParamsError, match=f"drafter.draft_vocab_size: drafter.kind {kind} has no pruned-vocabulary"):
        build_drafter_config(params.drafter, target)


def test_draft_vocab_size_outside_the_vocabulary_is_refused():
    target = small_qwen3_config(layers=4, hidden=64, vocab=1000)
    with pytest.raises(ParamsError, match="in 1..999"):
        build_drafter_config(
            repo_params(["drafter.draft_vocab_size=1000", "drafter.mask_token_id=999"]).drafter, target
        )
    cfg = build_drafter_config(
        repo_params(["drafter.draft_vocab_size=64", "drafter.mask_token_id=999"]).drafter, target
    )
    assert cfg.draft_vocab_size == 64


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n = 6
    h = torch.randn(n * B, H, generator=g)
    target_h = torch.randn(20, H, generator=g)
    anchors = torch.arange(n) * 2
    valid = torch.rand(n * B, generator=g) > 0.2
    valid.view(n, B)[:, 0] = False
    labels = torch.randint(0, V, (n * B,), generator=g)
    return h, target_h, anchors, valid, labels


def _loss(head, h, labels, valid, target_h, anchors, loss_target, weighting="decay"):
    h = h.clone().requires_grad_(True)
    out = block_loss(
        h,
        labels,
        valid,
        head,
        slot_w=slot_weights(B, 4.0),
        normaliser=3.0,
        chunk_rows=5,
        loss_target=loss_target,
        weighting=weighting,
        target_hidden=target_h,
        anchors=anchors,
    )
    out.loss.backward()
    return out, h.grad


@pytest.mark.parametrize("zero_rows", [False, True])
@pytest.mark.parametrize(
    ("loss_target", "weighting"),
    [("tokens", "decay"), ("tokens", "dpace"), ("target_argmax", "decay"), ("target_kl", "decay")],
)
def test_loss_over_a_draft_vocabulary_holding_every_token_equals_the_full_vocabulary_loss(
    loss_target, weighting, zero_rows
):
    torch.manual_seed(0)
    lin = torch.nn.Linear(H, V, bias=False)
    if zero_rows:  # the demo's tiny target: rows of unseen tokens are exactly zero (the full head folds them)
        with torch.no_grad():
            lin.weight[10:30] = 0
    h, target_h, anchors, valid, labels = _case()
    full = LMHead.from_linear(lin)
    draft = DraftHead.from_target(lin, np.arange(V))
    pruned = LMHead.draft_vocab(draft.weight, draft.token_ids, V)
    a, ga = _loss(full, h, labels, valid, target_h, anchors, loss_target, weighting)
    b, gb = _loss(pruned, h, labels, valid, target_h, anchors, loss_target, weighting)
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gb, ga, rtol=1e-5, atol=1e-6)
    assert torch.equal(a.correct, b.correct) and torch.equal(a.counted, b.counted)


@pytest.mark.parametrize("loss_target", ["tokens", "target_argmax", "target_kl"])
def test_loss_over_a_pruned_vocabulary_is_the_loss_over_its_rows(loss_target):
    """The stated rule: softmax over the D rows only; target_kl: the target's distribution restricted to them and
    renormalised; target_argmax: its argmax among them. Checked against a direct computation on -inf logits."""
    torch.manual_seed(1)
    lin = torch.nn.Linear(H, V, bias=False)
    h, target_h, anchors, valid, labels = _case(2)
    ids = np.array(sorted(set(labels.tolist()) | {0, 33, 44}))  # every label inside: nothing is masked
    draft = DraftHead.from_target(lin, ids)
    out, _ = _loss(
        LMHead.draft_vocab(draft.weight, draft.token_ids, V), h, labels, valid, target_h, anchors, loss_target
    )
    idx = torch.nonzero(valid).squeeze(1)
    w = slot_weights(B, 4.0)[idx % B] / 3.0
    with torch.no_grad():
        logq = torch.log_softmax(draft(h[idx]), dim=1)  # -inf outside: exp 0
        rows = anchors[idx // B] + idx % B - 1
        logp = torch.log_softmax(draft(target_h[rows]), dim=1)
        if loss_target == "tokens":
            per = -logq.gather(1, labels[idx, None])[:, 0]
        elif loss_target == "target_argmax":
            per = -logq.gather(1, logp.argmax(1, keepdim=True))[:, 0]
        else:
            inside = torch.from_numpy(ids)
            per = (logp[:, inside].exp() * (logp[:, inside] - logq[:, inside])).sum(1)
    torch.testing.assert_close(out.loss.detach(), (w * per).sum(), rtol=1e-5, atol=1e-6)


def test_labels_outside_the_vocabulary_are_masked_and_counted():
    from dflash.train.data import Batch
    from dflash.train.micro import MicroBatch

    ids = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8])
    batch = Batch.__new__(Batch)  # only the fields on_device reads
    batch.input_ids, batch.loss_mask = ids, torch.tensor([0, 0, 1, 1, 1, 1, 1, 1])
    batch.doc_ids, batch.anchors = torch.zeros(8, dtype=torch.long), torch.tensor([1, 4])
    inside = torch.zeros(V, dtype=torch.bool)
    inside[[3, 4, 6]] = True
    plain = MicroBatch.on_device(0, batch, B, torch.device("cpu"))
    m = MicroBatch.on_device(0, batch, B, torch.device("cpu"), inside)
    # block at 1: slots -> 3, 4, 5; block at 4: slots -> 6, 7, 8 (all supervised); 5, 7, 8 are outside
    assert plain.valid.sum() == 6 and m.valid.sum() == 3 and m.outside == 3
    assert sorted(m.labels[m.valid].tolist()) == [3, 4, 6]


def test_export_writes_the_tables_and_loads_them_back(tmp_path):
    from dflash.core.io import read_json
    from dflash.drafter.build import build_drafter
    from dflash.drafter.export import load_draft_head, load_drafter, save_drafter

    target = small_qwen3_config(layers=4, hidden=64, vocab=1000)
    cfg = build_drafter_config(
        repo_params(["drafter.draft_vocab_size=40", "drafter.mask_token_id=999"]).drafter, target
    )
    model = build_drafter(cfg)
    lm_head = torch.nn.Linear(64, 1000, bias=False)
    ids = select({7: 3, 500: 2}, [998], 40, 1000)
    head = DraftHead.from_target(lm_head, ids)
    with pytest.raises(ValueError, match="a DraftHead is needed"):
        save_drafter(model, cfg, tmp_path / "none")
    folder = save_drafter(model, cfg, tmp_path / "d", head)
    raw = read_json(folder / "config.json")
    assert raw["draft_vocab_size"] == 40 and raw["vocab_size"] == 1000
    loaded, lcfg = load_drafter(folder, target_config=target)
    assert lcfg == cfg
    back = load_draft_head(folder, lcfg)
    assert back.token_ids.tolist() == ids.tolist() and torch.equal(back.weight, head.weight)
    h = torch.randn(2, 64)
    assert torch.equal(back(h), head(h))
    whole = build_drafter_config(repo_params(["drafter.mask_token_id=999"]).drafter, target)
    assert load_draft_head(save_drafter(model, whole, tmp_path / "w"), whole) is None
