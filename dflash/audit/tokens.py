"""The audit's token path: template refusals, prompt tokens and loss-mask sums of one chunk's candidate rows
(rows that passed every structural check), without rendering and tokenizing every row.

Inputs: a chunk's Turns and features (dflash/audit/checks.py), its canonical `messages` / `tools` JSON,
conversation ids and candidate mask. Output: TokenResult: per-row prompt tokens and loss-mask sums (-1 where
not counted), template errors, and the seeded sample mask (the rows whose counts feed the statistics).

Exhaustive (`audit.exhaustive_tokens: true`, or a tokenizer outside premise 1): every candidate's prompt
and full conversation are rendered with the target's chat template and tokenized. The default gives the
same `template_error` / `prompt_too_long` verdicts for every row while rendering only:
  - the first row of each distinct structure signature (roles, which keys each turn has, which strings are
    empty, the shape of its tool calls, the tools list as written), plus that row with every non-empty
    content / reasoning replaced by "x" (the skeleton: the template's own text for this structure);
  - the rows whose byte bound B exceeds `audit.max_prompt_tokens` (exact counts decide them);
  - a seeded sample of about `audit.token_sample_rows` rows (prompt-token stats, loss-mask histogram).
Exactness:
  1. tokens(T) <= max(UTF-8 bytes of T, of NFD(T)) for a byte-level BPE tokenizer whose normalizer is
     none / NFC / NFD: every token covers >= 1 byte of the normalized text (or of a raw added token), NFC never
     has more bytes than NFD (bytes(c) <= bytes(NFD(c)) for every NFC character c; tests check all of Unicode),
     and both byte counts add up over any split of T. `fast_path_premise` checks the tokenizer.
  2. bytes(render(prompt)) <= B = bytes(skeleton) + V + TURN_SLACK * prompt turns (bytes as in 1), where V
     sums the bytes of every string the prompt turns hold (tool calls twice: `tojson` may add spaces).
     Assumption L: the template writes each string at most once (or a part of it) and its own text depends
     on the structure signature, up to TURN_SLACK bytes a turn (Qwen3: `</think>` inside a content or a
     user turn that is a tool response adds a think block, < 32 bytes).
  3. Assumption R: whether the template refuses a conversation depends only on its structure signature,
     not on the text of non-empty strings (Qwen3's template never refuses; templates that refuse
     alternating-role violations or unknown keys qualify).
Every row rendered exactly checks 2 and 3 against its own render; a violation stops the audit with a
UserError (set `audit.exhaustive_tokens: true` for such a template).
"""

from __future__ import annotations

import json
import logging
import unicodedata
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dflash.audit.counts import TokenCounter
from dflash.audit.hub import HubSpec, is_hub
from dflash.audit.readers import count_rows
from dflash.audit.state import segment_sum
from dflash.core.errors import UserError

log = logging.getLogger(__name__)

TURN_SLACK = 32  # bytes a prompt turn's template text may exceed its structure's skeleton (assumption L)
SAMPLE_SEED = 0x5EED_D1F1A5  # the token sample's seed (keys = splitmix64(conversation id ^ seed))
_UNQUOTE_KEYS = (r'"([A-Za-z_][A-Za-z0-9_]*)":', r"\1:")  # JSON keys kept (only keys are followed by ':')
_ABSTRACT_STRINGS = (r'("(?:[^"\\]|\\.)+")|("")', r"\2x")  # non-empty string value -> x, "" -> ""x


@dataclass
class Structure:
    first: str  # its first row, named as row_ref names it (rendered with its real content)
    error: str | None  # that row's template error
    skeleton: int  # bytes (NFD) of the skeleton's rendered prompt; a huge value if the skeleton failed


@dataclass
class TokenResult:
    prompt_tokens: np.ndarray  # (rows,) int64, -1 where not counted
    mask_sums: np.ndarray  # (rows,) int64, -1 where not counted (only sampled rows with a response)
    errors: dict[int, str]  # row -> template error
    sampled: np.ndarray  # (rows,) bool: in the token sample


