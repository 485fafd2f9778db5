"""Shared cores every stage builds on; no stage logic here.

  params.py, loader.py   the params schema (dataclasses) and its strict loader (-S overrides, overlays);
                         params_plan.py its plan section
  yamlio.py              the ONE YAML reading (DVC's: YAML 1.2 core schema, duplicate keys refused)
  cli.py, errors.py      the stages' command line; UserError, the one error type a user can fix
  paths.py               output folders that overlap each other or an input are refused before any stage runs
  io.py                  atomic writes, JSON, hashes, Arrow IPC shards
  chat.py                chat-template rendering (transformers' tokenizer, or jinja2 + tokenizers: no torch)
  target_config.py       the ONE reader of a target's target.json / config.json (TargetArch)
  target_counts.py       parameter and prefill FLOP counts of a target (the plan and the training pilot)
  hf.py                  the target through transformers: tokenizer, config fallback, weights (lazy imports)
  contracts.py           the Arrow schemas handed from stage to stage
  gates.py               data-quality gates (audit and tokenize)
  validate.py            the params checks plan, generate, eval and train run first (engine / train / plan sizes)
  concurrency.py         the pilot sweep's knee rule and `generate.max_num_seqs: auto` (generate and plan)
  hardware.py            hardware profiles read strictly from `plan.hardware_file` (the plan, the training pilot)
  metrics.py             a stage's headline metrics (NAME.json) apart from its details (NAME_details.json)
  figures.py             the one renderer: Vega-Lite charts to PNG without a network, the offline `dvc plots show` page
  processes.py           engine worker processes: clean exit, process-tree kill (generate and eval)
  overlay.py             write a params overlay into params.yaml (`python -m dflash.core.overlay`)

May import: dflash.core only. No torch, transformers or vLLM at module level (hf.py imports transformers
inside its functions; the data stages never reach it).
"""
