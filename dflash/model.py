"""The DFlash drafter: config from params + target, validation, training forward, inference drafting.

Spec: DESIGN.md sections 3 (architecture), 5 (export) and 6 (inference). Masks live in
dflash/masks.py, layers in dflash/layers.py, the z-lab checkpoint format in dflash/export.py.

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

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dflash.config import DrafterParams
from dflash.layers import DecoderLayer, RMSNorm, rope_cos_sin
from dflash.masks import FULL, LAYER_TYPES, SLIDING, build_masks


@dataclass(frozen=True)
class DrafterConfig:
    """Everything that defines the drafter. Hidden size and vocab come from the target; the rest from params."""

    hidden_size: int  # H, equal to the target's hidden size (shared embedding, lm_head, fc output)
    vocab_size: int  # V, the target's embedding rows (the drafter has no embedding or head of its own)
    num_hidden_layers: int  # drafter decoder layers
    num_attention_heads: int  # the drafter's own query heads
    num_key_value_heads: int  # the drafter's own KV heads
    head_dim: int  # the drafter's own head width
    intermediate_size: int  # SwiGLU width
    layer_types: tuple[str, ...]  # per layer "full_attention" | "sliding_attention" (resolved, never empty)
    sliding_window: int  # window (tokens) of sliding_attention layers
    rope_theta: float  # the drafter's RoPE base (full-head rotary)
    rms_norm_eps: float  # RMSNorm epsilon
    max_position_embeddings: int  # longest position the drafter supports
    block_size: int  # B
    mask_token_id: int  # embedding row used for slots 1..B-1
    target_layer_ids: tuple[int, ...]  # target layer outputs feeding fc (HF hidden_states[id + 1])
    num_target_layers: int  # decoder layers of the target the ids refer to

    @property
    def num_target_features(self) -> int:
        return len(self.target_layer_ids)


def default_target_layer_ids(num_target_layers: int, k: int) -> list[int]:
    """K ids evenly spaced from 1 to n-3, rounded (z-lab's rule): 64, 5 -> [1, 16, 31, 46, 61]."""
    if k == 1:
        return [num_target_layers // 2]
    span = (num_target_layers - 3) - 1
    return [int(round(1 + i * span / (k - 1))) for i in range(k)]


def target_dims(target_config: Any) -> tuple[int, int, int]:
    """(hidden_size, vocab_size, num_hidden_layers) of an HF config (text part of multimodal ones) or dict."""
    cfg = target_config
    if isinstance(cfg, dict):
        cfg = cfg.get("text_config", cfg)
        return int(cfg["hidden_size"]), int(cfg["vocab_size"]), int(cfg["num_hidden_layers"])
    if hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    return int(cfg.hidden_size), int(cfg.vocab_size), int(cfg.num_hidden_layers)


def check_mask_token(mask_token_id: int, tokenizer: Any, where: str = "drafter.mask_token_id") -> None:
    """The mask token must never occur in real data. Ids past the tokenizer (Qwen3: 151669 = len(tokenizer))
    are safe; an id inside it must be an added special token that is not eos/bos/pad/unk and is not
    spelled in the chat template. Text tokens and special tokens the data uses are refused. `tokenizer` may
    also be a plain int, the number of ids the tokenizer can emit (then every id below it is refused)."""
    if isinstance(tokenizer, int):
        if mask_token_id < tokenizer:
            raise ValueError(f"{where}: {mask_token_id} is below the tokenizer's {tokenizer} ids; pick an unused row")
        return
    if mask_token_id >= len(tokenizer):
        return
    token = tokenizer.convert_ids_to_tokens(mask_token_id)
    added = getattr(tokenizer, "added_tokens_decoder", {}).get(mask_token_id)
    if added is None or not getattr(added, "special", False):
        raise ValueError(f"{where}: {mask_token_id} is the tokenizer's text token {token!r}; pick an unused row")
    named = {getattr(tokenizer, f"{n}_token_id", None) for n in ("eos", "bos", "pad", "unk")}
    if mask_token_id in named or token in (getattr(tokenizer, "chat_template", None) or ""):
        raise ValueError(f"{where}: {mask_token_id} ({token!r}) is a special token the data uses")


def validate_config(
    cfg: DrafterConfig,
    target_config: Any = None,
    tokenizer: Any = None,
    prefix: str = "drafter.",
    keys: dict[str, str] | None = None,
) -> None:
    """Raise ValueError naming `prefix + key` (params: "drafter.block_size"; an export: "DIR/config.json:
    dflash_config.target_layer_ids") for anything that would train or serve a broken drafter."""
    keys = keys or {}

    def fail(field: str, msg: str) -> None:
        raise ValueError(f"{prefix}{keys.get(field, field)}: {msg}")

    for field in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size"):
        if getattr(cfg, field) < 1:
            fail(field, f"must be >= 1, got {getattr(cfg, field)}")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        fail(
            "num_key_value_heads",
            f"{cfg.num_attention_heads} query heads are not a multiple of {cfg.num_key_value_heads} KV heads",
        )
    if cfg.head_dim % 2:
        fail("head_dim", f"must be even for RoPE, got {cfg.head_dim}")
    if cfg.block_size < 2:
        fail("block_size", f"must be >= 2 (anchor + at least one drafted slot), got {cfg.block_size}")
    if cfg.sliding_window < 1:
        fail("sliding_window", f"must be >= 1, got {cfg.sliding_window}")
    if cfg.rope_theta <= 0 or cfg.rms_norm_eps <= 0:
        fail("rope_theta" if cfg.rope_theta <= 0 else "rms_norm_eps", "must be > 0")
    if cfg.max_position_embeddings < cfg.block_size:
        fail("max_position_embeddings", f"must be >= block_size, got {cfg.max_position_embeddings}")
    if len(cfg.layer_types) != cfg.num_hidden_layers:
        fail("layer_types", f"has {len(cfg.layer_types)} entries for {cfg.num_hidden_layers} layers")
    for i, t in enumerate(cfg.layer_types):
        if t not in LAYER_TYPES:
            fail("layer_types", f"entry {i} is {t!r}; expected one of {', '.join(LAYER_TYPES)}")
    ids = list(cfg.target_layer_ids)
    n = cfg.num_target_layers
    if not ids:
        fail("target_layer_ids", "is empty")
    if any(i < 0 or i >= n for i in ids):
        fail("target_layer_ids", f"{ids} out of range for a target with {n} layers (0..{n - 1})")
    if len(set(ids)) != len(ids):
        fail("target_layer_ids", f"{ids} has duplicates")
    if ids != sorted(ids):
        fail("target_layer_ids", f"{ids} is not sorted (features are concatenated shallow to deep)")
    if ids[-1] == n - 1:
        fail(
            "target_layer_ids",
            f"{ids} includes the target's last layer {n - 1}: HF applies the final norm to that hidden_states "
            "entry and vLLM does not, so training and serving would see different features",
        )
    if not 0 <= cfg.mask_token_id < cfg.vocab_size:
        fail("mask_token_id", f"{cfg.mask_token_id} is outside the {cfg.vocab_size} embedding rows")
    if target_config is not None:
        hidden, vocab, layers = target_dims(target_config)
        if cfg.hidden_size != hidden:
            fail("hidden_size", f"drafter hidden size {cfg.hidden_size} != target hidden size {hidden}")
        if cfg.vocab_size != vocab:
            fail("vocab_size", f"drafter vocab {cfg.vocab_size} != target embedding rows {vocab}")
        if n != layers:
            fail("num_target_layers", f"drafter was built for {n} target layers, the target has {layers}")
    if tokenizer is not None:
        check_mask_token(cfg.mask_token_id, tokenizer, f"{prefix}{keys.get('mask_token_id', 'mask_token_id')}")


def build_drafter_config(drafter: DrafterParams, target_config: Any, tokenizer: Any = None) -> DrafterConfig:
    """The drafter config from the `drafter` params section plus the target's HF config (validated)."""
    hidden, vocab, n_layers = target_dims(target_config)
    ids = list(drafter.target_layer_ids)
    if not ids:
        if drafter.num_target_features < 1:
            raise ValueError(f"drafter.num_target_features: must be >= 1, got {drafter.num_target_features}")
        ids = default_target_layer_ids(n_layers, drafter.num_target_features)
        if len(set(ids)) != len(ids) or not all(0 <= i < n_layers - 1 for i in ids):
            raise ValueError(
                f"drafter.num_target_features: {drafter.num_target_features} evenly spaced ids from 1 to n-3 give "
                f"{ids} for a {n_layers}-layer target; set drafter.target_layer_ids explicitly"
            )
    cfg = DrafterConfig(
        hidden_size=hidden,
        vocab_size=vocab,
        num_hidden_layers=drafter.num_hidden_layers,
        num_attention_heads=drafter.num_attention_heads,
        num_key_value_heads=drafter.num_key_value_heads,
        head_dim=drafter.head_dim,
        intermediate_size=drafter.intermediate_size,
        layer_types=tuple(drafter.layer_types) or (FULL,) * max(drafter.num_hidden_layers, 0),
        sliding_window=drafter.sliding_window,
        rope_theta=float(drafter.rope_theta),
        rms_norm_eps=float(drafter.rms_norm_eps),
        max_position_embeddings=drafter.max_position_embeddings,
        block_size=drafter.block_size,
        mask_token_id=drafter.mask_token_id,
        target_layer_ids=tuple(ids),
        num_target_layers=n_layers,
    )
    validate_config(cfg, target_config, tokenizer, prefix="drafter.")
    return cfg


class DFlashDrafter(nn.Module):
    """Trainable body only: `layers`, `fc`, `hidden_norm`, `norm` (state_dict == the exported checkpoint)."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        c = self.config = config
        self.layers = nn.ModuleList(
            DecoderLayer(
                c.hidden_size,
                c.num_attention_heads,
                c.num_key_value_heads,
                c.head_dim,
                c.intermediate_size,
                c.rms_norm_eps,
            )
            for _ in range(c.num_hidden_layers)
        )
        self.fc = nn.Linear(c.num_target_features * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.reset_parameters()

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
        """Training forward over all N blocks of one packed row -> (N*B, H) hidden after `norm`.

        `masks` (from masks.build_masks with the same anchors / doc_ids) may be passed to build them once.
        """
        c = self.config
        S, B = target_hidden.shape[0], c.block_size
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


# --------------------------------------------------------------------------------------------
# Inference (DESIGN.md section 6): cached context K/V, one drafter pass per block
# --------------------------------------------------------------------------------------------


class DraftSession:
    """One request's drafter state: per-layer context K/V of positions 0..length-1 (k_norm + RoPE applied).

    Use: extend(prompt features); then per cycle draft(bonus, start=length) -> B-1 greedy ids; the target
    verifies; extend(features of the accepted positions, which are start..start+accepted). `embed` maps
    ids (n,) -> (n, H) and `lm_head` (n, H) -> (n, V): the target's own frozen modules.
    """

    def __init__(self, drafter: DFlashDrafter, embed: Callable, lm_head: Callable):
        self.drafter, self.embed, self.lm_head = drafter, embed, lm_head
        c = drafter.config
        w = drafter.fc.weight
        empty = torch.empty(0, c.num_key_value_heads, c.head_dim, dtype=w.dtype, device=w.device)
        self.k = [empty] * c.num_hidden_layers
        self.v = [empty] * c.num_hidden_layers
        self.length = 0

    @torch.no_grad()
    def extend(self, features: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        """Append context features (T, K*H) for positions length..length+T-1 (the only positions accepted)."""
        c, T = self.drafter.config, features.shape[0]
        expected = torch.arange(self.length, self.length + T, device=features.device)
        if positions is not None and not torch.equal(positions.to(expected.device), expected):
            raise ValueError(f"positions must continue the cached context at {self.length}, got {positions.tolist()}")
        ctx = self.drafter.context(features)  # (T, H)
        cos, sin = rope_cos_sin(expected, c.head_dim, c.rope_theta, ctx.dtype)
        for i, layer in enumerate(self.drafter.layers):
            k, v = layer.self_attn.project_kv(ctx, cos, sin)  # (T, nkv, hd)
            self.k[i] = torch.cat([self.k[i], k])
            self.v[i] = torch.cat([self.v[i], v])
        self.length += T

    def _mask(self, kind: str, device: torch.device) -> torch.Tensor:
        """(B, length + B): all cached context (sliding: within the window); the block per layer type."""
        c, T = self.drafter.config, self.length
        o = torch.arange(c.block_size, device=device)[:, None]  # query offset
        p = torch.arange(T, device=device)[None, :]
        o2 = torch.arange(c.block_size, device=device)[None, :]
        ctx = torch.ones(c.block_size, T, dtype=torch.bool, device=device)
        blk = torch.ones(c.block_size, c.block_size, dtype=torch.bool, device=device)
        if kind == SLIDING:
            ctx = (T + o) - p <= c.sliding_window - 1
            blk = (o2 <= o) & (o - o2 <= c.sliding_window - 1)
        return torch.cat([ctx, blk], dim=1)

    @torch.no_grad()
    def draft_hidden(self, bonus_token_id: int, start_position: int) -> torch.Tensor:
        """(B, H) hidden after `norm` for the block [bonus, mask x (B-1)] at positions start..start+B-1."""
        c = self.drafter.config
        if start_position != self.length:
            raise ValueError(f"start_position {start_position} != cached context length {self.length}")
        dev = self.drafter.fc.weight.device
        ids = torch.full((c.block_size,), c.mask_token_id, dtype=torch.long, device=dev)
        ids[0] = bonus_token_id
        h = self.embed(ids).to(self.drafter.fc.weight.dtype)  # (B, H)
        pos = torch.arange(start_position, start_position + c.block_size, device=dev)
        cos, sin = rope_cos_sin(pos, c.head_dim, c.rope_theta, h.dtype)
        masks = {kind: self._mask(kind, dev) for kind in dict.fromkeys(c.layer_types)}
        for i, (layer, kind) in enumerate(zip(self.drafter.layers, c.layer_types, strict=True)):
            h = layer(h, self.k[i], self.v[i], cos, sin, masks[kind], "sdpa")
        return self.drafter.norm(h)

    @torch.no_grad()
    def draft(self, bonus_token_id: int, start_position: int) -> list[int]:
        """B-1 greedy draft tokens for slots 1..B-1 (one drafter pass)."""
        h = self.draft_hidden(bonus_token_id, start_position)
        return self.lm_head(h[1:]).argmax(dim=-1).tolist()


def build_drafter(config: DrafterConfig, device: str | torch.device = "cpu", dtype=torch.float32) -> DFlashDrafter:
    """Construct on `device` ("meta" allocates nothing: parameter counting for the planner)."""
    with torch.device(device):
        model = DFlashDrafter(config)
    return model.to(dtype=dtype)


def config_dict(config: DrafterConfig) -> dict:
    return {
        f.name: list(v) if isinstance(v := getattr(config, f.name), tuple) else v for f in dataclasses.fields(config)
    }


__all__ = [
    "DFlashDrafter",
    "DraftSession",
    "DrafterConfig",
    "block_input_ids",
    "block_labels",
    "build_drafter",
    "build_drafter_config",
    "check_mask_token",
    "config_dict",
    "context_features",
    "count_parameters",
    "default_target_layer_ids",
    "target_dims",
    "validate_config",
]
