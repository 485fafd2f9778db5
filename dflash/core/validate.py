"""The params checks every stage runs before any work: engine sizes, train sizes, plan inputs. One set of rules,
so what train or generate would refuse the plan refuses too, before it estimates anything.

Inputs: a `Params` (dflash.core.params). Outputs: nothing, or a ParamsError naming the full key and the rule
(`generate.tensor_parallel_size: must be >= 1, got 0`). Pure params: no file is read, no library imported.

    check_target(params)           target: the tiny target's sizes, and the hybrid's linear-attention geometry
    check_generate(params, pilot)  generate / pilot: the generate section (engine sizes, units, sampling)
    check_eval(params)             eval: its engine list and engine sizes
    check_train(params)            train: every train size, and train.max_length against the drafter's positions
    check_plan(params)             plan: its own inputs + check_generate + check_train (the runs it prices)

The drafter's geometry (heads, layer ids, mask token against the target) needs the target's config and stays
in dflash/drafter/geometry.py (`build_drafter_config`), which plan, train and eval all call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dflash.core.errors import ParamsError
from dflash.core.params import Params

Rule = tuple[str, Callable[[Any], bool]]  # (what the value must be, in words; the test)


def at_least(lo: int | float) -> Rule:
    return f">= {lo}", lambda v: v >= lo


POSITIVE: Rule = ("> 0", lambda v: v > 0)
SHARE: Rule = ("in (0, 1]", lambda v: 0 < v <= 1)  # an efficiency, a memory fraction, a sampling mass


def check(section: Any, prefix: str, rules: dict[str, Rule]) -> None:
    """ParamsError `prefix.key: must be RULE, got VALUE` for the first key of `section` that breaks its rule.
    NaN breaks every rule (each comparison is False)."""
    for key, (words, ok) in rules.items():
        value = getattr(section, key)
        if not ok(value):
            raise ParamsError(f"{prefix}.{key}: must be {words}, got {value!r}")


TINY = {  # target.tiny: every size of the embedded tiny target
    "hidden_size": at_least(1),
    "intermediate_size": at_least(1),
    "num_hidden_layers": at_least(1),
    "num_attention_heads": at_least(1),
    "num_key_value_heads": at_least(1),
    "head_dim": at_least(1),
    "rope_theta": POSITIVE,
    "max_position_embeddings": at_least(1),
    "linear_num_key_heads": at_least(1),
    "linear_num_value_heads": at_least(1),
    "linear_head_dim": at_least(1),
    "corpus_size": at_least(1),
    "steps": at_least(0),  # 0 = random weights
    "batch_size": at_least(1),
    "max_length": at_least(2),
    "lr": POSITIVE,
    "margin_prompts": at_least(0),  # 0 = no margin report, no gate
    "margin_max_tokens": at_least(1),
}
HYBRID_EVERY = 4  # qwen3_next tiny target: every 4th layer is full attention (the Qwen3.5 / 3.6 pattern, 3 : 1)


def check_target(params: Params) -> None:
    """The tiny target's sizes; a qwen3_next one needs a full-attention layer and grouped value heads."""
    t = params.target.tiny
    check(t, "target.tiny", TINY)
    if t.num_attention_heads % t.num_key_value_heads:
        raise ParamsError(
            f"target.tiny.num_attention_heads: must be a multiple of target.tiny.num_key_value_heads "
            f"{t.num_key_value_heads}, got {t.num_attention_heads}"
        )
    if t.architecture == "qwen3_next":
        if t.num_hidden_layers < HYBRID_EVERY:
            raise ParamsError(
                f"target.tiny.num_hidden_layers: must be >= {HYBRID_EVERY} for architecture qwen3_next (every "
                f"{HYBRID_EVERY}th layer is full attention), got {t.num_hidden_layers}"
            )
        if t.linear_num_value_heads % t.linear_num_key_heads:
            raise ParamsError(
                f"target.tiny.linear_num_value_heads: must be a multiple of target.tiny.linear_num_key_heads "
                f"{t.linear_num_key_heads}, got {t.linear_num_value_heads}"
            )


