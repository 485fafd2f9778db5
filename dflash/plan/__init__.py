"""Stage `plan`: time, memory and cost of generation and training before any GPU time is spent.

  sizing.py     bytes a target loads and reads per decode step, KV / Gated DeltaNet cache, decode FLOPs
  inputs.py     what the plan reads: GPU profiles, the target's config, audit / tokenize / pilot metrics
  estimate.py   make_plan: reads the inputs, runs the estimates below, the summary (plan.json) and assumptions
  generation.py generation: roofline decode per vLLM engine, cache capacity, pilot calibration
  training.py   training: FLOPs per sequence, per-GPU memory and time per device layout (single, split, DDP)
  deadline.py   plan.deadline_hours: the smallest cluster (nodes x GPUs) that meets it, gradient all-reduce included
  report.py     plan.md, the deadline and scaling tables

May import: dflash.core, dflash.drafter (its torch-free geometry and flops only). No torch.
"""
