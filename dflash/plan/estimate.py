"""Plan: time, memory and cost of generation and training, before any GPU time is spent, and how close it came once
the stages have run.

Pure arithmetic on configs and measurements (no torch, no model download):
- the target's config.json (`plan.target_config`, default `${base.target_dir}/config.json`), counted by
  dflash/core/target_counts.py and dflash/plan/sizing.py; the drafter from the `drafter` params
  (dflash/drafter/geometry.py, its FLOPs dflash/drafter/flops.py);
- a hardware profile (`plan.hardware` in `plan.hardware_file`: a GPU's vendor peaks, or the CPU host's measured
  ones) and a GPU count;
- the dataset: `audit.json`, `tokenize.json` and the generate pilot when they exist, else the `plan.dataset`
  fallbacks (dflash/plan/inputs.py);
- the pilots when they exist: the generate pilot's measured rate and output lengths drive the generation time, the
  training pilot's step times the training time, its peak the memory verdict (dflash/plan/measured.py);
- the stages' own reports once they ran: `calibration` (dflash/plan/calibration.py);
- the published runs the model is held against (dflash/plan/published.py).

Models (every knob a param, every assumption printed in the report, dflash/plan/assumptions.py): generation in
dflash/plan/generation.py (a roofline decode per engine, cache capacity), training in dflash/plan/training.py
(FLOPs per sequence at an MFU, per-GPU memory per device layout); with `plan.deadline_hours` set, the smallest
cluster that meets it in dflash/plan/deadline.py. `build_plan` returns the typed `Plan`; `make_plan` its JSON.

Command: python -m stages.plan --params params.yaml [--overlay params/gpu-qwen3.6-27b.yaml]
"""

from __future__ import annotations

from pathlib import Path

from dflash.core import target_counts
from dflash.core.params import Params
from dflash.core.validate import check_plan
from dflash.drafter.geometry import build_drafter_config, config_dict, parameter_counts
from dflash.plan.assumptions import assumptions
from dflash.plan.calibration import calibration_summary, generate_calibration, train_calibration
from dflash.plan.deadline import GRAD_BYTES_PER_PARAM, PlanContext, deadline_assumptions, deadline_plan
from dflash.plan.generation import generation_estimate
from dflash.plan.inputs import dataset_inputs, load_target, load_tokenizer_facts, planned_hardware, resolve_paths
from dflash.plan.measured import read_generate_run, read_train_pilot, read_train_run
from dflash.plan.published import check_runs
from dflash.plan.result import Plan, ScalingRow
from dflash.plan.serving import plan_serving
from dflash.plan.settings import generation_settings, planned_max_num_seqs, train_settings
from dflash.plan.training import training_at, training_estimate

__all__ = ["Plan", "build_plan", "generation_settings", "make_plan", "planned_max_num_seqs"]


