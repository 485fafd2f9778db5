"""Audit outputs for people and for DVC: audit_details.json (every count), report.md (findings and what to do,
with the length histograms as pictures), plots/*.csv (histograms declared as DVC plots) and plots/*.png (the same
histograms rendered offline by dflash/core/figures.py). Called by dflash.audit.run.run_audit."""

from __future__ import annotations

from pathlib import Path

from dflash.audit.state import AuditState
from dflash.core.figures import bar_chart, write_png
from dflash.core.io import atomic_write, write_json

DETAILS = "audit_details.json"
PLOTS = {
    # file: (x column, y column, histogram unit)
    "response_lengths.csv": ("response_chars", "conversations", "chars"),
    "loss_mask_sums.csv": ("loss_mask_tokens", "samples", "tokens"),
}
FIGURES = {
    # plot file: (title, x axis title, what is missing when it is empty)
    "response_lengths.csv": ("Response lengths", "final response length (characters)", "no response was read"),
    "loss_mask_sums.csv": (
        "Loss-mask tokens per sample",
        "loss-mask tokens (assistant tokens under the chat template)",
        "no tokenizer, or no row was tokenized",
    ),
}
CHECKS = [
    # (metric count key in counts/reasons, label, what it means)
    (
        "placeholder_response",
        "placeholder or empty responses",
        'conversations with an assistant turn like "OK." or empty',
    ),
    ("empty_response", "empty responses", "conversations with an empty assistant turn (no text, no tool call)"),
    (
        "placeholder_in_prompt",
        "placeholders inside the prompt",
        "multi-turn conversations whose history keeps a placeholder answer",
    ),
    ("short_response", "short responses", "final response of at most `audit.short_response_chars` characters"),
    (
        "role_order",
        "roles out of order",
        "user after user, assistant after assistant, tool without a call, late system",
    ),
    ("no_response", "prompt only", "no recorded response; fine, generation writes one"),
    ("tool_calls", "tool calls", "conversations with assistant tool calls or tool turns"),
    ("multi_turn", "multi-turn", "two or more user turns"),
    ("system_prompt", "system prompt", "a system turn"),
]


def write_outputs(out: Path, metrics: dict, state: AuditState) -> None:
    for name, (x, y, unit) in PLOTS.items():
        rows = state.histogram_rows(unit)
        lines = [f"{x},{y}"] + [f"{v},{n}" for v, n in rows]
        atomic_write(out / "plots" / name, "\n".join(lines) + "\n")
        write_png(out / "plots" / name.replace(".csv", ".png"), _histogram(name, rows))
    write_json(out / DETAILS, metrics)
    atomic_write(out / "report.md", render_report(metrics, state))


def _histogram(name: str, rows: list[tuple[int, int]]) -> dict:
    """The Vega-Lite histogram of one plot file (exact values; a spike is one tall bar)."""
    x, y, _ = PLOTS[name]
    title, x_title, empty = FIGURES[name]
    subtitle = "one bar per exact value; one tall bar = templated or placeholder answers"
    return bar_chart(
        [{x: v, y: n} for v, n in rows],
        x=x,
        y=y,
        title=title,
        x_title=x_title,
        y_title=y,
        subtitle=subtitle if rows else f"empty: {empty}",
        log_x=True,
    )


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _refs(refs: list[str]) -> str:
    return ", ".join(f"`{r}`" for r in refs) if refs else ""


