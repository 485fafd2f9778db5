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
cluster that meets it in dflash/plan/deadline.py. `build_plan` returns the typed `Plan`; `make_plan` its JSON. Every
input is read and every path resolved once, into the `PlanContext` (dflash/plan/context.py) the estimates share; the
published runs are planned over the params file the stage read (an argument: nothing here reads the working
directory).

Command: python -m stages.plan --params params.yaml [--overlay params/gpu-qwen3.6-27b.yaml]
"""

from __future__ import annotations

from dflash.core import target_counts
from dflash.core.params import Params
from dflash.core.validate import check_plan
from dflash.drafter.geometry import build_drafter_config, parameter_counts
from dflash.plan.assumptions import assumptions
from dflash.plan.calibration import Calibration, calibration_summary, generate_calibration, train_calibration
from dflash.plan.context import PlanContext
from dflash.plan.deadline import deadline_assumptions, deadline_plan
from dflash.plan.generation import GenerationEstimate
from dflash.plan.inputs import dataset_inputs, load_target, load_tokenizer_facts, planned_hardware, resolve_paths
from dflash.plan.measured import read_generate_run, read_train_pilot, read_train_run
from dflash.plan.published import PublishedRuns, check_runs
from dflash.plan.result import DrafterFacts, Plan, PlanInputs, PlannedHardware, ScalingRow, TargetFacts
from dflash.plan.serving import plan_serving
from dflash.plan.settings import generation_settings, planned_max_num_seqs, train_settings
from dflash.plan.training import TrainingEstimate, training_estimate

__all__ = ["Plan", "build_plan", "generation_settings", "make_plan", "planned_max_num_seqs"]


def plan_context(params: Params) -> PlanContext:
    """Every input of the plan, read once: the target (and its tokenizer, for train's mask-token check), the drafter,
    the hardware profile, the stages' settings, the dataset and the training pilot (set aside when it ran on other
    hardware)."""
    check_plan(params)  # everything generate and train refuse about their sizes, before any estimate
    plan = params.plan
    paths = resolve_paths(plan, params.base)
    target = load_target(paths.target_config)
    tokenizer = load_tokenizer_facts(paths.target_config)
    drafter = build_drafter_config(params.drafter, target, tokenizer)  # train's checks, its mask-token one included
    hw = planned_hardware(plan)
    data = dataset_inputs(plan, paths, signature=target.signature)
    pilot = read_train_pilot(paths.train_pilot, target.signature, data.ignored)
    if pilot is not None and not pilot.ran_on(hw):
        data.ignored[str(paths.train_pilot)] = f"ran on {pilot.device}, not on the planned {hw.name}"
    return PlanContext(
        params=params,
        paths=paths,
        target=target,
        tokenizer=tokenizer,
        drafter=drafter,
        hw=hw,
        gs=generation_settings(params, paths),
        ta=train_settings(params, hw),
        data=data,
        pilot=pilot,
        price=plan.price_per_gpu_hour or hw.price_per_gpu_hour,
    )


def headline_training(ctx: PlanContext) -> TrainingEstimate:
    """Training on the planned GPUs in the planned layout, with its cost (dflash/plan/training.py)."""
    ta = ctx.ta
    train = training_estimate(
        ctx.target,
        ctx.drafter,
        ctx.hw,
        ta=ta,
        weight_dtype=ctx.weight_dtype,
        num_gpus=ta.num_gpus,
        data=ctx.data,
        pilot=ctx.pilot,
    )
    train.num_gpus = ta.num_gpus
    train.cost_usd = train.headline.gpu_hours * ctx.price if ctx.price > 0 else None
    return train


def scaling_rows(ctx: PlanContext) -> list[ScalingRow]:
    """Hours of generation and training at each of plan.gpu_counts (the split keeps its planned share)."""
    rows = []
    for gpus in ctx.plan.gpu_counts:
        tr = ctx.training_on(gpus)
        gen_h = ctx.generation_on(gpus).wall_hours.mid if gpus >= ctx.gs.tensor_parallel_size else None
        rows.append(ScalingRow(gpus, gen_h, tr.headline.total_hours, tr.layout, tr.headline.fits))
    return rows


def calibrations(ctx: PlanContext) -> list[Calibration]:
    """The plan against the stages' own reports, for the stages that ran (dflash/plan/calibration.py)."""
    out = []
    generate_run = read_generate_run(ctx.paths.generate, ctx.target.signature, ctx.data.ignored)
    if generate_run is not None:
        out.append(generate_calibration(ctx, generate_run))
    drafter_params = parameter_counts(ctx.drafter)["total"]
    train_run = read_train_run(ctx.paths.train, drafter_params, ctx.hw, ignored=ctx.data.ignored)
    if train_run is not None:
        tr = ctx.params.train
        layout = "split" if tr.target_device != tr.drafter_device else "data_parallel"
        out.append(train_calibration(ctx, train_run, layout))
    return out


