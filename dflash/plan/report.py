"""Render the plan dict (dflash.plan.make_plan) as a readable markdown report and as plot tables.

Pure formatting: no arithmetic beyond unit conversions, so the JSON and the markdown never disagree.
"""

from __future__ import annotations

from typing import Any

from dflash.core.figures import line_chart


def _n(x: float | None, digits: int = 1) -> str:
    """Human number: 1.73 B, 902.0 K, 12.3."""
    if x is None:
        return "n/a"
    for scale, unit in ((1e12, " T"), (1e9, " B"), (1e6, " M"), (1e3, " K")):
        if abs(x) >= scale:
            return f"{x / scale:.{digits + 1}f}{unit}"
    return f"{x:.{digits}f}"


def _h(hours: float | None) -> str:
    if hours is None or hours != hours or hours == float("inf"):
        return "n/a"
    if hours >= 24:
        return f"{hours:,.1f} h ({hours / 24:.1f} d)"
    if hours >= 1:
        return f"{hours:.2f} h"
    return f"{hours * 60:.1f} min" if hours * 60 >= 1 else f"{hours * 3600:.2g} s"


def _count(x: float | None) -> str:
    return "n/a" if x is None else f"{x:,.0f}"


def _usd(x: float | None) -> str:
    return "n/a (no price: set plan.price_per_gpu_hour)" if x is None else f"${x:,.0f}"


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out


