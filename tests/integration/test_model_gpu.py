"""CUDA: flex_attention (compiled create_block_mask, H=None, compiled kernel) against SDPA with the dense
mask, in bf16, forward and backward. Skipped without a GPU (run by the lead on a GPU host)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import Qwen3Config

from dflash.drafter.geometry import build_drafter_config
from dflash.drafter.masks import build_masks
from dflash.drafter.model import build_drafter
from tests.helpers import repo_params

pytestmark = pytest.mark.gpu


def _setup(repo_root, layer_types, window):
    params = repo_params()
    dp = dataclasses.replace(
        params.drafter,
        num_hidden_layers=len(layer_types),
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        intermediate_size=1024,
        layer_types=layer_types,
        sliding_window=window,
        block_size=16,
        mask_token_id=1000,
        target_layer_ids=[1, 4, 7],
    )
    target = Qwen3Config(vocab_size=1024, hidden_size=512, num_hidden_layers=10, num_attention_heads=4, head_dim=128)
    cfg = build_drafter_config(dp, target)
    torch.manual_seed(0)
    model = build_drafter(cfg, device="cuda", dtype=torch.bfloat16)
    S, N = 700, 96  # lengths that are not multiples of the 128-token sparse block
    g = torch.Generator(device="cuda").manual_seed(0)
    features = torch.randn(S, cfg.num_target_features * cfg.hidden_size, device="cuda", generator=g).bfloat16()
    doc_ids = torch.zeros(S, dtype=torch.long, device="cuda")
    doc_ids[300:] = 1
    doc_ids[520:] = 2
    anchors = torch.randperm(S, device="cuda", generator=g)[:N].sort().values
    embeds = torch.randn(N * cfg.block_size, cfg.hidden_size, device="cuda", generator=g).bfloat16()
    return cfg, model, features, doc_ids, anchors, embeds


@pytest.mark.parametrize(
    "layer_types,window",
    [(["full_attention", "full_attention"], 2048), (["sliding_attention", "full_attention"], 64)],
)
def test_flex_matches_sdpa_on_cuda_bf16(repo_root, layer_types, window):
    cfg, model, features, doc_ids, anchors, embeds = _setup(repo_root, layer_types, window)
    flex_masks = build_masks(cfg.layer_types, anchors, features.shape[0], cfg.block_size, window, doc_ids, "flex")
    for bm in flex_masks.values():
        assert bm.kv_num_blocks.shape[:2] == (1, 1)  # H=None: one mask for every head
    results = {}
    for backend, masks in (("sdpa", None), ("flex", flex_masks)):
        model.zero_grad()
        f = features.clone().requires_grad_(True)
        out = model(f, embeds, anchors, doc_ids, backend=backend, masks=masks)
        out.float().square().mean().backward()
        grads = {n: p.grad.float().clone() for n, p in model.named_parameters()}
        results[backend] = (out.float(), f.grad.float(), grads)
    out_s, fg_s, g_s = results["sdpa"]
    out_f, fg_f, g_f = results["flex"]
    torch.testing.assert_close(out_f, out_s, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(fg_f, fg_s, rtol=5e-2, atol=5e-3)
    for name in g_s:
        rel = (g_f[name] - g_s[name]).norm() / g_s[name].norm().clamp_min(1e-12)
        assert rel < 5e-2, (name, float(rel))
