"""The DFlash drafter's trainable body and its training forward, the block inputs and labels.

Spec: docs/design/drafter.md (architecture), checkpoint-serving.md (export) and inference.md (inference). The config and its validation
live in dflash/drafter/geometry.py, masks in dflash/drafter/masks.py, layers in dflash/drafter/layers.py,
inference drafting in dflash/drafter/session.py, the z-lab checkpoint format in dflash/drafter/export.py.

Legend (one packed row, no batch dimension; several documents may share the row):
  S   context positions of the row (target tokens)     K   number of target features (len(target_layer_ids))
  H   hidden size (= the target's)                     V   vocabulary rows (= the target's)
  N   anchors (blocks) in the row                      B   block_size (slot 0 = anchor, 1..B-1 = mask token)
  nh / nkv / hd   the drafter's OWN query heads / KV heads / head_dim (never copied from the target)

Data contracts (what training and evaluation pass in and get back):
  input_ids        (S,) long     the row's tokens
  loss_mask        (S,) bool     1 on supervised (assistant) tokens
  doc_ids          (S,) long     document of each position (None = one document); equal ids are contiguous
  position_ids     (S,) long     RoPE position of each context token (None = arange(S)); consecutive inside
                                 a document (packed rows may restart them at 0 per document)
  anchors          (N,) long     block starts, indices into the row (sorted is faster with flex, not required)
  target_hidden    (S, K*H)      context_features(hidden_states, ids): concat of HF `hidden_states[id + 1]`
                                 for id in target_layer_ids, in that order (index 0 is the embeddings)
  block_ids        (N*B,) long   block_input_ids(): [input_ids[a], mask x (B-1)] per block
  block_embeds     (N*B, H)      the target's frozen embedding of block_ids
  labels, valid    (N*B,)        block_labels(): slot k of the block at a -> input_ids[a + k]; valid is False
                                 for slot 0, past the row / document end, or where loss_mask is 0
  forward(...)  -> (N*B, H)      hidden after `norm`; the caller applies the target's frozen lm_head (in chunks)

Attention (masks.py): a block sees context positions strictly before its anchor in its own document and its
own block (bidirectional in full_attention layers, causal + window in sliding_attention layers), never other
blocks. Block slot k sits at position position_ids[a] + k.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dflash.drafter.geometry import DrafterConfig
from dflash.drafter.layers import DecoderLayer, RMSNorm, rope_cos_sin
from dflash.drafter.masks import build_masks


class DFlashDrafter(nn.Module):
    """Trainable body only: `layers`, `fc`, `hidden_norm`, `norm` (state_dict == the exported checkpoint).
    The successor kinds subclass it (dflash/drafter/dspark.py, dflash2.py: their own layers via make_layer, their
    heads beside the body)."""

    def make_layer(self, c: DrafterConfig) -> nn.Module:
        return DecoderLayer(
            c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size, c.rms_norm_eps
        )

    def __init__(self, config: DrafterConfig):
        super().__init__()
        c = self.config = config
        self.layers = nn.ModuleList(self.make_layer(c) for _ in range(c.num_hidden_layers))
        self.fc = nn.Linear(c.num_target_features * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        # train.activation_checkpointing: keep only each decoder layer's inputs and recompute the layer in backward
        # (memory of the saved activations of every block token in every layer, for a slower backward)
        self.activation_checkpointing = False
        self.reset_parameters()

    @classmethod
    def build(
        cls, config: DrafterConfig, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
    ) -> DFlashDrafter:
        """Construct on `device` ("meta" allocates nothing: parameter counting for the planner), float32 unless
        `dtype` (dflash.drafter.kinds.build_drafter builds every kind through its class's build)."""
        with torch.device(device):
            model = cls(config)
        return model.to(dtype=dtype or torch.float32)

    def label_row_weight(self) -> torch.Tensor | None:
        """The kind's own output rows for labels whose lm_head rows are exactly zero (DSpark: markov_w2); None when
        the lm_head's rows serve (train/loop.py then keeps the lm_head's zero-row folding)."""
        return None

    def reset_parameters(self, std: float = 0.02) -> None:
        """HF default init (normal(0, 0.02) linears, unit norms); seed with torch.manual_seed beforehand."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    def context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """(S, K*H) target features -> (S, H) fused context feature (fc -> hidden_norm), shared by all layers."""
        expected = self.config.num_target_features * self.config.hidden_size
        if target_hidden.shape[-1] != expected:
            raise ValueError(f"target_hidden: last dim {target_hidden.shape[-1]} != K*H = {expected}")
        return self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))

    def forward(
        self,
        target_hidden: torch.Tensor,
        block_embeds: torch.Tensor,
        anchors: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        backend: str = "sdpa",
        masks: dict[str, object] | None = None,
    ) -> torch.Tensor:
        """Training forward over all N blocks of one packed row -> (N*B, H) hidden after `norm` (B: the kind's
        query_slots, block_size except for DSpark).

        `masks` (from masks.build_masks with the same anchors / doc_ids) may be passed to build them once.
        """
        c = self.config
        S, B = target_hidden.shape[0], c.query_slots
        assert block_embeds.shape == (anchors.numel() * B, c.hidden_size), "block_embeds: expected (N*B, H)"
        if position_ids is None:
            position_ids = torch.arange(S, device=target_hidden.device)
        blk_pos = (position_ids[anchors][:, None] + torch.arange(B, device=anchors.device)).flatten()  # (N*B,)
        if masks is None:
            masks = build_masks(c.layer_types, anchors, S, B, c.sliding_window, doc_ids, backend)
        ctx = self.context(target_hidden)  # (S, H)
        dtype = ctx.dtype
        ctx_cos, ctx_sin = rope_cos_sin(position_ids, c.head_dim, c.rope_theta, dtype)  # (S, hd)
        cos, sin = rope_cos_sin(blk_pos, c.head_dim, c.rope_theta, dtype)  # (N*B, hd)
        h = block_embeds.to(dtype)  # (N*B, H)
        for layer, kind in zip(self.layers, c.layer_types, strict=True):
            ctx_k, ctx_v = layer.self_attn.project_kv(ctx, ctx_cos, ctx_sin)  # (S, nkv, hd)
            if self.activation_checkpointing and torch.is_grad_enabled():
                h = checkpoint(layer, h, ctx_k, ctx_v, cos, sin, masks[kind], backend, use_reentrant=False)
            else:
                h = layer(h, ctx_k, ctx_v, cos, sin, masks[kind], backend)
        return self.norm(h)


# --------------------------------------------------------------------------------------------
# Data helpers for training (the loss itself lives with the training loop)
# --------------------------------------------------------------------------------------------


def context_features(hidden_states: Sequence[torch.Tensor], target_layer_ids: Sequence[int]) -> torch.Tensor:
    """HF `output_hidden_states` -> target features: concat of hidden_states[id + 1], ids in order.

    hidden_states[0] is the embedding output, so the output of decoder layer L is hidden_states[L + 1]
    (vLLM's aux layer id L + 1). (..., S, H) each -> (..., S, K*H).
    """
    if max(target_layer_ids) + 1 >= len(hidden_states):
        raise ValueError(f"target_layer_ids {list(target_layer_ids)}: only {len(hidden_states)} hidden_states")
    return torch.cat([hidden_states[i + 1] for i in target_layer_ids], dim=-1)


def block_input_ids(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int):
    """(S,), (N,) -> (N*B,) long: [input_ids[a], mask x (B-1)] for each anchor a."""
    ids = torch.full((anchors.numel(), block_size), mask_token_id, dtype=torch.long, device=input_ids.device)
    ids[:, 0] = input_ids[anchors]
    return ids.flatten()


def block_labels(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    block_size: int,
    doc_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels (N*B,) long and valid (N*B,) bool. Slot k of the block at a is trained toward input_ids[a + k]
    (the SAME position, no extra shift). valid is False for slot 0 (the anchor is given), for a + k past the
    row or in another document, and where loss_mask[a + k] == 0; labels are 0 there (safe to gather)."""
    S = input_ids.shape[0]
    pos = anchors[:, None] + torch.arange(block_size, device=anchors.device)  # (N, B)
    inside = pos < S
    p = pos.clamp(max=S - 1)
    valid = inside & loss_mask.to(torch.bool)[p]
    if doc_ids is not None:
        valid &= doc_ids[p] == doc_ids[anchors][:, None]
    valid[:, 0] = False
    labels = torch.where(valid, input_ids[p], torch.zeros_like(p))
    return labels.flatten(), valid.flatten()


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def build_drafter(config: DrafterConfig, device: str | torch.device = "cpu", dtype=torch.float32) -> DFlashDrafter:
    """Construct on `device` ("meta" allocates nothing: parameter counting for the planner). DFlash only: every
    kind is built by dflash.drafter.kinds.build_drafter."""
    if config.kind != "dflash":
        raise ValueError(f"drafter.kind {config.kind}: build it with dflash.drafter.kinds.build_drafter")
    return DFlashDrafter.build(config, device, dtype)


@torch.no_grad()
def draft_step(
    session: Any, hidden: torch.Tensor, lm_head: Callable[[torch.Tensor], torch.Tensor], bonus: int, pick: Any
) -> tuple[list[int], torch.Tensor]:
    """DFlash's decode step (the reference evaluator's, dflash/eval/reference.py): hidden (B, H) of one block; slots
    1..B-1 each draft their own token, independently. Returns the drafts and their (B-1, V) logits."""
    logits = lm_head(hidden[1:]).float()
    return [pick(row, j) for j, row in enumerate(logits)], logits
