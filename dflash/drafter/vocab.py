"""The pruned draft vocabulary (`drafter.draft_vocab_size`): which target tokens the drafter can propose, the
`d2t` / `t2d` tables vLLM loads, and coverage (docs/design/draft-vocab.md).

Build rule. The tokenize stage counts the training split's loss tokens (`${tokenize.out}/token_counts.json`,
count_loss_tokens). A vocabulary of D tokens is the tokenizer's added tokens (the special and chat-template
tokens: <|im_start|>, <|im_end|>, <think>, </think>, ...: drafts need them whatever the counts say) plus the most
frequent loss tokens (ties: the smaller id), then, when fewer than D tokens were ever seen, the smallest unused
ids; sorted by target id. Draft id i is target id ids[i].

Tables, as vLLM 0.32 reads them (qwen3_dflash.py / qwen3_dspark.py, `draft_vocab_size` in the config):
  d2t  (D,) int64 offsets: target_id = draft_id + d2t[draft_id] (vLLM's `draft_id_to_target_id`)
  t2d  (V,) bool: True on the target ids inside the vocabulary (training-only; vLLM skips it)
Coverage: the share of loss tokens whose id is inside the vocabulary.

Which drafter.kind trains and serves a pruned vocabulary is its KindSpec.draft_vocab (dflash/drafter/kinds.py).

The drafter's own lm_head over the vocabulary (torch): dflash/drafter/draft_head.py.

May import: dflash.core, numpy. No torch (the tokenize and plan stages import it, through geometry.py too).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dflash.core.io import read_json
from dflash.drafter.kinds import KINDS, spec_for

COUNTS_FILE = "token_counts.json"  # in ${tokenize.out}: the training split's loss-token counts
COVERAGE_SIZES = (64, 128, 256, 1024, 4096, 32768)  # vocabulary sizes the tokenize stage reports coverage for


def check_draft_vocab(kind: str, size: int, vocab_size: int, fail: Any) -> None:
    """Refuse a draft_vocab_size this kind cannot train or serve: fail(field, message)."""
    if size == 0:
        return
    if not spec_for(kind).draft_vocab:
        kinds = ", ".join(name for name, spec in KINDS.items() if spec.draft_vocab)
        fail("draft_vocab_size", f"drafter.kind {kind} has no pruned-vocabulary path (supported: {kinds}); set 0")
    if not 0 < size < vocab_size:
        fail("draft_vocab_size", f"must be 0 (the whole vocabulary) or in 1..{vocab_size - 1}, got {size}")


def count_loss_tokens(input_ids: np.ndarray, loss_mask: np.ndarray) -> dict[int, int]:
    """Flat token ids and their loss mask -> {id: count} of the supervised tokens."""
    ids = np.asarray(input_ids)[np.asarray(loss_mask) != 0]
    values, counts = np.unique(ids, return_counts=True)
    return {int(v): int(c) for v, c in zip(values, counts, strict=True)}


def added_token_ids(tokenizer_dir: str | Path | None) -> list[int]:
    """The tokenizer's added tokens (tokenizer.json `added_tokens`: specials and chat-template markers), sorted."""
    if tokenizer_dir is None or not (Path(tokenizer_dir) / "tokenizer.json").exists():
        return []
    return sorted(int(t["id"]) for t in read_json(Path(tokenizer_dir) / "tokenizer.json").get("added_tokens", []))


@dataclass(frozen=True)
class TokenCounts:
    """The tokenize stage's count file: loss-token counts of the training split and the always-in tokens."""

    counts: dict[int, int]  # target id -> loss tokens with that id
    always_in: tuple[int, ...]  # the tokenizer's added tokens

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def to_json(self) -> dict[str, Any]:
        ids = sorted(self.counts)
        return {"ids": ids, "counts": [self.counts[i] for i in ids], "always_in": list(self.always_in)}

    @classmethod
    def read(cls, path: str | Path) -> TokenCounts:
        raw = read_json(path)
        return cls(dict(zip(raw["ids"], raw["counts"], strict=True)), tuple(raw["always_in"]))


def select(counts: Mapping[int, int], always_in: Iterable[int], size: int, vocab_size: int) -> np.ndarray:
    """The vocabulary of `size` target ids (module docstring), sorted ascending, int64."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft vocabulary size {size}: expected 1..{vocab_size}")
    chosen = list(dict.fromkeys(i for i in always_in if 0 <= i < vocab_size))
    if len(chosen) > size:
        raise ValueError(f"draft vocabulary size {size} is below the tokenizer's {len(chosen)} added tokens")
    taken = set(chosen)
    for i, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(chosen) == size:
            break
        if i not in taken and 0 <= i < vocab_size:
            chosen.append(i)
            taken.add(i)
    filler = (i for i in range(vocab_size) if i not in taken)
    while len(chosen) < size:
        chosen.append(next(filler))
    return np.array(sorted(chosen), dtype=np.int64)


def coverage(counts: Mapping[int, int], ids: np.ndarray) -> float:
    """Share of the loss tokens whose id is in `ids` (1.0 when there are none)."""
    total = sum(counts.values())
    inside = set(ids.tolist())
    return sum(c for i, c in counts.items() if i in inside) / total if total else 1.0


def coverage_table(tc: TokenCounts, sizes: Sequence[int], vocab_size: int) -> dict[str, float]:
    """{str(size): coverage} for each size below the vocabulary (whole vocabulary: 1.0 by definition)."""
    out = {}
    for size in sizes:
        ids = select(tc.counts, tc.always_in, min(size, vocab_size), vocab_size)
        out[str(size)] = round(coverage(tc.counts, ids), 6)
    return out


def d2t_table(ids: np.ndarray) -> np.ndarray:
    """(D,) sorted target ids -> (D,) int64 offsets: target_id = draft_id + d2t[draft_id]."""
    return (np.asarray(ids, dtype=np.int64) - np.arange(len(ids), dtype=np.int64)).astype(np.int64)


def t2d_table(ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """(D,) target ids -> (V,) bool, True inside the vocabulary."""
    mask = np.zeros(vocab_size, dtype=bool)
    mask[np.asarray(ids, dtype=np.int64)] = True
    return mask


def ids_from_d2t(d2t: np.ndarray) -> np.ndarray:
    """The inverse of d2t_table: (D,) offsets -> (D,) target ids."""
    d2t = np.asarray(d2t, dtype=np.int64)
    return d2t + np.arange(len(d2t), dtype=np.int64)


__all__ = [
    "COUNTS_FILE",
    "COVERAGE_SIZES",
    "TokenCounts",
    "added_token_ids",
    "check_draft_vocab",
    "count_loss_tokens",
    "coverage",
    "coverage_table",
    "d2t_table",
    "ids_from_d2t",
    "select",
    "t2d_table",
]
