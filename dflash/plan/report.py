"""Render the plan (dflash/plan/estimate.py `build_plan`, the typed `Plan` of dflash/plan/result.py) as a readable markdown
report and as plot tables.

Pure formatting: no arithmetic beyond unit conversions, so the JSON and the markdown never disagree. One function per
section: headline, inputs, target, drafter, hardware here; generation (dflash/plan/report_generation.py), training
with its pilot (report_training.py), the deadline (report_deadline.py), calibration and the published runs
(report_checks.py); then hours vs GPUs and the assumptions.
"""

from __future__ import annotations

from dflash.core.figures import line_chart
from dflash.plan.report_checks import calibration_lines, published_lines
from dflash.plan.report_deadline import deadline_lines
from dflash.plan.report_format import count, hours, num, table, usd
from dflash.plan.report_generation import generation_lines
from dflash.plan.report_serving import serving_lines
from dflash.plan.report_training import training_lines
from dflash.plan.result import Plan, ScalingRow


def render_markdown(p: Plan) -> str:
    """The whole report, section by section."""
    lines = headline_lines(p)
    lines += calibration_lines(p.calibration)
    if p.deadline is not None:
        lines += deadline_lines(p.deadline, p.hardware.profile.name)
    lines += inputs_lines(p) + target_lines(p) + drafter_lines(p) + hardware_lines(p)
    lines += generation_lines(p.generation)
    lines += training_lines(p.training, p.drafter.config.block_size)
    lines += serving_lines(p.serving)
    lines += scaling_lines(p.scaling)
    lines += published_lines(p.published)
    lines += ["", "## Assumptions", ""] + [f"- {a}" for a in p.assumptions]
    return "\n".join(lines) + "\n"


def headline_lines(p: Plan) -> list[str]:
    hw, tg, dr = p.hardware, p.target, p.drafter
    gen, tr = p.generation, p.training
    mem, head = gen.memory, tr.headline
    lines = [
        f"# Plan: {tg.architecture} on {hw.count} x {hw.profile.name}",
        "",
        "Estimates from configs, a GPU profile and (when present) measurements; not measurements themselves. "
        "Every input and assumption is listed below. Command: `python -m stages.plan`.",
        "",
        "## Headline",
        "",
    ]
    wh = gen.wall_hours
    gen_rate = f"{num(gen.model_tokens_per_s)} tok/s modelled"
    if gen.pilot:
        gen_rate += f", {num(gen.pilot.measured_per_engine * gen.engines)} tok/s from the pilot"
    lines += table(
        ["", "estimate"],
        [
            [
                "generation wall time",
                f"{hours(wh.mid)} (range {hours(wh.low)} - {hours(wh.high)}; {gen.wall_source})"
                if wh.mid is not None
                else f"n/a: the weights ({mem.weights_gb_per_gpu:.1f} GB a GPU) DO NOT FIT "
                f"({mem.budget_gb_per_gpu:.1f} GB budget, {mem.reserve_gb_per_gpu:.1f} GB reserve)",
            ],
            ["generation throughput", f"{gen_rate}, {gen.engines} engine(s) x TP {gen.tensor_parallel_size}"],
            ["generation GPU-hours / cost", f"{count(gen.gpu_hours)} / {usd(gen.cost_usd)}"],
            [
                "training",
                f"{tr.layout} on {head.gpus} GPU(s): {hours(head.total_hours)} for the epochs "
                f"({'training pilot' if tr.source == 'pilot' else 'FLOPs model'}), "
                f"{'fits' if head.fits else 'DOES NOT FIT'} (margin {head.margin_gb:.1f} GB)"
                + (f"; measured peak {tr.pilot.peak_memory_gb:.3g} GB at the worst rows" if tr.pilot else ""),
            ],
            ["training GPU-hours / cost", f"{head.gpu_hours:,.0f} / {usd(tr.cost_usd)}"],
            [
                "drafter",
                f"{num(dr.params['total'], 2)} trainable params ({dr.params['total'] * 2 / 1e9:.2f} GB bf16)",
            ],
        ],
    )
    return lines


def inputs_lines(p: Plan) -> list[str]:
    ds, inputs = p.dataset, p.inputs
    src = inputs.sources
    lines: list[str] = ["", "## Inputs", ""]
    lines += table(
        ["input", "value", "from"],
        [
            ["target config", inputs.target_config, "plan.target_config"],
            ["prompts", count(ds.num_prompts), src["num_prompts"]],
            ["mean prompt tokens", f"{ds.mean_prompt_tokens:.0f}", src["mean_prompt_tokens"]],
            [
                "mean output tokens",
                f"{ds.mean_output_tokens:.0f} (range {ds.low:.0f} - {ds.high:.0f})",
                src["mean_output_tokens"],
            ],
            ["training samples", count(ds.train_samples), src["train_samples"]],
            ["tokens per training sample", f"{ds.seq_tokens:.0f}", src["seq_tokens"]],
            ["loss tokens per training sample", f"{ds.loss_tokens:.0f}", src["loss_tokens"]],
            ["audit metrics", inputs.audit_json or "absent (params used)", ""],
            ["tokenize metrics", inputs.tokenize_json or "absent (params used)", ""],
            ["pilot", inputs.pilot_json or "absent (model only)", ""],
            ["training pilot", inputs.train_pilot_json or "absent (model only)", ""],
        ]
        + [[f"ignored: {path}", why, ""] for path, why in inputs.ignored.items()],
    )
    return lines


