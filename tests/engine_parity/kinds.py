"""What the parity harness needs to know per drafter kind: one EngineKind each, in ENGINE_KINDS.

A kind's entry names vLLM's speculator class, its query layout, the method vLLM's SpeculativeConfig takes, our
drafter's kind-specific head (perturbed in the trained drafter so it still changes drafts), the drafter params that
differ from tests/integration/test_vllm_kinds.py's `_ours` defaults, and `setup`: the speculator fields its
_generate_draft reads beyond the ones every kind shares (harness.EngineProposer sets those). `before_draft` runs
before each draft with the target's latest pass (verify.Blocks' last_features / last_rejected), for speculators that publish per-cycle state
outside _generate_draft, as vLLM's propose does before it drafts. `fit_head`: how the trained drafter's head is
fitted after its backbone (None: the head is only perturbed).

LiLiCorr (vllm/v1/worker/gpu/spec_decode/lilicorr/speculator.py) is a DFlash2Speculator whose _score_candidates
reads the target's embeddings of the candidates and a normed anchor hidden state: its entry is DFlash2's walk with
LiLiCorr's top-K, `target_embeddings` and the lm_head set by its own load_draft_model, and the anchor published by
its own prepare_context_anchor from the verify pass's fused context (vLLM's combine_hidden_states) before each
draft. vLLM picks LiLiCorr from the export's architecture (method "dflash").
The reference side needs nothing here: it is dflash.eval.reference.propose for whatever kind the drafter is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from dflash.drafter.kinds import DFLASH2, DSPARK, LILICORR


@dataclass(frozen=True)
class EngineKind:
    speculator: tuple[str, str]  # (module, class) of vLLM's speculator
    fill_in: bool  # True: 1 + N queries [bonus, mask x N], the N masks sampled; False: N queries, anchor first
    candidate_top_k: Callable[[Any], int] | None  # cfg -> K: the walk samples among each slot's top-K candidates,
    # their ids key the noise; None: full-vocabulary rows
    method: str  # SpeculativeConfig(method=...)
    head: str  # our drafter's kind-specific module
    drafter_changes: dict[str, Any] = field(default_factory=dict)
    setup: Callable[[Any, Any, int], None] = lambda s, cfg, n: None  # (speculator, drafter config, N)
    before_draft: Callable[[Any, Any], None] | None = None  # (speculator, verify.Blocks: the latest pass)
    backbone_steps: int = 150  # Adam steps fitting the trained drafter's backbone (harness._fit_backbone)
    fit_head: Callable[..., None] | None = None  # (cfg, drafter, target, harness.fitting_data) after the backbone

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

    s.top_k = int(s.model.config.dflash_config[s._candidate_top_k_key])  # vLLM reads K from the export's config
    s.candidate_sampler = CandidateSampler(1, n, s.top_k, torch.device("cpu"))


def _markov_loop(s, cfg, n: int) -> None:
    """vllm/v1/worker/gpu/spec_decode/dspark/speculator.py DSparkSpeculator.__init__ / load_draft_model's fields
    for a full-vocabulary draft, no confidence-gated verification (vLLM's default)."""
    s._anchor_idx = torch.zeros(1, dtype=torch.int64)
    s._step_cols = torch.arange(n, dtype=torch.int32)
    s._draft_topk, s.use_confidence_head = None, False
    s._d2t_scatter_index, s._draft_scatter_buf = None, None


class _Target(nn.Module):
    """What LiLiCorrSpeculator.load_draft_model reads of the target: `model.embed_tokens` and `lm_head` (vLLM's
    VocabParallelEmbedding / ParallelLMHead, holding the target's weights: harness.drafters copies them in)."""

    def __init__(self, embed_tokens: nn.Module, lm_head: nn.Module):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = embed_tokens
        self.lm_head = lm_head


def _lattice_walk(s, cfg, n: int) -> None:
    """LiLiCorrSpeculator.__init__ (its anchor buffers, one request) and load_draft_model: vLLM's own method, run
    over the module already loaded from our export (the DFlash loader it calls first is the one part replaced),
    sets `target_embeddings` to the target's input embedding and the lm_head to the target's, with its checks."""
    from vllm.v1.worker.gpu.spec_decode.dflash import speculator as dflash_speculator

    _candidate_walk(s, cfg, n)
    hidden = s.model.config.hidden_size
    s.anchor_hidden = torch.zeros(1, hidden, dtype=torch.float32)
    s.anchor_valid = torch.zeros(1, dtype=torch.bool)
    loaded, target = s.model, _Target(s.model.model.embed_tokens, s.model.lm_head)
    s.vllm_config = None  # read only by the DFlash loader replaced below
    with contextlib.ExitStack() as undo:
        load = dflash_speculator.load_dflash_model
        undo.callback(setattr, dflash_speculator, "load_dflash_model", load)
        dflash_speculator.load_dflash_model = lambda _target, _config: loaded
        s.model = s.load_draft_model(target, set())
    assert s.target_embeddings is target.model.embed_tokens


def _publish_anchor(s, verified) -> None:
    """LiLiCorr's part of vLLM's DFlashSpeculator.propose before it drafts: the verify pass's target features
    through vLLM's combine_hidden_states (its fc) into the speculator's `hidden_states`, then its own
    prepare_context_anchor with the pass's query_start_loc and rejected count (int32, as the V2 runner has them)."""
    rows = verified.last_features.shape[0]
    s.hidden_states = s.model.combine_hidden_states(verified.last_features.to(s.anchor_hidden.dtype))
    batch = SimpleNamespace(num_reqs=1, query_start_loc=torch.tensor([0, rows], dtype=torch.int32))
    s.prepare_context_anchor(batch, torch.tensor([verified.last_rejected], dtype=torch.int32))


def _fit_correlator(cfg, model, target, data, steps: int = 100) -> None:
    """Adam steps of the project's own transition loss (dflash/train/loss_lilicorr.py correlator_loss: the
    teacher-forced walk toward the target's greedy choices) on the correlator alone, the fitted backbone frozen: a
    random correlator picks among the K candidates at random and the target would accept next to nothing."""
    from dflash.train.loss import LMHead
    from dflash.train.loss_lilicorr import correlator_loss

    head, embed = LMHead.from_linear(target.get_output_embeddings()), target.get_input_embeddings()
    model.requires_grad_(False)
    model.lilicorr.requires_grad_(True)
    opt = torch.optim.Adam(model.lilicorr.parameters(), lr=3e-3)
    ones = torch.ones(cfg.block_size)
    for _ in range(steps):
        loss = 0.0
        for d in data:
            hidden = model(d.features, d.blocks, d.anchors)
            term, _, _ = correlator_loss(
                hidden,
                torch.ones(hidden.shape[0], dtype=torch.bool),
                head,
                drafter=model,
                embed=embed,
                features=d.features,
                doc_ids=torch.zeros(d.features.shape[0], dtype=torch.long),
                anchors=d.anchors,
                chunk_rows=1024,
                target_hidden=d.final,
                slot_w=ones,
                normaliser=float(len(d.anchors)),
            )
            loss = loss + term
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.requires_grad_(True)
    model.eval()


ENGINE_KINDS: dict[str, EngineKind] = {
    DFLASH2: EngineKind(
        speculator=("vllm.v1.worker.gpu.spec_decode.dflash2.speculator", "DFlash2Speculator"),
        fill_in=True,
        candidate_top_k=lambda cfg: cfg.selector_top_k,
        method="dflash",
        head="candidate_selector",
        drafter_changes={"conv_kernel_size": 3, "conv_group_size": 16},
        setup=_candidate_walk,
    ),
    DSPARK: EngineKind(
        speculator=("vllm.v1.worker.gpu.spec_decode.dspark.speculator", "DSparkSpeculator"),
        fill_in=False,
        candidate_top_k=None,
        method="dspark",
        head="markov_head",
        setup=_markov_loop,
    ),
    LILICORR: EngineKind(
        speculator=("vllm.v1.worker.gpu.spec_decode.lilicorr.speculator", "LiLiCorrSpeculator"),
        fill_in=True,
        candidate_top_k=lambda cfg: cfg.lilicorr.candidate_top_k,
        method="dflash",
        head="lilicorr",
        # a correlator narrower than the target (vLLM's token_proj runs), one lattice layer, K 8
        drafter_changes={"lilicorr": {"candidate_top_k": 8, "hidden_size": 32, "num_layers": 1}},
        setup=_lattice_walk,
        before_draft=_publish_anchor,
        # a backbone fitted less, so its lm_head's top-1 misses labels its top-K holds: the fitted correlator picks
        # them (at temperature 0 vLLM's drafts then differ from the per-slot argmax in every cycle, and are accepted)
        backbone_steps=40,
        fit_head=_fit_correlator,
    ),
}

__all__ = ["ENGINE_KINDS", "EngineKind"]