def fast_path_premise(tokenizer) -> str | None:
    """Why premise 1 (tokens <= NFD bytes) may fail for this `tokenizers.Tokenizer`; None when it holds."""
    model = type(tokenizer.model).__name__
    if model != "BPE":
        return f"its model is {model}, not byte-level BPE"
    pre = tokenizer.pre_tokenizer
    if pre is None or '"ByteLevel"' not in pre.__getstate__().decode():
        return "it has no ByteLevel pre-tokenizer"
    norm = tokenizer.normalizer
    kind = None if norm is None else json.loads(norm.__getstate__()).get("type")
    if kind not in (None, "NFC", "NFD"):
        return f"its normalizer is {kind} (only none / NFC / NFD keep tokens <= bytes)"
    for tok in tokenizer.get_added_tokens_decoder().values():
        if not tok.content or _nfd_bytes(tok.content) < len(tok.content.encode()):
            return f"added token {tok.content!r} is empty or shrinks under NFD"
    return None


def _nfd_bytes(text: str) -> int:
    """max(UTF-8 bytes of text, of NFD(text)): >= the bytes the tokenizer sees with no normalizer, NFC or NFD."""
    raw = len(text.encode("utf-8", "surrogatepass"))
    return max(raw, len(unicodedata.normalize("NFD", text).encode("utf-8", "surrogatepass")))


def byte_lengths(arr: pa.Array) -> np.ndarray:
    """_nfd_bytes of each string (0 for null), vectorised; only non-ASCII strings are normalized."""
    arr = pc.fill_null(arr, "")
    out = pc.binary_length(arr).to_numpy(zero_copy_only=False).astype(np.int64)
    wide = np.flatnonzero(~pc.string_is_ascii(arr).to_numpy(zero_copy_only=False))
    if len(wide):
        norm = pc.utf8_normalize(arr.take(pa.array(wide)), "NFD")
        out[wide] = np.maximum(out[wide], pc.binary_length(norm).to_numpy(zero_copy_only=False))
    return out


def _sample_keys(ids: list[str], rows: np.ndarray) -> np.ndarray:
    """Seeded 64-bit keys of conversation ids (splitmix64 of the id's first 8 bytes ^ seed)."""
    x = np.frombuffer(bytes.fromhex("".join(ids[r] for r in rows)), dtype=">u8").astype(np.uint64)
    x = x ^ np.uint64(SAMPLE_SEED)
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _state(arr: pa.Array) -> pa.Array:
    """'-' absent, '0' empty, '1' text."""
    return pc.if_else(pc.is_null(arr), "-", pc.if_else(pc.equal(arr, ""), "0", "1"))


def signatures(t, tools: pa.Array) -> pa.Array:
    """Each row's structure signature (see the module docstring): what the template sees, minus the text."""
    calls = pc.replace_substring_regex(t.tool_calls, *_UNQUOTE_KEYS)
    calls = pc.fill_null(pc.replace_substring_regex(calls, *_ABSTRACT_STRINGS), "-")
    turn = pc.binary_join_element_wise(
        pc.fill_null(t.role, ""),
        _state(t.content),
        _state(t.reasoning),
        _state(t.name),
        _state(t.tool_call_id),
        calls,
        "\x1f",
    )
    lists = pa.ListArray.from_arrays(pa.array(t.offsets, pa.int64()).cast(pa.int32()), turn)
    return pc.binary_join_element_wise(pc.binary_join(lists, "\x1e"), tools, "\x1d")


def _skeleton(messages: list[dict]) -> list[dict]:
    out = []
    for m in messages:
        m = dict(m)
        for key in ("content", "reasoning_content"):
            if isinstance(m.get(key), str) and m[key]:
                m[key] = "x"
        out.append(m)
    return out


def mask_sum(p: list[int], full: list[int], p_text: str, f_text: str) -> int:
    """Tokens of the recorded trailing assistant turns after the prompt."""
    if f_text.startswith(p_text):
        return len(full) - len(p)
    # the template renders history differently once answered: count after the common prefix
    k = next((i for i, (a, b) in enumerate(zip(p, full, strict=False)) if a != b), min(len(p), len(full)))
    return len(full) - k


