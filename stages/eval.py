"""Stage `eval`: the drafter's acceptance length tau measured by real vLLM speculative decoding on held-out
prompts, beside the PyTorch reference evaluator, an untrained drafter, vLLM's n-gram drafter and plain decoding.

Inputs: the exported drafter `${train.out}/drafter`, the target in `${base.target_dir}`, the tokenize stage's eval
shards `${tokenize.out}/eval/shard-*.arrow`. Outputs: `reports/eval.json` (the headline: tau, tau_reference,
tau_untrained, tau_ngram, acceptance per position, speedup, num_prompts, ...), `reports/eval_details.json` (per
engine, the reference, goals, notes), `reports/eval.md`, `reports/eval_acceptance.csv`. Each engine configuration
in `eval.engines` starts its own vLLM engine (~15 s each on this 2-core CPU with the core in the worker).

    python -m stages.eval --params params.yaml
    python -m stages.eval -S eval.engines='[dflash, none]' -S eval.reference=false   (fewer engines)
"""

from dflash.core import cli


def main(params):
    from dflash.eval.stage import run

    report = run(params).report
    keys = ("tau", "tau_reference", "tau_untrained", "tau_ngram", "speedup", "greedy_identical_frac", "num_prompts")
    print({k: report[k] for k in keys})
    print(f"report: {params.base.reports_dir}/eval.md")


if __name__ == "__main__":
    cli.run(main, __doc__.split("\n\n")[0])
