"""Stage `eval`: tau measured by the serving engine itself, beside an independent PyTorch reference.

  engines.py     one engine configuration per spawned worker: vLLM speculative decoding, its counters
  progress.py    the progress bars: an engine's clock starts when it is up (it says so while it starts)
  prompt_sets.py named prompt sets beside the held-out split (local files, hub datasets), their table
  reference.py   the PyTorch reference evaluator (transformers target + DraftSession): every drafter.kind
                 decoded as vLLM drafts it, greedy or rejection sampling at eval.reference_temperatures
  speed.py       speedup measured side by side: engines kept alive in workers, run in interleaved rounds on the
                 same prompts, with the step time split into target forward / drafting / the rest (also
                 benchmarks/spec_speedup.py)
  report.py      eval.json, eval.md, the acceptance plot table
  stage.py       the stage: prompts, engines in turn, the reference, the reports

May import: dflash.core, dflash.drafter. vLLM only inside the engine worker process.
"""
