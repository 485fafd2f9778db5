"""Stage `target`: the embedded tiny Qwen3 target, or a reference to a real one.

  build.py       tiny target builder (exact sparse-vocabulary CPU pre-training) / real-target reference;
                 `python -m dflash.target.build` writes params' recipe's cache entry
  cache.py       pre-trained tiny targets kept in the repository, one file per recipe (the same target on every CPU)
  margins.py     how decided the tiny target's greedy choices are (the stage's margin report and gate)
  synthetic.py   synthetic conversations: the tiny target's corpus and the bundled sample data

May import: dflash.core.
"""
