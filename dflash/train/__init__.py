"""Stage `train`: the drafter (drafter.kind: dflash | dspark | dflash2 | lilicorr) trained online against the target, then exported.

  data.py         training shards -> packed rows, per-document anchors, batches
  data_plan.py    DataPlan: which packed rows each optimizer step takes, this process's micro-batches of them
  features.py     the target in-process: hooks keep only the feature layers and stop the forward there
  loss.py         decayed CE through the frozen lm_head in chunks (exact zero-row softmax), accuracy, tau_hat
  micro.py        MicroBatch: one micro-step's rows, anchors, labels and valid flags on the drafter's device; the
                  kind's loss of a micro-step (micro_loss); the seeded feature noise
  loss_dspark.py  DSpark: Markov-corrected CE + L1 to the target's distribution + confidence BCE, chunked; the
                  Markov head's start from the data's previous-token counts (drafter.dspark.markov_init)
  loss_dflash2.py DFlash2: the lm_head loss + the candidate selector's top-K cross-entropy
  draft_vocab.py  drafter.draft_vocab_size: the run's pruned vocabulary, its loss head, label mask and coverage
  loss_lilicorr.py LiLiCorr: the lm_head loss + the correlator's teacher-forced transition cross-entropy
  checkpoint.py   atomic config-hashed checkpoints (safetensors + weights-only state), provenance
  distributed.py  ranks (global vs local), devices, the global batch over any world size, collectives, checks
  parallel.py     the drafter's wrapper (train.parallel: ddp | fsdp = FSDP2), full checkpoint state, export copy
  parts.py        the trainer's set-up steps: devices, the checkpoint folder's key, the target's frozen parts, the
                  drafter with its optimizer and schedule (lr_factor)
  loop.py         the Trainer: its set-up in named steps, the training step, exact resume, the loop, export
  summary.py      TrainSummary: a run's figures, each under one key (train_details.json), HEADLINE (train.json)
  log.py          dvclive metrics / plots and the progress bar
  pilot.py        the training pilot: measured steps on the worst and ordinary rows before the long run
  pilot_data.py   the pilot's rows (longest, most anchors, ordinary sample) and PilotData, the data plan feeding them
  probes.py       what the pilot measures around the trainer: peak memory, timed features and their norms, kernels

May import: dflash.core, dflash.drafter.
"""