def render_markdown(p: dict) -> str:
    hw, tg, dr, ds = p["hardware"], p["target"], p["drafter"], p["dataset"]
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
    gen_rate = f"{_n(gen['model_tokens_per_s'])} tok/s modelled"
    if gen.get("pilot"):
        gen_rate += f", {_n(gen['pilot']['measured_per_engine'] * gen['engines'])} tok/s from the pilot"
    lines += _table(
        ["", "estimate"],
        [
            [
                "generation wall time",
                f"{_h(wh['mid'])} (range {_h(wh['low'])} - {_h(wh['high'])}; {gen['wall_source']})"
                if wh["mid"] is not None
                else f"n/a: the weights ({mem['weights_gb_per_gpu']:.1f} GB a GPU) DO NOT FIT "
                f"({mem['budget_gb_per_gpu']:.1f} GB budget, {mem['reserve_gb_per_gpu']:.1f} GB reserve)",
            ],
            ["generation throughput", f"{gen_rate}, {gen['engines']} engine(s) x TP {gen['tensor_parallel_size']}"],
            ["generation GPU-hours / cost", f"{_count(gen['gpu_hours'])} / {_usd(gen['cost_usd'])}"],
            [
                "training",
                f"{tr['layout']} on {head['gpus']} GPU(s): {_h(head['total_hours'])} for the epochs, "
                f"{'fits' if head['fits'] else 'DOES NOT FIT'} (margin {head['margin_gb']:.1f} GB)",
            ],
            ["training GPU-hours / cost", f"{head['gpu_hours']:,.0f} / {_usd(tr['cost_usd'])}"],
            [
                "drafter",
                f"{_n(dr['params']['total'], 2)} trainable params ({dr['params']['total'] * 2 / 1e9:.2f} GB bf16)",
            ],
        ],
    )
    if p.get("deadline"):
        lines += deadline_lines(p["deadline"], hw["name"])
    src = p["inputs"]["sources"]
    lines += ["", "## Inputs", ""]
    lines += _table(
        ["input", "value", "from"],
        [
            ["target config", p["inputs"]["target_config"], "plan.target_config"],
            ["prompts", _count(ds["num_prompts"]), src["num_prompts"]],
            ["mean prompt tokens", f"{ds['mean_prompt_tokens']:.0f}", src["mean_prompt_tokens"]],
            [
                "mean output tokens",
                f"{ds['mean_output_tokens']:.0f} (range {ds['low']:.0f} - {ds['high']:.0f})",
                src["mean_output_tokens"],
            ],
            ["training samples", _count(ds["train_samples"]), src["train_samples"]],
            ["tokens per training sample", f"{ds['seq_tokens']:.0f}", src["seq_tokens"]],
            ["loss tokens per training sample", f"{ds['loss_tokens']:.0f}", src["loss_tokens"]],
            ["audit metrics", p["inputs"]["audit_json"] or "absent (params used)", ""],
            ["tokenize metrics", p["inputs"]["tokenize_json"] or "absent (params used)", ""],
            ["pilot", p["inputs"]["pilot_json"] or "absent (model only)", ""],
        ]
        + [[f"ignored: {path}", why, ""] for path, why in p["inputs"].get("ignored", {}).items()],
    )
    tp = tg["params"]
    lines += ["", "## Target", ""]
    lines += [
        f"{tg['layers']} layers = {tg['linear_attention_layers']} linear-attention (Gated DeltaNet) + "
        f"{tg['full_attention_layers']} attention; hidden {tg['hidden_size']}, vocab {tg['vocab_size']}; "
        f"weights {tg['weight_dtype']}.",
        "",
    ]
    lines += _table(
        ["part", "parameters", "counted for"],
        [
            ["decoder layers + final norm", _n(tp["decoder"], 2), "memory, decode reads, FLOPs"],
            ["embed_tokens", _n(tp["embed_tokens"], 2), "memory (decode gathers only b rows)"],
            ["lm_head", _n(tp["lm_head"], 2), "memory, decode reads, FLOPs"],
            ["text model total", _n(tp["text_total"], 2), f"{gen['weights_gb']:.1f} GB loaded"],
            ["MTP layers", _n(tp["mtp_skipped"], 2), "skipped (vLLM does not load mtp.*)"],
            ["vision tower (approx.)", _n(tp["vision_skipped"], 2), "skipped (--language-model-only)"],
        ],
    )
    d = dr["params"]
    lines += ["", "## Drafter", ""]
    lines += [
        f"{dr['num_hidden_layers']} layers ({', '.join(dr['layer_types'])}), {dr['num_attention_heads']} x "
        f"{dr['head_dim']} heads, {dr['num_key_value_heads']} KV heads, FFN {dr['intermediate_size']}, block "
        f"{dr['block_size']}, K = {len(dr['target_layer_ids'])} target features {dr['target_layer_ids']} (last layer "
        f"read: {dr['deepest_target_layer']}).",
        "",
    ]
    lines += _table(
        ["part", "parameters"],
        [
            ["q/o projections", _n(d["attn_q_o"], 2)],
            ["k/v projections", _n(d["attn_kv"], 2)],
            ["SwiGLU MLPs", _n(d["mlp"], 2)],
            ["fc (K*H -> H)", _n(d["fc"], 2)],
            ["norms", _n(d["norms"], 2)],
            ["total trainable", f"{_count(d['total'])} ({_n(d['total'], 2)})"],
        ],
    )
    lines += ["", "## Hardware", ""]
    lines += [
        f"{hw['count']} x {hw['name']}: {hw['memory_gb']:.0f} GB, {hw['bandwidth_tbps']} TB/s, "
        f"{hw['bf16_tflops']:.0f} TFLOP/s dense BF16, {hw['interconnect']}.",
        "",
        f"Source: {hw['source']}",
    ]
    lines += ["", "## Generation", ""]
    lines += _table(
        ["per GPU", "value"],
        [
            ["memory x gpu_memory_utilization", f"{mem['budget_gb_per_gpu']:.1f} GB"],
            ["weights", f"{mem['weights_gb_per_gpu']:.1f} GB"],
            ["activation reserve", f"{mem['reserve_gb_per_gpu']:.1f} GB"],
            [
                "left for KV cache + GDN state",
                f"{mem['cache_gb_per_gpu']:.1f} GB (full card minus weights: {mem['headroom_gb_full_card']:.1f} GB)",
            ],
            ["mean resident context", f"{mem['resident_context_tokens']:.0f} tokens"],
            ["KV cache per token", f"{mem['kv_kb_per_token']:.1f} KB"],
            ["GDN state per sequence", f"{mem['state_mb_per_seq']:.1f} MB"],
            ["cache per resident sequence", f"{mem['cache_mb_per_seq']:.1f} MB"],
            ["sequences that fit", f"{mem['max_seqs_in_cache']}"],
            ["batch (min with max_num_seqs)", f"{mem['batch']}"],
            [
                "one max_model_len sequence fits",
                "yes" if mem["max_model_len_fits"] else "NO (vLLM would refuse to start)",
            ],
        ],
    )
    lines += [
        "",
        f"Batch-1 bound: {gen['batch1_bound_tokens_per_s']:.1f} tok/s per engine "
        f"({gen['weights_read_per_step_gb']:.1f} GB read per step at peak bandwidth).",
        "",
    ]
    if gen["decode_curve"]:
        lines += _table(
            ["batch", "step ms", "memory ms", "compute ms", "tok/s per engine", "bound"],
            [
                [
                    c["batch"],
                    f"{c['step_ms']:.1f}",
                    f"{c['memory_ms']:.1f}",
                    f"{c['compute_ms']:.1f}",
                    f"{c['tokens_per_s']:,.0f}",
                    c["bound"],
                ]
                for c in gen["decode_curve"]
            ],
        )
    lines += [
        "",
        f"Output tokens: {_n(gen['output_tokens'], 2)}; prompt tokens: {_n(gen['prompt_tokens'], 2)} "
        f"(prefill {_h(gen['prefill_hours'])}).",
        f"Model wall time: {_h(gen['model_wall_hours']['mid'])} (output length range: "
        f"{_h(gen['model_wall_hours']['low'])} - {_h(gen['model_wall_hours']['high'])}).",
    ]
    if gen.get("pilot"):
        pl = gen["pilot"]
        ratio = pl["measured_over_model"]
        lines += ["", "### Pilot: estimate vs measured", ""]
        lines += _table(
            ["", "value"],
            [
                [
                    "measured aggregate tok/s",
                    f"{pl['measured_tokens_per_s']:,.0f} over {pl['pilot_engines']:.0f} engine(s)",
                ],
                ["per engine: model / measured", f"{pl['model_per_engine']:,.0f} / {pl['measured_per_engine']:,.0f}"],
                ["measured / model", f"{ratio:.2f}" if ratio else "n/a"],
                [
                    "output tokens p10 / mean / p90",
                    f"{_n(pl['p10_output_tokens'])} / {_n(pl['mean_output_tokens'])} / {_n(pl['p90_output_tokens'])}",
                ],
                ["pilot's own full-run estimate", _h(pl["pilot_estimated_total_hours"])],
                ["calibrated wall time (this plan's engines)", _h(pl["calibrated_wall_hours"])],
            ],
        )
        lines += ["", "The pilot is assumed to have run on this plan's GPU type; the ratio calibrates the model."]
        lines += [f"Measured rate: {pl['rate_source']}; max_num_seqs from {gen['max_num_seqs_source']}."]
        if pl["sweep_vs_model"]:
            lines += ["", f"Pilot sweep (one engine; chosen max_num_seqs {pl['chosen_max_num_seqs']}):", ""]
            lines += _table(
                ["max_num_seqs", "measured tok/s", "model tok/s", "measured / model"],
                [
                    [
                        str(r["max_num_seqs"]),
                        f"{r['measured']:,.0f}",
                        f"{r['model']:,.0f}" if r["model"] else "n/a",
                        f"{r['measured'] / r['model']:.2f}" if r["model"] else "n/a",
                    ]
                    for r in pl["sweep_vs_model"]
                ],
            )
    f = tr["flops_per_sequence"]
    lines += ["", "## Training", ""]
    lines += [
        f"Per sequence: {f['seq_tokens']:.0f} tokens, {f['anchors']:.0f} anchors x block {dr['block_size']} = "
        f"{f['block_tokens']:.0f} block tokens; loss target {f.get('loss_target', 'tokens')}.",
        "",
    ]
    lines += _table(
        ["FLOPs per sequence", "value"],
        [
            [k, _n(f[k], 2)]
            for k in (
                "target_forward",
                "target_lm_head",
                "drafter_q_o_mlp",
                "drafter_kv_projection",
                "drafter_fc",
                "drafter_attention",
                "lm_head",
                "total",
            )
        ]
        + [["(rule of thumb 6 x drafter params x block tokens)", _n(f["simple_6PN"], 2)]],
    )
    lines += [
        "",
        f"One GPU: {tr['seconds_per_sequence_one_gpu']:.2f} s per sequence at the MFU assumed "
        f"(target {tr['target_seconds_per_sequence']:.2f} s + drafter {tr['drafter_seconds_per_sequence']:.2f} s).",
        "",
    ]
    rows = []
    for name, lay in tr["layouts"].items():
        need = ", ".join(f"{role} {c['need_gb']:.1f} GB" for role, c in lay["per_gpu"].items())
        rows.append(
            [
                name + (" (headline)" if name == tr["layout"] else ""),
                lay["gpus"],
                need,
                f"{lay['margin_gb']:.1f} GB",
                "fits" if lay["fits"] else "DOES NOT FIT",
                f"{lay['step_s']:.2f}",
                f"{lay['steps_per_epoch']:,}",
                _h(lay["epoch_hours"]),
                _h(lay["total_hours"]),
            ]
        )
    lines += _table(
        ["layout", "GPUs", "per-GPU memory", "margin", "verdict", "step s", "steps/epoch", "epoch", "all epochs"], rows
    )
    lines += ["", "Memory parts (GB, per GPU before sharding):", ""]
    lines += _table(["part", "GB"], [[k, f"{v:.2f}"] for k, v in tr["memory_parts_gb"].items()])
    lines += ["", "## Time vs GPU count", ""]
    lines += _table(
        ["GPUs", "generation", "training", "training layout"],
        [
            [
                r["gpus"],
                _h(r["generation_hours"]),
                _h(r["train_hours"]),
                r["train_layout"] + ("" if r["train_fits"] else " (DOES NOT FIT)"),
            ]
            for r in p["scaling"]
        ],
    )
    lines += ["", f"![Time vs GPU count]({FIGURE})"]
    lines += ["", "## Assumptions", ""] + [f"- {a}" for a in p["assumptions"]]
    return "\n".join(lines) + "\n"


