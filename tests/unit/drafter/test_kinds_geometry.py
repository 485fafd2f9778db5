"""drafter.kind: each kind's params validated by the one geometry validator, priced by the plan, and the plan's
parameter count of every kind equal to the torch module's own count."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from dflash.core.errors import ParamsError
from dflash.drafter.geometry import KINDS, build_drafter_config, kind_cost, parameter_counts
from tests.helpers import REPO, plan_params, repo_params
from tests.helpers.models import kind_drafter_params, small_qwen3_config


def _drafter(kind: str, **changes):
    """A small drafter of `kind` over the small test target (vocab 512, hidden 64); block 8 unless changed."""
    return kind_drafter_params(kind, **{"num_hidden_layers": 1, "block_size": 8, **changes})


@pytest.mark.parametrize(
    ("kind", "changes", "message"),
    [
        ("dspark", {"markov_rank": 0}, r"^drafter\.dspark\.markov_rank: must be >= 1, got 0$"),
        (
            "dflash2",
            {"conv_group_size": 24},
            r"^drafter\.dflash2\.conv_group_size: 24 does not divide the hidden size 64",
        ),
        ("dflash2", {"conv_kernel_size": 9}, r"^drafter\.dflash2\.conv_kernel_size: 9 taps reach past a block of 8"),
        ("dflash2", {"conv_kernel_size": 0}, r"^drafter\.dflash2\.conv_kernel_size: must be >= 1, got 0$"),
        ("dflash2", {"selector_top_k": 513}, r"^drafter\.dflash2\.selector_top_k: 513 exceeds the 512 vocabulary rows"),
        ("dflash2", {"selector_rank": 0}, r"^drafter\.dflash2\.selector_rank: must be >= 1, got 0$"),
    ],
)
def test_the_geometry_validator_names_the_kinds_own_key(kind, changes, message):
    with pytest.raises(ParamsError, match=message):
        build_drafter_config(_drafter(kind, **changes), small_qwen3_config(4))


def test_an_unknown_kind_is_refused_by_the_params_loader():
    with pytest.raises(ParamsError, match=r"drafter\.kind"):
        repo_params(["drafter.kind=eagle3"])


def test_a_kinds_fields_come_only_from_its_own_section():
    target = small_qwen3_config(4)
    base = build_drafter_config(_drafter("dflash"), target)
    other = build_drafter_config(_drafter("dflash", markov_rank=64, selector_rank=3, conv_group_size=7), target)
    assert base == other and base.markov_rank == 0 and base.selector_top_k == 0  # dflash ignores both sections
    dspark = build_drafter_config(_drafter("dspark", selector_rank=3), target)
    assert (dspark.markov_rank, dspark.selector_rank, dspark.confidence_head) == (8, 0, True)
    assert (base.query_slots, dspark.query_slots) == (8, 7)  # DSpark: B-1 slots drafting B-1 tokens
    assert base.draft_tokens == dspark.draft_tokens == 7


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (["drafter.kind=dspark", "train.position_weighting=dpace"], r"train\.position_weighting: dpace is defined"),
        (["drafter.kind=dflash2", "train.position_weighting=dpace"], r"train\.position_weighting: dpace is defined"),
        (["drafter.kind=dspark", "train.dspark_loss.l1=-1"], r"^train\.dspark_loss\.l1: must be >= 0, got -1"),
        (["drafter.kind=dflash2", "train.dflash2_loss.selector=-0.5"], r"^train\.dflash2_loss\.selector: must be >= 0"),
        (["drafter.kind=dspark", "train.parallel=fsdp"], r"^train\.parallel: fsdp shards the drafter's weights"),
    ],
)
def test_train_refuses_what_a_kind_does_not_define(override, message):
    from dflash.core.validate import check_train

    with pytest.raises(ParamsError, match=message):
        check_train(repo_params(override))


def test_reference_temperatures_are_checked():
    from dflash.core.validate import check_eval

    for override, message in [
        ("eval.reference_temperatures=[]", r"must hold at least one temperature"),
        ("eval.reference_temperatures=[0.0, -1.0]", r"reference_temperatures\[1\]: must be >= 0, got -1"),
        ("eval.reference_temperatures=[1.0, 1.0]", r"has duplicates"),
    ]:
        with pytest.raises(ParamsError, match=message):
            check_eval(repo_params([override]))


@pytest.mark.parametrize("kind", KINDS)
def test_the_plans_count_of_each_kind_is_the_modules_own(kind):
    """geometry.parameter_counts (torch-free, what the plan prices) == the built module's trainable parameters."""
    from dflash.drafter.build import build_drafter
    from dflash.drafter.model import count_parameters

    cfg = build_drafter_config(_drafter(kind, num_hidden_layers=2), small_qwen3_config(4))
    model = build_drafter(cfg, device="meta")
    assert count_parameters(model) == parameter_counts(cfg)["total"]
    body = parameter_counts(dataclasses.replace(cfg, kind="dflash"))["total"]
    assert parameter_counts(cfg)["total"] - body == kind_cost(cfg).params == sum(kind_cost(cfg).parts.values())
    assert (kind_cost(cfg).params > 0) == (kind != "dflash")


def test_the_27b_heads_cost_what_the_issue_says(tmp_path):
    """Markov heads at the 27B target's 248,320-row vocabulary and r 256: 2 x V x r = 127.1 M parameters."""
    from dflash.plan import estimate as plan

    # the overlay trains DFlash with target_argmax + dpace: tokens + decay here, so only the kind differs
    kind = {k: [f"drafter.kind={k}", "train.position_weighting=decay", "train.loss_target=tokens"] for k in KINDS}
    runs = {k: plan.make_plan(plan_params(tmp_path, *kind[k])) for k in KINDS}
    vocab = json.loads(Path(REPO / "params/targets/qwen3.6-27b.config.json").read_text())["text_config"]["vocab_size"]
    total = {k: r["summary"]["drafter_params"] for k, r in runs.items()}
    assert total["dspark"] - total["dflash"] == 2 * vocab * 256 + 5120 + 256 + 1  # + the confidence head
    assert 2 * vocab * 256 == pytest.approx(127.1e6, rel=1e-3)
    assert total["dflash2"] - total["dflash"] == 2 * vocab * 256 + 256 * 5120 + 5 * 2 * (2 * 2 * 5120 * (1 + 320))
    flops = {k: r["training"]["flops_per_sequence"] for k, r in runs.items()}
    for k in ("dspark", "dflash2"):  # their losses need the target's own logits: its whole depth and lm_head
        assert flops[k]["target_lm_head"] > 0 == flops["dflash"]["target_lm_head"]
        assert flops[k]["drafter_kind_extra"] > 0 == flops["dflash"]["drafter_kind_extra"]
        assert flops[k]["total"] > flops["dflash"]["total"]
    assert flops["dspark"]["block_tokens"] / flops["dflash"]["block_tokens"] == pytest.approx(15 / 16)
