"""The tiny target's margin report (dflash.target.margins): the shares below each bound, the fixed prompt sample, every
greedy decision counted. The stage's gate: tests/integration/test_target_margins.py."""

from __future__ import annotations

import pytest

from dflash.target import margins
from tests.helpers import repo_params
from tests.helpers.models import NARROW_TARGET


def test_summarize_counts_the_shares_below_each_bound():
    report = margins.summarize([0.005, 0.05, 0.5, 2.0, 3.0], prompts=2)
    assert report.shares_below == {"0.01": 0.2, "0.1": 0.4, "1.0": 0.6}
    assert report.near_tie_frac == 0.4 and report.decisions == 5 and report.prompts == 2
    assert report.min_margin == 0.005 and report.median_margin == 0.5
    assert margins.NEAR_TIE_MARGIN in margins.MARGIN_BOUNDS  # the gate's figure is one of the reported shares
    assert margins.summarize([], prompts=0).near_tie_frac == 0.0


def test_top2_margins_is_the_gap_between_the_two_best_logits():
    import torch

    logits = torch.tensor([[[1.0, 3.0, 2.5], [0.0, 0.0, -1.0]]])
    assert torch.allclose(margins.top2_margins(logits), torch.tensor([[0.5, 0.0]]))


def test_the_margin_sample_is_fixed_by_the_seed_and_holds_no_answers():
    a, b = margins.margin_prompts(20, seed=7), margins.margin_prompts(20, seed=7)
    assert a == b and len(a) == 20
    assert all(m["role"] in ("system", "user") for p in a for m in p) and all(p[-1]["role"] == "user" for p in a)
    assert margins.margin_prompts(20, seed=8) != a


@pytest.fixture(scope="module")
def untrained_target(tmp_path_factory):
    """A narrow tiny target with random weights (its logits are all near zero: most decisions near-ties)."""
    from dflash.target.build import build_tiny

    params = repo_params(["target.tiny.steps=0", *NARROW_TARGET])
    out = tmp_path_factory.mktemp("untrained") / "target"
    build_tiny(params.target, params.base, out)
    return out


def test_margins_count_every_decision_and_scale_with_the_logits(untrained_target):
    import torch
    from transformers import AutoModelForCausalLM

    from dflash.core.hf import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(untrained_target, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(untrained_target)
    prompts = margins.margin_prompts(3, seed=1)
    chat = {"enable_thinking": True}
    small = margins.summarize(margins.greedy_margins(model, tokenizer, prompts, 6, chat), prompts=3)
    assert small.decisions == 18  # random weights never pick EOS first: 3 prompts x 6 tokens
    assert small.near_tie_frac > 0.5  # random weights: logits of about 0.16, mostly tied
    # The same network with its lm_head scaled: every margin scales with it, the near-ties are gone.
    with torch.no_grad():
        model.lm_head.weight.mul_(1e4)
    decided = margins.summarize(margins.greedy_margins(model, tokenizer, prompts, 6, chat), prompts=3)
    assert decided.near_tie_frac < 0.2 and decided.median_margin > 1e3 * small.median_margin