# Engine sizes: the same names and rules in `generate` and `eval` (both start vLLM engines; the plan models
# the generate engines from them).
ENGINE = {
    "max_model_len": at_least(1),
    "max_num_seqs": at_least(1),
    "max_num_batched_tokens": at_least(1),
    "gpu_memory_utilization": SHARE,
    "kv_cache_memory_gb": at_least(0),  # 0 = the gpu_memory_utilization share
}
GENERATE = {
    "num_engines": at_least(1),
    "tensor_parallel_size": at_least(1),
    "unit_size": at_least(1),
    "unit_retries": at_least(0),
    "engine_start_retries": at_least(0),
    "request_retries": at_least(0),
    "pilot_samples": at_least(0),
    "request_timeout_s": POSITIVE,
    "server_failures_in_a_row": at_least(1),
    "server_failure_share": SHARE,
    "server_failure_window": at_least(1),
    **ENGINE,
    "max_num_seqs": (">= 1 or auto", lambda v: v == "auto" or (isinstance(v, int) and v >= 1)),
}
SAMPLING = {"temperature": at_least(0), "top_p": SHARE, "top_k": at_least(0), "max_tokens": at_least(1)}
EVAL = {
    "num_prompts": at_least(0),
    "max_tokens": at_least(1),
    "temperature": at_least(0),
    "ngram_num_speculative_tokens": at_least(0),
    "prompt_lookup_min": at_least(1),
    "engine_timeout_s": at_least(1),
    "speed_rounds": at_least(0),  # 0 = the engines' own timed runs, one after another
    "speed_prompts": at_least(0),  # 0 = all held-out prompts
    **ENGINE,
}
PROMPT_SET = {"num_prompts": at_least(0)}
TRAIN = {
    "max_length": at_least(2),
    "pack_window": at_least(1),
    "num_anchors": at_least(1),
    "epochs": at_least(1),
    "batch_size": at_least(1),
    "grad_accum_steps": at_least(1),
    "global_batch": at_least(0),  # 0 = batch_size x grad_accum_steps x processes
    "lr": POSITIVE,
    "min_lr_ratio": ("in [0, 1]", lambda v: 0 <= v <= 1),
    "warmup_ratio": ("in [0, 1)", lambda v: 0 <= v < 1),
    "weight_decay": at_least(0),
    "grad_clip": at_least(0),
    "loss_gamma": POSITIVE,
    "logits_chunk_blocks": at_least(1),
    "feature_noise": at_least(0),
    "gpus_per_process": at_least(1),
    "target_batch_tokens": at_least(1),
    "checkpoint_every": at_least(0),
    "keep_checkpoints": at_least(1),
    "log_every": at_least(1),
    "max_steps": at_least(0),
    "pilot_warmup_steps": at_least(0),
    "pilot_steps": at_least(1),
}
PLAN = {
    "num_gpus": at_least(1),
    "price_per_gpu_hour": at_least(0),
    "deadline_hours": at_least(0),  # 0 = no deadline
    "gpus_per_node": at_least(1),
    "internode_gbps": POSITIVE,
    "allreduce_overlap": ("in [0, 1]", lambda v: 0 <= v <= 1),
}
PLAN_DATASET = {  # > 0 where no metrics file replaces them: dflash/plan/inputs.py; the range: low <= mean <= high
    "num_prompts": at_least(0),
    "mean_prompt_tokens": at_least(0),
    "mean_output_tokens": POSITIVE,
    "output_tokens_low": POSITIVE,
    "output_tokens_high": POSITIVE,
}
PLAN_GENERATION = {
    "activation_reserve_gb": at_least(0),
    "bandwidth_efficiency": SHARE,
    "decode_mfu": SHARE,
    "prefill_mfu": SHARE,
    "output_length_cv": at_least(0),
}
PLAN_TRAIN = {
    "num_gpus": at_least(0),
    "split_target_gpus": at_least(1),
    "mfu": SHARE,
    "state_bytes_per_param": at_least(2),  # the bf16 weight alone is 2
    "logits_chunk_blocks": at_least(1),
    "runtime_reserve_gb": at_least(0),
}


def check_generate(params: Params, pilot: bool = False) -> None:
    """The generate section (and, for a pilot, a pilot that samples something)."""
    g = params.generate
    check(g, "generate", GENERATE)
    check(g.sampling, "generate.sampling", SAMPLING)
    if pilot and g.pilot_samples < 1:
        raise ParamsError(f"generate.pilot_samples: must be >= 1 for a pilot run, got {g.pilot_samples}")
    for i, n in enumerate(g.pilot_sweep):
        if n < 1:
            raise ParamsError(f"generate.pilot_sweep[{i}]: must be >= 1, got {n}")
    for i, url in enumerate(g.server_urls):
        check_server_url(url, f"generate.server_urls[{i}]")
    if g.server_registry and g.server_urls:
        raise ParamsError("generate.server_registry: set it or generate.server_urls, not both")


