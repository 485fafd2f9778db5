"""Stage `target`: the embedded tiny Qwen3 target, or a reference to a real one.

  build.py       tiny target builder (exact sparse-vocabulary CPU pre-training) / real-target reference
  synthetic.py   synthetic conversations: the tiny target's corpus and the bundled sample data
  margins.py     how decided the tiny target's greedy choices are: margins and near-tie shares (the stage's gate)

May import: dflash.core.
"""
