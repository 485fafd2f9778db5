"""Anchor-block masks: the dense (SDPA) mask and the flex BlockMask against the naive per-(query, key) rule."""

from __future__ import annotations

import pytest
import torch

from dflash.drafter.masks import FULL, SLIDING, dense_mask, flex_block_mask, naive_mask


def _random_row(seed: int, num_ctx: int, n_anchors: int, n_docs: int):
    g = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randperm(num_ctx - 1, generator=g)[: n_docs - 1].add(1).tolist())
    doc_ids = torch.zeros(num_ctx, dtype=torch.long)
    for c in cuts:
        doc_ids[c:] += 1
    anchors = torch.randperm(num_ctx, generator=g)[:n_anchors].sort().values
    return anchors, doc_ids


def _effective_block_mask(bm, n_q: int, n_kv: int) -> torch.Tensor:
    """What flex actually computes: full blocks whole, partial blocks through mask_mod, the rest nothing."""
    bq, bkv = bm.BLOCK_SIZE
    n_qb, n_kvb = -(-n_q // bq), -(-n_kv // bkv)
    full = torch.zeros(n_qb, n_kvb, dtype=torch.bool)
    partial = torch.zeros(n_qb, n_kvb, dtype=torch.bool)
    for grid, num, idx in (
        (partial, bm.kv_num_blocks, bm.kv_indices),
        (full, bm.full_kv_num_blocks, bm.full_kv_indices),
    ):
        if num is None:
            continue
        for r in range(n_qb):
            grid[r, idx[0, 0, r, : num[0, 0, r]]] = True
    q = torch.arange(n_q)[:, None]
    kv = torch.arange(n_kv)[None, :]
    elementwise = bm.mask_mod(torch.tensor(0), torch.tensor(0), q, kv)
    full_el = full.repeat_interleave(bq, 0).repeat_interleave(bkv, 1)[:n_q, :n_kv]
    partial_el = partial.repeat_interleave(bq, 0).repeat_interleave(bkv, 1)[:n_q, :n_kv]
    return full_el | (partial_el & elementwise)


def test_naive_rule_on_a_hand_checked_row():
    # Context 0..5 in two documents [0,0,0 | 1,1,1]; blocks of 3 at anchors 2 and 4.
    docs = [0, 0, 0, 1, 1, 1]
    full = naive_mask([2, 4], 6, 3, FULL, 100, docs)
    ctx, blocks = full[:, :6], full[:, 6:]
    assert ctx[0:3].nonzero()[:, 1].unique().tolist() == [0, 1]  # strictly before anchor 2
    assert ctx[3:6].nonzero()[:, 1].unique().tolist() == [3]  # anchor 4: doc 1 only, never 4 itself
    assert blocks[0:3, 0:3].all() and not blocks[0:3, 3:6].any()  # own block, bidirectional
    assert blocks[3:6, 3:6].all() and not blocks[3:6, 0:3].any()
    sliding = naive_mask([2, 4], 6, 3, SLIDING, 2, docs)
    # Query (block 0, offset 0) sits at position 2: window 2 keeps positions 1..2 -> context 1 only.
    assert sliding[0, :6].nonzero().flatten().tolist() == [1]
    assert sliding[1, :6].nonzero().flatten().tolist() == []  # position 3: needs p >= 2, but p < anchor 2
    # Inside the block: causal and windowed (offset o sees o-1 and o).
    assert sliding[0:3, 6:9].tolist() == [[True, False, False], [True, True, False], [False, True, True]]


@pytest.mark.parametrize("layer_type,window", [(FULL, 2048), (SLIDING, 2048), (SLIDING, 7), (SLIDING, 3), (SLIDING, 1)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dense_mask_matches_naive(layer_type, window, seed):
    num_ctx, block = 37, 5
    anchors, doc_ids = _random_row(seed, num_ctx, 6, 3)
    got = dense_mask(anchors, num_ctx, block, layer_type, window, doc_ids)
    want = naive_mask(anchors.tolist(), num_ctx, block, layer_type, window, doc_ids.tolist())
    assert torch.equal(got, want)
    assert got.any(dim=1).all()  # every query sees at least its own slot


def test_dense_mask_single_document_default():
    anchors = torch.tensor([0, 3, 9])
    got = dense_mask(anchors, 12, 4, FULL, 100)
    assert torch.equal(got, naive_mask([0, 3, 9], 12, 4, FULL, 100))
    assert not got[0:4, :12].any()  # an anchor at position 0 has no context at all


@pytest.mark.parametrize("layer_type,window", [(FULL, 2048), (SLIDING, 6), (SLIDING, 2)])
@pytest.mark.parametrize("seed", [0, 1])
def test_block_mask_matches_naive(layer_type, window, seed):
    num_ctx, block, n = 45, 4, 9
    anchors, doc_ids = _random_row(seed + 10, num_ctx, n, 3)
    bm = flex_block_mask(anchors, num_ctx, block, layer_type, window, doc_ids, compile=False, sparse_block=8)
    assert bm.kv_num_blocks.shape[:2] == (1, 1)  # B=None, H=None: one mask shared by the batch and all heads
    n_q, n_kv = n * block, num_ctx + n * block
    want = naive_mask(anchors.tolist(), num_ctx, block, layer_type, window, doc_ids.tolist())
    assert torch.equal(_effective_block_mask(bm, n_q, n_kv), want)
    # The sparsity is real: blocks with nothing to attend are skipped, not merely masked.
    assert int(bm.kv_num_blocks.sum() + bm.full_kv_num_blocks.sum()) < (-(-n_q // 8)) * (-(-n_kv // 8))


def test_naive_mask_can_disagree():
    # Guard for the tests above: a context visible AT the anchor (the classic bug) differs from the rule.
    anchors, doc_ids = _random_row(3, 30, 4, 1)
    good = naive_mask(anchors.tolist(), 30, 4, FULL, 100, doc_ids.tolist())
    leaky = good.clone()
    for j, a in enumerate(anchors.tolist()):
        leaky[j * 4 : (j + 1) * 4, a] = True
    assert not torch.equal(dense_mask(anchors, 30, 4, FULL, 100, doc_ids), leaky)


def test_unknown_layer_type_is_refused():
    with pytest.raises(ValueError, match="layer type"):
        dense_mask(torch.tensor([1]), 4, 2, "global", 4)
