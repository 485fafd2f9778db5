"""The plan reads the pilots and holds itself against what ran: the training ETA from the training pilot when one
was measured on the planned hardware (the model otherwise), calibration against the stages' own reports, the
generate pilot's drain, and the published runs.

Everything is planned for Qwen3.6-27B (params/gpu-qwen3.6-27b.yaml, no download); the measurement files are written
here with that target's signature, as the real stages would write them on an RTX PRO 6000 host.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from dflash.core.target_config import target_signature
from dflash.plan import estimate, report
from dflash.plan.generation_pilot import drain_step_cost, drained_seconds, steady_rate
from dflash.plan.published import PublishedRuns, check_runs
from tests.helpers import PARAMS, REPO, plan_params, repo_params

SIGNATURE = target_signature(REPO / "params/targets/qwen3.6-27b.config.json")
RTX = "NVIDIA RTX PRO 6000 Blackwell Server Edition"


def _write(reports: Path, name: str, headline: dict, details: dict | None = None) -> None:
    reports.mkdir(parents=True, exist_ok=True)
    (reports / f"{name}.json").write_text(json.dumps(headline))
    if details is not None:
        (reports / f"{name}_details.json").write_text(json.dumps({**headline, **details}))


def _train_pilot(reports: Path, device: str = RTX, verdict: str = "ok", **changes) -> dict:
    pilot = {
        "verdict": verdict,
        "problem": None if verdict == "ok" else "train pilot: out of memory on the longest rows (...)",
        "device": device,
        "world_size": 2,
        "layout": "split",
        "step_seconds": 1.9,
        "tokens_per_s": 4400.0,
        "samples_per_s": 2.0,
        "target_share": 0.4,
        "worst_step_seconds": 3.1,
        "peak_memory_gb": 71.5,
        "device_memory_gb": 95.6,
        "peak_phase": "anchors",
        "achieved_tflops": 150.0,
        "mfu": 0.3,
        "steps_per_epoch": 100,
        "epochs": 6,
        "target_signature": SIGNATURE,
        **changes,
    }
    _write(reports, "train_pilot", pilot, {"device_type": "cuda", "rows_per_step": 2, "rows_per_epoch": 200})
    return pilot


# ------------------------------------------------------------------------------------------ the training pilot


def test_the_plan_uses_the_pilots_epoch_step_time_and_keeps_the_targets_measured_seconds(tmp_path):
    """A pilot's few ordinary rows carry more (or fewer) blocks than the epoch's average: the plan reads the step
    time for the epoch's mix (epoch_step_seconds) and the target forward's seconds as measured."""
    reports = tmp_path / "reports"
    dp = "plan.train_assumptions.layout=data_parallel"
    _train_pilot(reports)
    plain = estimate.build_plan(plan_params(reports, dp)).training
    _train_pilot(reports, epoch_step_seconds=1.5)
    mixed = estimate.build_plan(plan_params(reports, dp)).training
    assert mixed.headline.total_hours == pytest.approx(plain.headline.total_hours * 1.5 / 1.9)
    assert mixed.target_seconds_per_sequence == pytest.approx(plain.target_seconds_per_sequence)  # 0.4 x 1.9 s
    assert mixed.drafter_seconds_per_sequence == pytest.approx(
        plain.drafter_seconds_per_sequence * (1.5 - 0.4 * 1.9) / (0.6 * 1.9)
    )


def test_training_eta_uses_the_pilot_when_present_and_the_model_when_not(tmp_path):
    reports = tmp_path / "reports"
    dp = "plan.train_assumptions.layout=data_parallel"
    model = estimate.build_plan(plan_params(reports, dp))
    assert model.training.source == "model" and model.summary["train_source"] == "model"
    flops = model.training.flops_per_sequence.total
    peak = 503.8e12  # the rtx-pro-6000 profile's bf16 peak
    assert model.training.seconds_per_sequence_one_gpu == pytest.approx(flops / (peak * 0.35), rel=0.05)

    _train_pilot(reports)
    measured = estimate.build_plan(plan_params(reports, dp))
    tr = measured.training
    assert tr.source == "pilot" and measured.summary["train_source"] == "pilot"
    samples, epochs, gpus = measured.dataset.train_samples, 6, 4
    epoch_one_process = 200 / (2 / 2) * 1.9  # the pilot's 200 packed rows, 2 rows a step over 2 processes, 1.9 s a step
    per_sample = epoch_one_process / samples
    assert (tr.target_seconds_per_sequence, tr.drafter_seconds_per_sequence) == pytest.approx(
        (0.4 * per_sample, 0.6 * per_sample)
    )
    assert tr.headline.total_hours == pytest.approx(epochs * epoch_one_process / gpus / 3600)  # scaled to 4 GPUs
    assert tr.model_seconds_per_sequence == pytest.approx(model.training.seconds_per_sequence_one_gpu)
    implied = flops / per_sample / peak  # the planner's FLOPs per sequence over its measured seconds
    assert tr.pilot.implied_mfu == pytest.approx(implied) and measured.summary["train_mfu_implied"] == pytest.approx(
        implied
    )
    assert tr.pilot.memory_fits and tr.pilot.memory_margin_gb == pytest.approx(95.6 - 71.5)
    md = report.render_markdown(measured)
    assert "### Training pilot: model vs measured" in md and "71.5 GB (anchors rows, split)" in md
    assert f"{implied:.3g} implied" in md and "0.35 assumed" in md

    # the deadline sizes the cluster with the pilot's step times too
    dl = estimate.build_plan(plan_params(reports, "plan.deadline_hours=200"))
    assert dl.deadline.train_source == "pilot"
    no_pilot = estimate.build_plan(plan_params(tmp_path / "empty", "plan.deadline_hours=200"))
    assert (
        no_pilot.deadline.train_source == "model"
        and dl.deadline.chosen.train_hours != no_pilot.deadline.chosen.train_hours
    )


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"device": "NVIDIA H200"}, "ran on NVIDIA H200, not on the planned"),
        ({"verdict": "out_of_memory"}, "verdict 'out_of_memory'"),
        ({"target_signature": "Qwen3ForCausalLM/layers=4/hidden=256/vocab=151936"}, "measured on Qwen3ForCausalLM"),
    ],
)
def test_a_pilot_that_cannot_stand_in_is_set_aside_and_said_so(tmp_path, change, why):
    reports = tmp_path / "reports"
    _train_pilot(reports, **change)
    result = estimate.build_plan(plan_params(reports))
    assert result.training.source == "model"
    assert why in result.inputs.ignored[str(reports / "train_pilot.json")]


# ------------------------------------------------------------------------------------------ calibration


def _ran(reports: Path) -> None:
    """The stages' own reports of a run of this plan on 4 x RTX PRO 6000 (generate) and 2 split processes (train)."""
    _write(
        reports,
        "generate",
        {"output_tokens": 1.4e9, "output_tokens_per_s": 7000.0, "target_signature": SIGNATURE},
        {"generation_wall_s": 2.0e5, "stage_wall_s": 2.01e5, "num_engines": 4},
    )
    _write(
        reports,
        "train",
        {
            "completed": True,
            "steps": 2_700_000,
            "tokens_per_s": 4000.0,
            "wall_seconds": 2.5e6,
            "drafter_params": estimate.make_plan(plan_params(reports))["summary"][
                "drafter_params"
            ],  # this plan's drafter
        },
        {"world_size": 2, "device": "cuda:1"},
    )


