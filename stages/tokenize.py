"""Stage `tokenize`: training samples (input_ids + assistant-only loss_mask) in Arrow shards, with a
held-out eval split by conversation and the loss-mask gate.

Inputs: params `tokenize`, `base` (seed, thinking mode, template kwargs, target folder); the current
generate run (`tokenize.source: generated`) or `${audit.out}/conversations.arrow` (`recorded`) rendered
with the target's chat template. Outputs: `${tokenize.out}/train/shard-*.arrow`,
`${tokenize.out}/eval/shard-*.arrow`, `${tokenize.out}/manifest.json`, metrics `reports/tokenize.json`,
plot data `reports/tokenize_loss_mask_sums.csv`. A crossed `fail` gate, or no training sample at all,
exits non-zero AFTER everything is written.

    python -m stages.tokenize --params params.yaml
    python -m stages.tokenize --params params.yaml -S tokenize.source=recorded
"""

from dflash.core import cli
from dflash.core.errors import UserError


def main(params):
    from dflash.core.gates import gate_failure_message
    from dflash.tokenize.stage import run

    m = run(params)
    dropped = ", ".join(f"{k} {v}" for k, v in m["dropped_by_reason"].items() if v) or "none"
    print(
        f"tokenize ({m['source']}): {m['num_input']} input samples -> {m['num_samples']} kept "
        f"({m['train_samples']} train / {m['eval_samples']} eval in {m['eval_conversations']} held-out "
        f"conversations); dropped: {dropped}; {m['total_tokens']} tokens, {m['loss_token_frac']:.1%} under the "
        f"loss mask; most common loss-mask sum {m['loss_mask_sum_mode']} tokens ({m['loss_mask_sum_mode_frac']:.1%} "
        f"of samples); {m['tokens_per_s']:.0f} tokens/s -> {params.tokenize.out}"
    )
    message = gate_failure_message(m["gates"], "tokenize.gates")
    if message:
        raise UserError(
            f"{message}\nEverything was written under {params.tokenize.out} and {params.base.reports_dir}/."
        )
    if m["train_samples"] == 0:
        raise UserError(
            f"tokenize: no training samples left ({m['num_input']} input, dropped {m['dropped_by_reason']}, "
            f"{m['eval_samples']} held out); see {params.base.reports_dir}/tokenize_details.json"
        )


if __name__ == "__main__":
    cli.run(main, __doc__.split("\n\n")[0])
