"""DFlash anchor-block attention masks: one rule, two backends, one naive reference.

Layout (one packed row; no batch dimension):
  queries  = N blocks x B slots, query index q = j * B + o (block j, offset o)      -> Q = N * B
  keys     = [context positions 0..S-1 ; the same N * B block slots]              -> KV = S + N * B

The rule (docs/design/drafter.md, visibility). Query (j, o) with anchor a = anchors[j] may attend to
  - context key p < S      iff p < a (strictly: the anchor's own hidden state does not exist yet at
                             inference), doc_ids[p] == doc_ids[a] (packed rows keep documents apart)
                             and, in sliding_attention layers, p >= a + o - (window - 1);
  - block key (j', o')     iff j' == j (blocks never see each other) and, in sliding_attention layers,
                             o' <= o and o - o' <= window - 1 (causal + window inside the block);
                             full_attention layers see the whole block (bidirectional).
Every query sees at least its own slot, so no softmax row is empty.

`_allowed` writes the rule once on broadcastable index tensors; `dense_mask` (SDPA) and the flex
`mask_mod` (BlockMask) both call it, so the two backends agree by construction. `naive_mask` is an
independent per-(query, key) loop written from the prose above; tests check both against it.

Flex notes (docs/design/training.md, masks): build the BlockMask with H=None (a per-head mask OOMs at long
context) and, on CUDA, with a compiled `create_block_mask` (uncompiled, it materialises the dense
Q x KV grid first).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dflash.drafter.geometry import FULL, LAYER_TYPES, SLIDING

_compiled_create_block_mask = None


def _allowed(q_idx, kv_idx, anchors, doc_ids, num_ctx: int, block_size: int, sliding: bool, window: int):
    """The rule on index tensors (any broadcastable shapes). anchors (N,), doc_ids (S,) long."""
    n_blocks = anchors.shape[0]
    j = torch.clamp(q_idx // block_size, max=n_blocks - 1)  # clamp: flex may pad Q past N*B
    o = q_idx % block_size
    a = anchors[j]
    in_ctx = kv_idx < num_ctx
    p = torch.clamp(kv_idx, max=num_ctx - 1)
    ctx_ok = in_ctx & (kv_idx < a) & (doc_ids[p] == doc_ids[a])
    blk = kv_idx - num_ctx
    ob = blk % block_size
    blk_ok = ~in_ctx & (blk // block_size == j)
    if sliding:
        ctx_ok = ctx_ok & (kv_idx >= a + o - (window - 1))
        blk_ok = blk_ok & (ob <= o) & (o - ob <= window - 1)
    return ctx_ok | blk_ok


def _check(anchors: torch.Tensor, doc_ids: torch.Tensor | None, num_ctx: int, layer_type: str) -> torch.Tensor:
    if layer_type not in LAYER_TYPES:
        raise ValueError(f"layer type {layer_type!r}: expected one of {LAYER_TYPES}")
    assert anchors.ndim == 1 and anchors.numel() > 0, "anchors: expected a non-empty (N,) tensor"
    assert int(anchors.min()) >= 0 and int(anchors.max()) < num_ctx, "anchors must index the context"
    if doc_ids is None:
        return torch.zeros(num_ctx, dtype=torch.long, device=anchors.device)
    assert doc_ids.shape == (num_ctx,), f"doc_ids: expected ({num_ctx},), got {tuple(doc_ids.shape)}"
    return doc_ids.to(device=anchors.device, dtype=torch.long)


def dense_mask(
    anchors: torch.Tensor,
    num_ctx: int,
    block_size: int,
    layer_type: str,
    window: int,
    doc_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean (N*B, S + N*B) mask for SDPA (True = may attend). Memory is Q x KV: tests / CPU / fallback."""
    docs = _check(anchors, doc_ids, num_ctx, layer_type)
    dev = anchors.device
    q = torch.arange(anchors.numel() * block_size, device=dev)
    kv = torch.arange(num_ctx + anchors.numel() * block_size, device=dev)
    return _allowed(q[:, None], kv[None, :], anchors, docs, num_ctx, block_size, layer_type == SLIDING, window)


def flex_block_mask(
    anchors: torch.Tensor,
    num_ctx: int,
    block_size: int,
    layer_type: str,
    window: int,
    doc_ids: torch.Tensor | None = None,
    compile: bool | None = None,
    sparse_block: int = 128,
):
    """flex_attention BlockMask (B=None, H=None) for the same rule. compile defaults to True on CUDA."""
    from torch.nn.attention.flex_attention import create_block_mask

    global _compiled_create_block_mask
    docs = _check(anchors, doc_ids, num_ctx, layer_type)
    sliding = layer_type == SLIDING

    def mask_mod(b, h, q_idx, kv_idx):
        return _allowed(q_idx, kv_idx, anchors, docs, num_ctx, block_size, sliding, window)

    n_q = anchors.numel() * block_size
    if compile is None:
        compile = anchors.is_cuda
    build = create_block_mask
    if compile:
        if _compiled_create_block_mask is None:
            _compiled_create_block_mask = torch.compile(create_block_mask)
        build = _compiled_create_block_mask
    return build(mask_mod, None, None, n_q, num_ctx + n_q, device=anchors.device, BLOCK_SIZE=sparse_block)


def build_masks(
    layer_types: Sequence[str],
    anchors: torch.Tensor,
    num_ctx: int,
    block_size: int,
    window: int,
    doc_ids: torch.Tensor | None = None,
    backend: str = "sdpa",
) -> dict[str, object]:
    """One mask per distinct layer type: {layer_type: dense bool tensor (sdpa) | BlockMask (flex)}."""
    if backend not in ("sdpa", "flex"):
        raise ValueError(f"attention backend {backend!r}: expected 'sdpa' or 'flex'")
    make = dense_mask if backend == "sdpa" else flex_block_mask
    return {t: make(anchors, num_ctx, block_size, t, window, doc_ids) for t in dict.fromkeys(layer_types)}


def naive_mask(
    anchors: Sequence[int],
    num_ctx: int,
    block_size: int,
    layer_type: str,
    window: int,
    doc_ids: Sequence[int] | None = None,
) -> torch.Tensor:
    """Reference for tests: the rule in the module docstring, one (query, key) pair at a time."""
    docs = list(doc_ids) if doc_ids is not None else [0] * num_ctx
    n_q = len(anchors) * block_size
    out = torch.zeros(n_q, num_ctx + n_q, dtype=torch.bool)
    sliding = layer_type == SLIDING
    for j, a in enumerate(anchors):
        for o in range(block_size):
            q = j * block_size + o
            q_pos = a + o
            for p in range(num_ctx):
                visible = p < a and docs[p] == docs[a]
                if sliding and q_pos - p > window - 1:
                    visible = False
                out[q, p] = visible
            for o2 in range(block_size):
                visible = True
                if sliding:
                    visible = o2 <= o and o - o2 <= window - 1
                out[q, num_ctx + j * block_size + o2] = visible
    return out


__all__ = ["FULL", "LAYER_TYPES", "SLIDING", "build_masks", "dense_mask", "flex_block_mask", "naive_mask"]
