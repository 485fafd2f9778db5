"""Stage `plan`: time, memory and cost of generation and training before any GPU time is spent, and how close the
plan came once the stages ran.

  inputs.py       what the plan reads: the hardware profile, the target's config, audit / tokenize / pilot metrics
  measured.py     the training pilot and the stages' own reports (generate.json, train.json)
  settings.py     the runs it prices: generate's engines and train's knobs beside the efficiency assumptions
  context.py      PlanContext: every input above, read and resolved once, passed down to the estimates
  sizing.py       bytes a target loads and reads per decode step, KV / Gated DeltaNet cache, decode FLOPs
  generation.py   generation: roofline decode per vLLM engine, cache capacity, the generate pilot's rate in it
  generation_pilot.py  which measured rate stands for the planned run, the drain a pilot run includes
  training_costs.py    FLOPs and per-GPU memory of one training sequence, by part (TrainingFlops, TrainingMemory)
  training.py     training: time and memory per device layout, the training pilot in place of the model
  serving.py      the predicted speedup of speculative decoding (plan.serving): draft + verification step roofline,
                  with the whole and a pruned draft vocabulary, and the training the pruned one saves
  deadline.py     plan.deadline_hours: the smallest cluster (nodes x GPUs) that meets it, gradient all-reduce included
  calibration.py  planned vs measured per stage (plan.json["calibration"])
  published.py    the pre-pilot model against published measured runs (params/published/runs.yaml beside the params
                  file: both files are arguments)
  assumptions.py  the modelling choices in words, what the model leaves out
  result.py       the typed Plan (every section typed) and its JSON
  estimate.py     build_plan / make_plan: reads the inputs into a PlanContext, runs the estimates above
  report.py       plan.md rendered from the typed Plan, section by section (report_generation.py, report_training.py, report_serving.py,
                  report_deadline.py, report_checks.py; number formatting in report_format.py)

May import: dflash.core, dflash.drafter (its torch-free geometry and flops only). No torch.
"""
