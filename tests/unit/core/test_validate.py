"""One set of params checks, applied by every stage it concerns: each size rule of dflash/core/validate.py is
refused by the plan AND by train (train sizes) AND by generate, the pilot and eval (engine sizes), through each
stage's own entry point and before that stage reads anything. The plan's torch-free tokenizer reading gives
train's mask-token verdict."""

from __future__ import annotations

import dataclasses
import re

import pytest

from dflash.core import params as schema
from dflash.core import validate
from dflash.core.errors import ParamsError, UserError
from tests.helpers import repo_params

OVERLAY = "params/gpu-qwen3.6-27b.yaml"


@pytest.fixture(autouse=True)
def _in_repo(repo_root, monkeypatch):
    monkeypatch.chdir(repo_root)


def _bad_values(words: str, tp: type) -> list:
    """Values that break a rule stated in words (independent of the rule's own test)."""
    if m := re.fullmatch(r">= (-?\d+)( or auto)?", words):
        return [tp(int(m.group(1)) - 1)]
    return {
        "> 0": [tp(0), tp(-1)],
        "in (0, 1]": [0.0, 1.5],
        "in [0, 1]": [-0.1, 1.1],
        "in [0, 1)": [1.0, -0.1],
    }[words]


def _cases(rules: dict, prefix: str, cls: type) -> list[tuple[str, object]]:
    types = {f.name: f.type for f in dataclasses.fields(cls)}
    out = []
    for key, (words, _) in rules.items():
        tp = {"int": int, "float": float, "int | Literal['auto']": int}[types[key]]
        out += [(f"{prefix}.{key}", v) for v in _bad_values(words, tp)]
    return out


ENGINE_CASES = _cases(validate.ENGINE, "generate", schema.GenerateParams)
GENERATE_CASES = _cases(validate.GENERATE, "generate", schema.GenerateParams) + _cases(
    validate.SAMPLING, "generate.sampling", schema.GenerateSamplingParams
)
TRAIN_CASES = _cases(validate.TRAIN, "train", schema.TrainParams) + [
    ("train.max_tokens_per_row", 256),  # < train.max_length 512
    ("train.adam_betas", [0.9]),
    ("train.adam_betas", [0.9, 1.0]),
]
EVAL_CASES = _cases(validate.EVAL, "eval", schema.EvalParams) + [
    ("eval.engines", ["dflash", "dflash"]),
    ("eval.engines", ["none", "ngram"]),
    ("eval.prompt_lookup_max", 1),  # < prompt_lookup_min 2
]
PLAN_CASES = (
    _cases(validate.PLAN, "plan", schema.PlanParams)
    + _cases(validate.PLAN_DATASET, "plan.dataset", schema.PlanDatasetParams)
    + _cases(validate.PLAN_GENERATION, "plan.generation", schema.PlanGenerationParams)
    + _cases(validate.PLAN_TRAIN, "plan.train_assumptions", schema.PlanTrainParams)
    + [("plan.gpu_counts", [1, 0])]
)


def _params(key: str, value, overlay: bool = False):
    import json

    return repo_params([f"{key}={json.dumps(value)}"], [OVERLAY] if overlay else [])


def _key_pattern(key: str) -> str:
    return rf"^{re.escape(key)}(\[\d+\])?: "


def _plan(params):
    from dflash.plan.estimate import make_plan

    return make_plan(params)


def _train(params):
    pytest.importorskip("torch")
    from dflash.train.loop import Trainer

    return Trainer(params, "no-such-data")  # bad params fail before the target config or the data are read


def _generate(params):
    from dflash.generate import stage

    return stage.run(params)  # bad params fail before the audit's conversations are read


def _pilot(params):
    from dflash.generate import stage

    return stage.run(params, pilot=True)


def _eval(params):
    from dflash.eval import stage

    return stage.run(params)  # bad params fail before the target, the drafter or the prompts are read


def test_the_shipped_params_pass_every_check():
    for overlays in ([], [OVERLAY]):
        p = repo_params([], overlays)
        validate.check_plan(p)
        validate.check_generate(p, pilot=True)
        validate.check_eval(p)
        validate.check_train(p)


@pytest.mark.parametrize(("key", "value"), TRAIN_CASES, ids=lambda x: str(x))
@pytest.mark.parametrize("stage", [_plan, _train], ids=["plan", "train"])
def test_train_sizes_are_refused_by_plan_and_train(stage, key, value):
    with pytest.raises(ParamsError, match=_key_pattern(key)):
        stage(_params(key, value))


@pytest.mark.parametrize("stage", [_plan, _train], ids=["plan", "train"])
def test_the_longest_document_must_fit_the_drafters_positions(stage):
    """train.max_length 512 + drafter.block_size 8 > drafter.max_position_embeddings 519."""
    with pytest.raises(ParamsError, match=r"^train\.max_length: 512 \+ drafter\.block_size 8 exceeds"):
        stage(_params("drafter.max_position_embeddings", 519))
    stage_ok = _params("drafter.max_position_embeddings", 520)
    validate.check_train(stage_ok)  # 520 is enough