def test_calibration_sets_planned_beside_measured(tmp_path):
    reports = tmp_path / "reports"
    assert "calibration" not in estimate.make_plan(plan_params(reports))["summary"]  # nothing ran yet: nothing to hold
    _ran(reports)
    _train_pilot(reports)
    result = estimate.build_plan(plan_params(reports))
    cal = {c.stage: c for c in result.calibration}
    gen, tr = cal["generate"], cal["train"]
    assert gen.planned_from == "model" and gen.pilot_s is None  # no generate pilot: the model
    assert gen.planned_s == pytest.approx(result.generation.model_wall_hours.mid * 3600)  # 4 engines, as planned
    assert gen.error == pytest.approx(gen.planned_s / 2.0e5 - 1) and gen.measured_rate == 7000.0
    assert tr.planned_from == "pilot" and tr.pilot_s == tr.planned_s and tr.model_s > 0
    assert tr.error == pytest.approx(tr.planned_s / 2.5e6 - 1)
    assert tr.model_error == pytest.approx(tr.model_s / 2.5e6 - 1)
    summary = json.loads(json.dumps(result.summary))
    assert summary["calibration"]["train"] == {"planned_s": tr.planned_s, "measured_s": 2.5e6, "error": tr.error}
    md = report.render_markdown(result)
    assert "## How good was this plan (calibration)" in md and f"{tr.error:+.0%}" in md