def plan_summary(ctx: PlanContext, gen: GenerationEstimate, train: TrainingEstimate) -> dict:
    """reports/plan.json, the DVC metrics: the few numbers worth diffing between experiments."""
    plan = ctx.plan
    return {
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
        "drafter_params": parameter_counts(ctx.drafter)["total"],
        "generation_cost_usd": gen.cost_usd,
        "train_cost_usd": train.cost_usd,
        "target_signature": ctx.target.signature,
    }


def plan_inputs(ctx: PlanContext, train: TrainingEstimate) -> PlanInputs:
    paths, data, tokenizer = ctx.paths, ctx.data, ctx.tokenizer
    return PlanInputs(
        target_config=str(paths.target_config),
        mask_token_checked_against=str(tokenizer.folder / "tokenizer.json")
        if tokenizer
        else "the target's embedding rows only (no tokenizer.json beside the config)",
        audit_json=str(paths.audit) if data.audit_found else None,
        tokenize_json=str(paths.tokenize) if data.tokenize_found else None,
        pilot_json=str(paths.pilot) if data.pilot else None,
        train_pilot_json=str(paths.train_pilot) if ctx.pilot is not None and train.source == "pilot" else None,
        sources=data.sources,
        ignored=data.ignored,
    )


def target_facts(ctx: PlanContext) -> TargetFacts:
    t = ctx.target
    return TargetFacts(
        architecture=t.architecture,
        layers=t.num_layers,
        full_attention_layers=t.n_attention,
        linear_attention_layers=t.n_linear,
        hidden_size=t.hidden_size,
        vocab_size=t.vocab_size,
        params=target_counts.target_params(t),
        weight_dtype=ctx.weight_dtype,
    )


def build_plan(params: Params, *, published: PublishedRuns | None = None) -> Plan:
    """The plan (module docstring); with `published`, the model held against those published runs."""
    ctx = plan_context(params)
    gen = ctx.generation_on(ctx.plan.num_gpus, ctx.price)
    train = headline_training(ctx)
    deadline = deadline_plan(ctx) if ctx.plan.deadline_hours > 0 else None
    calibration = calibrations(ctx)
    serving = plan_serving(ctx, gen.memory.resident_context_tokens)
    summary = plan_summary(ctx, gen, train)
    if deadline is not None:
        summary["deadline"] = deadline.summary()
    if calibration:
        summary["calibration"] = calibration_summary(calibration)
    if serving is not None:
        summary["serving_speedup_batch1"] = serving.rows[0].speedup
    drafter = ctx.drafter
    result = Plan(
        summary=summary,
        inputs=plan_inputs(ctx, train),
        hardware=PlannedHardware(profile=ctx.hw, count=ctx.plan.num_gpus, price_used=ctx.price or None),
        target=target_facts(ctx),
        drafter=DrafterFacts(drafter, parameter_counts(drafter), drafter.deepest_target_layer),
        dataset=ctx.data,
        generation=gen,
        training=train,
        scaling=scaling_rows(ctx),
        deadline=deadline,
        calibration=calibration,
        published=check_runs(published) if published is not None else [],
        serving=serving,
    )
    result.assumptions = assumptions(ctx, result) + (deadline_assumptions(deadline) if deadline else [])
    return result


def make_plan(params: Params, *, published: PublishedRuns | None = None) -> dict:
    """The plan as one JSON-able dict (plan_details.json)."""
    return build_plan(params, published=published).to_json()
