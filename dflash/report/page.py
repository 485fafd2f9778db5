"""The run report as ONE self-contained HTML page: headline numbers, every figure (PNG inside the page as a `data:`
URI), the markdown reports with their tables, every stage's metrics, the params that differ from the defaults, the
dvc.lock identity of each stage and links to the detailed files (relative: the page moves with the folder).

Nothing on the page is fetched: no script, no stylesheet or font from elsewhere, images inline, and a
Content-Security-Policy that forbids the browser any request the page itself might cause (links are followed
only when clicked, and point at local files). tests/integration/test_report_html.py opens it in headless Chromium.
"""

from __future__ import annotations

import html
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash.core.figures import SCALE, data_uri
from dflash.report.run_info import ParamsDiff, StageIdentity

CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'; base-uri 'none'; form-action 'none'"
# The numbers a reader looks for first: (metrics file, key, label, format)
HEADLINE = [
    ("eval", "tau", "tau in vLLM (trained drafter)", "{:.3f}"),
    ("eval", "tau_reference", "tau, PyTorch reference", "{:.3f}"),
    ("eval", "tau_untrained", "tau, untrained drafter", "{:.3f}"),
    ("eval", "tau_ngram", "tau, n-gram drafter", "{:.3f}"),
    ("eval", "speedup", "speedup vs no speculation", "{:.2f}x"),
    ("eval", "greedy_identical_frac", "outputs identical to greedy", "{:.0%}"),
    ("train", "final_loss", "final training loss", "{:.3f}"),
    ("train", "final_tau_hat", "training tau estimate", "{:.2f}"),
    ("generate", "output_tokens_per_s", "generation output tokens/s", "{:,.0f}"),
    ("generate", "num_completed", "prompts generated", "{:,}"),
    ("audit", "num_kept", "conversations kept by the audit", "{:,}"),
    ("plan", "generation_hours", "planned generation hours", "{:.3g}"),
    ("plan", "train_hours", "planned training hours", "{:.3g}"),
]
STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, "Liberation Sans", sans-serif; margin: 0;
       color: #1b1f24; background: #f6f7f9; }
