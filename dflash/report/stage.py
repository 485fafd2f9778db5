"""The report stage: the figures of the stages that run a model, then the one-page HTML report of the run.

Reads what the other stages wrote (reports/*.json, the markdown reports, their PNGs and plot data, dvc.lock),
writes `${base.reports_dir}/{pilot_sweep,train_loss,train_acceptance,eval_acceptance}.png` (dflash/report/charts.py)
and `${base.reports_dir}/report.html` (dflash/report/page.py). A stage that has not run yet leaves a gap the page
names; nothing here fails for it, so `make report` works at any point of a run.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from pathlib import Path

from dflash.core.figures import render_png
from dflash.core.io import atomic_write, read_json
from dflash.core.params import Params
from dflash.report import run_info
from dflash.report.charts import model_figures
from dflash.report.page import FigureEntry, MarkdownReport, PageInputs, render

log = logging.getLogger(__name__)

PAGE = "report.html"
STAGES = ("target", "audit", "pilot", "generate", "tokenize", "train", "eval", "plan")  # pipeline order
DETAIL_SUFFIXES = (".json", ".csv", ".md", ".png")


def _stage_figure(path: Path, title: str, caption: str, sources: tuple[str, ...]) -> FigureEntry | None:
    """A figure a stage drew itself (audit, plan), read from its file; None before that stage has run."""
    if not path.is_file():
        return None
    return FigureEntry(title, caption, path.read_bytes(), path, sources)


def run(params: Params, params_file: str | Path = "params.yaml", lock_file: str | Path = "dvc.lock") -> Path:
    reports = Path(params.base.reports_dir)
    audit_plots = Path(params.audit.out) / "plots"
    drawn = {}
    for fig in model_figures(params):
        png = render_png(fig.spec)
        atomic_write(reports / fig.name, png)
        drawn[fig.name] = FigureEntry(fig.spec["title"]["text"], fig.caption, png, reports / fig.name, fig.sources)
    audit_caption = "Every exact length is one bar: one tall bar means templated or placeholder answers."
    figures = {  # label (named on the page while missing) -> the figure, None before its stage has run
        "the audit's response lengths": _stage_figure(
            audit_plots / "response_lengths.png",
            "Response lengths",
            f"Audit: final response lengths in characters. {audit_caption}",
            (str(audit_plots / "response_lengths.csv"),),
        ),
        "the audit's loss-mask sums": _stage_figure(
            audit_plots / "loss_mask_sums.png",
            "Loss-mask tokens per sample",
            f"Audit: assistant tokens under the chat template per sample. {audit_caption}",
            (str(audit_plots / "loss_mask_sums.csv"),),
        ),
        **{name: drawn[name] for name in drawn},
        "the plan's time vs GPU count": _stage_figure(
            reports / "plan_time_vs_gpus.png",
            "Time vs GPU count",
            "Plan: hours of generation and of training by GPU count (log scales).",
            (str(reports / "plan_generation_scaling.csv"), str(reports / "plan_train_scaling.csv")),
        ),
    }
    metrics = {s: read_json(reports / f"{s}.json") for s in STAGES if (reports / f"{s}.json").is_file()}
    md = [
        MarkdownReport("Audit report", Path(params.audit.out) / "report.md"),
        MarkdownReport("Eval report", reports / "eval.md"),
        MarkdownReport("Plan", reports / "plan.md"),
    ]
    files = (
        sorted(p for p in reports.iterdir() if p.is_file() and p.suffix in DETAIL_SUFFIXES) if reports.is_dir() else []
    )
    files += [
        p
        for p in (Path(params.audit.out) / n for n in ("report.md", "audit_details.json", "rejected.jsonl"))
        if p.is_file()
    ]
    files += [p for p in (Path(params.train.live_dir) / "metrics.json", Path(lock_file)) if p.is_file()]
    inputs = PageInputs(
        out=reports / PAGE,
        commit=run_info.commit(outputs=(str(lock_file), str(reports))),
        machine=run_info.machine(),
        created=datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        metrics=metrics,
        figures=[f for f in figures.values() if f is not None],
        missing=[label for label, f in figures.items() if f is None],
        reports=[r for r in md if r.path.is_file()],
        params=run_info.params_diff(params, params_file),
        lock=run_info.lock_identities(lock_file, skip=("report",)),
        files=files,
    )
    atomic_write(inputs.out, render(inputs))
    if inputs.missing:
        log.info("report: not drawn yet (their stages have not run): %s", ", ".join(inputs.missing))
    return inputs.out


__all__ = ["PAGE", "run"]
