"""The reference evaluator for every drafter kind and temperature: greedy speculative decoding reproduces the
target's greedy output whatever the drafter (DSpark's Markov walk, DFlash2's selector walk, LiLiCorr's lattice
walk), rejection sampling draws from the target's distribution, and the expected acceptance along a path is the sampled acceptance's mean.
(At temperature 0 with kind dflash the reference equals vLLM exactly: tests/integration/test_eval_stage.py.)"""

from __future__ import annotations

import pytest
import torch

from dflash.eval.reference import _Sampler, greedy_decode, reference_decode, summarize
from tests.helpers.models import sampling_drafter, sampling_target


@pytest.mark.parametrize("kind", ["dflash", "dspark", "dflash2", "lilicorr"])
def test_greedy_speculation_reproduces_the_targets_greedy_output(kind):
    target = sampling_target(64)
    drafter = sampling_drafter(kind, target)
    prompts = [[3, 9, 4, 1], [7, 7, 2], [5, 1, 8, 12, 2, 9]]
    results = [reference_decode(target, drafter, p, 24, mode="recompute") for p in prompts]
    assert [r.tokens for r in results] == [greedy_decode(target, p, 24) for p in prompts]
    s = summarize(results, 4)
    assert s["num_drafts"] > 0 and "expected_tau" not in s  # greedy: no expectation column


def test_rejection_sampling_emits_the_targets_distribution():
    """One drafted position: whatever q is, the emitted token is distributed as p (the speculative sampling
    theorem), and the acceptance rate is sum_x min(p, q)."""
    g = torch.Generator().manual_seed(0)
    p_logits = torch.randn(2, 6, generator=g)
    q_logits = torch.randn(1, 6, generator=g)
    sampler = _Sampler(1.0, 0)
    counts, accepted, n = torch.zeros(6), 0, 8000
    for _ in range(n):
        d = sampler.choose(q_logits[0], 0)
        k, token, expected = sampler.verify([d], q_logits, p_logits)
        counts[d if k == 1 else token] += 1  # the token committed at the drafted position
        accepted += k
    p, q = torch.softmax(p_logits[0].double(), -1), torch.softmax(q_logits[0].double(), -1)
    assert (counts.double() / n - p).abs().max() < 0.025  # the draft's own q is far from p here:
    assert (p - q).abs().max() > 0.1  # a sampler that kept the drafts would fail the line above
    assert accepted / n == pytest.approx(float(torch.minimum(p, q).sum()), abs=0.025)
    assert expected == pytest.approx([float(torch.minimum(p, q).sum())])


def test_expected_acceptance_is_exact_when_the_target_depends_on_the_drafted_prefix():
    """Two drafted positions, the target's distribution at the second one depending on the first draft (as it
    does in decoding): over every drawn path (d0, d1) weighted by its probability, the expected accepted tokens
    verify reports equal the exact probabilities of accepting position 0 and positions 0 and 1. (The product of
    the per-position sums of min(p, q) along the path is off here by more than 0.05.)"""
    g = torch.Generator().manual_seed(3)
    v = 4
    q_logits = torch.randn(2, v, generator=g) * 2
    p0, p2 = torch.randn(v, generator=g) * 2, torch.randn(v, generator=g)
    p1_given = torch.randn(v, v, generator=g) * 3  # the target's logits at position 1 after each first draft
    sampler = _Sampler(1.0, 0)
    q = sampler.probs(q_logits)
    mean, exact = torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    for d0 in range(v):
        p = sampler.probs(torch.stack([p0, p1_given[d0], p2]))
        a0 = min(1.0, float(p[0, d0] / q[0, d0]))
        for d1 in range(v):
            weight = float(q[0, d0] * q[1, d1])
            _, _, expected = sampler.verify([d0, d1], q_logits, torch.stack([p0, p1_given[d0], p2]))
            mean += weight * torch.tensor(expected, dtype=torch.float64)
            exact += weight * torch.tensor([a0, a0 * min(1.0, float(p[1, d1] / q[1, d1]))], dtype=torch.float64)
    assert mean.tolist() == pytest.approx(exact.tolist(), abs=1e-12)
