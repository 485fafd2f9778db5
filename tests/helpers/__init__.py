"""Shared test helpers (plain functions and constants; the fixtures are in tests/conftest.py), by area:

  __init__.py   the repository: REPO, PARAMS, the overlays, repo_params (params.yaml as a stage reads it, with
                -S overrides and overlays), plan_params (the plan's 27B case with its own reports folder)
  generate.py   the generate stage as a subprocess, a worker config for runs against fake servers
  inputs.py     hand-made stage inputs: conversations (the audit's contract), eval shards (tokenize's), the
                bundled sample's distinct conversations
  models.py     small Qwen3 / Qwen3-Next / drafter geometries, a drafter-overfit helper, greedy continuations, one
                DFlash engine serving greedily, the reference-sampling target and drafters, the narrowest vLLM target
  train.py      the training tests' target and shards, their params, torch thread control, the torchrun environment
  audit.py      audit inputs: judged rows, a `datasets` hub cache made offline, save_to_disk folders, the stage run
  gpu.py        benchmarks/gpu_check.sh run from a test
  dvc.py        DVC in a throw-away repo: the environment, params written as `dvc exp run -S` does, a run's folders

Import them as `from tests.helpers import REPO` / `from tests.helpers.train import train_params`.
"""

from __future__ import annotations

from pathlib import Path

from dflash.core.loader import load_params
from dflash.core.params import Params

REPO = Path(__file__).resolve().parents[2]  # the repository root
PARAMS = REPO / "params.yaml"
GPU_OVERLAY = REPO / "params/gpu-qwen3.6-27b.yaml"
HYBRID_OVERLAY = REPO / "params/demo-hybrid.yaml"


# Applied before a test's own overrides: the unit and integration tests were written for a drafter over the whole
# vocabulary (and switch drafter.kind freely, which a pruned vocabulary forbids for every kind but dflash); the
# demo's pruned default (drafter.draft_vocab_size) has its own tests (test_vocab, test_train_draft_vocab,
# test_export_vllm_vocab) and runs in the pipeline tests through params.yaml.
TEST_DEFAULTS = ("drafter.draft_vocab_size=0",)


def repo_params(overrides=(), overlays=()) -> Params:
    """params.yaml of this checkout with overlay files, TEST_DEFAULTS and `-S`-style `overrides` applied (what a
    stage reads); a relative overlay path is the repository's."""
    return load_params(PARAMS, [*TEST_DEFAULTS, *overrides], [REPO / o for o in overlays])


def plan_params(reports: Path, *overrides: str, overlay: bool = True) -> Params:
    """The plan's params for the 27B case (the GPU overlay; overlay=False: params.yaml alone), every metrics file it
    reads taken from `reports` (the test's own folder), then `overrides`."""
    isolate = [f"base.reports_dir={reports}", "plan.audit_json=", "plan.tokenize_json=", "plan.pilot_json="]
    return repo_params([*isolate, *overrides], [GPU_OVERLAY] if overlay else [])
