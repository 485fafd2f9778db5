"""The Gumbel noise vLLM 0.32's drafting adds to a logit, computed by vLLM's own Triton helpers
(vllm/v1/worker/gpu/sample/gumbel.py: murmur3_uniform32, _log1p_neg_stable, _DRAFT_NOISE_SALT, as
gumbel_noised_argmax composes them on its fp32 path) in a small kernel of ours that stores the noise instead of
taking the argmax. Import only after tests.engine_parity.triton_env.enable_interpreter().

The harness keys the reference's draws with it (harness.py, `keyed_choose`): same seed and position, same noise
per token id, so a draft drawn by the reference and one drawn by vLLM's kernels can be compared token for token.
"""

from __future__ import annotations

import torch
from vllm.triton_utils import tl, triton
from vllm.v1.worker.gpu.sample import gumbel


@triton.jit
def _draft_noise_kernel(keys_ptr, seed_ptr, pos_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    inside = offsets < n
    keys = tl.load(keys_ptr + offsets, mask=inside, other=0)
    seed = tl.load(seed_ptr)
    pos = tl.load(pos_ptr + offsets, mask=inside, other=0) + gumbel._DRAFT_NOISE_SALT  # drafting's salted stream
    u = gumbel.murmur3_uniform32(seed, pos, keys)  # elementwise: each element's own position, as a scalar one
    tl.store(out_ptr + offsets, -tl.log(-gumbel._log1p_neg_stable(u)), mask=inside)


def draft_noise(seed: int, positions: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """float32 noise (R, M) vLLM's drafting adds for token ids `keys` (R, M) of the request seeded `seed`, row r's
    draws keyed by position positions[r] (the predicted token's position - 1). One launch for all the rows: the
    interpreter's cost is per launch, and a cycle's slots are known before its first draw."""
    keys = keys.to(torch.int64).contiguous()
    pos = positions.to(torch.int64)[:, None].expand_as(keys).contiguous()
    out = torch.empty(keys.shape, dtype=torch.float32)
    _draft_noise_kernel[(1,)](
        keys,
        torch.tensor([seed], dtype=torch.int64),
        pos,
        out,
        keys.numel(),
        BLOCK=triton.next_power_of_2(keys.numel()),
    )
    return out


__all__ = ["draft_noise"]
