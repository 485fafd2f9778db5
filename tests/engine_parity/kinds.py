"""What the parity harness needs to know per drafter kind: one EngineKind each, in ENGINE_KINDS.

A kind's entry names vLLM's speculator class, its query layout, the method vLLM's SpeculativeConfig takes, our
drafter's kind-specific head (perturbed in the trained drafter so it still changes drafts), the drafter params that
differ from tests/integration/test_vllm_kinds.py's `_ours` defaults, and `setup`: the speculator fields its
_generate_draft reads beyond the ones every kind shares (harness.EngineProposer sets those). `before_draft`
runs before each draft, for speculators that keep per-cycle state outside _generate_draft.

Plugging in LiLiCorr (vllm/v1/worker/gpu/spec_decode/lilicorr/speculator.py, a DFlash2Speculator whose
_score_candidates reads the target's embeddings of the candidates and a normed anchor hidden state): an entry like
DFlash2's with speculator LiLiCorrSpeculator, fill_in True, candidate keys, method "dflash" (vLLM picks LiLiCorr
from the export's architecture), setup also setting `target_embeddings` (the target's embed_tokens, as its
load_draft_model does) and `anchor_hidden` / `anchor_valid` (1, H) / (1,) buffers, and before_draft calling its
prepare_context_anchor with the verified context's last hidden state (the speculator's `hidden_states`).
The reference side needs nothing here: it is dflash.eval.reference.propose for whatever kind the drafter is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from dflash.drafter.kinds import DFLASH2, DSPARK


@dataclass(frozen=True)
class EngineKind:
    speculator: tuple[str, str]  # (module, class) of vLLM's speculator
    fill_in: bool  # True: 1 + N queries [bonus, mask x N], the N masks sampled; False: N queries, anchor first
    candidate_keys: bool  # True: the walk samples among each slot's top-K candidates, their ids key the noise
    method: str  # SpeculativeConfig(method=...)
    head: str  # our drafter's kind-specific module
    drafter_changes: dict[str, Any] = field(default_factory=dict)
    setup: Callable[[Any, Any, int], None] = lambda s, cfg, n: None  # (speculator, drafter config, N)
    before_draft: Callable[[Any, torch.Tensor], None] | None = None  # (speculator, backbone hidden states)

    def speculator_class(self) -> type:
        import importlib

        module, name = self.speculator
        return getattr(importlib.import_module(module), name)

    @property
    def sampled_rows(self) -> slice:
        """The query rows that draft (their hidden states are what the heads read)."""
        return slice(1, None) if self.fill_in else slice(0, None)


def _candidate_walk(s, cfg, n: int) -> None:
    """vllm/v1/worker/gpu/spec_decode/dflash2/speculator.py DFlash2Speculator.__init__'s walk state."""
    from vllm.v1.worker.gpu.spec_decode.dflash2.speculator import CandidateSampler

    s.top_k = cfg.selector_top_k
    s.candidate_sampler = CandidateSampler(1, n, s.top_k, torch.device("cpu"))


def _markov_loop(s, cfg, n: int) -> None:
    """vllm/v1/worker/gpu/spec_decode/dspark/speculator.py DSparkSpeculator.__init__ / load_draft_model's fields
    for a full-vocabulary draft, no confidence-gated verification (vLLM's default)."""
    s._anchor_idx = torch.zeros(1, dtype=torch.int64)
    s._step_cols = torch.arange(n, dtype=torch.int32)
    s._draft_topk, s.use_confidence_head = None, False
    s._d2t_scatter_index, s._draft_scatter_buf = None, None


ENGINE_KINDS: dict[str, EngineKind] = {
    DFLASH2: EngineKind(
        speculator=("vllm.v1.worker.gpu.spec_decode.dflash2.speculator", "DFlash2Speculator"),
        fill_in=True,
        candidate_keys=True,
        method="dflash",
        head="candidate_selector",
        drafter_changes={"conv_kernel_size": 3, "conv_group_size": 16},
        setup=_candidate_walk,
    ),
    DSPARK: EngineKind(
        speculator=("vllm.v1.worker.gpu.spec_decode.dspark.speculator", "DSparkSpeculator"),
        fill_in=False,
        candidate_keys=False,
        method="dspark",
        head="markov_head",
        setup=_markov_loop,
    ),
}

__all__ = ["ENGINE_KINDS", "EngineKind"]
