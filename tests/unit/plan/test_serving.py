"""dflash/plan/serving.py: the predicted speedup of speculative decoding, with and without a pruned draft
vocabulary, and the training a pruned vocabulary saves (the 27B case of params/gpu-qwen3.6-27b.yaml)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from dflash.core.errors import UserError
from dflash.plan import estimate as plan
from dflash.plan import report as plan_report
from dflash.plan import serving
from dflash.plan.inputs import resolve_paths
from tests.helpers import plan_params

VOCAB_27B = 248_320
HIDDEN_27B = 5_120


def test_geometric_acceptance_adds_up_to_tau_and_falls_with_the_position():
    acc = serving.geometric_acceptance(3.0, 7)
    assert 1 + sum(acc) == pytest.approx(3.0, abs=1e-9)
    assert all(a > b for a, b in zip(acc, acc[1:], strict=False))
    assert serving.geometric_acceptance(1.0, 3) == pytest.approx([0.0, 0.0, 0.0])
    with pytest.raises(UserError, match="assumed_tau"):
        serving.geometric_acceptance(9.0, 7)


def test_coverage_scales_position_k_by_coverage_to_the_k():
    assert serving.with_coverage([0.8, 0.5, 0.2], 0.5) == pytest.approx([0.4, 0.125, 0.025])
    with pytest.raises(UserError, match="coverage"):
        serving.with_coverage([0.5], 0.0)


def test_acceptance_source_given_then_assumed_then_measured():
    assert serving.choose_acceptance([0.5, 0.25], 3.0, [0.9], positions=7).source == "plan.serving.acceptance"
    assert serving.choose_acceptance([], 3.0, [0.9], positions=7).tau == pytest.approx(3.0)
    measured = serving.choose_acceptance([], 0, [0.6, 0.3], positions=7)
    assert measured.tau == pytest.approx(1.9) and "eval.json" in measured.source
    assert serving.choose_acceptance([], 0, None, positions=7) is None


def test_the_27b_plan_predicts_the_speedup_with_and_without_a_32k_draft_vocabulary(tmp_path):
    p = plan.build_plan(plan_params(tmp_path / "reports"))
    s = p.serving
    assert s.tau == pytest.approx(3.609) and s.draft_vocab_size == 32_768
    full = {r.batch: r for r in s.rows if r.vocab_rows == VOCAB_27B}
    pruned = {r.batch: r for r in s.rows if r.vocab_rows == 32_768}
    assert sorted(full) == sorted(pruned) == [1, 8, 32, 64]
    b1 = full[1]
    assert b1.speedup == pytest.approx(b1.tau * b1.plain_ms / (b1.draft_ms + b1.verify_ms))
    assert b1.draft_bound == b1.verify_bound == "bandwidth"
    # at batch 1 the draft step reads every lm_head row: pruning saves exactly the bytes of the rows left out
    params = plan_params(tmp_path / "reports")
    gs = plan.generation_settings(params, resolve_paths(params.plan, params.base))
    bandwidth = p.hardware.profile.bandwidth_tbps * 1e12 * gs.bandwidth_efficiency * gs.tensor_parallel_size
    saved_ms = (VOCAB_27B - 32_768) * HIDDEN_27B * 2 / bandwidth * 1e3
    assert b1.draft_ms - pruned[1].draft_ms == pytest.approx(saved_ms, rel=1e-6)
    assert 0.3 < b1.draft_head_ms / b1.draft_ms < 0.5  # the issue's ~40% of drafting time
    assert pruned[1].speedup > b1.speedup > 1
    # verification grows compute-bound with the batch and the speedup shrinks
    assert full[64].speedup < full[32].speedup < full[8].speedup
    # the summary holds the headline number
    assert p.summary["serving_speedup_batch1"] == pytest.approx(b1.speedup)


def test_pruned_vocabulary_scales_only_the_drafter_lm_head_in_training(tmp_path):
    s = plan.build_plan(plan_params(tmp_path / "reports")).serving
    assert s.train_lm_head_tflops_pruned == pytest.approx(s.train_lm_head_tflops * 32_768 / VOCAB_27B)
    assert s.train_total_tflops - s.train_total_tflops_pruned == pytest.approx(
        s.train_lm_head_tflops - s.train_lm_head_tflops_pruned
    )
    assert s.train_hours_pruned < s.train_hours


def test_coverage_below_one_lowers_the_pruned_tau_and_its_speedup(tmp_path):
    whole = plan.build_plan(plan_params(tmp_path / "reports")).serving
    low = plan.build_plan(plan_params(tmp_path / "reports", "plan.serving.draft_vocab_coverage=0.8")).serving
    assert low.tau_pruned < whole.tau_pruned == pytest.approx(whole.tau)
    assert [r.speedup for r in low.rows if r.vocab_rows == 32_768] < [
        r.speedup for r in whole.rows if r.vocab_rows == 32_768
    ]


def test_plan_reads_eval_json_acceptance_and_shows_its_measured_speedup(tmp_path):
    reports = tmp_path / "reports"
    reports.mkdir()
    eval_json = {"acceptance": {"pos_2": 0.25, "pos_1": 0.5}, "speedup": 1.3, "platform": "cpu"}
    (reports / "eval.json").write_text(json.dumps(eval_json))
    params = plan_params(tmp_path / "reports", "plan.serving.assumed_tau=0", "plan.serving.draft_vocab_size=0")
    p = plan.build_plan(replace(params, eval=replace(params.eval, max_num_seqs=1)))
    assert p.serving.acceptance == [0.5, 0.25] and p.serving.tau == pytest.approx(1.75)
    # eval ran on the CPU, the plan prices a GPU: shown, and said not comparable
    assert p.serving.measured_speedup == 1.3 and "not comparable" in p.serving.measured_note
    assert p.serving.draft_vocab_size == 0 and all(r.vocab_rows == p.serving.vocab_size for r in p.serving.rows)
    md = plan_report.render_markdown(p)
    assert "## Serving: predicted speedup" in md and "eval measured 1.3 on cpu" in md


def test_no_acceptance_no_serving_section(tmp_path):
    p = plan.build_plan(plan_params(tmp_path / "reports", "plan.serving.assumed_tau=0"))
    assert p.serving is None
    assert "## Serving" not in plan_report.render_markdown(p)


def test_bad_serving_params_are_refused(tmp_path):
    with pytest.raises(UserError, match="draft_vocab_size"):
        plan.build_plan(plan_params(tmp_path / "reports", f"plan.serving.draft_vocab_size={VOCAB_27B + 1}"))
    with pytest.raises(UserError, match="batch_sizes"):
        plan.build_plan(plan_params(tmp_path / "reports", "plan.serving.batch_sizes=[0]"))
