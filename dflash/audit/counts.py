"""Exact token counts of rendered texts, cheaper than tokenizing each text whole (dflash/audit/tokens.py).

Input: a `tokenizers.Tokenizer` and texts; output: len(encode(text, add_special_tokens=False)) per text.

With Qwen2/Qwen3's pre-tokenizer (a Split on QWEN_PATTERN, then ByteLevel without its own regex) a text
is cut where a letter or digit is followed by a space, a newline, a digit or punctuation (WORD_END), and the count is the sum of the pieces'
counts, each piece counted once and cached (words repeat, long prompts are mostly repeated words). Exact
because such a position is always a pre-token boundary: a match of QWEN_PATTERN that holds a letter ends
in a letter run (or a contraction) and stops at the first non-letter; a digit is a pre-token of its own;
NFC cannot compose or reorder across it (the next character is a starter that composes with nothing);
and no added token may span a cut point or strip spaces (checked, else texts are tokenized whole). tests/unit/audit/test_tokens.py checks the sums
against whole-text encodes on random text.
"""

from __future__ import annotations

import json
import re

QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Cut points: after an ASCII letter / digit or a CJK ideograph (all \p{L} or \p{N}), before a space, tab,
# newline, digit or ASCII / CJK punctuation (starters that never compose: not \p{L}, not marks). The
# look-ahead comes first: most positions fail it at once (20% faster than look-behind first).
WORD_END = re.compile(
    "(?=[ \t\n.,;:!?'\"()\\[\\]{}0-9\u3001\u3002\uff01\uff0c\uff1a\uff1b\uff1f])(?<=[A-Za-z0-9\u4e00-\u9fff])"
)
CACHE_LIMIT = 1 << 21  # cached pieces; the cache is cleared when it grows past this


def splits_at_word_ends(tokenizer) -> bool:
    """True when cutting before "letter/digit, space" keeps token counts additive for this tokenizer."""
    pre = tokenizer.pre_tokenizer
    if pre is None or type(tokenizer.model).__name__ != "BPE":
        return False
    state = json.loads(pre.__getstate__())
    steps = state.get("pretokenizers") if state.get("type") == "Sequence" else None
    if not steps or len(steps) != 2:
        return False
    split, byte_level = steps
    if not (
        split.get("type") == "Split"
        and split.get("pattern") == {"Regex": QWEN_PATTERN}
        and split.get("behavior") == "Isolated"
        and not split.get("invert")
        and byte_level.get("type") == "ByteLevel"
        and not byte_level.get("add_prefix_space")
        and not byte_level.get("use_regex")
    ):
        return False
    norm = tokenizer.normalizer
    if norm is not None and json.loads(norm.__getstate__()).get("type") not in ("NFC", "NFD"):
        return False
    for tok in tokenizer.get_added_tokens_decoder().values():
        if tok.lstrip or tok.rstrip or tok.single_word or WORD_END.search(tok.content):
            return False
    return True


class TokenCounter:
    """Token counts of texts (no special tokens added: the chat template wrote them)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.split = splits_at_word_ends(tokenizer)
        self.cache: dict[str, int] = {}

    def encode(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def counts(self, texts: list[str]) -> list[int]:
        if not self.split:
            return [len(ids) for ids in self.encode(texts)]
        if len(self.cache) > CACHE_LIMIT:
            self.cache.clear()
        cache = self.cache
        pieces = [WORD_END.split(t) for t in texts]
        missing = list({p for ps in pieces for p in ps if p not in cache})
        if missing:
            cache.update(zip(missing, (len(ids) for ids in self.encode(missing)), strict=True))
        return [sum(map(cache.__getitem__, ps)) for ps in pieces]