@pytest.mark.parametrize(("key", "value"), GENERATE_CASES, ids=lambda x: str(x))
@pytest.mark.parametrize("stage", [_plan, _generate, _pilot], ids=["plan", "generate", "pilot"])
def test_generate_sizes_are_refused_by_plan_generate_and_pilot(stage, key, value):
    with pytest.raises(ParamsError, match=_key_pattern(key)):
        stage(_params(key, value))


@pytest.mark.parametrize(("key", "value"), ENGINE_CASES, ids=lambda x: str(x))
def test_eval_engines_obey_the_same_engine_rules(key, value):
    """The engine sizes generate (and the plan) refuse, eval refuses under its own keys."""
    eval_key = key.replace("generate.", "eval.", 1)
    with pytest.raises(ParamsError, match=_key_pattern(eval_key)):
        _eval(_params(eval_key, value))


@pytest.mark.parametrize(("key", "value"), EVAL_CASES, ids=lambda x: str(x))
def test_eval_sizes_are_refused_by_eval(key, value):
    with pytest.raises(ParamsError, match=_key_pattern(key)):
        _eval(_params(key, value))


@pytest.mark.parametrize(("key", "value"), PLAN_CASES, ids=lambda x: str(x))
def test_plan_inputs_are_refused_before_any_estimate(key, value):
    with pytest.raises(ParamsError, match=_key_pattern(key)):
        _plan(_params(key, value, overlay=True))


def test_a_pilot_needs_samples_a_full_run_does_not():
    params = _params("generate.pilot_samples", 0)
    with pytest.raises(ParamsError, match=r"^generate\.pilot_samples: must be >= 1 for a pilot run"):
        _pilot(params)
    validate.check_generate(params)  # 0 is fine when no pilot runs


TARGET_CASES = _cases(validate.TINY, "target.tiny", schema.TinyTargetParams) + [
    ("target.tiny.num_attention_heads", 3),  # not a multiple of 2 KV heads
]
HYBRID_CASES = [
    ("target.tiny.num_hidden_layers", 3),  # no full-attention layer in the 3 : 1 pattern
    ("target.tiny.linear_num_value_heads", 3),  # not a multiple of 2 key heads
]


@pytest.mark.parametrize(("key", "value"), TARGET_CASES)
def test_tiny_target_sizes_are_refused_by_the_target_stage(key, value, tmp_path):
    from stages import target as stage

    params = _params(key, value)
    params = dataclasses.replace(params, base=dataclasses.replace(params.base, target_dir=str(tmp_path / "t")))
    with pytest.raises(ParamsError, match=_key_pattern(key)):
        stage.main(params)
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize(("key", "value"), HYBRID_CASES)
def test_hybrid_geometry_is_refused_for_qwen3_next_only(key, value):
    import json

    hybrid = repo_params(["target.tiny.architecture=qwen3_next", f"{key}={json.dumps(value)}"])
    with pytest.raises(ParamsError, match=_key_pattern(key)):
        validate.check_target(hybrid)
    validate.check_target(_params(key, value))  # the dense target has no linear-attention layers


def test_every_size_of_the_checked_sections_has_a_rule():
    """A new int / float knob in generate, eval, train or plan gets a rule here (or a reason to have none)."""
    unruled = {  # no size: any value is meaningful
        "GenerateSamplingParams": {"seed"},
        "TrainParams": {"max_tokens_per_row"},  # checked against train.max_length
        "EvalParams": {"prompt_lookup_max"},  # checked against eval.prompt_lookup_min
    }
    tables = {
        schema.TinyTargetParams: validate.TINY,
        schema.GenerateParams: validate.GENERATE,
        schema.GenerateSamplingParams: validate.SAMPLING,
        schema.EvalParams: validate.EVAL,
        schema.TrainParams: validate.TRAIN,
        schema.PlanParams: validate.PLAN,
        schema.PlanDatasetParams: validate.PLAN_DATASET,
        schema.PlanGenerationParams: validate.PLAN_GENERATION,
        schema.PlanTrainParams: validate.PLAN_TRAIN,
    }
    for cls, rules in tables.items():
        sizes = {f.name for f in dataclasses.fields(cls) if f.type in ("int", "float")}
        missing = sizes - set(rules) - unruled.get(cls.__name__, set())
        assert not missing, f"{cls.__name__}: no rule in dflash/core/validate.py for {sorted(missing)}"


# ------------------------------------------------------------------ the mask token, without transformers


@pytest.mark.parametrize("token_id", [0, 100, 151642, 151643, 151644, 151645, 151657, 151668, 151669, 151935])
def test_plan_tokenizer_gives_trains_mask_token_verdict(qwen_tokenizer, tmp_path, token_id):
    """TokenizerFacts (tokenizers + tokenizer_config.json) and transformers' tokenizer: the same verdict."""
    import shutil

    from dflash.drafter.geometry import check_mask_token
    from dflash.plan.inputs import load_tokenizer_facts
    from dflash.target.build import qwen3_tokenizer_dir

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(qwen3_tokenizer_dir() / name, tmp_path / name)
    facts = load_tokenizer_facts(tmp_path / "config.json")
    assert facts is not None and len(facts) == len(qwen_tokenizer)

    def verdict(tok):
        try:
            check_mask_token(token_id, tok)
        except UserError as exc:
            return str(exc).split(" is ")[1].split(";")[0]  # which reason
        return "ok"

    assert verdict(facts) == verdict(qwen_tokenizer)
