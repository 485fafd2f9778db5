"""The figures of the stages that run a model (pilot, train, eval), built from the plot data those stages already
write, so that a change to a figure never reruns generation, training or eval:

  pilot_sweep.png       output tokens/s by in-flight requests (reports/pilot_sweep.json), the chosen knee named
  train_loss.png        training loss by optimizer step (dvclive: ${train.live_dir}/plots/metrics/train/loss.tsv)
  train_acceptance.png  accuracy by block position, last epoch (dvclive: plots/custom/accuracy_by_position.json)
  eval_acceptance.png   acceptance per drafted position, one panel per prompt set, one line per engine and the
                        PyTorch reference (reports/eval_details.json "prompt_set_details")

Each figure is a `Figure` (file name, caption, the files it was drawn from, the Vega-Lite spec); an input that
is missing or empty gives a chart that says so, so the report stage always writes the same files.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

from dflash.core.figures import line_chart
from dflash.core.params import Params


@dataclass(frozen=True)
class Figure:
    name: str  # the PNG's file name, written into base.reports_dir
    caption: str  # one sentence under the picture
    sources: tuple[str, ...]  # the data files it was drawn from (linked from the page)
    spec: dict  # the Vega-Lite spec (data inline)


def _json(path: Path, default):
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else default


def _tsv(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    with path.open(encoding="utf-8", newline="") as fh:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(fh, delimiter="\t")]


def _missing(rows: list, path: Path, what: str) -> str:
    return "" if rows else f"empty: no {what} in {path}"


def pilot_sweep(params: Params) -> Figure:
    path = Path(params.base.reports_dir) / "pilot_sweep.json"
    rows = [
        {"in-flight requests": r["max_num_seqs"], "output tok/s": r["output_tokens_per_s"]} for r in _json(path, [])
    ]
    chosen = _json(Path(params.base.reports_dir) / "pilot.json", {}).get("chosen_max_num_seqs")
    note = f"the knee chosen for generate.max_num_seqs: auto is {chosen}" if chosen else "no knee chosen"
    spec = line_chart(
        rows,
        x="in-flight requests",
        y="output tok/s",
        title="Pilot concurrency sweep",
        subtitle=_missing(rows, path, "sweep level (generate.pilot_sweep is empty)") or note,
        x_title="in-flight requests (max_num_seqs)",
        y_title="output tokens / s",
        log_x=True,
        y_zero=True,  # a rate: the gain from concurrency reads true only from zero
    )
    return Figure("pilot_sweep.png", f"Throughput of the target by concurrency; {note}.", (str(path),), spec)


def train_loss(params: Params) -> Figure:
    path = Path(params.train.live_dir) / "plots/metrics/train/loss.tsv"
    rows = [{"step": int(r["step"]), "loss": r["loss"]} for r in _tsv(path)]
    spec = line_chart(
        rows,
        x="step",
        y="loss",
        title="Training loss",
        subtitle=_missing(rows, path, "logged step") or f"mean over every train.log_every steps; {len(rows)} points",
        x_title="optimizer step",
        y_title="loss",
        log_y=True,
        points=False,
    )
    return Figure("train_loss.png", "The drafter's training loss by optimizer step (log scale).", (str(path),), spec)


def train_acceptance(params: Params) -> Figure:
    path = Path(params.train.live_dir) / "plots/custom/accuracy_by_position.json"
    rows = [{"position": r["position"], "accuracy": r["accuracy"]} for r in _json(path, [])]
    spec = line_chart(
        rows,
        x="position",
        y="accuracy",
        title="Training accuracy by block position (last epoch)",
        subtitle=_missing(rows, path, "position")
        or "share of slot-k labels equal to the target's argmax; drafts decay along the block",
        x_title="position in the block",
        y_title="accuracy",
        y_domain=(0.0, 1.0),
    )
    caption = "How often the drafter predicts each block position right in training (the last epoch)."
    return Figure("train_acceptance.png", caption, (str(path),), spec)


def eval_acceptance(params: Params) -> Figure:
    """One panel per prompt set; a line per engine that drafted (vLLM counters) and one for the reference."""
    path = Path(params.base.reports_dir) / "eval_details.json"
    sets = _json(path, {}).get("prompt_set_details", {})
    rows = []
    for name, s in sets.items():
        series = {"dflash": s.get("acceptance_per_position")}  # the trained drafter's, also in older reports
        series.update(
            {
                engine: d["acceptance_per_position"]
                for engine, d in s["engines"].items()
                if d.get("acceptance_per_position")
            }
        )
        series["reference"] = (s.get("reference") or {}).get("acceptance_per_position")
        for engine, acc in series.items():  # `none` drafts nothing: no line
            kind = "PyTorch reference" if engine == "reference" else "vLLM"
            rows += [
                {"prompt set": name, "engine": engine, "measured by": kind, "position": k, "acceptance": a}
                for k, a in enumerate(acc or [], start=1)
            ]
    spec = line_chart(
        rows,
        x="position",
        y="acceptance",
        title="Eval acceptance per drafted position",
        subtitle=_missing(rows, path, "per-engine acceptance")
        or "share of drafts whose first k tokens were all accepted (vLLM counters; reference: PyTorch, dashed)",
        x_title="drafted position k",
        y_title="acceptance",
        color="engine",
        column="prompt set",
        y_domain=(0.0, 1.0),
        dash="measured by",
        dash_values=("vLLM", "PyTorch reference"),
    )
    caption = "Acceptance per drafted position in vLLM speculative decoding, per prompt set, beside the reference."
    return Figure("eval_acceptance.png", caption, (str(path),), spec)


def model_figures(params: Params) -> list[Figure]:
    return [pilot_sweep(params), train_loss(params), train_acceptance(params), eval_acceptance(params)]


__all__ = ["Figure", "eval_acceptance", "model_figures", "pilot_sweep", "train_acceptance", "train_loss"]
