"""Stage `audit`: check raw conversations before any GPU time and write the prompts generation completes.

Inputs: params `audit` (input files, gates, tokenizer setting), `base` (target folder for the tokenizer,
thinking mode and template kwargs). Outputs under `audit.out`: conversations.arrow (kept rows),
rejected.jsonl (every rejected row with reasons), audit_details.json (every count), report.md, plots/*.csv;
the headline metrics in `${base.reports_dir}/audit.json`.
A crossed `fail` gate exits non-zero AFTER everything is written, naming gate, value, threshold and fix.

    python -m stages.audit --params params.yaml
    python -m stages.audit --params params.yaml -S audit.input=FILE -S audit.out=DIR
"""

from pathlib import Path

from dflash.core import cli
from dflash.core.errors import UserError
from dflash.core.io import write_json


def main(params):
    from dflash.audit.run import HEADLINE, run_audit
    from dflash.core.gates import gate_failure_message
    from dflash.core.metrics import headline

    metrics = run_audit(params.audit, params.base, params.tokenize.source)
    write_json(Path(params.base.reports_dir) / "audit.json", headline(metrics, HEADLINE))
    print(
        f"audit: {metrics['num_rows']} rows, {metrics['num_kept']} kept, {metrics['num_rejected']} rejected "
        f"({metrics['num_malformed']} malformed); placeholders {metrics['placeholder_response_frac']:.1%}, "
        f"length spike {metrics['response_length_spike_frac']:.1%} at {metrics['response_length_spike_value']} "
        f"{metrics['response_length_spike_unit']}; {metrics['rows_per_s']:.0f} rows/s -> {params.audit.out}/report.md"
    )
    message = gate_failure_message(metrics["gates"], "audit.gates")
    if message:
        raise UserError(f"{message}\nEverything was written under {params.audit.out} (see report.md).")


if __name__ == "__main__":
    cli.run(main, __doc__.split("\n\n")[0])
