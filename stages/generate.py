"""Stage `generate` (and `pilot`): regenerate every assistant turn with the target through real vLLM.

Inputs: `${audit.out}/conversations.arrow` (the audit's kept conversations), the target in `${base.target_dir}`.
Outputs: `${generate.out}/run-<hash>/unit-*.arrow` + `current.json`, metrics `reports/generate.json` (+ `_details`);
with `--pilot`: `${generate.pilot_out}/...` and `reports/pilot.json` (throughput, output lengths,
extrapolated full-run tokens and hours; + `reports/pilot_details.json`). Resumable: re-running skips committed units.

    python -m stages.generate --params params.yaml
    python -m stages.generate --params params.yaml --pilot
"""

from dflash.core import cli
from dflash.core.errors import UserError


def add_args(parser):
    parser.add_argument(
        "--pilot", action="store_true", help="pilot: generate.pilot_samples prompts, write reports/pilot.json"
    )


def _why(failed_unit: dict) -> str:
    """A failed unit's cause: the request error (servers backend) or the worker's exit code (engines)."""
    return failed_unit.get("error") or f"exit code {failed_unit['exit_code']}"


def main(params, args):
    from dflash.generate import stage as generate

    metrics = generate.run(params, pilot=args.pilot)
    keys = ("num_prompts", "num_completed", "num_skipped", "num_failed", "output_tokens_per_s", "mean_output_tokens")
    print(
        {k: metrics.get(k) for k in keys if k in metrics}
        | ({"estimated_total_hours": metrics["estimated_total_hours"]} if args.pilot else {})
    )
    failed = metrics.get("units_failed") or []
    if failed:
        raise UserError(
            f"generate: {len(failed)} work unit(s) failed after retries ({metrics['num_failed']} prompts): "
            + ", ".join(f"{f['name']} ({_why(f)}, {f['attempts']} attempts)" for f in failed)
            + ". Completed units are kept; fix the cause and re-run to finish them."
        )


if __name__ == "__main__":
    cli.run(main, __doc__.split("\n\n")[0], add_args=add_args)
