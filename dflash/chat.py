"""Chat rendering with the target's own tokenizer and chat template.

One place decides how a conversation becomes token ids, so generation, tokenization and eval render
identically: the template comes from the target's tokenizer, thinking mode and extra template
kwargs come from `base` params. Ids are produced by the template + tokenizer (never by string
concatenation of our own).
"""

from __future__ import annotations

from typing import Any


def template_kwargs(enable_thinking: bool, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Keyword arguments for `apply_chat_template` (params `base.enable_thinking`, `base.chat_template_kwargs`)."""
    return {"enable_thinking": enable_thinking, **(extra or {})}


def render_text(
    tokenizer: Any,
    messages: list[dict],
    add_generation_prompt: bool,
    kwargs: dict[str, Any],
    tools: list[dict] | None = None,
) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )


def render_ids(
    tokenizer: Any,
    messages: list[dict],
    add_generation_prompt: bool,
    kwargs: dict[str, Any],
    tools: list[dict] | None = None,
) -> list[int]:
    """Token ids of the rendered conversation (the template's special tokens are real special ids)."""
    text = render_text(tokenizer, messages, add_generation_prompt, kwargs, tools)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