def test_calibration_of_a_resumed_run_counts_every_step_not_the_last_invocation(tmp_path):
    """A run resumed from its checkpoint (a crash, or a rerun that found the finished checkpoint) has a wall_seconds
    of the last invocation only: the calibration reads steps_seconds, the summed seconds of every step."""
    reports = tmp_path / "reports"
    _ran(reports)
    _train_pilot(reports)
    train = json.loads((reports / "train.json").read_text())
    details = {"world_size": 2, "device": "cuda:1", "resumed": True}
    _write(reports, "train", train | {"wall_seconds": 0.003, "steps_seconds": 2.4e6}, details)
    (tr,) = [c for c in estimate.build_plan(plan_params(reports)).calibration if c.stage == "train"]
    assert tr.measured_s == 2.4e6 and tr.error == pytest.approx(tr.planned_s / 2.4e6 - 1)
    _write(reports, "train", train | {"wall_seconds": 0.003}, details)  # an older report: no steps_seconds
    result = estimate.build_plan(plan_params(reports))
    assert [c.stage for c in result.calibration] == ["generate"]
    assert "resumed run" in result.inputs.ignored[str(reports / "train.json")]


def test_calibration_ignores_another_runs_reports(tmp_path):
    reports = tmp_path / "reports"
    _ran(reports)
    (reports / "train.json").write_text(
        json.dumps({"completed": True, "wall_seconds": 130.0, "drafter_params": 984192})
    )
    generate = json.loads((reports / "generate.json").read_text()) | {"target_signature": "Tiny/layers=4"}
    (reports / "generate.json").write_text(json.dumps(generate))
    result = estimate.build_plan(plan_params(reports))
    assert result.calibration == []
    ignored = result.inputs.ignored
    assert "984192 parameters" in ignored[str(reports / "train.json")] and str(reports / "generate.json") in ignored


# ------------------------------------------------------------------------------------------ the generate pilot's drain


def test_a_drain_step_costs_what_the_sweep_measured_at_its_batch():
    """The demo's CPU sweep (step time grows with the batch): a drain step from 64 down to 1 costs 0.61 of a
    full-batch step; a flat step time (bandwidth-bound decode) or a sweep that does not span the concurrency: 1."""
    cpu = [
        {"max_num_seqs": 4, "output_tokens_per_s": 164.72},
        {"max_num_seqs": 16, "output_tokens_per_s": 411.88},
        {"max_num_seqs": 64, "output_tokens_per_s": 671.75},
    ]
    step = {r["max_num_seqs"]: r["max_num_seqs"] / r["output_tokens_per_s"] for r in cpu}
    by_hand = (4 * step[4] + sum(step[4] + (step[16] - step[4]) * (b - 4) / 12 for b in range(5, 17))) / 64
    by_hand += sum(step[16] + (step[64] - step[16]) * (b - 16) / 48 for b in range(17, 65)) / 64
    assert drain_step_cost(cpu, 64) == pytest.approx(by_hand / step[64]) and 0.55 < drain_step_cost(cpu, 64) < 0.65
    flat = [{"max_num_seqs": b, "output_tokens_per_s": b * 50.0} for b in (4, 16, 64)]
    assert drain_step_cost(flat, 64) == pytest.approx(1.0)
    assert drain_step_cost(cpu, 128) == 1.0 and drain_step_cost(cpu[:1], 4) == 1.0 and drain_step_cost([], 64) == 1.0


