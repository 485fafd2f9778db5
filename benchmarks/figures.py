"""Benchmark the offline figures: how long each figure of a run takes to draw, how big its PNG is, the offline
`dvc plots show` template, and the report stage end to end, side by side in one run.

Data: a run's reports (default: this checkout's committed `reports/`, `reports/train_live/`, and the audit folder
when it exists); the plan's and the audit's figures are drawn from their plot data as their stages draw them.
Times are wall seconds, best of --repeats after one warm-up (the first render in a process also starts the
JavaScript engine: printed apart). Goal: the report stage well under the ~20 s a DVC stage of the demo takes
to start; each figure well under a second.

    python benchmarks/figures.py
    python benchmarks/figures.py --reports build/demo-hybrid/reports --repeats 5
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash.core import figures  # noqa: E402
from dflash.core.io import read_json  # noqa: E402
from dflash.core.loader import load_params  # noqa: E402
from dflash.plan.report import time_vs_gpus  # noqa: E402
from dflash.plan.result import ScalingRow  # noqa: E402
from dflash.report import charts  # noqa: E402


def best(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reports", default="reports")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    params = load_params(
        "params.yaml", [f"base.reports_dir={args.reports}", f"train.live_dir={args.reports}/train_live"]
    )

    t = time.perf_counter()
    figures.render_png(figures.line_chart([{"x": 1, "y": 1}], x="x", y="y", title="t", x_title="x", y_title="y"))
    print(f"first render in this process (starts the JavaScript engine): {time.perf_counter() - t:.2f} s")

    specs = {f.name: f.spec for f in charts.model_figures(params)}
    plan = Path(args.reports) / "plan_details.json"
    if plan.is_file():
        specs["plan_time_vs_gpus.png"] = time_vs_gpus([ScalingRow(**r) for r in read_json(plan)["scaling"]])
    print(f"\n{'figure':<26} {'points':>7} {'best s':>8} {'PNG kB':>8}")
    for name, spec in specs.items():
        seconds, png = best(lambda spec=spec: figures.render_png(spec), args.repeats)
        points = len(spec["data"]["values"])
        print(f"{name:<26} {points:>7} {seconds:>8.3f} {len(png) / 1000:>8.1f}")

    seconds, page = best(figures.plots_template, 1)  # vl-convert keeps the bundle: only the first call counts
    print(f"\ndvc plots template (Vega inlined): {seconds:.2f} s, {len(page) / 1e6:.2f} MB")

    with tempfile.TemporaryDirectory() as tmp:  # the stage writes its PNGs into reports_dir: work on a copy
        import shutil

        shutil.copytree(args.reports, Path(tmp) / "reports", ignore=shutil.ignore_patterns("hybrid"))
        overrides = [f"base.reports_dir={tmp}/reports", f"train.live_dir={tmp}/reports/train_live"]
        from dflash.report.stage import run

        seconds, out = best(lambda: run(load_params("params.yaml", overrides), "params.yaml"), args.repeats)
        print(f"report stage (4 figures + the page): {seconds:.2f} s, report.html {os.path.getsize(out) / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
