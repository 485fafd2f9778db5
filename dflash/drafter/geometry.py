"""The drafter's geometry: one `DrafterConfig` from the `drafter` params and the target, one validator, and
the parameter counts. Torch-free: the model, the export AND the plan use exactly these rules, so a plan
never prices a drafter that training would refuse.

Only the hidden size and the vocabulary come from the target (the drafter shares its frozen embedding and
lm_head). Heads, head_dim, KV heads, FFN and layers are the drafter's own: copying the target's (for
Qwen3.6-27B: head_dim 256, 24 heads, 4 KV heads instead of the drafter's 128 / 32 / 8) is the classic
silent bug this module exists to stop. Layer-id convention: id L is the OUTPUT of target decoder layer L
(transformers' `hidden_states[L + 1]`; vLLM's aux layer id L + 1); see docs/design/drafter.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from dflash.core.errors import ParamsError, UserError
from dflash.core.params import DrafterParams, LiLiCorrParams
from dflash.core.target_config import as_target_arch
from dflash.drafter.kinds import DFLASH, KINDS, KindCost, spec_for
from dflash.drafter.vocab import check_draft_vocab

FULL = "full_attention"
SLIDING = "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)


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
    kind: str = DFLASH  # dflash | dspark | dflash2 | lilicorr; the fields below are 0 / False / None unless chosen
    markov_rank: int = 0  # dspark: r of the Markov head
    confidence_head: bool = False  # dspark: the acceptance-confidence head exists
    conv_kernel_size: int = 0  # dflash2 (lilicorr: optional): taps of the grouped causal convs
    conv_group_size: int = 0  # dflash2 (lilicorr: optional): channels per predicted tap coefficient
    selector_rank: int = 0  # dflash2: r of the candidate selector
    selector_top_k: int = 0  # dflash2: candidates ranked per slot
    draft_vocab_size: int = 0  # D rows of the drafter's own lm_head (dflash/drafter/vocab.py); 0 = the target's V
    lilicorr: LiLiCorrParams | None = None  # lilicorr: its correlator (dflash/drafter/lilicorr_spec.py); None otherwise

    @property
    def num_target_features(self) -> int:
        return len(self.target_layer_ids)

    @property
    def draft_tokens(self) -> int:
        """Tokens drafted per block (vLLM's num_speculative_tokens): block_size - 1 for every kind."""
        return self.block_size - 1

    @property
    def query_slots(self) -> int:
        """Slots of one drafter block. DFlash / DFlash2: the anchor + B-1 mask slots, slot k drafting the token at
        anchor + k. DSpark: B-1 slots (the anchor + B-2 masks), slot k drafting the token at anchor + k + 1."""
        return spec_for(self.kind).query_slots(self.block_size)

    @property
    def deepest_target_layer(self) -> int:
        """The target forward can stop after this layer: nothing deeper feeds the drafter."""
        return max(self.target_layer_ids)


def default_target_layer_ids(num_target_layers: int, k: int) -> list[int]:
    """K ids evenly spaced from 1 to n-3, rounded (z-lab's rule): 64, 5 -> [1, 16, 31, 46, 61]."""
    if k == 1:
        return [num_target_layers // 2]
    span = (num_target_layers - 3) - 1
    return [int(round(1 + i * span / (k - 1))) for i in range(k)]


def check_mask_token(mask_token_id: int, tokenizer: Any, where: str = "drafter.mask_token_id") -> None:
    """The mask token must never occur in real data. Ids past the tokenizer (Qwen3: 151669 = len(tokenizer))
    are safe; an id inside it must be an added special token that is not eos/bos/pad/unk and is not
    spelled in the chat template. Text tokens and special tokens the data uses are refused. `tokenizer` may
    also be a plain int, the number of ids the tokenizer can emit (then every id below it is refused)."""
    error = ParamsError if where.startswith("drafter.") else UserError  # a params value, or an export's config
    if isinstance(tokenizer, int):
        if mask_token_id < tokenizer:
            raise error(f"{where}: {mask_token_id} is below the tokenizer's {tokenizer} ids; pick an unused row")
        return
    if mask_token_id >= len(tokenizer):
        return
    token = tokenizer.convert_ids_to_tokens(mask_token_id)
    added = getattr(tokenizer, "added_tokens_decoder", {}).get(mask_token_id)
    if added is None or not getattr(added, "special", False):
        raise error(f"{where}: {mask_token_id} is the tokenizer's text token {token!r}; pick an unused row")
    named = {getattr(tokenizer, f"{n}_token_id", None) for n in ("eos", "bos", "pad", "unk")}
    if mask_token_id in named or token in (getattr(tokenizer, "chat_template", None) or ""):
        raise error(f"{where}: {mask_token_id} ({token!r}) is a special token the data uses")


def validate_config(
    cfg: DrafterConfig,
    target: Any = None,
    tokenizer: Any = None,
    prefix: str = "drafter.",
    keys: dict[str, str] | None = None,
) -> None:
    """Raise ParamsError (params: exit 2) or UserError (an export: exit 1) naming `prefix + key` (params: "drafter.block_size"; an export: "DIR/config.json:
    dflash_config.target_layer_ids") for anything that would train or serve a broken drafter."""
    keys = keys or {}
    error = ParamsError if prefix == "drafter." else UserError  # params exit 2; a bad export's config.json exits 1

    def fail(field: str, msg: str) -> None:
        raise error(f"{prefix}{keys.get(field, field)}: {msg}")

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
    if target is not None:
        target = as_target_arch(target)
        hidden, vocab, layers = target.hidden_size, target.vocab_size, target.num_layers
        if cfg.hidden_size != hidden:
            fail("hidden_size", f"drafter hidden size {cfg.hidden_size} != target hidden size {hidden}")
        if cfg.vocab_size != vocab:
            fail("vocab_size", f"drafter vocab {cfg.vocab_size} != target embedding rows {vocab}")
        if n != layers:
            fail("num_target_layers", f"drafter was built for {n} target layers, the target has {layers}")
    _validate_kind(cfg, fail)
    if tokenizer is not None:
        check_mask_token(cfg.mask_token_id, tokenizer, f"{prefix}{keys.get('mask_token_id', 'mask_token_id')}")


def _validate_kind(cfg: DrafterConfig, fail: Any) -> None:
    """The kind and its own fields (field names as in params: dspark.markov_rank, dflash2.conv_group_size...)."""
    if cfg.kind not in KINDS:
        fail("kind", f"{cfg.kind!r}: expected one of {', '.join(KINDS)}")
    check_draft_vocab(cfg.kind, cfg.draft_vocab_size, cfg.vocab_size, fail)
    spec_for(cfg.kind).check(cfg, fail)


def build_drafter_config(drafter: DrafterParams, target: Any, tokenizer: Any = None) -> DrafterConfig:
    """The drafter config from the `drafter` params section plus the target (validated). `target`: a TargetArch,
    or a config.json dict / transformers config to read into one."""
    target = as_target_arch(target)
    hidden, vocab, n_layers = target.hidden_size, target.vocab_size, target.num_layers
    ids = list(drafter.target_layer_ids)
    if not ids:
        if drafter.num_target_features < 1:
            raise ParamsError(f"drafter.num_target_features: must be >= 1, got {drafter.num_target_features}")
        ids = default_target_layer_ids(n_layers, drafter.num_target_features)
        if len(set(ids)) != len(ids) or not all(0 <= i < n_layers - 1 for i in ids):
            raise ParamsError(
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
        draft_vocab_size=drafter.draft_vocab_size,
        **kind_fields(drafter),
    )
    validate_config(cfg, target, tokenizer, prefix="drafter.")
    return cfg


def kind_fields(drafter: DrafterParams) -> dict[str, Any]:
    """The DrafterConfig fields of the chosen kind from its params section (the other kinds' stay 0 / False, so a
    DFlash config never depends on the dspark / dflash2 sections)."""
    out: dict[str, Any] = {"kind": drafter.kind}
    if drafter.kind in KINDS:
        out.update(spec_for(drafter.kind).params_fields(drafter))
    return out


def config_dict(config: DrafterConfig) -> dict:
    """JSON-ready fields; a None section (lilicorr for the other kinds) is left out, so their hashes stay as they were."""
    out = {}
    for f in dataclasses.fields(config):
        v = getattr(config, f.name)
        if v is not None:
            out[f.name] = (
                dataclasses.asdict(v) if dataclasses.is_dataclass(v) else list(v) if isinstance(v, tuple) else v
            )
    return out


def kind_cost(d: DrafterConfig) -> KindCost:
    """Parameters and FLOPs of the kind's additions (docs/design/successors.md; each kind's own count in
    dflash/drafter/kinds.py). 2 FLOPs per multiply-add."""
    return spec_for(d.kind).cost(d)


def parameter_counts(d: DrafterConfig) -> dict[str, int]:
    """Trainable parameters: per layer q/k/v/o + q_norm/k_norm + SwiGLU + 2 norms; fc (K*H -> H); hidden_norm; norm;
    plus the kind's own parts (kind_cost). No embedding and no lm_head: the drafter borrows the target's (frozen)."""
    h = d.hidden_size
    q = d.num_attention_heads * d.head_dim
    kv = d.num_key_value_heads * d.head_dim
    attn_q_o = 2 * h * q
    attn_kv = 2 * h * kv
    mlp = 3 * h * d.intermediate_size
    small = 2 * d.head_dim + 2 * h  # q_norm, k_norm, input / post-attention norms
    per_layer = attn_q_o + attn_kv + mlp + small
    fc = d.num_target_features * h * h
    n = d.num_hidden_layers
    return {
        "per_layer": per_layer,
        "layers": n * per_layer,
        "attn_q_o": n * attn_q_o,  # applied to block tokens only
        "attn_kv": n * attn_kv,  # applied to context features AND block tokens (KV injection)
        "mlp": n * mlp,
        "fc": fc,
        "norms": n * small + 2 * h,
        "kind_extra": kind_cost(d).params,  # DSpark heads / DFlash2 convs + selector (0 for dflash)
        "total": n * per_layer + fc + 2 * h + kind_cost(d).params,
    }
