"""Stage `report`: the figures of the stages that run a model and ONE self-contained HTML page of the whole run.

Inputs: every stage's reports (`${base.reports_dir}/*.json`, eval.md, plan.md, `${audit.out}/report.md`), their
plot data and pictures, dvc.lock, params.yaml and its committed version (git HEAD). Outputs:
`${base.reports_dir}/{pilot_sweep,train_loss,train_acceptance,eval_acceptance}.png` and
`${base.reports_dir}/report.html` (every figure and table inline; opens offline, fetches nothing).
No torch; renders with vl-convert (dflash/core/figures.py). Runs at any point: a stage not run yet is a gap.

    python -m stages.report --params params.yaml      (make report)
"""

from dflash.core import cli


def main(params, args):
    from dflash.report.stage import run

    out = run(params, args.params)
    print(f"report: {out}")


if __name__ == "__main__":
    cli.run(main, __doc__.split("\n\n")[0], add_args=lambda parser: None)
