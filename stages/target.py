"""Stage `target`: build the embedded tiny Qwen3 target, or record a reference to a real target.

Inputs: params `base`, `target`. Outputs: `${base.target_dir}/` (tiny: a full Qwen3 checkpoint with the
real Qwen3 tokenizer + target.json; real: target.json + config.json), metrics `reports/target.json` (tiny: with
the margins of its greedy decisions over a fixed prompt sample, dflash.target.margins). A crossed `fail` gate
(`target.tiny.gates.near_tie_frac`: too many near-tied greedy decisions) makes the stage exit non-zero after
everything is written.

    python -m stages.target --params params.yaml
"""

from pathlib import Path

from dflash.core import cli
from dflash.core.errors import UserError
from dflash.core.io import write_json
from dflash.core.validate import check_target

NEAR_TIE_FIX = (
    "train the tiny target until its greedy choices are decided (target.tiny.steps, corpus_size, lr, width), "
    "or set target.tiny.gates.near_tie_frac.action: report for a target whose outputs may differ between machines"
)


def main(params):
    from dflash.core.chat import template_kwargs
    from dflash.core.gates import check_gates, evaluate_gates, failed_gates, gate_failure_message
    from dflash.target import build as target
    from dflash.target import margins

    check_target(params)  # before any work: a refused size leaves the previous target as it was
    tiny = params.target.tiny
    check_gates(tiny.gates, "target.tiny.gates")

    if params.target.source != "tiny":
        metrics = target.write_reference(params.target, params.base.target_dir, params.base.trust_remote_code)
        write_json(Path(params.base.reports_dir) / "target.json", metrics)
        print(metrics)
        return
    metrics = target.build_tiny(params.target, params.base, params.base.target_dir)
    gates = []
    if tiny.margin_prompts > 0:
        report = margins.measure_saved(
            params.base.target_dir,
            n_prompts=tiny.margin_prompts,
            max_tokens=tiny.margin_max_tokens,
            seed=params.base.seed,
            chat=template_kwargs(params.base.enable_thinking, params.base.chat_template_kwargs),
        )
        metrics.update(report.metrics())
        gates = evaluate_gates({"near_tie_frac": report.near_tie_frac}, tiny.gates, {"near_tie_frac": NEAR_TIE_FIX})
        metrics["gate_failed"] = failed_gates(gates)
    write_json(Path(params.base.reports_dir) / "target.json", metrics)
    print(metrics)
    message = gate_failure_message(gates, "target.tiny.gates")
    if message:
        raise UserError(
            f"{message}\nEverything was written under {params.base.target_dir} and {params.base.reports_dir}/."
        )


if __name__ == "__main__":
    cli.run(main, __doc__.split("\n\n")[0])
