"""dflash.core.chat's fast renderer (jinja2 + tokenizers, no transformers) equals apply_chat_template exactly."""

from __future__ import annotations

import json

import pytest

from dflash.core.chat import load_fast_chat, render_ids, render_text, template_kwargs
from dflash.core.errors import UserError

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city — für Städte",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": "Oslo"})}}
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "OK."}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Count to 3."},
        {"role": "assistant", "content": "1, 2, 3.", "reasoning_content": "Simple counting."},
        {"role": "user", "content": 'Now "reverse" it\nplease.'},
        {"role": "assistant", "content": "<think>\nreverse\n</think>\n\n3, 2, 1."},
    ],
    [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": '{"celsius": 3}'},
        {"role": "assistant", "content": "It is 3 degrees."},
    ],
]


@pytest.fixture(scope="module")
def fast():
    from dflash.target.build import qwen3_tokenizer_dir

    return load_fast_chat(qwen3_tokenizer_dir())


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_fast_render_equals_transformers(fast, qwen_tokenizer, thinking, index):
    messages = CONVERSATIONS[index]
    kwargs = template_kwargs(thinking)
    for tools in (None, TOOLS):
        for prompt_only in (False, True):
            msgs = messages[:-1] if prompt_only else messages
            text = fast.render(msgs, prompt_only, kwargs, tools)
            assert text == render_text(qwen_tokenizer, msgs, prompt_only, kwargs, tools)
            ids = fast.encode_batch([text])[0]
            assert ids == render_ids(qwen_tokenizer, msgs, prompt_only, kwargs, tools)
            assert fast.count_batch([text]) == [len(ids)]


def test_missing_tokenizer_file_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match="tokenizer.json missing"):
        load_fast_chat(tmp_path)


def test_sandbox_verdict_cache_still_refuses_unsafe_attributes():
    """compile_chat_template caches the sandbox's attribute verdicts per (type, name): a second render must
    refuse exactly what the first refused."""
    from jinja2.exceptions import SecurityError

    from dflash.core.chat import compile_chat_template

    for _ in range(2):
        with pytest.raises(SecurityError, match="append"):
            compile_chat_template("{% set l = [] %}{{ l.append(1) }}").render()
        with pytest.raises(SecurityError, match="__class__"):
            compile_chat_template("{{ (1).__class__.__mro__ }}").render()
        assert compile_chat_template("{{ 'a b'.split(' ') | length }}").render() == "2"
