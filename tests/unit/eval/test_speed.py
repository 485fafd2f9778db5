"""dflash/eval/speed.py: the interleaved order, the paired speedup and the step-time breakdown (no engine)."""

from __future__ import annotations

import pytest

from dflash.core.errors import UserError
from dflash.eval.speed import RunResult, StepTimes, interleaved_order, measure, spread, summarize


def _run(name: str, rnd: int, tokens: int, wall: float, steps: int = 10, concurrency: int = 1, **times) -> RunResult:
    t = StepTimes(
        steps=steps,
        step_s=times.get("step_s", wall),
        target_forward_s=times.get("target_forward_s", 0.0),
        drafting_s=times.get("drafting_s", 0.0),
        draft_logits_s=times.get("draft_logits_s", 0.0),
    )
    return RunResult(name, rnd, concurrency, tokens, wall, t, tokens=[[0] * tokens])


def test_interleaved_order_runs_every_configuration_once_per_round_in_turn():
    assert interleaved_order(["a", "b", "c"], 2) == [(0, "a"), (0, "b"), (0, "c"), (1, "a"), (1, "b"), (1, "c")]


@pytest.mark.parametrize(("names", "rounds"), [(["a"], 0), ([], 2), (["a", "a"], 2)])
def test_interleaved_order_refuses_no_rounds_and_repeated_names(names, rounds):
    with pytest.raises(UserError):
        interleaved_order(names, rounds)


def test_speedup_pairs_each_run_with_the_baseline_of_its_own_round():
    # the machine slows down in round 1 (both halve): paired ratios stay 2, a ratio of medians would not
    results = [
        _run("none", 0, 100, 1.0),
        _run("dflash", 0, 100, 0.5),
        _run("none", 1, 100, 4.0),
        _run("dflash", 1, 100, 2.0),
        _run("none", 2, 100, 1.0),
        _run("dflash", 2, 100, 0.25),
    ]
    s = summarize(results, baseline="none")
    assert s["none"].speedup is None
    assert s["dflash"].speedup.min == pytest.approx(2.0)
    assert s["dflash"].speedup.median == pytest.approx(2.0)
    assert s["dflash"].speedup.max == pytest.approx(4.0)
    assert s["dflash"].tokens_per_s.min == pytest.approx(50.0)
    assert s["dflash"].tokens_per_s.median == pytest.approx(200.0)
    assert s["none"].ms_per_token.median == pytest.approx(10.0)
    assert s["none"].rounds == 3


def test_breakdown_is_mean_ms_per_step_and_rest_is_what_the_hooks_did_not_see():
    results = [
        _run("dflash", 0, 30, 1.0, steps=10, step_s=0.9, target_forward_s=0.4, drafting_s=0.3, draft_logits_s=0.2),
        _run("dflash", 1, 30, 1.0, steps=10, step_s=1.1, target_forward_s=0.4, drafting_s=0.5, draft_logits_s=0.2),
    ]
    b = summarize(results)["dflash"].breakdown_ms_per_step
    assert b["step"] == pytest.approx(100.0)
    assert b["target_forward"] == pytest.approx(40.0)
    assert b["drafting"] == pytest.approx(40.0)
    assert b["draft_logits"] == pytest.approx(20.0)
    assert b["rest"] == pytest.approx(20.0)
    assert summarize(results)["dflash"].tokens_per_step == pytest.approx(3.0)


def test_summarize_refuses_unpaired_rounds_and_mixed_concurrency():
    with pytest.raises(ValueError, match="no none run"):
        summarize([_run("none", 0, 10, 1.0), _run("dflash", 1, 10, 1.0)], baseline="none")
    with pytest.raises(ValueError, match="no runs"):
        summarize([_run("dflash", 0, 10, 1.0)], baseline="none")
    with pytest.raises(ValueError, match="one concurrency"):
        summarize([_run("none", 0, 10, 1.0), _run("none", 1, 10, 1.0, concurrency=4)])


def test_spread_of_even_count_uses_the_middle_pair():
    s = spread([4.0, 1.0, 3.0, 2.0])
    assert (s.min, s.median, s.max) == (1.0, 2.5, 4.0)


class _Recorder:
    """Stands in for a SpeedEngine's worker: records the order runs were asked for."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def run(self, prompts, concurrency, round_index):
        self.log.append((round_index, self.name, concurrency, len(prompts)))
        return _run(self.name, round_index, 10, 1.0, concurrency=concurrency)


def test_measure_asks_the_engines_in_interleaved_rounds_on_the_same_prompts():
    log: list = []
    engines = {n: _Recorder(n, log) for n in ("none", "dflash", "ngram")}
    seen = []
    results = measure(engines, [[1, 2], [3]], rounds=2, concurrency=4, on_run=seen.append)
    assert [(r, n) for r, n, _, _ in log] == interleaved_order(["none", "dflash", "ngram"], 2)
    assert {(c, p) for _, _, c, p in log} == {(4, 2)}
    assert seen == results and len(results) == 6


def _engine_result(rate: float, tokens: list[list[int]], interleaved: dict | None = None) -> dict:
    counters = {"tau": 2.0, "acceptance_per_position": [0.5, 0.5], "num_drafts": 4, "num_draft_tokens": 8}
    counters |= {"num_accepted_tokens": 4, "num_accepted_tokens_per_pos": [2, 2]}
    out = {"speculative_config": None, "counters": counters, "tokens_per_step": 2.0, "output_tokens": 8}
    out |= {"wall_s": 8 / rate, "output_tokens_per_s": rate, "engine_start_s": 1.0, "finish_reasons": ["length"]}
    out |= {"tokens": tokens, "platform": "cpu", "vllm_version": "test"}
    if interleaved is not None:
        out["interleaved"] = interleaved
    return out


def test_eval_speedup_is_the_interleaved_median_when_the_rounds_ran():
    from types import SimpleNamespace

    from dflash.eval.report import build_report, markdown
    from tests.helpers import repo_params

    e = repo_params().eval
    dcfg = SimpleNamespace(block_size=3, num_hidden_layers=1, kind="dflash")
    prompts = [{"sample_id": "a", "prompt_ids": [1]}]
    runs = [_run("none", r, 100, 1.0) for r in range(3)] + [
        _run("dflash", r, 100, w) for r, w in enumerate((0.8, 0.5, 0.4))
    ]
    speed = {n: {**s.to_json(), "num_prompts": 1, "engine_start_s": 1.0} for n, s in summarize(runs, "none").items()}
    engines = {"dflash": _engine_result(50.0, [[1, 2]], speed["dflash"]), "none": _engine_result(100.0, [[1, 2]])}
    report = build_report(e, dcfg, prompts, [], engines, None)
    assert report["speedup"] == pytest.approx(2.0)  # median of 1.25, 2, 2.5; the sequential ratio was 0.5
    assert report["engines"]["dflash"]["speedup_sequential"] == pytest.approx(0.5)
    assert "median of 3 interleaved rounds" in markdown(report)
    engines["dflash"].pop("interleaved")
    assert build_report(e, dcfg, prompts, [], engines, None)["speedup"] == pytest.approx(0.5)