def deadline_lines(d: dict, gpu_name: str) -> list[str]:
    """The deadline section (dflash/plan/deadline.py): the cluster, its memory verdict, hours vs GPUs."""
    c, g = d["chosen"], d["gpus_per_node"]
    lines = ["", f"## Deadline: {_h(d['hours'])} for generation + training", ""]
    if d["met"]:
        lines.append(
            f"Smallest cluster that meets it: **{d['gpus']} x {gpu_name}** = {d['nodes']} node(s) x {g} GPUs "
            f"({_h(d['total_hours'])})."
            + (f" {d['previous']['gpus']} GPUs take {_h(d['previous']['total_hours'])}." if d["previous"] else "")
        )
    else:
        lines.append(
            f"**NOT MET** by any cluster of up to {d['max_gpus']} GPUs: the best achievable is "
            f"{_h(d['best_hours'])} on {d['gpus']} GPUs ({d['nodes']} node(s) x {g})."
        )
    need = ", ".join(f"{role} {gb:.1f} GB" for role, gb in c["need_gb"].items())
    lines += [""] + _table(
        ["", "value"],
        [
            ["GPUs / nodes x GPUs per node", f"{d['gpus']} / {d['nodes']} x {g}"],
            ["generation", _h(d["generation_hours"])],
            ["training", f"{_h(d['train_hours'])} ({c['layout']}, {c['ranks']} data-parallel drafter rank(s))"],
            ["total", _h(d["total_hours"])],
            [
                "per-GPU memory (training)",
                f"{need}: {'fits' if c['fits'] else 'DOES NOT FIT'} (margin {c['margin_gb']:.1f} GB)",
            ],
            [
                "gradient all-reduce per step",
                f"{d['grad_gb_per_step']:.2f} GB: {c['allreduce_s']:.3f} s at {c['link_gbps']:g} GB/s, "
                f"{c['exposed_s']:.3f} s not hidden (step {c['step_s']:.3f} s, compute {c['compute_step_s']:.3f} s)",
            ],
        ],
    )
    for s in d["communication_dominates"]:
        lines += [
            "",
            f"Communication dominates from {s['from_gpus']} to {s['to_gpus']} GPUs: training takes "
            f"{_h(s['to_train_hours'])} instead of {_h(s['from_train_hours'])} (all-reduce {s['allreduce_s']:.2f} s a "
            f"step over {s['link_gbps']:g} GB/s).",
        ]
    lines += ["", "Hours vs GPUs (communication included):", ""]
    lines += _table(
        ["GPUs", "nodes", "generation", "training", "total", "all-reduce s/step (exposed)", "meets"],
        [
            [
                r["gpus"],
                r["nodes"],
                _h(r["generation_hours"]),
                _h(r["train_hours"]) + ("" if r["fits"] else " (DOES NOT FIT)"),
                _h(r["total_hours"]),
                f"{r['allreduce_s']:.3f} ({r['exposed_s']:.3f})",
                "yes" if r["total_hours"] is not None and r["total_hours"] <= d["hours"] else "no",
            ]
            for r in d["curve"]
        ],
    )
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
