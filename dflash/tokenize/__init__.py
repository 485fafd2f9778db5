"""Stage `tokenize`: training samples (token ids + an assistant-only loss mask), a held-out split, the gates.

  sources.py   what it reads (the current generate run, or the audit's conversations) and the survey
  samples.py   the per-chunk work, in worker processes: exact input_ids / loss_mask, filters, split
  stage.py     the stage: shards, manifest, metrics, the loss-mask gate

May import: dflash.core, dflash.drafter. No torch, no transformers.
"""