def build_plan(params: Params) -> Plan:
    """The plan (module docstring)."""
    check_plan(params)  # everything generate and train refuse about their sizes, before any estimate
    plan = params.plan
    paths = resolve_paths(plan, params.base)
    target = load_target(paths.target_config)
    tokenizer = load_tokenizer_facts(paths.target_config)
    drafter = build_drafter_config(params.drafter, target, tokenizer)  # train's checks, its mask-token one included
    hw = planned_hardware(plan)
    price = plan.price_per_gpu_hour or hw.price_per_gpu_hour
    data = dataset_inputs(plan, paths, target.signature)
    dparams = parameter_counts(drafter)
    pilot = read_train_pilot(paths.train_pilot, target.signature, data.ignored)
    if pilot is not None and not pilot.ran_on(hw):
        data.ignored[str(paths.train_pilot)] = f"ran on {pilot.device}, not on the planned {hw.name}"
    ta = train_settings(params, hw)
    gs = generation_settings(params, paths.target_config)
    backend = params.generate.backend
    gen = generation_estimate(target, hw, gs, plan.weight_dtype, plan.num_gpus, data, price, backend)
    train = training_estimate(target, drafter, hw, ta, plan.weight_dtype, ta.num_gpus, data, pilot=pilot)
    train.num_gpus = ta.num_gpus
    train.cost_usd = train.headline.gpu_hours * price if price > 0 else None
    scaling = []
    for g in plan.gpu_counts:
        tr = training_at(target, drafter, hw, ta, plan.weight_dtype, g, data, ta.num_gpus, pilot)  # split share kept
        gen_h = None
        if g >= gs.tensor_parallel_size:
            gen_h = generation_estimate(target, hw, gs, plan.weight_dtype, g, data, price, backend).wall_hours.mid
        scaling.append(ScalingRow(g, gen_h, tr.headline.total_hours, tr.layout, tr.headline.fits))
    deadline = None
    if plan.deadline_hours > 0:
        ctx = PlanContext(
            plan=plan,
            target=target,
            drafter=drafter,
            hw=hw,
            gs=gs,
            ta=ta,
            data=data,
            train_gpus=ta.num_gpus,
            gpus_per_node=plan.gpus_per_node,
            grad_bytes=dparams["total"] * GRAD_BYTES_PER_PARAM,
            pilot=pilot,
            backend=backend,
        )
        deadline = deadline_plan(ctx)
    calibration = []
    generate_run = read_generate_run(paths.generate, target.signature, data.ignored)
    if generate_run is not None:
        calibration.append(generate_calibration(plan, target, hw, gs, data, generate_run, backend))
    train_run = read_train_run(paths.train, dparams["total"], hw, data.ignored)
    if train_run is not None:
        layout = "split" if params.train.target_device != params.train.drafter_device else "data_parallel"
        calibration.append(train_calibration(plan, target, drafter, hw, ta, data, train_run, pilot, layout))
    published = check_runs() if Path("params.yaml").exists() else []
    context = gen.memory.resident_context_tokens
    serving = plan_serving(params, target, drafter, hw, gs, ta, plan.weight_dtype, data, context, pilot)
    summary = {  # reports/plan.json, the DVC metrics: the few numbers worth diffing between experiments
        "hardware": plan.hardware,
        "num_gpus": plan.num_gpus,
        "generation_hours": gen.wall_hours.mid,
        "generation_tokens_per_s": gen.model_tokens_per_s,
        "generation_batch_per_engine": gen.memory.batch,
        "train_hours": train.headline.total_hours,
        "train_source": train.source,
        "train_layout": train.layout,
        "train_fits": train.headline.fits,
        "train_margin_gb": train.headline.margin_gb,
        "train_mfu_implied": train.pilot.implied_mfu if train.pilot else None,
        "target_weights_gb": gen.weights_gb,
        "drafter_params": dparams["total"],
        "generation_cost_usd": gen.cost_usd,
        "train_cost_usd": train.cost_usd,
        "target_signature": target.signature,
    }
    if deadline is not None:
        summary["deadline"] = deadline.summary()
    if calibration:
        summary["calibration"] = calibration_summary(calibration)
    if serving is not None:
        summary["serving_speedup_batch1"] = serving.rows[0].speedup
    result = Plan(
        summary=summary,
        inputs={
            "target_config": str(paths.target_config),
            "mask_token_checked_against": str(tokenizer.folder / "tokenizer.json")
            if tokenizer
            else "the target's embedding rows only (no tokenizer.json beside the config)",
            "audit_json": str(paths.audit) if data.audit_found else None,
            "tokenize_json": str(paths.tokenize) if data.tokenize_found else None,
            "pilot_json": str(paths.pilot) if data.pilot else None,
            "train_pilot_json": str(paths.train_pilot) if pilot is not None and train.source == "pilot" else None,
            "sources": data.sources,
            "ignored": data.ignored,
        },
        hardware={**hw.__dict__, "count": plan.num_gpus, "price_used": price or None},
        target={
            "architecture": target.architecture,
            "layers": target.num_layers,
            "full_attention_layers": target.n_attention,
            "linear_attention_layers": target.n_linear,
            "hidden_size": target.hidden_size,
            "vocab_size": target.vocab_size,
            "params": target_counts.target_params(target),
            "weight_dtype": plan.weight_dtype,
        },
        drafter={"params": dparams, **config_dict(drafter), "deepest_target_layer": drafter.deepest_target_layer},
        dataset=data,
        generation=gen,
        training=train,
        scaling=scaling,
        deadline=deadline,
        calibration=calibration,
        published=published,
        serving=serving,
    )
    result.assumptions = assumptions(params, target, hw, gs, ta, result) + (
        deadline_assumptions(deadline) if deadline else []
    )
    return result


def make_plan(params: Params) -> dict:
    """The plan as one JSON-able dict (plan_details.json)."""
    return build_plan(params).to_json()
