"""The hybrid path end to end at the smallest size that still trains: a barely pre-trained tiny Qwen3-Next target (Gated
DeltaNet layers 0-2 + full attention in layer 3, params/demo-hybrid.yaml shrunk) through target -> audit ->
generate (vLLM, bfloat16, prefix caching off) -> tokenize -> train -> eval (vLLM DFlash + plain greedy +
the PyTorch reference, which restores the recurrent state after each rejection). Every stage runs as its
own process (`python -m stages.NAME`), as `dvc repro` runs it, with every output path in a tmp folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dflash.core.io import read_json
from tests.helpers.inputs import distinct_sample_rows
from tests.helpers.models import NARROW_HYBRID

OVERLAY = "params/demo-hybrid.yaml"
SMALL = [
    # A few pre-training steps: random weights give near-tied logits, whose argmax differs between the engine's
    # batch shapes in bfloat16 (eval reports it); a little training makes greedy choices clear.
    "target.tiny.steps=20",
    "target.tiny.margin_prompts=0",  # no margin report: an untrained target's decisions are near-ties (its gate)
    "target.tiny.corpus_size=200",
    "target.tiny.batch_size=8",
    "target.tiny.max_length=128",
    *NARROW_HYBRID,
    "generate.unit_size=8",
    "generate.max_model_len=512",
    "generate.sampling.max_tokens=16",
    "tokenize.drop_truncated=false",  # a random target rambles until the budget (as tests/integration/test_repro.py)
    "tokenize.drop_missing_think_end=false",
    "tokenize.eval_count=3",
    "tokenize.gates.loss_mask_sum_mode_frac.action=report",
    "tokenize.num_workers=1",
    "drafter.block_size=4",
    "train.epochs=1",
    "train.num_anchors=4",
    "eval.engines=[dflash, none]",  # spec vs plain greedy; the other baselines are tests/integration/test_eval_stage.py's
    "eval.num_prompts=3",
    "eval.max_tokens=16",
    "eval.max_model_len=512",
]
STAGES = [("target", []), ("audit", []), ("generate", []), ("tokenize", []), ("train", []), ("eval", [])]


def _input(path, n=16):
    """The first n well-formed conversations of the bundled sample with distinct first prompts."""
    path.write_text("".join(json.dumps(r) + "\n" for r in distinct_sample_rows(n)))


@pytest.mark.slow
def test_hybrid_target_through_generate_tokenize_train_eval(repo_root, tmp_path):
    _input(tmp_path / "tiny.jsonl")
    paths = {
        "base.target_dir": "target",
        "base.reports_dir": "reports",
        "audit.input": "tiny.jsonl",
        "audit.out": "audit",
        "generate.out": "generate",
        "generate.pilot_out": "pilot",
        "tokenize.out": "tokenize",
        "train.out": "train",
        "train.live_dir": "reports/train_live",
    }
    overrides = [*SMALL, *(f"{k}={tmp_path / v}" for k, v in paths.items())]
    env = {**os.environ, "PYTHONPATH": str(repo_root)}
    for stage, extra in STAGES:
        cmd = [sys.executable, "-m", f"stages.{stage}", "--params", "params.yaml", "--overlay", OVERLAY, *extra]
        cmd += [a for o in overrides for a in ("-S", o)]
        proc = subprocess.run(cmd, cwd=repo_root, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"stage {stage} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        if stage == "generate":
            assert "hybrid target Qwen3NextForCausalLM: 3 Gated DeltaNet + 1 full-attention layers" in proc.stderr
    reports = tmp_path / "reports"
    target = read_json(reports / "target.json")
    assert target["architecture"] == "Qwen3NextForCausalLM" and target["dtype"] == "bfloat16"
    assert target["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert read_json(reports / "train.json")["steps"] >= 1
    ev = read_json(reports / "eval.json")
    assert ev["num_prompts"] == 3
    assert ev["greedy_identical_frac"] == 1.0  # speculative greedy output == plain greedy, every prompt
    assert ev["tau"] >= 1.0 and ev["tau_reference"] >= 1.0
    details = read_json(reports / "eval_details.json")
    assert details["reference"]["mode"] == "cache"