def check_server_url(url: str, key: str) -> None:
    """A server base URL: http(s)://host[:port][/path], nothing else (no credentials, queries or fragments)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        port = parts.port  # raises on a bad port
    except ValueError as exc:
        raise ParamsError(f"{key}: {url!r} is not a URL ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ParamsError(f"{key}: {url!r} must be an http:// or https:// URL with a host, e.g. http://node7:8000/v1")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise ParamsError(f"{key}: {url!r} must be a plain base URL (no user:password@, ?query or #fragment)")
    del port


def check_eval(params: Params) -> None:
    e = params.eval
    if "dflash" not in e.engines:
        raise ParamsError(f"eval.engines: {e.engines} must include 'dflash' (the drafter under evaluation)")
    if len(set(e.engines)) != len(e.engines):
        raise ParamsError(f"eval.engines: {e.engines} has duplicates")
    check(e, "eval", EVAL)
    for name, spec in e.prompt_sets.items():
        if name == "heldout":
            raise ParamsError("eval.prompt_sets.heldout: the name is taken by the held-out split (eval.num_prompts)")
        check(spec, f"eval.prompt_sets.{name}", PROMPT_SET)
    if e.prompt_lookup_max < e.prompt_lookup_min:
        raise ParamsError(
            f"eval.prompt_lookup_max: must be >= eval.prompt_lookup_min {e.prompt_lookup_min}, got {e.prompt_lookup_max}"
        )
    if e.reference and not e.reference_temperatures:
        raise ParamsError("eval.reference_temperatures: must hold at least one temperature when eval.reference is on")
    for i, temp in enumerate(e.reference_temperatures):
        if not temp >= 0:
            raise ParamsError(f"eval.reference_temperatures[{i}]: must be >= 0, got {temp}")
    if len(set(e.reference_temperatures)) != len(e.reference_temperatures):
        raise ParamsError(f"eval.reference_temperatures: {e.reference_temperatures} has duplicates")


def check_train(params: Params) -> None:
    """Every train size, the AdamW betas, and the longest document against the drafter's positions."""
    t, d = params.train, params.drafter
    check(t, "train", TRAIN)
    if t.max_tokens_per_row < t.max_length:
        raise ParamsError(
            f"train.max_tokens_per_row: must be >= train.max_length {t.max_length}, got {t.max_tokens_per_row}"
        )
    if len(t.adam_betas) != 2 or not all(0 <= b < 1 for b in t.adam_betas):
        raise ParamsError(f"train.adam_betas: must be two values in [0, 1), got {t.adam_betas}")
    if t.max_length + d.block_size > d.max_position_embeddings:
        raise ParamsError(
            f"train.max_length: {t.max_length} + drafter.block_size {d.block_size} exceeds "
            f"drafter.max_position_embeddings {d.max_position_embeddings}"
        )
    # a kind with a loss of its own has its weights in train.<kind>_loss (dflash/drafter/kinds.py: KindSpec.loss_params)
    own_loss = getattr(t, f"{d.kind}_loss", None)
    if own_loss is not None and t.position_weighting != "decay":
        raise ParamsError(
            f"train.position_weighting: {t.position_weighting} is defined for drafter.kind dflash only; "
            f"{d.kind} weighs its slots by decay (exp(-(k-1)/train.loss_gamma), as its paper does)"
        )
    if own_loss is not None and t.parallel == "fsdp":
        raise ParamsError(
            f"train.parallel: fsdp shards the drafter's weights between forward passes, and {d.kind}'s loss reads its "
            "heads outside the forward; use ddp"
        )
    if own_loss is not None:
        check(own_loss, f"train.{d.kind}_loss", dict.fromkeys(vars(own_loss), at_least(0)))


def check_plan(params: Params) -> None:
    """The plan's own inputs, then everything generate and train would refuse (the plan prices those runs)."""
    p = params.plan
    check(p, "plan", PLAN)
    for i, n in enumerate(p.gpu_counts):
        if n < 1:
            raise ParamsError(f"plan.gpu_counts[{i}]: must be >= 1, got {n}")
    check(p.dataset, "plan.dataset", PLAN_DATASET)
    check(p.generation, "plan.generation", PLAN_GENERATION)
    check(p.train_assumptions, "plan.train_assumptions", PLAN_TRAIN)
    check_generate(params)
    check_train(params)