main { max-width: 1180px; margin: 0 auto; padding: 24px 32px 64px; background: #fff; }
h1 { margin: 0 0 4px; font-size: 26px; } h2 { margin-top: 40px; border-bottom: 2px solid #e3e6ea; padding-bottom: 4px; }
h3 { margin-top: 28px; } .meta { color: #57606a; font-size: 14px; }
nav a { margin-right: 14px; font-size: 14px; }
.cards { display: grid; grid-template-columns: repeat(auto-fill, minmax(200px, 1fr)); gap: 12px; margin: 16px 0; }
.card { border: 1px solid #d8dee4; border-radius: 8px; padding: 10px 14px; }
.card .v { font-size: 24px; font-weight: 600; } .card .k { color: #57606a; font-size: 13px; }
.figures { display: grid; grid-template-columns: repeat(auto-fill, minmax(540px, 1fr)); gap: 8px 24px; }
figure { margin: 12px 0 20px; } figure.wide { grid-column: 1 / -1; } figure img { max-width: 100%; height: auto; border: 1px solid #e3e6ea; }
figcaption { color: #57606a; font-size: 14px; margin-top: 4px; }
table { border-collapse: collapse; margin: 10px 0; font-size: 13px; }
th, td { border: 1px solid #d8dee4; padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #f0f2f4; } code { font-size: 12px; background: #f0f2f4; padding: 1px 3px; border-radius: 3px; }
.report { border-left: 4px solid #e3e6ea; padding-left: 16px; }
.report img { max-width: 100%; }
"""


@dataclass(frozen=True)
class FigureEntry:
    title: str
    caption: str
    png: bytes
    file: Path  # the PNG beside the reports
    sources: tuple[str, ...]


@dataclass(frozen=True)
class MarkdownReport:
    title: str
    path: Path


@dataclass(frozen=True)
class PageInputs:
    out: Path  # where the page is written (links are made relative to its folder)
    commit: str
    machine: str
    created: str
    metrics: dict[str, dict]  # stage -> its NAME.json (missing ones left out)
    figures: list[FigureEntry]
    reports: list[MarkdownReport]
    params: ParamsDiff
    lock: list[StageIdentity]
    files: list[Path]  # the detailed files linked at the end
    missing: list[str] = field(default_factory=list)  # figures whose stage has not run yet


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _link(inputs: PageInputs, path: str | Path, text: str | None = None) -> str:
    rel = os.path.relpath(Path(path), inputs.out.parent)
    return f'<a href="{_e(Path(rel).as_posix())}">{_e(text if text is not None else path)}</a>'


def _fmt(value: Any, pattern: str = "{}") -> str:
    if value is None:
        return "-"
    try:
        return pattern.format(value)
    except (ValueError, TypeError):
        return str(value)


def _table(head: list[str], rows: list[list[str]]) -> str:
    """Cells are HTML already (escaped by the caller)."""
    th = "".join(f"<th>{h}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def _flat(obj: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(obj, dict):
        return [kv for k, v in obj.items() for kv in _flat(v, f"{prefix}{k}.")]
    if isinstance(obj, list):
        shown = ", ".join(_fmt(v, "{:.4g}") if isinstance(v, float) else str(v) for v in obj[:12])
        return [(prefix.rstrip("."), f"[{shown}{', ...' if len(obj) > 12 else ''}]")]
    return [(prefix.rstrip("."), obj)]


def _cards(inputs: PageInputs) -> str:
    cards = []
    for stage, key, label, pattern in HEADLINE:
        if key in inputs.metrics.get(stage, {}):
            value = _fmt(inputs.metrics[stage][key], pattern)
            cards.append(f'<div class="card"><div class="v">{_e(value)}</div><div class="k">{_e(label)}</div></div>')
    return f'<div class="cards">{"".join(cards)}</div>' if cards else "<p>No stage has written its metrics yet.</p>"


def _figures(inputs: PageInputs) -> str:
    parts = []
    for f in inputs.figures:
        sources = ", ".join(_link(inputs, s, Path(s).name) for s in f.sources)
        parts.append(
            f'<figure{_wide(f.png)}><img src="{data_uri(f.png)}" alt="{_e(f.title)}"{_size(f.png)}>'
            f"<figcaption>{_e(f.caption)} Picture: {_link(inputs, f.file, f.file.name)}; data: {sources}."
            "</figcaption></figure>"
        )
    gap = (
        f"<p>Not drawn yet (their stages have not run): {_e(', '.join(inputs.missing))}.</p>" if inputs.missing else ""
    )
    return f'<div class="figures">{"".join(parts)}</div>{gap}'


def _wide(png: bytes) -> str:
    """Panels side by side (eval's prompt sets) take the whole row instead of shrinking into a column."""
    return ' class="wide"' if int.from_bytes(png[16:20], "big") / SCALE > 700 else ""


def _size(png: bytes) -> str:
    """width / height attributes at the chart's CSS size (the PNG holds SCALE pixels per CSS pixel)."""
    if png[12:16] != b"IHDR":
        return ""
    w, h = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    return f' width="{round(w / SCALE)}" height="{round(h / SCALE)}"'


def _markdown(inputs: PageInputs, report: MarkdownReport) -> str:
    """The report's markdown as HTML; its local images inlined, its other links made relative to the page."""
    import markdown

    text = report.path.read_text(encoding="utf-8")
    body = markdown.markdown(text, extensions=["tables", "fenced_code"], output_format="html")

    def image(m: re.Match) -> str:
        target = report.path.parent / html.unescape(m.group(2))
        if target.is_file() and target.suffix == ".png":
            return f'{m.group(1)}"{data_uri(target.read_bytes())}"'
        return f'{m.group(1)}""'  # an image that is not there is left out, never fetched

    body = re.sub(r'(<img[^>]*?src=)"([^"]*)"', image, body)
    body = re.sub(r"<(/?)h([1-4])", lambda m: f"<{m.group(1)}h{int(m.group(2)) + 2}", body)  # under the page's h2

    def rebase(m: re.Match) -> str:  # a link from the report's folder, made relative to the page's
        return f'href="{_e(_rel(inputs, report.path.parent / html.unescape(m.group(1))))}"'

    body = re.sub(r'href="(?!#|[a-z]+:)([^"]*)"', rebase, body)
    return f'<div class="report">{body}</div>'


def _rel(inputs: PageInputs, path: Path) -> str:
    return Path(os.path.relpath(path, inputs.out.parent)).as_posix()


def _metrics(inputs: PageInputs) -> str:
    parts = []
    for stage, values in inputs.metrics.items():
        rows = [[_e(k), _e(_fmt(v, "{:.6g}") if isinstance(v, float) else _fmt(v))] for k, v in _flat(values)]
        parts.append(f"<h3>{_e(stage)}</h3>" + _table(["metric", "value"], rows))
    return "".join(parts)


def _params(inputs: PageInputs) -> str:
    d = inputs.params
    head = f"<p>Compared with {_e(d.baseline)}.</p>"
    if not d.available:
        return head
    if not d.changes:
        return head + "<p>None: this run used the defaults.</p>"
    rows = [[f"<code>{_e(k)}</code>", _e(_fmt(a)), _e(_fmt(b))] for k, a, b in d.changes]
    return head + _table(["param", "default", "this run"], rows)


def _lock(inputs: PageInputs) -> str:
    if not inputs.lock:
        return "<p>No dvc.lock: the stages were run outside DVC.</p>"
    rows = [
        [
            _e(s.stage),
            f"<code>{_e(s.identity)}</code>",
            f"<code>{_e(s.cmd)}</code>",
            _e(s.num_deps),
            "<br>".join(f"{_e(p)} <code>{_e(h)}</code>" for p, h in s.outs),
        ]
        for s in inputs.lock
    ]
    intro = (
        "<p>identity = the first 12 hex digits of the sha256 of the stage's dvc.lock entry (its command, the hash "
        "of every dep and out, its params): equal identities, the same stage on the same inputs with the same "
        "outputs.</p>"
    )
    return intro + _table(["stage", "identity", "command", "deps", "outs (md5)"], rows)


def render(inputs: PageInputs) -> str:
    sections = [
        ("headline", "Headline", _cards(inputs)),
        ("figures", "Figures", _figures(inputs)),
        *[
            (f"report-{i}", r.title, _markdown(inputs, r) + f"<p>File: {_link(inputs, r.path)}</p>")
            for i, r in enumerate(inputs.reports)
        ],
        ("metrics", "Every stage's metrics", _metrics(inputs)),
        ("params", "Params that differ from the defaults", _params(inputs)),
        ("lock", "Stages (dvc.lock)", _lock(inputs)),
        ("files", "Detailed files", "<ul>" + "".join(f"<li>{_link(inputs, p)}</li>" for p in inputs.files) + "</ul>"),
    ]
    nav = "".join(f'<a href="#{sid}">{_e(title)}</a>' for sid, title, _ in sections)
    body = "".join(f'<section id="{sid}"><h2>{_e(title)}</h2>{content}</section>' for sid, title, content in sections)
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{CSP}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>dflash-pipeline run report</title>
<style>{STYLE}</style>
</head>
<body><main>
<h1>dflash-pipeline run report</h1>
<p class="meta">commit {_e(inputs.commit)} &middot; {_e(inputs.machine)} &middot; written {_e(inputs.created)}</p>
<nav>{nav}</nav>
{body}
</main></body>
</html>
"""


__all__ = ["CSP", "FigureEntry", "MarkdownReport", "PageInputs", "render"]