class TokenPath:
    """The token path of one audit run (state across chunks: structures seen, sample rate, counters)."""

    def __init__(self, chat, params, kwargs: dict) -> None:
        self.chat, self.kwargs, self.limit = chat, kwargs, params.max_prompt_tokens
        premise = fast_path_premise(chat.tokenizer)
        self.exhaustive = bool(params.exhaustive_tokens) or premise is not None
        self.why = "audit.exhaustive_tokens: true" if params.exhaustive_tokens else premise
        if premise and not params.exhaustive_tokens:
            log.warning(
                "audit: every row is rendered and tokenized: the byte bound needs a byte-level BPE (%s)", premise
            )
        hub = HubSpec.from_params(params) if is_hub(params.input) else None
        self.estimated_rows = 0 if self.exhaustive else count_rows(params.input, hub)
        self.rate = 1.0 if self.exhaustive else min(1.0, params.token_sample_rows / max(self.estimated_rows, 1))
        self.threshold = np.uint64(min(int(self.rate * 2.0**64), 2**64 - 1))
        self.structures: dict[str, Structure] = {}
        self.counter = TokenCounter(chat.tokenizer)
        self.candidates = self.sampled = self.counted = self.over_bound = self.rendered = 0

    def summary(self) -> dict:
        return {
            "mode": "exhaustive" if self.exhaustive else "bounded",
            "why_exhaustive": self.why if self.exhaustive else None,
            "candidates": self.candidates,
            "sample_rows": self.sampled,
            "sample_rate": round(self.rate, 6),
            "sample_seed": SAMPLE_SEED,
            "exact_prompt_counts": self.counted,
            "over_byte_bound": self.over_bound,
            "structures": len(self.structures),
            "rendered_rows": self.rendered,
        }

    def _render(self, messages: list[dict], prompt_len: int, has_response: bool, tools) -> tuple:
        """(prompt text, full text or "", error or None) exactly as the exhaustive audit renders them."""
        self.rendered += 1
        try:
            p = self.chat.render(messages[:prompt_len], True, self.kwargs, tools)
            full = self.chat.render(messages, False, self.kwargs, tools) if has_response else ""
            return p, full, None
        except Exception as exc:  # jinja raise_exception / undefined: the template refuses this shape
            return None, None, f"chat template error: {exc}"

    def chunk(self, ref, t, f, messages: pa.Array, tools: pa.Array, ids, candidate) -> TokenResult:
        """`ref(r)`: how row r of the chunk is named in messages (dflash.audit.records.row_ref)."""
        n = len(candidate)
        res = TokenResult(np.full(n, -1, np.int64), np.full(n, -1, np.int64), {}, np.zeros(n, dtype=bool))
        cand = np.flatnonzero(candidate)
        self.candidates += len(cand)
        if not len(cand):
            return res
        prompt_len, has_response = f["prompt_len"], f["has_response"]
        loaded: dict[int, tuple] = {}

        def load(r: int) -> tuple:
            if r not in loaded:
                tj = tools[r].as_py()
                loaded[r] = (json.loads(messages[r].as_py()), json.loads(tj) if tj else None)
            return loaded[r]

        if self.exhaustive:
            exact, sampled = cand, cand
            bound = {}
            structure = {}
        else:
            keys = _sample_keys(ids, cand)
            in_sample = keys < self.threshold if self.rate < 1.0 else np.ones(len(cand), dtype=bool)
            sampled = cand[in_sample]
            enc = pc.dictionary_encode(signatures(t, tools).take(pa.array(cand)))
            codes = enc.indices.to_numpy(zero_copy_only=False)
            names = enc.dictionary.to_pylist()
            _, first = np.unique(codes, return_index=True)
            for c, i in enumerate(first.tolist()):
                if names[c] not in self.structures:
                    self.structures[names[c]] = self._structure(ref, cand[i], load, prompt_len, has_response)
            per = [self.structures[s] for s in names]
            skel = np.array([s.skeleton for s in per], dtype=np.int64)[codes]
            has_err = np.array([s.error is not None for s in per], dtype=bool)[codes]
            turn_bytes = (
                byte_lengths(t.content)
                + byte_lengths(t.reasoning)
                + byte_lengths(t.name)
                + byte_lengths(t.tool_call_id)
                + 2 * byte_lengths(t.tool_calls)
            )
            values = segment_sum(np.where(f["in_prompt"], turn_bytes, 0), t.offsets)
            b = skel + values[cand] + TURN_SLACK * prompt_len[cand]
            over = b > self.limit
            self.over_bound += int(over.sum())
            pick = in_sample | over
            exact = cand[pick]
            bound = dict(zip(exact.tolist(), b[pick].tolist(), strict=True))
            structure = dict(zip(exact.tolist(), (per[c] for c in codes[pick].tolist()), strict=True))
            for r, c in zip(cand[has_err & ~pick].tolist(), codes[has_err & ~pick].tolist(), strict=True):
                res.errors[r] = per[c].error
        res.sampled[sampled] = True
        self.sampled += len(sampled)

        p_texts, f_texts, p_rows, f_rows = [], [], [], []
        for r in exact.tolist():
            msgs, tl = load(r)
            p, full, err = self._render(msgs, int(prompt_len[r]), bool(has_response[r]), tl)
            s = structure.get(r)
            if s is not None and (err is None) != (s.error is None):
                raise UserError(
                    f"{ref(r)}: the chat template {'refuses' if err else 'accepts'} this row but "
                    f"{'accepted' if err else 'refused'} {s.first}, which has the same structure (roles, keys, "
                    "empty strings): its refusals depend on the text, so the audit cannot render one row per "
                    "structure; set audit.exhaustive_tokens: true"
                )
            if err is not None:
                res.errors[r] = err
                continue
            if s is not None and _nfd_bytes(p) > bound[r]:
                raise UserError(
                    f"{ref(r)}: the chat template writes {_nfd_bytes(p)} bytes for this prompt, more than "
                    f"the audit's bound {bound[r]} (its text varies with the content beyond {TURN_SLACK} bytes a "
                    "turn); set audit.exhaustive_tokens: true"
                )
            p_texts.append(p)
            p_rows.append(r)
            if res.sampled[r] and has_response[r]:
                f_texts.append(full)
                f_rows.append(r)
        if p_texts:
            self.counted += len(p_rows)
            self._count(res, p_rows, p_texts, f_rows, f_texts)
        return res

    def _count(self, res: TokenResult, p_rows, p_texts, f_rows, f_texts) -> None:
        """Prompt tokens of p_rows and loss-mask sums of f_rows (a subset). Exhaustive: whole-text encodes
        (the reference); default: TokenCounter (exact, cached pieces) where the prompt is a prefix of the
        full text, ids only where the template renders the history differently once answered."""
        prompt = dict(zip(p_rows, p_texts, strict=True))
        if self.exhaustive:
            p_ids = dict(zip(p_rows, self.counter.encode(p_texts), strict=True))
            for r, ids in p_ids.items():
                res.prompt_tokens[r] = len(ids)
            for r, full, ft in zip(f_rows, self.counter.encode(f_texts), f_texts, strict=True):
                res.mask_sums[r] = mask_sum(p_ids[r], full, prompt[r], ft)
            return
        res.prompt_tokens[p_rows] = self.counter.counts(p_texts)
        prefix = [i for i, (r, ft) in enumerate(zip(f_rows, f_texts, strict=True)) if ft.startswith(prompt[r])]
        rows = [f_rows[i] for i in prefix]
        res.mask_sums[rows] = (
            np.array(self.counter.counts([f_texts[i] for i in prefix]), dtype=np.int64) - (res.prompt_tokens[rows])
        )
        other = sorted(set(range(len(f_rows))) - set(prefix))
        if other:
            p_ids = self.counter.encode([prompt[f_rows[i]] for i in other])
            f_ids = self.counter.encode([f_texts[i] for i in other])
            for i, p, full in zip(other, p_ids, f_ids, strict=True):
                res.mask_sums[f_rows[i]] = mask_sum(p, full, prompt[f_rows[i]], f_texts[i])

    def _structure(self, ref, r, load, prompt_len, has_response) -> Structure:
        """Render a structure's first row (its verdict) and its skeleton (its template text)."""
        msgs, tl = load(r)
        _, _, err = self._render(msgs, int(prompt_len[r]), bool(has_response[r]), tl)
        p, _, skel_err = self._render(_skeleton(msgs), int(prompt_len[r]), False, tl)
        skeleton = _nfd_bytes(p) if skel_err is None else 1 << 40  # a skeleton refused: count all its rows
        return Structure(ref(r), err, skeleton)
