"""The reference evaluator for every drafter kind and temperature: greedy speculative decoding reproduces the
target's greedy output whatever the drafter (DSpark's Markov walk, DFlash2's selector walk), rejection sampling
draws from the target's distribution, and the expected acceptance along a path is the sampled acceptance's mean.
(At temperature 0 with kind dflash the reference equals vLLM exactly: tests/integration/test_eval_stage.py.)"""

from __future__ import annotations

import pytest
import torch

from dflash.eval.reference import reference_decode, summarize
from tests.helpers.models import SAMPLING_VOCAB, sampling_drafter, sampling_target


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dflash", "dspark", "dflash2"])
def test_sampled_speculation_draws_from_the_target_and_expects_what_it_accepts(kind):
    """At temperature 1 the first two output tokens follow the target's own sampling distribution (the second
    passes through a draft, its acceptance and the residual draw), and the expected acceptance along the drawn
    paths agrees with the sampled acceptance."""
    target, prompt = sampling_target(), [3, 6, 4, 1]
    drafter = sampling_drafter(kind, target)
    with torch.no_grad():
        first = torch.softmax(target(torch.tensor([prompt])).logits[0, -1].double(), -1)
        second = torch.stack(
            [
                torch.softmax(target(torch.tensor([[*prompt, t]])).logits[0, -1].double(), -1)
                for t in range(SAMPLING_VOCAB)
            ]
        )
    joint = first[:, None] * second  # P(x1, x2)
    n = 1000
    seen = torch.zeros(SAMPLING_VOCAB, SAMPLING_VOCAB, dtype=torch.float64)
    results = []
    for seed in range(n):
        r = reference_decode(target, drafter, prompt, 2, mode="recompute", temperature=1.0, seed=seed)
        seen[r.tokens[0], r.tokens[1]] += 1
        results.append(r)
    tv = 0.5 * (seen.sum(0) / n - joint.sum(0)).abs().sum()  # the second token: it went through the rejection
    assert tv < 0.08, f"total variation {float(tv):.3f} from the target's own distribution"
    assert 0.5 * (seen.sum(1) / n - first).abs().sum() < 0.08
    again = reference_decode(target, drafter, prompt, 6, mode="recompute", temperature=1.0, seed=5)
    assert again == reference_decode(target, drafter, prompt, 6, mode="recompute", temperature=1.0, seed=5)
    s = summarize(results, 4)
    assert s["num_drafts"] == n and 0 < s["num_accepted_tokens_per_pos"][0] < n
    # the expected acceptance along the drawn paths estimates the same quantities, per position and in total
    for k in range(3):
        assert s["expected_acceptance_per_position"][k] == pytest.approx(s["acceptance_per_position"][k], abs=0.04)
    assert s["expected_tau"] == pytest.approx(s["tau"], abs=0.06)