def test_a_pilot_the_size_of_the_run_predicts_its_own_wall():
    """steady_rate takes the pilot's drain out, drained_seconds adds one back: a run of the pilot's own size gets the
    pilot's own time, a larger run a higher rate (its drain is a smaller share)."""
    prompts, mean, c, tail, rate = 175, 46.85, 64, 128, 774.0
    steady = steady_rate(rate, prompts, mean, concurrency=c, tail_tokens=tail)
    assert steady > rate
    assert drained_seconds(prompts * mean, 1, c, rate=steady, tail_tokens=tail) == pytest.approx(prompts * mean / rate)
    big = 10 * prompts * mean
    assert big / drained_seconds(big, 1, c, rate=steady, tail_tokens=tail) > rate


def test_the_pilot_runs_own_rate_wins_at_its_concurrency_and_drains(tmp_path):
    reports = tmp_path / "reports"
    sweep = [{"max_num_seqs": n, "output_tokens_per_s": r} for n, r in ((8, 500.0), (32, 1500.0), (96, 1600.0))]
    pilot = {"output_tokens_per_s": 6000.0, "mean_output_tokens": 1500.0, "num_engines": 4, "pilot_prompts": 512}
    pilot |= {"sweep": sweep, "chosen_max_num_seqs": 32, "target_signature": SIGNATURE}
    details = {"max_num_seqs": 32, "backend": "engines", "p99_output_tokens": 9000.0, "full_run_prompts": 950000}
    _write(reports, "pilot", pilot, details)
    gen = estimate.build_plan(plan_params(reports)).generation
    drain = 9000.0 * drain_step_cost(sweep, 32)  # p99 steps, each at the sweep's mean drain cost (0.85 here)
    assert 0.8 < drain / 9000.0 < 0.9 and gen.pilot.drain_tokens == pytest.approx(drain)
    steady = steady_rate(1500.0, 128, 1500.0, concurrency=32, tail_tokens=drain)
    assert gen.pilot.measured_per_engine == pytest.approx(steady) and "steady once its drain" in gen.pilot.rate_source
    assert gen.output_tokens == pytest.approx(950000 * 1500.0)  # the full run's turns, from the pilot's details
    hours = drained_seconds(950000 * 1500.0, 4, 32, rate=steady, tail_tokens=drain) / 3600
    assert gen.wall_hours.mid == pytest.approx(hours)


# ------------------------------------------------------------------------------------------ published runs


def test_published_runs_state_the_models_error(tmp_path):
    published = PublishedRuns.beside(PARAMS)
    checks = {c.key: c for c in check_runs(published)}
    b200, rtx = checks["b200x7-regeneration"], checks["rtx-pro-6000x4-regeneration"]
    assert (b200.value, b200.unit, rtx.value) == (17.45, "h", 400.0)
    # the model of the same setup, planned independently through the stage's own path (no measurement files)
    p = repo_params([f"base.reports_dir={tmp_path}"], ["params/published/b200x7-qwen3.6-27b-regeneration.yaml"])
    hours = estimate.build_plan(p).generation.model_wall_hours.mid
    assert b200.model == pytest.approx(hours) and b200.error == pytest.approx(hours / 17.45 - 1)
    assert b200.optimistic == (hours < 17.45) and rtx.optimistic == (rtx.model > 400)
    assert not math.isclose(b200.error, 0.0, abs_tol=0.01)
    # a published run sizes its KV cache as the GPU run did (the share), never with params.yaml's CPU size
    assert p.generate.kv_cache_memory_gb == 0
    text = " ".join(estimate.build_plan(plan_params(tmp_path), published=published).assumptions)
    assert f"model {b200.model:,.4g} vs measured 17.45 h ({b200.error:+.0%}" in text
    assert "scheduling" in text and "long tail of thinking outputs" in text
