"""Running state of an audit across chunks: counts, examples, duplicate keys, histograms, rejected rows.

Kept apart from dflash/audit/checks.py (the per-chunk checks) so that each file holds one concept. Memory
does not grow with text size: duplicate keys are 8-byte hashes kept in sorted numpy runs, each with an
8-byte ref to its first occurrence (two sets: ~32 bytes a kept row), length histograms are fixed-size
counts, and only the kept rows' prompt lengths are stored (16 bytes a row).
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dflash.audit.records import row_ref
from dflash.core.params import AuditParams

LENGTH_CAP = 1 << 20  # length histograms count exact values below this; longer ones share the last bin
EXAMPLE_VALUES = 4096  # example rows are remembered for length values below this


# ---------------------------------------------------------------------------- segment reductions


def segment_sum(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Per-row sums of per-turn values; rows may be empty."""
    cs = np.concatenate(([0], np.cumsum(values, dtype=np.int64)))
    return cs[offsets[1:]] - cs[offsets[:-1]]


def _segment_reduce(ufunc, values: np.ndarray, offsets: np.ndarray, empty: int) -> np.ndarray:
    out = np.full(len(offsets) - 1, empty, dtype=np.int64)
    nonempty = offsets[1:] > offsets[:-1]
    if nonempty.any():
        out[nonempty] = ufunc.reduceat(values.astype(np.int64), offsets[:-1][nonempty])
    return out


