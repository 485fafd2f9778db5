"""Stage `plan`: time, memory and cost of generation and training before any GPU time is spent.

  sizing.py     parameter / byte / FLOP counts of a target (dense or hybrid Gated DeltaNet)
  inputs.py     what the plan reads: GPU profiles, the target's config, audit / tokenize / pilot metrics
  estimate.py   generation (roofline decode, cache capacity) and training (FLOPs, memory per layout)
  report.py     plan.md and the scaling tables

May import: dflash.core, dflash.drafter (its torch-free geometry only). No torch.
"""
