"""vLLM's greedy verification of the engine run's cycles: `rejection_sample` of
vllm/v1/worker/gpu/spec_decode/rejection_sampler_utils.py (its Triton kernels under the interpreter) on the target
logits of each verified block, against the accepted length the reference's verification found for it.

Greedy only: at temperature 1 vLLM's `_resample_kernel` calls libdevice's log1p, which the interpreter cannot run
(docs/results/engine-parity.md), and vLLM's accept / resample draws are keyed differently from the reference's.
Import only after tests.engine_parity.triton_env.enable_interpreter().
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from dflash.eval import reference


@dataclass
class Blocks:
    """What the reference's target verified in one decode, block by block (the prompt's forward left out of the
    lists), and its latest pass."""

    ids: list[list[int]] = field(default_factory=list)  # [bonus, d_1 .. d_N]
    logits: list[torch.Tensor] = field(default_factory=list)  # (N + 1, V): the target's logits after each slot
    kept: list[int] = field(default_factory=list)  # verified positions committed: accepted + 1
    # the latest pass, the prompt's included, as vLLM's propose receives it: its rows' target features (rows, K*H)
    # (the aux hidden states) and how many of its last rows verification rejected (num_rejected)
    last_features: torch.Tensor | None = None
    last_rejected: int = 0


@contextlib.contextmanager
def recording_blocks():
    """Record every block the reference's _Target is fed and how much of it is committed, and its latest pass."""
    blocks, forward, commit = Blocks(), reference._Target.forward, reference._Target.commit
    calls = {"n": 0}

    def record_forward(self, new_ids):
        logits, feats = forward(self, new_ids)
        blocks.last_features, blocks.last_rejected = feats, 0
        calls["n"] += 1
        if calls["n"] > 1:  # the first forward is the prompt's
            blocks.ids.append(list(new_ids))
            blocks.logits.append(logits.detach().clone())
        return logits, feats

    def record_commit(self, new_ids, keep):
        blocks.last_rejected = len(new_ids) - keep
        if calls["n"] > 1:
            blocks.kept.append(keep)
        return commit(self, new_ids, keep)

    reference._Target.forward, reference._Target.commit = record_forward, record_commit
    try:
        yield blocks
    finally:
        reference._Target.forward, reference._Target.commit = forward, commit


def vllm_greedy_accepted(blocks: Blocks, seed: int) -> list[int]:
    """The accepted length of each block by vLLM's rejection_sample at temperature 0 (one request, N + 1 logits:
    the slots' target logits; draft_sampled holds the block, the drafts after slot 0)."""
    from vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils import rejection_sample

    out = []
    for ids, logits in zip(blocks.ids, blocks.logits, strict=True):
        n = len(ids) - 1
        sampled, num_sampled = rejection_sample(
            logits.float().contiguous(),
            None,  # greedy: no draft logits
            torch.tensor(ids, dtype=torch.int64),
            torch.tensor([0, n + 1], dtype=torch.int32),
            torch.arange(n + 1, dtype=torch.int64),
            torch.zeros(1, dtype=torch.int32),
            torch.zeros(n + 1, dtype=torch.int32),
            torch.arange(n + 1, dtype=torch.int32),
            torch.zeros(1, dtype=torch.float32),
            torch.tensor([seed], dtype=torch.int64),
            n,
        )
        out.append(int(num_sampled[0]) - 1)
    return out


__all__ = ["Blocks", "recording_blocks", "vllm_greedy_accepted"]
