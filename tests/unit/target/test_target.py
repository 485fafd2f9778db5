"""The embedded tiny target's tokenizer and template: the real Qwen3 tokenizer, and a two-turn conversation
renders exactly (thinking on and off). The build itself: tests/integration/test_target_build.py.
"""

from __future__ import annotations

import pytest

from dflash.core.chat import render_ids, render_text, template_kwargs

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