def render_report(m: dict, state: AuditState) -> str:
    n_conv = max(m["num_conversations"], 1)
    out = ["# Data audit", ""]
    tok = f"`{m['tokenizer']}`" if m["tokenizer"] else "none (character counts only)"
    out.append(
        f"Input: {', '.join(f'`{f}`' for f in m['input_files'])}. **{m['num_rows']}** rows: **{m['num_kept']}** kept "
        f"(`conversations.arrow`), **{m['num_rejected']}** rejected (`rejected.jsonl`, with reasons); "
        f"{m['num_malformed']} of them unreadable"
        + (f", {m['num_non_text_part']} with content parts that are not text" if m.get("num_non_text_part") else "")
        + f". Tokenizer: {tok}."
    )
    out += _input_notes(m)
    out += ["", "## Gates", "", "| gate | measured | max | action | result |", "|---|---|---|---|---|"]
    for g in m["gates"]:
        result = ("**FAILED**" if g["action"] == "fail" else "crossed (report only)") if g["crossed"] else "ok"
        action = f"{g['action']} (auto)" if g.get("configured") == "auto" else g["action"]
        out.append(f"| {g['name']} | {_pct(g['value'])} | {_pct(g['max'])} | {action} | {result} |")
    whys = sorted({g["why"] for g in m["gates"] if g.get("why")})
    if whys:
        out += [""] + [f"Gate action {why}." for why in whys]
    if m["gate_failed"]:
        out += ["", f"**The audit failed** on: {', '.join(m['failed_gates'])}. The outputs are written anyway."]

    out += [
        "",
        "## Findings",
        "",
        "| check | meaning | conversations | share | example rows |",
        "|---|---|---|---|---|",
    ]
    for key, label, meaning in CHECKS:
        count = state.counts[key]
        out.append(f"| {label} | {meaning} | {count} | {_pct(count / n_conv)} | {_refs(m['examples'].get(key, []))} |")
    unit = m["response_length_spike_unit"]
    plot = "loss_mask_sums" if unit == "tokens" else "response_lengths"
    out += [
        "",
        f"**Response length spike**: {_pct(m['response_length_spike_frac'])} of {m['num_responses']} responses are exactly "
        f"{m['response_length_spike_value']} {unit} long"
        + (" (loss-mask tokens under the chat template)" if unit == "tokens" else "")
        + f"; examples {_refs(m['examples'].get('response_length_spike', []))}. "
        "Natural answers spread over many lengths; one length holding a large share means templated or placeholder answers "
        f"(the 27B regeneration case: 87% at 6 tokens). Histogram: `plots/{plot}.csv`.",
        "",
        "![Response lengths](plots/response_lengths.png)",
        "",
        "![Loss-mask tokens per sample](plots/loss_mask_sums.png)",
    ]
    if m["repeated_responses"]:
        out += [
            "",
            f"Most repeated responses (each in at least {m['repeated_response_threshold']} responses):",
            "",
            "| response | count | share | first seen |",
            "|---|---|---|---|",
        ]
        for r in m["repeated_responses"]:
            text = (r["text"] or "?").replace("|", "\\|").replace("\n", " ")
            out.append(
                f"| `{text[:60]}` | {r['count']} | {_pct(r['share'])} | {_refs([r['example']] if r['example'] else [])} |"
            )

    out += [
        "",
        "## Prompt lengths (kept conversations)",
        "",
        "| | min | p50 | p90 | p99 | max | mean |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in ("prompt_chars", "prompt_tokens"):
        s = m.get(name)
        if s and s.get("count"):
            out.append(
                f"| {name.split('_')[1]} | {s['min']} | {s['p50']:.0f} | {s['p90']:.0f} | {s['p99']:.0f} | {s['max']} | {s['mean']} |"
            )
    out += _token_sample(m)

    out += ["", "## Rejected rows", "", "| reason | rows | example rows |", "|---|---|---|"]
    for reason, count in m["rejected_by_reason"].items():
        out.append(f"| {reason} | {count} | {_refs(m['examples'].get(reason, []))} |")
    out += [
        "",
        "Every rejected row is in `rejected.jsonl` with its file, row, reasons and (for unreadable rows) what is wrong.",
    ]
    out += ["", "## What to do", ""] + [f"- {line}" for line in _advice(m, state)]
    return "\n".join(out) + "\n"


def _input_notes(m: dict) -> list[str]:
    """The hub split read, files that held no rows, folder files that are not inputs, and regions that could not be read."""
    out = []
    if m.get("hub"):
        h = m["hub"]
        out += [
            "",
            f"Hub dataset `{h['dataset']}`, split `{h['split']}`, revision `{h['revision']}`, read from the datasets "
            f"cache `{h['cache']}`; rows are named `hf:{h['dataset']} split {h['split']} row N` "
            f"(`load_dataset(ID, split=..., revision=...)[N]`).",
        ]
    out += _forms(m)
    if m.get("empty_files"):
        out += ["", f"Empty files (no rows): {', '.join(f'`{f}`' for f in m['empty_files'])}."]
    if m.get("num_skipped_files"):
        more = m["num_skipped_files"] - len(m["skipped_files"])
        names = ", ".join(f"`{f}`" for f in m["skipped_files"]) + (f" and {more} more" if more > 0 else "")
        out += [
            "",
            f"Skipped {m['num_skipped_files']} files of the input folder that are not .jsonl / .ndjson / .json / "
            f".parquet / .arrow (.gz / .zst for the text formats) nor in a save_to_disk folder: {names}.",
        ]
    if m.get("num_unreadable_regions"):
        out += [
            "",
            f"**{m['num_unreadable_regions']} regions ({m['unreadable_bytes']} bytes) of the input could not be read** "
            "(a JSON array's syntax error or data after its end; each is one malformed row in `rejected.jsonl`, and "
            "`unreadable` in audit_details.json gives lines and bytes):",
            "",
        ]
        out += [f"- `{u['file']}` lines {u['lines'][0]}-{u['lines'][1]}: {u['reason']}" for u in m["unreadable"][:20]]
    return out


def _forms(m: dict) -> list[str]:
    """What each file was read as (from its bytes: dflash/audit/forms.py), and where that differs from its name."""
    forms, notes = m.get("input_forms") or {}, m.get("form_notes") or {}
    if not forms:
        return []
    if len(forms) <= 20:
        read = "; ".join(f"`{f}` {notes.get(f) or 'as ' + what}" for f, what in forms.items())
        out = ["", f"Read (the form from each file's bytes): {read}."]
    else:
        counts: dict[str, int] = {}
        for what in forms.values():
            counts[what] = counts.get(what, 0) + 1
        out = [
            "",
            "Read (the form from each file's bytes): " + ", ".join(f"{n} as {w}" for w, n in counts.items()) + ".",
        ]
        if notes:
            more = m.get("num_form_notes", len(notes)) - len(notes)
            out += ["", f"{m.get('num_form_notes', len(notes))} files are not what their names say:", ""]
            out += [f"- `{f}`: {note}" for f, note in notes.items()] + ([f"- and {more} more"] if more > 0 else [])
    return out


def _token_sample(m: dict) -> list[str]:
    """How the token counts were made (dflash/audit/tokens.py): exhaustive, or a stated seeded sample."""
    ts = m.get("token_sample")
    if not ts:
        return []
    if ts["mode"] == "exhaustive":
        return ["", f"Token counts: every candidate row was rendered and tokenized ({ts['why_exhaustive']})."]
    return [
        "",
        f"Token statistics (prompt tokens above, the loss-mask histogram and its spike) come from a seeded sample of "
        f"**{ts['sample_rows']}** of {ts['candidates']} candidate rows (rate {ts['sample_rate']}, "
        "`audit.token_sample_rows`). `prompt_too_long` and `template_error` are decided for every row, as an "
        f"exhaustive run decides them: {ts['exact_prompt_counts']} prompts counted exactly ({ts['over_byte_bound']} "
        f"over the byte bound), {ts['structures']} chat-template structures rendered; `prompt_tokens` in "
        "`conversations.arrow` is -1 where a row was not counted.",
    ]


def _advice(m: dict, state: AuditState) -> list[str]:
    gates = {g["name"]: g for g in m["gates"]}
    lines = []
    if any(
        gates[k]["crossed"]
        for k in ("placeholder_response_frac", "response_length_spike_frac", "repeated_response_frac")
    ):
        lines.append(
            f"**The responses are not usable training targets** ({_pct(m['placeholder_response_frac'])} placeholders, "
            f"{_pct(m['response_length_spike_frac'])} at one length). Do not tokenize or train on them: regenerate every "
            "response with the generate stage, which completes `prompt_messages` of `conversations.arrow` with the target "
            "itself (the demo does exactly this)."
        )
        if state.counts["placeholder_in_prompt"]:
            lines.append(
                f"{state.counts['placeholder_in_prompt']} multi-turn conversations keep placeholder answers inside their prompt "
                "history. The generate stage regenerates every assistant turn in order, each against its own earlier answers, "
                "so these are replaced too; trained as recorded, they would teach placeholder context."
            )
    if m["num_malformed"]:
        lines.append(
            f"{m['num_malformed']} rows could not be read; `rejected.jsonl` names file and line and what is wrong. "
            "Fix them at the source if they matter."
        )
    if m.get("num_non_text_part"):
        lines.append(
            f"{m['num_non_text_part']} rows hold message content parts that are not text (`non_text_part`: an image, "
            "audio, a file; `rejected.jsonl` names the part): the data is multimodal, and the drafter trains on text. "
            "Drop those parts (keep the text parts) or those rows at the source if the rest is worth keeping."
        )
    if m["duplicate_prompt_count"] or m["near_duplicate_prompt_count"]:
        lines.append(
            f"{m['duplicate_prompt_count']} exact and {m['near_duplicate_prompt_count']} near (case / whitespace) duplicate "
            "prompts were left out (the first occurrence is kept)."
        )
    if m["rejected_by_reason"].get("prompt_too_long"):
        lines.append(
            "Some prompts exceed `audit.max_prompt_tokens`: raise it (the target's context must still fit the answer) or shorten them."
        )
    if state.counts["role_order"]:
        lines.append(
            "Some conversations have roles out of order; they are kept (the chat template renders them) but check the source."
        )
    if not m["tokenizer"]:
        lines.append(
            "No tokenizer was used: token counts, the loss-mask histogram and `max_prompt_tokens` were skipped "
            "(set `audit.tokenizer`, or run the target stage first with `audit.tokenizer: auto`)."
        )
    if not lines:
        lines.append("Nothing to fix: the data passes every check.")
    return lines
