"""dflash: the library behind the dflash-pipeline stages. One package per stage, plus two shared cores.

  core/      params schema + loader, CLI, errors, files, chat templates, the target's config, the data contracts
  drafter/   the DFlash drafter: torch-free geometry (used by train, eval AND plan), model, masks, export
  target/    stage `target`: the embedded tiny target and its synthetic corpus
  audit/     stage `audit`: readers, checks, running state, report
  generate/  stages `pilot` and `generate`: contract -> worker -> dispatch -> stage
  tokenize/  stage `tokenize`: sources, per-chunk samples, shards and gates
  train/     stage `train`: data packing, target features, loss, checkpoints, the loop, logging
  eval/      stage `eval`: vLLM engine runs, the PyTorch reference evaluator, reports
  plan/      stage `plan`: sizing, inputs, estimates, report
  report/    stage `report`: the run as one self-contained HTML page, the model stages' figures

Imports run one way: `stages/NAME.py` -> a stage package -> drafter -> core. A stage package never
imports another stage package; core imports nothing of ours outside core; nothing here imports
`stages/`. Only generate and eval import vLLM; audit, tokenize and plan reach no torch. Every
`__init__.py` is a docstring only (tests/unit/project/test_layout.py checks all of this, and that each stage's
dvc.yaml deps cover exactly the files it imports). The design: docs/design/ (mkdocs site: make docs).
"""
