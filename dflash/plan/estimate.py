"""Plan: time, memory and cost of generation and training, before any GPU time is spent.

Pure arithmetic on configs and measurements (no torch, no model download):
- the target's config.json (`plan.target_config`, default `${base.target_dir}/config.json`),
  counted by dflash/core/target_counts.py and dflash/plan/sizing.py; the drafter from the `drafter` params (dflash/drafter/geometry.py);
- a GPU profile (`plan.hardware` in `plan.hardware_file`) and a GPU count;
- the dataset: `audit.json` (num_conversations, mean prompt tokens) and `tokenize.json`
  (num_samples, total_tokens, loss_tokens) when they exist, else the `plan.dataset` fallbacks;
- the generate pilot (`pilot.json`) when it exists: estimate vs measured, and the measured mean
  output length and rate drive the wall time.

Models (every knob a param, every assumption printed in the report): generation in
dflash/plan/generation.py (a roofline decode per engine, cache capacity), training in
dflash/plan/training.py (FLOPs per sequence at an MFU, per-GPU memory per device layout); with
`plan.deadline_hours` set, the smallest cluster that meets it in dflash/plan/deadline.py.

Command: python -m stages.plan --params params.yaml [--overlay params/gpu-qwen3.6-27b.yaml]
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

from dflash.core import target_counts
from dflash.core.concurrency import chosen_from_pilot, resolve_max_num_seqs
from dflash.core.target_config import TargetArch, target_signature
from dflash.core.validate import check_plan
from dflash.drafter.geometry import build_drafter_config, config_dict, parameter_counts
from dflash.plan.deadline import GRAD_BYTES_PER_PARAM, deadline_assumptions, deadline_plan, deadline_summary
from dflash.plan.generation import generation_estimate
from dflash.plan.inputs import (
    GpuProfile,
    dataset_inputs,
    load_hardware,
    load_target,
    load_tokenizer_facts,
    resolve_paths,
    select_gpu,
)
from dflash.plan.training import train_inputs, training_at, training_estimate


def make_plan(params: Any) -> dict:
    """Everything the report shows, as one JSON-able dict."""
    check_plan(params)  # everything generate and train refuse about their sizes, before any estimate
    plan = params.plan
    paths = resolve_paths(plan, params.base)
    target = load_target(paths["target_config"])
    tokenizer = load_tokenizer_facts(paths["target_config"])
    drafter = build_drafter_config(params.drafter, target, tokenizer)  # train's checks, its mask-token one included
    hw_file = plan.hardware_file
    hw = select_gpu(load_hardware(hw_file), plan.hardware, hw_file)
    price = plan.price_per_gpu_hour or hw.price_per_gpu_hour
    signature = target.signature
    data = dataset_inputs(plan, paths, signature)
    data["low"], data["high"] = plan.dataset.output_tokens_low, plan.dataset.output_tokens_high
    if data["pilot"]:  # the measured mean replaces the assumed one; keep the range around it
        data["low"] = min(data["low"], data["mean_output_tokens"])
        data["high"] = max(data["high"], data["mean_output_tokens"])
    ta = train_inputs(params)
    train_gpus = ta.num_gpus or plan.num_gpus
    gs = generation_settings(params)
    gen = generation_estimate(target, hw, gs, plan.weight_dtype, plan.num_gpus, data, price)
    gen["max_num_seqs_source"] = planned_max_num_seqs(params)[1]
    train = training_estimate(target, drafter, hw, ta, plan.weight_dtype, train_gpus, data)
    train["num_gpus"] = train_gpus
    train["cost_usd"] = train["headline"]["gpu_hours"] * price if price > 0 else None
    scaling = []
    for g in plan.gpu_counts:
        row: dict[str, Any] = {"gpus": g}
        row["generation_hours"] = (
            generation_estimate(target, hw, gs, plan.weight_dtype, g, data, price)["wall_hours"]["mid"]
            if g >= gs.tensor_parallel_size
            else None
        )
        tr = training_at(target, drafter, hw, ta, plan.weight_dtype, g, data, train_gpus)  # the split's share kept
        row["train_hours"] = tr["headline"]["total_hours"]
        row["train_layout"] = tr["layout"]
        row["train_fits"] = tr["headline"]["fits"]
        scaling.append(row)
    tparams = target_counts.target_params(target)
    dparams = parameter_counts(drafter)
    summary = {  # reports/plan.json, the DVC metrics: the few numbers worth diffing between experiments
        "hardware": plan.hardware,
        "num_gpus": plan.num_gpus,
        "generation_hours": gen["wall_hours"]["mid"],
        "generation_tokens_per_s": gen["model_tokens_per_s"],
        "generation_batch_per_engine": gen["memory"]["batch"],
        "train_hours": train["headline"]["total_hours"],
        "train_layout": train["layout"],
        "train_fits": train["headline"]["fits"],
        "train_margin_gb": train["headline"]["margin_gb"],
        "target_weights_gb": gen["weights_gb"],
        "drafter_params": dparams["total"],
        "generation_cost_usd": gen["cost_usd"],
        "train_cost_usd": train["cost_usd"],
        "target_signature": target.signature,
    }
    deadline = None
    if plan.deadline_hours > 0:
        ctx = {"plan": plan, "target": target, "drafter": drafter, "hw": hw, "gs": gs, "ta": ta, "data": data}
        ctx |= {"train_gpus": train_gpus, "gpus_per_node": plan.gpus_per_node}
        ctx["grad_bytes"] = dparams["total"] * GRAD_BYTES_PER_PARAM
        deadline = deadline_plan(ctx)
        summary["deadline"] = deadline_summary(deadline)
    return {
        "summary": summary,
        "inputs": {
            "target_config": str(paths["target_config"]),
            "mask_token_checked_against": str(tokenizer.folder / "tokenizer.json")
            if tokenizer
            else "the target's embedding rows only (no tokenizer.json beside the config)",
            "audit_json": str(paths["audit"]) if data["audit"] else None,
            "tokenize_json": str(paths["tokenize"]) if data["tokenize"] else None,
            "pilot_json": str(paths["pilot"]) if data["pilot"] else None,
            "sources": data["sources"],
            "ignored": data["ignored"],
        },
        "hardware": {**hw.__dict__, "count": plan.num_gpus, "price_used": price or None},
        "target": {
            "architecture": target.architecture,
            "layers": target.num_layers,
            "full_attention_layers": target.n_attention,
            "linear_attention_layers": target.n_linear,
            "hidden_size": target.hidden_size,
            "vocab_size": target.vocab_size,
            "params": tparams,
            "weight_dtype": plan.weight_dtype,
        },
        "drafter": {"params": dparams, **config_dict(drafter), "deepest_target_layer": drafter.deepest_target_layer},
        "dataset": {k: data[k] for k in ("num_prompts", "mean_prompt_tokens", "mean_output_tokens", "low", "high")}
        | {k: data[k] for k in ("train_samples", "seq_tokens", "loss_tokens")},
        "generation": gen,
        "training": train,
        "scaling": scaling,
        "deadline": deadline,
        "assumptions": assumptions(params, target, hw) + (deadline_assumptions(deadline) if deadline else []),
    }


def planned_max_num_seqs(params: Any) -> tuple[int, str]:
    """The concurrency generate will run at, and where it came from: an integer param; auto -> the pilot
    sweep's chosen_max_num_seqs (dflash/core/concurrency.py); auto before any sweep -> its largest level."""
    gen = params.generate
    if gen.max_num_seqs != "auto":
        return gen.max_num_seqs, "param generate.max_num_seqs"
    paths = resolve_paths(params.plan, params.base)
    pilot = paths["pilot"]
    chosen = chosen_from_pilot(pilot, target_signature(paths["target_config"]))
    if chosen is not None:
        return chosen, f"{pilot} chosen_max_num_seqs (generate.max_num_seqs: auto)"
    if not gen.pilot_sweep:
        resolve_max_num_seqs(gen, pilot)  # the UserError generate would raise: run the pilot
    return max(gen.pilot_sweep), "largest generate.pilot_sweep level (auto, no sweep measured yet)"