def target_lines(p: Plan) -> list[str]:
    tg, gen = p.target, p.generation
    counts = tg.params
    lines: list[str] = ["", "## Target", ""]
    lines += [
        f"{tg.layers} layers = {tg.linear_attention_layers} linear-attention (Gated DeltaNet) + "
        f"{tg.full_attention_layers} attention; hidden {tg.hidden_size}, vocab {tg.vocab_size}; "
        f"weights {tg.weight_dtype}.",
        "",
    ]
    lines += table(
        ["part", "parameters", "counted for"],
        [
            ["decoder layers + final norm", num(counts["decoder"], 2), "memory, decode reads, FLOPs"],
            ["embed_tokens", num(counts["embed_tokens"], 2), "memory (decode gathers only b rows)"],
            ["lm_head", num(counts["lm_head"], 2), "memory, decode reads, FLOPs"],
            ["text model total", num(counts["text_total"], 2), f"{gen.weights_gb:.1f} GB loaded"],
            ["MTP layers", num(counts["mtp_skipped"], 2), "skipped (vLLM does not load mtp.*)"],
            ["vision tower (approx.)", num(counts["vision_skipped"], 2), "skipped (--language-model-only)"],
        ],
    )
    return lines


def drafter_lines(p: Plan) -> list[str]:
    dr = p.drafter
    c, counts = dr.config, dr.params
    lines: list[str] = ["", "## Drafter", ""]
    lines += [
        f"{c.num_hidden_layers} layers ({', '.join(c.layer_types)}), {c.num_attention_heads} x "
        f"{c.head_dim} heads, {c.num_key_value_heads} KV heads, FFN {c.intermediate_size}, block "
        f"{c.block_size}, K = {len(c.target_layer_ids)} target features {list(c.target_layer_ids)} (last layer "
        f"read: {dr.deepest_target_layer}).",
        "",
    ]
    lines += table(
        ["part", "parameters"],
        [
            ["q/o projections", num(counts["attn_q_o"], 2)],
            ["k/v projections", num(counts["attn_kv"], 2)],
            ["SwiGLU MLPs", num(counts["mlp"], 2)],
            ["fc (K*H -> H)", num(counts["fc"], 2)],
            ["norms", num(counts["norms"], 2)],
            ["total trainable", f"{count(counts['total'])} ({num(counts['total'], 2)})"],
        ],
    )
    return lines


def hardware_lines(p: Plan) -> list[str]:
    hw = p.hardware.profile
    lines: list[str] = ["", "## Hardware", ""]
    lines += [
        f"{p.hardware.count} x {hw.name}: {hw.memory_gb:.0f} GB, {hw.bandwidth_tbps} TB/s, "
        f"{hw.bf16_tflops:.3g} TFLOP/s dense BF16, {hw.fp32_tflops:.3g} FP32 (0 = unknown), {hw.interconnect}.",
        "",
        f"Source: {hw.source}",
    ]
    return lines


def scaling_lines(rows: list[ScalingRow]) -> list[str]:
    lines: list[str] = ["", "## Time vs GPU count", ""]
    lines += table(
        ["GPUs", "generation", "training", "training layout"],
        [
            [
                r.gpus,
                hours(r.generation_hours),
                hours(r.train_hours),
                r.train_layout + ("" if r.train_fits else " (DOES NOT FIT)"),
            ]
            for r in rows
        ],
    )
    lines += ["", f"![Time vs GPU count]({FIGURE})"]
    return lines


def scaling_csv(rows: list[ScalingRow], phase: str) -> str:
    """`gpus,hours` rows for one phase, generation or training (the DVC plot files)."""
    out = ["gpus,hours"]
    out += [f"{r.gpus},{h:.6g}" for r in rows if (h := _phase_hours(r, phase)) is not None]
    return "\n".join(out) + "\n"


def _phase_hours(row: ScalingRow, phase: str) -> float | None:
    return row.generation_hours if phase == "generation" else row.train_hours


FIGURE = "plan_time_vs_gpus.png"  # beside plan.md (stages/plan.py writes it)


def time_vs_gpus(rows: list[ScalingRow]) -> dict:
    """The Vega-Lite figure of the scaling table: hours of generation and of training by GPU count."""
    points = [
        {"GPUs": r.gpus, "phase": phase, "hours": h}
        for r in rows
        for phase in ("generation", "training")
        if (h := _phase_hours(r, phase)) is not None
    ]
    return line_chart(
        points,
        x="GPUs",
        y="hours",
        color="phase",
        title="Time vs GPU count",
        x_title="GPUs",
        y_title="hours",
        log_x=True,
        log_y=True,
        subtitle="the plan's estimate for each phase (log scales)",
    )
