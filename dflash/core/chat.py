"""Chat rendering with the target's own tokenizer and chat template.

One place decides how a conversation becomes token ids, so generation, tokenization and eval render
identically: the template comes from the target's tokenizer, thinking mode and extra template
kwargs come from `base` params. Ids are produced by the template + tokenizer (never by string
concatenation of our own).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.core.errors import UserError


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


# ------------------------------------------------------------------ fast rendering without transformers
# Audit and tokenize run on data boxes without torch, and `transformers` imports torch. These functions
# render the target's own chat template with jinja2 in the same environment transformers uses
# (trim_blocks, lstrip_blocks, loop controls, a `tojson` that keeps non-ASCII, `raise_exception`,
# `strftime_now`, a pass-through `{% generation %}` block) and count tokens with the `tokenizers`
# library. tests/unit/core/test_chat.py checks text and ids against `apply_chat_template` exactly.

CHAT_TEMPLATE_FILE = "chat_template.jinja"
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


@dataclass(frozen=True)
class FastChat:
    """A target's chat template (compiled jinja2) + its `tokenizers.Tokenizer`, loaded from one folder."""

    folder: str
    template: Any  # jinja2.Template
    tokenizer: Any  # tokenizers.Tokenizer
    special_tokens: dict[str, str]  # bos/eos/unk/pad strings the template may reference

    def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool,
        kwargs: dict[str, Any],
        tools: list[dict] | None = None,
    ) -> str:
        """The same text as `render_text(hf_tokenizer, ...)`."""
        return self.template.render(
            messages=messages,
            tools=tools or None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens,
            **kwargs,
        )

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of rendered texts (no special tokens added: the template wrote them)."""
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def count_batch(self, texts: list[str]) -> list[int]:
        return [len(e.ids) for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]


def compile_chat_template(source: str) -> Any:
    """Compile a chat template string the way transformers does (see the comment above)."""
    import json
    from datetime import datetime

    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        # `{% generation %}...{% endgeneration %}` marks assistant text for transformers' assistant masks;
        # rendering only needs its body.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    class Sandbox(ImmutableSandboxedEnvironment):
        # The same sandbox, a third faster: its verdict on an attribute depends only on the object's type
        # and the attribute's name (jinja2.sandbox.is_internal_attribute / modifies_known_mutable), so it
        # is computed once per (type, name) instead of on every `message.content.startswith` of a render.
        verdicts: dict[tuple[type, str], bool] = {}

        def is_safe_attribute(self, obj, attr, value):
            key = (type(obj), attr)
            verdict = self.verdicts.get(key)
            if verdict is None:
                verdict = self.verdicts[key] = super().is_safe_attribute(obj, attr, value)
            return verdict

    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def read_chat_template(folder: str | Path) -> tuple[str, dict]:
    """(chat template source, tokenizer_config.json) of a tokenizer folder. `chat_template.jinja` wins
    over the config's `chat_template` (transformers 5 saves it that way); a list of named templates
    yields the one named "default"."""
    import json

    folder = Path(folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.exists() else {}
    if (folder / CHAT_TEMPLATE_FILE).exists():
        return (folder / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8"), config
    source = config.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str) or not source:
        raise UserError(f"{folder}: no chat template ({CHAT_TEMPLATE_FILE} or tokenizer_config.json chat_template)")
    return source, config


def load_fast_chat(folder: str | Path) -> FastChat:
    """Load `tokenizer.json` + the chat template from a tokenizer / model folder (no transformers)."""
    from tokenizers import Tokenizer

    folder = Path(folder)
    if not (folder / "tokenizer.json").exists():
        raise UserError(f"{folder}: tokenizer.json missing (a fast tokenizer file is required)")
    source, config = read_chat_template(folder)
    special = {}
    for key in _SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        if isinstance(value, dict):  # older configs store AddedToken dicts
            value = value.get("content")
        if isinstance(value, str):
            special[key] = value
    return FastChat(
        str(folder), compile_chat_template(source), Tokenizer.from_file(str(folder / "tokenizer.json")), special
    )