def generation_settings(params: Any) -> SimpleNamespace:
    """The engine settings of the generate stage (what will really run) + the plan's efficiency assumptions."""
    gen, eff = params.generate, params.plan.generation
    return SimpleNamespace(
        tensor_parallel_size=gen.tensor_parallel_size,
        gpu_memory_utilization=gen.gpu_memory_utilization,
        max_num_seqs=planned_max_num_seqs(params)[0],
        max_model_len=gen.max_model_len,
        **{f.name: getattr(eff, f.name) for f in dataclasses.fields(eff)},
    )


def assumptions(params: Any, t: TargetArch, hw: GpuProfile) -> list[str]:
    """The modelling choices behind the numbers, in words (the report's last section)."""
    g, ta = generation_settings(params), train_inputs(params)
    out = [
        f"Generation: one vLLM engine per {g.tensor_parallel_size} GPU(s). A decode step takes max(bytes read / "
        f"(bandwidth x {g.bandwidth_efficiency}), FLOPs / (dense BF16 peak x {g.decode_mfu})); bytes = weights (minus "
        "the embedding table, of which only b rows are read) + each sequence's KV cache + its GDN state read and written.",
        f"Batch = min(max_num_seqs {g.max_num_seqs}, sequences that fit in memory x {g.gpu_memory_utilization} minus "
        f"weights minus a {g.activation_reserve_gb} GB reserve). Mean resident context = prompt + mean output x "
        f"(1 + cv^2) / 2 with cv = {g.output_length_cv}: in continuous batching long outputs stay resident longer.",
        f"KV cache {g.kv_cache_dtype}; GDN recurrent state {g.ssm_state_dtype} (value heads x key dim x value dim per "
        "linear layer) plus its causal-conv window (kernel - 1 rows, bf16); both constant per sequence.",
        f"Weights: the text model only, {params.plan.weight_dtype} (fp8 quantizes decoder matmuls; embeddings, lm_head "
        "and norms stay bf16). MTP layers and the vision tower are counted but not loaded.",
        f"Prefill: 2 x params x prompt tokens + causal attention at {g.prefill_mfu} MFU, added to decode time "
        "(continuous batching overlaps part of it: a slight overestimate).",
        "Attention and memory use mean lengths; sequences longer than the mean cost more than linearly in attention, "
        "so attention terms are a low estimate for long-tailed data.",
        f"Training: the target forward stops after the last feature layer; drafter forward + backward = 3 x forward "
        f"(6 x params per token); the frozen lm_head costs 4 x V x H per drafted slot (logits + input gradient); "
        f"MFU {ta.mfu}. Anchors per sequence = min(num_anchors {ta.num_anchors}, loss tokens - 1).",
        f"Training memory: target weights + one layer's temporaries + the K concatenated features; drafter "
        f"{ta.state_bytes_per_param} bytes/param (bf16 weight and grad, fp32 master, AdamW m and v; grads and states "
        f"{'sharded' if ta.shard_optimizer else 'not sharded'} over data-parallel ranks); saved activations of every "
        f"block token in every drafter layer; one logits chunk of {ta.logits_chunk_blocks} blocks (10 bytes per vocab "
        f"entry); {ta.runtime_reserve_gb} GB runtime reserve per GPU. Verdict against the full {hw.memory_gb:.0f} GB.",
        "Split layout: target GPUs and drafter GPUs form a pipeline; the slower side sets the rate. The drafter GPUs "
        "also hold the target's embedding and lm_head (frozen, shared by the drafter).",
        "Inputs that exist are read (audit / tokenize / pilot metrics); the DVC stage does not list them as deps yet.",
    ]
    if t.n_linear:
        out.append(
            "Hybrid target: vLLM pads each attention KV block to the size of one layer's GDN state and needs one such "
            "block per linear-layer group per running sequence; it refuses to start when max_num_seqs exceeds the "
            "blocks available (vLLM PR #38270). The vLLM recipe runs BF16 Qwen3.6-27B on an RTX PRO 6000 with "
            "--max-num-seqs 8 (a serving-latency setting). Run the generate pilot: its sweep measures each concurrency "
            "level on the real engine, and the rate at the chosen level replaces this model's."
        )
    return out