def segment_max(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Per-row max of non-negative per-turn values; 0 for empty rows."""
    return _segment_reduce(np.maximum, values, offsets, 0)


def segment_min(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Per-row min; int64 max for empty rows."""
    return _segment_reduce(np.minimum, values, offsets, np.iinfo(np.int64).max)


# ---------------------------------------------------------------------------- hashed keys


def first_occurrences(keys: np.ndarray) -> np.ndarray:
    """True at the first occurrence of each key in `keys` (Arrow's C++ hash table numbers distinct
    values in order of first appearance, so a row is first exactly when its code is a new maximum)."""
    if len(keys) == 0:
        return np.zeros(0, dtype=bool)
    codes = pc.dictionary_encode(pa.array(keys)).indices.to_numpy()
    running = np.maximum.accumulate(codes)
    return np.concatenate(([True], running[1:] > running[:-1]))


class KeySet:
    """A set of uint64 keys as a few sorted runs (merged when a newer run is as large as the older),
    each key with an int64 ref (the first occurrence's file and row, see AuditState.ref_code)."""

    def __init__(self) -> None:
        self.runs: list[np.ndarray] = []
        self.refs: list[np.ndarray] = []  # parallel to runs

    def contains(self, keys: np.ndarray) -> np.ndarray:
        hit = np.zeros(len(keys), dtype=bool)
        for run in self.runs:
            i = np.searchsorted(run, keys)
            hit |= (i < len(run)) & (run[np.minimum(i, len(run) - 1)] == keys)
        return hit

    def first_occurrence_mask(self, keys: np.ndarray) -> np.ndarray:
        """True where a key was seen before: in the set, or earlier in `keys` itself."""
        return self.contains(keys) | ~first_occurrences(keys)

    def lookup(self, keys: np.ndarray, refs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(True where a key was seen before: in the set or earlier in `keys`; the ref of that first
        occurrence there, -1 elsewhere). `refs`: the refs of `keys`."""
        hit = np.zeros(len(keys), dtype=bool)
        first = np.full(len(keys), -1, dtype=np.int64)
        for run, run_refs in zip(self.runs, self.refs, strict=True):
            i = np.minimum(np.searchsorted(run, keys), len(run) - 1)
            new = (run[i] == keys) & ~hit
            first[new] = run_refs[i[new]]
            hit |= new
        if len(keys):
            codes = pc.dictionary_encode(pa.array(keys)).indices.to_numpy()
            _, first_index = np.unique(codes, return_index=True)  # codes number keys in order of appearance
            earlier = (first_index[codes] != np.arange(len(keys))) & ~hit
            first[earlier] = refs[first_index[codes[earlier]]]
            hit |= earlier
        return hit, first

    def add(self, keys: np.ndarray, refs: np.ndarray | None = None) -> None:
        """Add keys not yet in the set (first occurrences), with their refs."""
        if len(keys):
            refs = np.full(len(keys), -1, dtype=np.int64) if refs is None else np.asarray(refs, dtype=np.int64)
            self._push(keys, refs)
            while len(self.runs) > 1 and len(self.runs[-1]) * 2 >= len(self.runs[-2]):
                b, a, rb, ra = self.runs.pop(), self.runs.pop(), self.refs.pop(), self.refs.pop()
                self._push(np.concatenate([a, b]), np.concatenate([ra, rb]))

    def _push(self, keys: np.ndarray, refs: np.ndarray) -> None:
        """Append one sorted run; of equal keys the earliest (older run, earlier row) is kept."""
        order = np.argsort(keys, kind="stable")
        x, r = keys[order], refs[order]
        first = np.concatenate(([True], x[1:] != x[:-1]))
        self.runs.append(x[first])
        self.refs.append(r[first])


class KeyCounter:
    """Counts of uint64 keys, as sorted (keys, counts) runs merged like KeySet's."""

    def __init__(self) -> None:
        self.runs: list[tuple[np.ndarray, np.ndarray]] = []

    def add(self, keys: np.ndarray, counts: np.ndarray) -> None:
        if len(keys):
            self.runs.append(self._merge(keys, counts))
            while len(self.runs) > 1 and len(self.runs[-1][0]) * 2 >= len(self.runs[-2][0]):
                (kb, cb), (ka, ca) = self.runs.pop(), self.runs.pop()
                self.runs.append(self._merge(np.concatenate([ka, kb]), np.concatenate([ca, cb])))

    @staticmethod
    def _merge(keys: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        uniq, inverse = np.unique(keys, return_inverse=True)
        return uniq, np.bincount(inverse, weights=counts, minlength=len(uniq)).astype(np.int64)

    def totals(self) -> tuple[np.ndarray, np.ndarray]:
        while len(self.runs) > 1:
            (kb, cb), (ka, ca) = self.runs.pop(), self.runs.pop()
            self.runs.append(self._merge(np.concatenate([ka, kb]), np.concatenate([ca, cb])))
        return self.runs[0] if self.runs else (np.zeros(0, np.uint64), np.zeros(0, np.int64))


# ---------------------------------------------------------------------------- state


class AuditState:
    def __init__(self, params: AuditParams) -> None:
        self.params = params
        texts = sorted({"".join(ch for ch in t.lower() if ch.isalnum()) for t in params.placeholder_texts})
        self.placeholder_set = pa.array(texts, pa.string())
        self.max_placeholder_len = max((len(t) for t in params.placeholder_texts), default=0) + 8
        self.files: set[str] = set()
        self.kinds: dict[str, str] = {}  # file -> its reader's kind (records.row_ref: what a row number means)
        self.file_list: list[str] = []  # file of each ref code
        self.forms: dict[str, str] = {}  # file -> what it was read as (dflash/audit/forms.py)
        self.form_notes: dict[str, str] = {}  # file -> how that differs from its name
        self.empty_files: list[str] = []
        self.skipped_files: list[str] = []
        self.unreadable: list[dict] = []  # regions of input files that could not be read (JSON arrays)
        self.rejected_file: Any = None
        self.num_rows = 0
        self.num_kept = 0
        self.reasons: Counter[str] = Counter()
        self.rows_rejected = 0
        self.examples: dict[str, list[str]] = {}
        self.counts: Counter[str] = Counter()
        self.seen_exact, self.seen_norm = KeySet(), KeySet()
        self.responses = KeyCounter()
        self.response_text: dict[int, tuple[str, str]] = {}  # key -> (text, first "file:row"), repeated keys only
        self.chars_hist = np.zeros(LENGTH_CAP + 1, dtype=np.int64)
        self.tokens_hist = np.zeros(LENGTH_CAP + 1, dtype=np.int64)
        self.value_examples: dict[str, dict[int, list[str]]] = {"chars": {}, "tokens": {}}
        self.prompt_chars: list[np.ndarray] = []
        self.prompt_tokens: list[np.ndarray] = []  # the token sample's kept rows (dflash/audit/tokens.py)
        self.tokens: Any = None  # the run's TokenPath once a chunk was tokenized (summary() -> metrics)

    def note_chunk(self, chunk) -> None:
        """What the reader noticed about the chunk's file: its kind and form, empty, skipped folder files, unread regions."""
        if chunk.file not in self.kinds:
            self.kinds[chunk.file] = chunk.kind
            self.file_list.append(chunk.file)
            if chunk.form:
                self.forms[chunk.file] = chunk.form
            if chunk.form_note:
                self.form_notes[chunk.file] = chunk.form_note
        if chunk.empty:
            self.empty_files.append(chunk.file)
        self.skipped_files += chunk.skipped
        self.unreadable += chunk.unreadable

    def ref(self, file: str, row: int) -> str:
        """row_ref of a row: `FILE:line N`, `FILE element N` or `FILE row N`."""
        return row_ref(self.kinds.get(file, "jsonl"), file, int(row))

    def ref_code(self, file: str, rows: np.ndarray) -> np.ndarray:
        """int64 codes of (file, row) for the duplicate sets (file index in the high bits)."""
        return np.asarray(rows, dtype=np.int64) + (self.file_list.index(file) << 40)

    def ref_text(self, code: int) -> str:
        return self.ref(self.file_list[code >> 40], code & ((1 << 40) - 1))

    def example(self, check: str, file: str, row: int) -> None:
        bucket = self.examples.setdefault(check, [])
        if len(bucket) < self.params.examples:
            bucket.append(self.ref(file, row))

    def reject(self, file: str, row: int, reasons: list[str], detail: str, cid: str | None, excerpt: str) -> None:
        self.rows_rejected += 1
        for reason in reasons:
            self.reasons[reason] += 1
            self.example(reason, file, row)
        record = {"source_file": file, "source_row": row, "reasons": reasons, "detail": detail}
        if cid is not None:
            record["conversation_id"] = cid
        record["excerpt"] = excerpt
        self.rejected_file.write(json.dumps(record, ensure_ascii=False) + "\n")

    def count_responses(
        self, keys: np.ndarray, counts: np.ndarray, texts: pa.Array, file: str, rows: np.ndarray
    ) -> None:
        """One chunk's distinct (normalized) final responses: their keys, counts, first text and row."""
        self.responses.add(keys, counts)
        for i in np.flatnonzero(counts >= 2).tolist():
            k = int(keys[i])
            if k not in self.response_text:
                self.response_text[k] = (texts[i].as_py()[:200], self.ref(file, rows[i]))

    def _histogram(self, unit: str, hist: np.ndarray, values: np.ndarray, file: str, rows: np.ndarray) -> None:
        hist += np.bincount(np.minimum(values, LENGTH_CAP), minlength=LENGTH_CAP + 1)
        small = np.flatnonzero(values < EXAMPLE_VALUES)
        if len(small) == 0:
            return
        order = small[np.argsort(values[small], kind="stable")]  # rows grouped by value, in row order
        starts = np.flatnonzero(np.concatenate(([True], values[order][1:] != values[order][:-1])))
        refs = self.value_examples[unit]
        for start, end in zip(starts.tolist(), [*starts[1:].tolist(), len(order)], strict=True):
            bucket = refs.setdefault(int(values[order[start]]), [])
            for i in order[start : min(end, start + self.params.examples - len(bucket))]:
                bucket.append(self.ref(file, rows[i]))

    def observe(self, file, rows, ok, f, prompt_tokens, mask_sums, kept, sampled) -> None:
        """Count one chunk's readable conversations (ok) and kept rows; token statistics come from the
        token sample (`sampled`: rows whose counts are a seeded sample, all of them when exhaustive)."""
        self.num_kept += int(kept.sum())
        c = self.counts
        c["conversations"] += int(ok.sum())
        checks = {
            "placeholder_response": ok & (f["placeholder_turns"] > 0),
            "empty_response": ok & (f["empty_turns"] > 0),
            "placeholder_in_prompt": ok & (f["placeholder_in_prompt"] > 0),
            "tool_calls": ok & f["has_tool_calls"],
            "multi_turn": ok & (f["num_user"] >= 2),
            "system_prompt": ok & f["has_system"],
            "role_order": ok & f["role_order"],
            "no_response": ok & ~f["has_response"],
            "short_response": ok & f["has_response"] & (f["response_chars"] <= self.params.short_response_chars),
        }
        for name, mask in checks.items():
            c[name] += int(mask.sum())
            for r in np.flatnonzero(mask)[: self.params.examples]:
                self.example(name, file, int(rows[r]))
        c["assistant_turns"] += f["assistant_turns"]
        c["placeholder_turns"] += f["placeholder_turn_total"]
        resp = ok & f["has_response"]
        c["responses"] += int(resp.sum())
        self._histogram("chars", self.chars_hist, f["response_chars"][resp], file, rows[resp])
        tok = mask_sums >= 0
        c["tokenized_responses"] += int(tok.sum())
        self._histogram("tokens", self.tokens_hist, mask_sums[tok], file, rows[tok])
        self.prompt_chars.append(f["prompt_chars"][kept].astype(np.int64))
        self.prompt_tokens.append(prompt_tokens[kept & sampled & (prompt_tokens >= 0)])

    # ------------------------------------------------------------------------ summary

    def metrics(self, tokenizer: str | None) -> dict:
        p, c = self.params, self.counts
        n_rows, n_conv = self.num_rows, c["conversations"]
        n_malformed, n_non_text = self.reasons["malformed"], self.reasons["non_text_part"]
        assert self.num_kept + self.rows_rejected == n_rows, "every input row is kept or rejected"
        assert n_conv + n_malformed + n_non_text == n_rows

        def frac(k: int, d: int) -> float:
            return round(k / d, 6) if d else 0.0

        chars_value, chars_frac = _spike(self.chars_hist, c["responses"])
        tokens_value, tokens_frac = _spike(self.tokens_hist, c["tokenized_responses"])
        by_tokens = tokenizer is not None and c["tokenized_responses"] > 0
        keys, counts = self.responses.totals()
        threshold = max(2, int(np.ceil(p.repeated_response_min_share * max(c["responses"], 1))))
        repeated = counts >= threshold
        order = np.argsort(-counts[repeated], kind="stable")[:10]
        top = []
        for k, n in zip(keys[repeated][order].tolist(), counts[repeated][order].tolist(), strict=True):
            text, ref = self.response_text.get(k, (None, None))
            top.append({"text": text, "count": int(n), "share": frac(int(n), c["responses"]), "example": ref})
        dup = self.reasons["duplicate_prompt"] + self.reasons["near_duplicate_prompt"]
        unit = "tokens" if by_tokens else "chars"
        spike_value, spike_frac = (tokens_value, tokens_frac) if by_tokens else (chars_value, chars_frac)
        hist = self.tokens_hist if by_tokens else self.chars_hist
        examples = dict(self.examples)
        examples["response_length_spike"] = self.value_examples[unit].get(spike_value, [])
        return {
            "num_rows": n_rows,
            "num_conversations": n_conv,
            "num_malformed": n_malformed,
            "num_non_text_part": n_non_text,  # readable rows with image / audio / file content parts
            "num_kept": self.num_kept,
            "num_rejected": self.rows_rejected,
            "kept_plus_rejected_equals_rows": self.num_kept + self.rows_rejected == n_rows,
            "rejected_by_reason": {r: self.reasons[r] for r in sorted(self.reasons)},
            "malformed_frac": frac(n_malformed, n_rows),
            "rejected_frac": frac(self.rows_rejected, n_rows),
            "placeholder_response_frac": frac(c["placeholder_response"], n_conv),
            "placeholder_response_count": c["placeholder_response"],
            "placeholder_turn_frac": frac(c["placeholder_turns"], c["assistant_turns"]),
            "empty_response_count": c["empty_response"],
            "placeholder_in_prompt_count": c["placeholder_in_prompt"],
            "response_length_spike_frac": spike_frac,
            "response_length_spike_value": spike_value,
            "response_length_spike_unit": unit,
            "response_length_spike_count": int(hist[spike_value]) if c["responses"] else 0,
            "response_chars_spike": {"value": chars_value, "frac": chars_frac},
            "loss_mask_spike": {"value": tokens_value, "frac": tokens_frac} if by_tokens else None,
            "repeated_response_frac": frac(int(counts[repeated].sum()), c["responses"]),
            "repeated_response_threshold": threshold,
            "repeated_responses": top,
            "short_response_frac": frac(c["short_response"], n_conv),
            "duplicate_prompt_frac": frac(dup, n_conv),
            "duplicate_prompt_count": self.reasons["duplicate_prompt"],
            "near_duplicate_prompt_count": self.reasons["near_duplicate_prompt"],
            "tool_call_frac": frac(c["tool_calls"], n_conv),
            "multi_turn_frac": frac(c["multi_turn"], n_conv),
            "system_prompt_frac": frac(c["system_prompt"], n_conv),
            "role_order_frac": frac(c["role_order"], n_conv),
            "no_response_count": c["no_response"],
            "num_responses": c["responses"],
            "prompt_chars": _stats(np.concatenate(self.prompt_chars) if self.prompt_chars else np.zeros(0)),
            "prompt_tokens": _stats(np.concatenate(self.prompt_tokens)) if tokenizer else None,
            "max_prompt_tokens": p.max_prompt_tokens if tokenizer else None,
            "tokenizer": tokenizer,
            "token_sample": self.tokens.summary() if tokenizer and self.tokens is not None else None,
            "input_files": sorted(self.files),
            "input_forms": {f: self.forms[f] for f in sorted(self.forms)[:1000]},  # file -> what it was read as
            "form_notes": {f: self.form_notes[f] for f in sorted(self.form_notes)[:100]},  # where its name differs
            "num_form_notes": len(self.form_notes),
            "empty_files": self.empty_files,
            "skipped_files": self.skipped_files[:100],
            "num_skipped_files": len(self.skipped_files),
            "unreadable": self.unreadable[:100],
            "num_unreadable_regions": len(self.unreadable),
            "unreadable_bytes": sum(u["bytes"][1] - u["bytes"][0] for u in self.unreadable),
            "examples": examples,
        }

    def histogram_rows(self, unit: str) -> list[tuple[int, int]]:
        """(value, count) for every non-zero bin; the last bin holds every value >= LENGTH_CAP."""
        hist = self.tokens_hist if unit == "tokens" else self.chars_hist
        return [(int(v), int(hist[v])) for v in np.flatnonzero(hist)]


def _spike(hist: np.ndarray, total: int) -> tuple[int, float]:
    """Most common exact value (below LENGTH_CAP) and its share of `total`."""
    if total == 0:
        return 0, 0.0
    k = int(np.argmax(hist[:LENGTH_CAP]))
    return k, round(float(hist[k] / total), 6)


def _stats(values: np.ndarray) -> dict:
    if values.size == 0:
        return {"count": 0}
    q = np.percentile(values, [50, 90, 99])
    return {
        "count": int(values.size),
        "min": int(values.min()),
        "mean": round(float(values.mean()), 2),
        "p50": float(q[0]),
        "p90": float(q[1]),
        "p99": float(q[2]),
        "max": int(values.max()),
    }
