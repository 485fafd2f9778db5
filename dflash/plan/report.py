"""Render the plan (dflash/plan/estimate.py `make_plan`, its JSON) as a readable markdown report and as plot tables.

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


def render_markdown(p: dict) -> str:
    """The whole report, section by section."""
    lines = headline_lines(p)
    lines += calibration_lines(p.get("calibration") or [])
    if p.get("deadline"):
        lines += deadline_lines(p["deadline"], p["hardware"]["name"])
    lines += inputs_lines(p) + target_lines(p) + drafter_lines(p) + hardware_lines(p)
    lines += generation_lines(p["generation"])
    lines += training_lines(p["training"], p["drafter"]["block_size"])
    lines += serving_lines(p.get("serving"))
    lines += scaling_lines(p)
    lines += published_lines(p.get("published") or [])
    lines += ["", "## Assumptions", ""] + [f"- {a}" for a in p["assumptions"]]
    return "\n".join(lines) + "\n"


def headline_lines(p: dict) -> list[str]:
    hw, tg, dr = p["hardware"], p["target"], p["drafter"]
    gen, tr = p["generation"], p["training"]
    mem, head = gen["memory"], tr["headline"]
    lines = [
        f"# Plan: {tg['architecture']} on {hw['count']} x {hw['name']}",
        "",
        "Estimates from configs, a GPU profile and (when present) measurements; not measurements themselves. "
        "Every input and assumption is listed below. Command: `python -m stages.plan`.",
        "",
        "## Headline",
        "",
    ]
    wh = gen["wall_hours"]
    gen_rate = f"{num(gen['model_tokens_per_s'])} tok/s modelled"
    if gen.get("pilot"):
        gen_rate += f", {num(gen['pilot']['measured_per_engine'] * gen['engines'])} tok/s from the pilot"
    lines += table(
        ["", "estimate"],
        [
            [
                "generation wall time",
                f"{hours(wh['mid'])} (range {hours(wh['low'])} - {hours(wh['high'])}; {gen['wall_source']})"
                if wh["mid"] is not None
                else f"n/a: the weights ({mem['weights_gb_per_gpu']:.1f} GB a GPU) DO NOT FIT "
                f"({mem['budget_gb_per_gpu']:.1f} GB budget, {mem['reserve_gb_per_gpu']:.1f} GB reserve)",
            ],
            ["generation throughput", f"{gen_rate}, {gen['engines']} engine(s) x TP {gen['tensor_parallel_size']}"],
            ["generation GPU-hours / cost", f"{count(gen['gpu_hours'])} / {usd(gen['cost_usd'])}"],
            [
                "training",
                f"{tr['layout']} on {head['gpus']} GPU(s): {hours(head['total_hours'])} for the epochs "
                f"({'training pilot' if tr['source'] == 'pilot' else 'FLOPs model'}), "
                f"{'fits' if head['fits'] else 'DOES NOT FIT'} (margin {head['margin_gb']:.1f} GB)"
                + (
                    f"; measured peak {tr['pilot']['peak_memory_gb']:.3g} GB at the worst rows"
                    if tr.get("pilot")
                    else ""
                ),
            ],
            ["training GPU-hours / cost", f"{head['gpu_hours']:,.0f} / {usd(tr['cost_usd'])}"],
            [
                "drafter",
                f"{num(dr['params']['total'], 2)} trainable params ({dr['params']['total'] * 2 / 1e9:.2f} GB bf16)",
            ],
        ],
    )
    return lines


def inputs_lines(p: dict) -> list[str]:
    ds = p["dataset"]
    lines: list[str] = []
    src = p["inputs"]["sources"]
    lines += ["", "## Inputs", ""]
    lines += table(
        ["input", "value", "from"],
        [
            ["target config", p["inputs"]["target_config"], "plan.target_config"],
            ["prompts", count(ds["num_prompts"]), src["num_prompts"]],
            ["mean prompt tokens", f"{ds['mean_prompt_tokens']:.0f}", src["mean_prompt_tokens"]],
            [
                "mean output tokens",
                f"{ds['mean_output_tokens']:.0f} (range {ds['low']:.0f} - {ds['high']:.0f})",
                src["mean_output_tokens"],
            ],
            ["training samples", count(ds["train_samples"]), src["train_samples"]],
            ["tokens per training sample", f"{ds['seq_tokens']:.0f}", src["seq_tokens"]],
            ["loss tokens per training sample", f"{ds['loss_tokens']:.0f}", src["loss_tokens"]],
            ["audit metrics", p["inputs"]["audit_json"] or "absent (params used)", ""],
            ["tokenize metrics", p["inputs"]["tokenize_json"] or "absent (params used)", ""],
            ["pilot", p["inputs"]["pilot_json"] or "absent (model only)", ""],
            ["training pilot", p["inputs"].get("train_pilot_json") or "absent (model only)", ""],
        ]
        + [[f"ignored: {path}", why, ""] for path, why in p["inputs"].get("ignored", {}).items()],
    )
    return lines


def target_lines(p: dict) -> list[str]:
    tg, gen = p["target"], p["generation"]
    lines: list[str] = []
    tp = tg["params"]
    lines += ["", "## Target", ""]
    lines += [
        f"{tg['layers']} layers = {tg['linear_attention_layers']} linear-attention (Gated DeltaNet) + "
        f"{tg['full_attention_layers']} attention; hidden {tg['hidden_size']}, vocab {tg['vocab_size']}; "
        f"weights {tg['weight_dtype']}.",
        "",
    ]
    lines += table(
        ["part", "parameters", "counted for"],
        [
            ["decoder layers + final norm", num(tp["decoder"], 2), "memory, decode reads, FLOPs"],
            ["embed_tokens", num(tp["embed_tokens"], 2), "memory (decode gathers only b rows)"],
            ["lm_head", num(tp["lm_head"], 2), "memory, decode reads, FLOPs"],
            ["text model total", num(tp["text_total"], 2), f"{gen['weights_gb']:.1f} GB loaded"],
            ["MTP layers", num(tp["mtp_skipped"], 2), "skipped (vLLM does not load mtp.*)"],
            ["vision tower (approx.)", num(tp["vision_skipped"], 2), "skipped (--language-model-only)"],
        ],
    )
    return lines


def drafter_lines(p: dict) -> list[str]:
    dr = p["drafter"]
    lines: list[str] = []
    d = dr["params"]
    lines += ["", "## Drafter", ""]
    lines += [
        f"{dr['num_hidden_layers']} layers ({', '.join(dr['layer_types'])}), {dr['num_attention_heads']} x "
        f"{dr['head_dim']} heads, {dr['num_key_value_heads']} KV heads, FFN {dr['intermediate_size']}, block "
        f"{dr['block_size']}, K = {len(dr['target_layer_ids'])} target features {dr['target_layer_ids']} (last layer "
        f"read: {dr['deepest_target_layer']}).",
        "",
    ]
    lines += table(
        ["part", "parameters"],
        [
            ["q/o projections", num(d["attn_q_o"], 2)],
            ["k/v projections", num(d["attn_kv"], 2)],
            ["SwiGLU MLPs", num(d["mlp"], 2)],
            ["fc (K*H -> H)", num(d["fc"], 2)],
            ["norms", num(d["norms"], 2)],
            ["total trainable", f"{count(d['total'])} ({num(d['total'], 2)})"],
        ],
    )
    return lines


def hardware_lines(p: dict) -> list[str]:
    hw = p["hardware"]
    lines: list[str] = []
    lines += ["", "## Hardware", ""]
    lines += [
        f"{hw['count']} x {hw['name']}: {hw['memory_gb']:.0f} GB, {hw['bandwidth_tbps']} TB/s, "
        f"{hw['bf16_tflops']:.3g} TFLOP/s dense BF16, {hw['fp32_tflops']:.3g} FP32 (0 = unknown), {hw['interconnect']}.",
        "",
        f"Source: {hw['source']}",
    ]
    return lines


def scaling_lines(p: dict) -> list[str]:
    lines: list[str] = []
    lines += ["", "## Time vs GPU count", ""]
    lines += table(
        ["GPUs", "generation", "training", "training layout"],
        [
            [
                r["gpus"],
                hours(r["generation_hours"]),
                hours(r["train_hours"]),
                r["train_layout"] + ("" if r["train_fits"] else " (DOES NOT FIT)"),
            ]
            for r in p["scaling"]
        ],
    )
    lines += ["", f"![Time vs GPU count]({FIGURE})"]
    return lines


def scaling_csv(p: dict, column: str) -> str:
    """`gpus,hours` rows for one phase (the DVC plot files)."""
    rows = ["gpus,hours"]
    rows += [f"{r['gpus']},{r[column]:.6g}" for r in p["scaling"] if r[column] is not None]
    return "\n".join(rows) + "\n"


FIGURE = "plan_time_vs_gpus.png"  # beside plan.md (stages/plan.py writes it)


def time_vs_gpus(p: dict) -> dict:
    """The Vega-Lite figure of the scaling table: hours of generation and of training by GPU count."""
    rows = [
        {"GPUs": r["gpus"], "phase": phase, "hours": r[key]}
        for r in p["scaling"]
        for phase, key in (("generation", "generation_hours"), ("training", "train_hours"))
        if r[key] is not None
    ]
    return line_chart(
        rows,
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
