"""Eval without vLLM: the PyTorch reference evaluator (KV-cached equals full recompute equals plain greedy; it
stops at a stop id like the engine), tau from the engine's counter deltas, held-out prompt loading, the engine
list check. The stage through vLLM: tests/integration/test_eval_stage.py.
"""

from __future__ import annotations

import random

import pyarrow as pa
import pytest
import torch
from transformers import Qwen3ForCausalLM

from dflash.core.errors import ParamsError, UserError
from dflash.core.io import write_arrow
from dflash.eval.reference import greedy_decode, reference_decode, summarize
from tests.helpers import repo_params
from tests.helpers.inputs import write_eval_shard
from tests.helpers.models import overfit_drafter, small_drafter_config, small_qwen3_config

# ------------------------------------------------------------------------------ reference evaluator (fast)


@pytest.fixture(scope="module")
def small():
    """A random small Qwen3 target (vocab 512) and a 2-layer drafter over-fitted on its greedy outputs."""
    torch.manual_seed(0)
    tc = small_qwen3_config(layers=4)
    target = Qwen3ForCausalLM(tc).eval()
    cfg = small_drafter_config(tc, layers=2)
    rng = random.Random(0)
    prompts = [[rng.randrange(500) for _ in range(rng.randint(3, 12))] for _ in range(4)]
    sequences = []
    for p in prompts:
        out = greedy_decode(target, p, 48)
        sequences.append((torch.tensor(p + out), len(p)))
    drafter, hits = overfit_drafter(cfg, target, sequences, steps=150, lr=1e-2)
    return target, drafter, prompts, hits


def test_reference_cache_equals_recompute_and_plain_greedy(small):
    target, drafter, prompts, hits = small
    assert hits > 0.5  # the drafter has learned enough for acceptance to be exercised
    results = []
    for p in prompts:
        greedy = greedy_decode(target, p, 40)
        cached = reference_decode(target, drafter, p, 40, mode="cache")
        full = reference_decode(target, drafter, p, 40, mode="recompute")
        assert cached.tokens == greedy  # speculation never changes greedy output
        assert (cached.tokens, cached.drafts, cached.accepted_per_pos) == (
            full.tokens,
            full.drafts,
            full.accepted_per_pos,
        )
        assert cached.finish_reason == "length"
        # Each cycle commits accepted + 1 tokens after the prefill's one; the last cycle may overshoot the budget.
        assert len(cached.tokens) <= 1 + cached.drafts + cached.accepted < 40 + drafter.config.block_size
        per = cached.accepted_per_pos
        assert all(a >= b for a, b in zip(per, per[1:], strict=False))  # position k+1 needs position k
        results.append(cached)
    s = summarize(results, drafter.config.block_size)
    assert s["num_accepted_tokens"] > 0
    assert s["tau"] == pytest.approx(1 + s["num_accepted_tokens"] / s["num_drafts"])
    assert s["acceptance_per_position"][0] == pytest.approx(s["num_accepted_tokens_per_pos"][0] / s["num_drafts"])


def test_reference_stops_at_a_stop_id_like_the_engine(small):
    target, drafter, prompts, _ = small
    greedy = greedy_decode(target, prompts[0], 40)
    stop = greedy[12]  # a token the target emits: both decoders must stop at its first occurrence, kept
    want = greedy[: greedy.index(stop) + 1]
    assert greedy_decode(target, prompts[0], 40, [stop]) == want
    for mode in ("cache", "recompute"):
        r = reference_decode(target, drafter, prompts[0], 40, [stop], mode=mode)
        assert r.tokens == want and r.finish_reason == "stop"
    with pytest.raises(ValueError, match="reference mode"):
        reference_decode(target, drafter, prompts[0], 4, mode="fast")


# ------------------------------------------------------------------------------ counters, prompts, params


def test_tau_and_acceptance_come_from_the_counter_deltas():
    from vllm.v1.metrics.reader import Counter, Vector

    from dflash.eval.engines import acceptance, read_counters

    def snapshot(drafts, accepted, per_pos):
        return [
            Counter(name="vllm:spec_decode_num_drafts", labels={}, value=drafts),
            Counter(name="vllm:spec_decode_num_draft_tokens", labels={}, value=3 * drafts),
            Counter(name="vllm:spec_decode_num_accepted_tokens", labels={}, value=accepted),
            Vector(name="vllm:spec_decode_num_accepted_tokens_per_pos", labels={}, values=per_pos),
            Counter(name="vllm:prompt_tokens", labels={}, value=999),
        ]

    before = read_counters(snapshot(2, 3, [2, 1, 0]))  # the warm-up request
    after = read_counters(snapshot(12, 23, [9, 8, 6]))
    a = acceptance(before, after)
    assert (a["num_drafts"], a["num_draft_tokens"], a["num_accepted_tokens"]) == (10, 30, 20)
    assert a["num_accepted_tokens_per_pos"] == [7, 7, 6]
    assert a["tau"] == pytest.approx(1 + 20 / 10)
    assert a["acceptance_per_position"] == pytest.approx([0.7, 0.7, 0.6])
    empty = read_counters([])  # no speculation: no counters at all
    assert acceptance(empty, empty)["tau"] is None


def test_prompts_are_the_prompt_part_of_the_eval_shards(tmp_path):
    from dflash.eval.stage import load_prompts

    write_eval_shard(tmp_path / "shard-00000.arrow", [("a:0", [1, 2, 3], [4, 5]), ("b:0", [6], [7, 8, 9])])
    write_eval_shard(tmp_path / "shard-00001.arrow", [("c:0", [10, 11], [12])])
    got = load_prompts(tmp_path, 0)
    assert got == [
        {"sample_id": "a:0", "prompt_ids": [1, 2, 3]},
        {"sample_id": "b:0", "prompt_ids": [6]},
        {"sample_id": "c:0", "prompt_ids": [10, 11]},
    ]
    assert [p["sample_id"] for p in load_prompts(tmp_path, 2)] == ["a:0", "b:0"]
    with pytest.raises(UserError, match="no shard"):
        load_prompts(tmp_path / "missing", 0)
    write_eval_shard(tmp_path / "shard-00002.arrow", [("d:0", [], [1, 2])])
    with pytest.raises(UserError, match=r"shard-00002\.arrow: row 0 \(d:0\): num_prompt_tokens 0"):
        load_prompts(tmp_path, 0)
    bad = tmp_path / "bad"
    bad.mkdir()
    write_arrow(bad / "shard-00000.arrow", pa.table({"sample_id": ["x"], "input_ids": [[1, 2]]}))
    with pytest.raises(UserError, match=r"shard-00000\.arrow: columns \['num_prompt_tokens'\] missing"):
        load_prompts(bad, 0)


def test_engine_list_is_checked(repo_root):
    from dflash.eval.engines import speculative_config
    from dflash.eval.stage import run

    with pytest.raises(ParamsError, match=r"eval\.engines\[1\]: expected one of"):
        repo_params(["eval.engines=[dflash, eagle]"])
    params = repo_params(["eval.engines=[none, ngram]"])
    with pytest.raises(UserError, match=r"eval\.engines: .* must include 'dflash'"):
        run(params)
    e = params.eval
    assert speculative_config("none", e, "", 8) is None
    ngram = speculative_config("ngram", e, "", 8)
    assert ngram["method"] == "ngram" and ngram["num_speculative_tokens"] == 7  # 0 = block_size - 1
    assert speculative_config("dflash", e, "/d", 8) == {"method": "dflash", "model": "/d", "num_speculative_tokens": 7}
