"""The PyTorch reference on a Gated DeltaNet hybrid (Qwen3-Next geometry, random small weights): cache mode's
snapshot-and-restore of the recurrent state equals a full recompute (logits within float tolerance, greedy
tokens and acceptance counts identical) and plain greedy. Crop-only diverging: tests/unit/eval/test_hybrid_reference.py.
"""

from __future__ import annotations

import pytest

from dflash.eval.reference import greedy_decode, reference_decode


@pytest.mark.slow
def test_restore_equals_recompute_and_plain_greedy_on_a_hybrid(hybrid_and_drafter):
    target, drafter, prompts, hits = hybrid_and_drafter
    assert hits > 0.5  # acceptance is exercised: partial accepts, full accepts and rejections all occur
    partial = accepted = 0
    for p in prompts:
        greedy = greedy_decode(target, p, 40)
        cached = reference_decode(target, drafter, p, 40, mode="cache")
        full = reference_decode(target, drafter, p, 40, mode="recompute")
        assert cached.tokens == greedy
        assert (cached.tokens, cached.drafts, cached.accepted_per_pos) == (
            full.tokens,
            full.drafts,
            full.accepted_per_pos,
        )
        partial += cached.drafts - cached.accepted_per_pos[-1]  # cycles with a rejection (a restore)
        accepted += cached.accepted
    assert partial > 0 and accepted > 0
