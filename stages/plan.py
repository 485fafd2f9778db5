"""Stage `plan`: time, memory and cost estimates for generation and training, before GPU time is spent, and how close
they came once the stages ran.

Inputs: params `plan`, `drafter`, `base` (and the generate / train knobs the estimates model); the target's
config.json (`plan.target_config`, default `${base.target_dir}/config.json`); the hardware profiles file
(`plan.hardware_file`: GPU profiles, or the CPU host profile benchmarks/hw_probe.py measured); and, when they exist,
the audit / tokenize / generate pilot / training pilot metrics (they replace the model's figures) and the generate /
train stages' own metrics (calibration); the published runs of params/published/runs.yaml (beside the params file). No torch, no download.
Outputs: `${base.reports_dir}/plan.md` (readable report, also printed), `plan.json` (headline metrics, with
`calibration` once the stages ran), `plan_details.json` (everything),
`plan_generation_scaling.csv` and `plan_train_scaling.csv` (hours vs GPU count, DVC plots) and their picture
`plan_time_vs_gpus.png`. With
`plan.deadline_hours` > 0, plan.json["deadline"] holds the smallest cluster that meets it (dflash/plan/deadline.py).

    python -m stages.plan --params params.yaml
    python -m stages.plan --overlay params/gpu-qwen3.6-27b.yaml    # Qwen3.6-27B on 4 x RTX PRO 6000
    python -m stages.plan --overlay params/gpu-qwen3.6-27b.yaml -S plan.deadline_hours=72   # the cluster for 3 days
"""

from pathlib import Path

from dflash.core import cli


def main(params, args):
    from dflash.core.figures import write_png
    from dflash.core.io import atomic_write, write_json
    from dflash.plan import report as plan_report
    from dflash.plan.estimate import build_plan
    from dflash.plan.published import PublishedRuns

    result = build_plan(params, published=PublishedRuns.beside(args.params))  # the runs beside the params file
    out = Path(params.base.reports_dir)
    text = plan_report.render_markdown(result)
    atomic_write(out / "plan.md", text)
    write_json(out / "plan.json", result.summary)  # the DVC metrics: the headline numbers
    write_json(out / "plan_details.json", result.to_json())
    atomic_write(out / "plan_generation_scaling.csv", plan_report.scaling_csv(result.scaling, "generation"))
    atomic_write(out / "plan_train_scaling.csv", plan_report.scaling_csv(result.scaling, "training"))
    write_png(out / plan_report.FIGURE, plan_report.time_vs_gpus(result.scaling))  # shown in plan.md
    print(text)


if __name__ == "__main__":
    cli.run(main, __doc__.split("\n\n")[0], with_args=True)
