"""Stage `generate` (and `pilot`): regenerate every assistant turn with the target through real vLLM.

Inputs: `${audit.out}/conversations.arrow` (the audit's kept conversations), the target in `${base.target_dir}`.
Outputs: `${generate.out}/run-<hash>/unit-*.arrow` + `current.json`, metrics `reports/generate.json` (+ `_details`);
with `--pilot`: `${generate.pilot_out}/...` and `reports/pilot.json` (throughput, output lengths,
extrapolated full-run tokens and hours; + `reports/pilot_details.json`). Resumable: re-running skips committed units.

    python -m stages.generate --params params.yaml
    python -m stages.generate --params params.yaml --pilot
    python -m stages.generate --server-command 8000 --server-host "$(hostname)"   # print a server's command
"""

from dflash.core import cli
from dflash.core.errors import UserError


def add_args(parser):
    parser.add_argument(
        "--pilot", action="store_true", help="pilot: generate.pilot_samples prompts, write reports/pilot.json"
    )
    parser.add_argument(
        "--server-command",
        type=int,
        metavar="PORT",
        help="print the vLLM server command with this stage's engine settings on PORT, and exit "
        "(slurm/generate-servers.sbatch; dflash/generate/serve_command.py)",
    )
    parser.add_argument("--server-host", default="127.0.0.1", help="with --server-command: the address it binds")


def _why(failed_unit: dict) -> str:
    """A unit given up on whole: why (its engine kept dying outside any request)."""
    return failed_unit.get("error") or f"exit code {failed_unit['exit_code']}"


def failure_message(metrics: dict) -> str | None:
    """One line on what failed (failed turns by reason, units given up on whole), or None."""
    if not metrics.get("num_failed"):
        return None
    parts = []
    by_reason = {k: v for k, v in (metrics.get("failed_by_reason") or {}).items() if k != "unit_failed"}
    if by_reason:
        turns = sum(by_reason.values())
        reasons = ", ".join(f"{n} {reason}" for reason, n in sorted(by_reason.items()))
        shown = metrics.get("failed_turns") or []
        example = f"; e.g. {shown[0]['sample_id']}: {shown[0]['error']}" if shown else ""
        parts.append(f"{turns} turn(s) failed ({reasons}{example})")
    units = metrics.get("units_failed") or []
    if units:
        parts.append(
            f"{len(units)} work unit(s) failed after retries, whole: "
            + ", ".join(f"{f['name']} ({_why(f)}, {f['attempts']} attempts)" for f in units)
        )
    return (
        "generate: " + "; ".join(parts) + ". Every other row is committed; a re-run asks again for exactly what failed "
        "(reports/generate_details.json lists it: fix the cause first)."
    )


def main(params, args):
    from dflash.generate import stage as generate

    if args.server_command is not None:
        from dflash.generate.serve_command import server_command_line

        print(server_command_line(params, args.server_host, args.server_command))
        return
    metrics = generate.run(params, pilot=args.pilot)
    keys = ("num_prompts", "num_completed", "num_skipped", "num_failed", "output_tokens_per_s", "mean_output_tokens")
    print(
        {k: metrics.get(k) for k in keys if k in metrics}
        | ({"estimated_total_hours": metrics["estimated_total_hours"]} if args.pilot else {})
    )
    message = failure_message(metrics)
    if message:
        raise UserError(message)


if __name__ == "__main__":
    cli.run(main, __doc__.split("\n\n")[0], add_args=add_args)
