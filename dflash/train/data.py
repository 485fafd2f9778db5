"""Training data: stream tokenized shards, pack documents into rows, sample anchors per document.

Input contract (the tokenize stage, `${tokenize.out}/train/shard-*.arrow`, Arrow IPC + zstd): one row per
sample; this module reads `input_ids` list<int32> and `loss_mask` list<int8> (same length; 1 on the supervised
completion incl. its end token). The other columns (sample_id, conversation_id, turn_index, num_tokens,
num_loss_tokens, num_prompt_tokens) are not needed here. `write_shard` writes that exact schema (tests, benchmarks).

Epoch plan: a pure function of (document index, seed, epoch), so every process and every resumed run rebuild
exactly the same rows without any saved data state except the step counter.
  1. shards in a seeded order; inside a shard, documents in a seeded order, cut into windows of `pack_window`;
  2. each window is packed best-fit decreasing (longest first, each into the fullest row it still fits) into rows
     of `max_tokens_per_row` tokens; rows are nearly full, so every micro-step costs about the same (length
     grouping at row level; the target forward also batches a micro-step's documents by length, features.py);
  3. a window's rows are emitted in a seeded order. Only the current shard is held in memory (streaming). Rows
     never mix shards, which is the price of streaming: order is shuffled within shards and across shard order.
Documents are cut to `max_length`; documents without an anchor candidate are skipped (counted in the index).

Anchors (docs/design/training.md): per document, the candidates are positions t with loss_mask[t] = loss_mask[t+1]
= 1 inside the (cut) document; up to `num_anchors` of them are drawn uniformly without replacement and sorted.
The generator is seeded by (seed, epoch, document), so every epoch re-samples, and the draw does not depend on
packing, on the process that draws it, or on resuming. Anchors never cross documents by construction (t + 1 is
in the same document) and block labels past a document's end are invalid (model.block_labels with doc_ids).

Sharding (any world size): an optimizer step takes the next `rows_per_step` rows of the epoch plan (the global
batch, the same set on every world size when train.global_batch is set); slot s of `batch_size` rows
(rows s*b .. s*b+b-1 of the step) goes to global rank s % world as its micro-step s // world (`shard_step`). Only
the global RANK / WORLD_SIZE enter; the per-row feature noise is seeded by the row's place in the step, so it
does not depend on the split either.

Batch contract (one micro-step: `batch_size` rows concatenated into one drafter row; documents stay apart through
doc_ids, so a concatenation of rows is itself a valid packed row):
  input_ids (S,) long, loss_mask (S,) bool, doc_ids (S,) long (0..D-1), position_ids (S,) long (restart at 0 per
  document), anchors (N,) long (sorted), doc_starts / doc_lengths (D,) lists (spans for the target forward),
  row_tokens: tokens of each packed row in order (their concatenation is input_ids), documents: their numbers.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dflash.core.contracts import SAMPLE_SCHEMA as SCHEMA
from dflash.core.errors import UserError
from dflash.core.io import iter_arrow_batches, list_shards, read_arrow, write_arrow

SHARD_GLOB = "shard-*.arrow"
_PLAN_STREAM, _ANCHOR_STREAM = 1, 2  # separate seeded streams for the epoch plan and the anchor draws


@dataclass
class DocIndex:
    """Per-document metadata of every shard (numpy arrays of equal length D)."""

    paths: list[Path]  # shard files, sorted by name
    shard: np.ndarray  # (D,) int32 shard number
    row: np.ndarray  # (D,) int64 row inside the shard
    length: np.ndarray  # (D,) int32 tokens after the cut to max_length
    candidates: np.ndarray  # (D,) int32 anchor candidates (loss_mask[t] and loss_mask[t+1]) inside the cut
    total_tokens: int  # tokens of all documents after the cut (including skipped ones)
    loss_tokens: int  # supervised tokens after the cut

    @property
    def usable(self) -> np.ndarray:
        return np.flatnonzero(self.candidates > 0)

    def fingerprint(self) -> dict:
        """What the checkpoint hash needs to know about the data (names, sizes, per-document lengths)."""
        import hashlib

        h = hashlib.sha256()
        for arr in (self.shard, self.row, self.length, self.candidates):
            h.update(np.ascontiguousarray(arr).tobytes())
        return {
            "shards": [[p.name, p.stat().st_size] for p in self.paths],
            "documents": int(len(self.length)),
            "index_sha256": h.hexdigest(),
        }


def _list_column(batch: pa.RecordBatch, name: str, path: Path) -> pa.ListArray:
    if name not in batch.schema.names:
        raise UserError(f"{path}: column {name!r} missing (expected the tokenize stage's schema)")
    return batch.column(batch.schema.get_field_index(name))


def scan_shards(
    folder: str | Path, max_length: int, vocab_size: int | None = None, mask_token_id: int | None = None
) -> DocIndex:
    """Read lengths and loss masks of every shard once (record batch by record batch) and check the data:
    equal input_ids / loss_mask lengths, ids below `vocab_size`, and no `mask_token_id` inside the used tokens."""
    paths = list_shards(folder, SHARD_GLOB)
    if not paths:
        raise UserError(f"{folder}: no {SHARD_GLOB} files (run the tokenize stage first)")
    shard, row, length, cands = [], [], [], []
    total = loss = 0
    for s, path in enumerate(paths):
        first_row = 0
        for batch in iter_arrow_batches(path):
            ids_col, mask_col = _list_column(batch, "input_ids", path), _list_column(batch, "loss_mask", path)
            n = len(ids_col)
            lens = np.asarray(pc.list_value_length(ids_col).fill_null(0), dtype=np.int64)
            mlens = np.asarray(pc.list_value_length(mask_col).fill_null(0), dtype=np.int64)
            bad = np.flatnonzero(lens != mlens)
            if bad.size:
                r = first_row + int(bad[0])
                raise UserError(f"{path}: row {r}: input_ids has {lens[bad[0]]} tokens, loss_mask {mlens[bad[0]]}")
            ids = ids_col.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
            mask = mask_col.flatten().to_numpy(zero_copy_only=False) != 0
            starts = np.concatenate([[0], np.cumsum(lens)[:-1]]) if n else np.zeros(0, dtype=np.int64)
            doc = np.repeat(np.arange(n), lens)  # document of each token
            pos = np.arange(len(ids)) - starts[doc] if len(ids) else np.zeros(0, dtype=np.int64)
            cut = np.minimum(lens, max_length)
            used = pos < cut[doc]
            _check_ids(ids, used, doc, vocab_size, mask_token_id, path, first_row)
            # candidate t: t and t + 1 both supervised, both in the same document and inside the cut
            pair = np.zeros(len(ids), dtype=bool)
            if len(ids) > 1:
                pair[:-1] = mask[:-1] & mask[1:] & (pos[:-1] + 1 < cut[doc[:-1]])
            cands.append(np.bincount(doc[pair], minlength=n).astype(np.int32))
            shard.append(np.full(n, s, dtype=np.int32))
            row.append(np.arange(first_row, first_row + n, dtype=np.int64))
            length.append(cut.astype(np.int32))
            total += int(cut.sum())
            loss += int((mask & used).sum())
            first_row += n
    return DocIndex(
        paths,
        np.concatenate(shard),
        np.concatenate(row),
        np.concatenate(length),
        np.concatenate(cands),
        total,
        loss,
    )


def _check_ids(ids, used, doc, vocab_size, mask_token_id, path, first_row) -> None:
    if vocab_size is not None:
        bad = np.flatnonzero(used & ((ids < 0) | (ids >= vocab_size)))
        if bad.size:
            r = first_row + int(doc[bad[0]])
            raise UserError(f"{path}: row {r}: input_ids holds {ids[bad[0]]}, outside the target's {vocab_size} rows")
    if mask_token_id is not None:
        bad = np.flatnonzero(used & (ids == mask_token_id))
        if bad.size:
            r = first_row + int(doc[bad[0]])
            raise UserError(
                f"{path}: row {r}: input_ids holds the drafter's mask token {mask_token_id} (drafter.mask_token_id "
                "must be a row the data never uses)"
            )


# --------------------------------------------------------------------------------------------------- packing


def pack_best_fit(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Best-fit decreasing: positions of `lengths`, grouped into rows whose sums stay <= capacity."""
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    free: list[tuple[int, int]] = []  # (free tokens, row number), sorted
    rows: list[list[int]] = []
    for i in order:
        n = int(lengths[i])
        assert 0 < n <= capacity, "documents are cut to max_length <= max_tokens_per_row"
        k = bisect.bisect_left(free, (n, -1))
        if k < len(free):
            left, r = free.pop(k)
        else:
            left, r = capacity, len(rows)
            rows.append([])
        rows[r].append(i)
        if left - n > 0:
            bisect.insort(free, (left - n, r))
    return rows


def epoch_rows(index: DocIndex, seed: int, epoch: int, capacity: int, window: int) -> list[np.ndarray]:
    """The epoch's packed rows, each an array of document numbers (module docstring, steps 1-3)."""
    rng = np.random.default_rng([seed, epoch, _PLAN_STREAM])
    usable = index.candidates > 0
    rows: list[np.ndarray] = []
    for s in rng.permutation(len(index.paths)):
        docs = np.flatnonzero((index.shard == s) & usable)
        docs = docs[rng.permutation(len(docs))]
        for w in range(0, len(docs), window):
            chunk = docs[w : w + window]
            packed = [chunk[r] for r in pack_best_fit(index.length[chunk], capacity)]
            rows += [packed[i] for i in rng.permutation(len(packed))]
    return rows


def packing_efficiency(index: DocIndex, rows: list[np.ndarray], capacity: int) -> float:
    """Real tokens / row capacity."""
    used = sum(int(index.length[r].sum()) for r in rows)
    return used / (len(rows) * capacity) if rows else 0.0


# --------------------------------------------------------------------------------------------------- anchors


def anchor_candidates(loss_mask: np.ndarray) -> np.ndarray:
    """Positions t with loss_mask[t] and loss_mask[t+1] (t + 1 inside the array)."""
    m = np.asarray(loss_mask) != 0
    return np.flatnonzero(m[:-1] & m[1:]) if len(m) > 1 else np.zeros(0, dtype=np.int64)


def sample_anchors(loss_mask: np.ndarray, num_anchors: int, seed: int, epoch: int, doc: int) -> np.ndarray:
    """Up to num_anchors candidates, uniformly without replacement, sorted; seeded by (seed, epoch, doc)."""
    cands = anchor_candidates(loss_mask)
    if len(cands) <= num_anchors:
        return cands
    rng = np.random.default_rng([seed, epoch, doc, _ANCHOR_STREAM])
    return np.sort(rng.choice(cands, size=num_anchors, replace=False))


# --------------------------------------------------------------------------------------------------- batches


class ShardReader:
    """Random access to documents, holding one shard's table at a time (rows never mix shards)."""

    def __init__(self, index: DocIndex):
        self.index = index
        self._shard = -1
        self._ids: pa.ListArray | None = None
        self._mask: pa.ListArray | None = None

    def document(self, doc: int) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids int64, loss_mask bool) of a document, cut to its indexed length."""
        s, r, n = int(self.index.shard[doc]), int(self.index.row[doc]), int(self.index.length[doc])
        if s != self._shard:
            table = read_arrow(self.index.paths[s])
            self._ids = table.column("input_ids").combine_chunks()
            self._mask = table.column("loss_mask").combine_chunks()
            self._shard = s
        ids = np.asarray(self._ids[r].values, dtype=np.int64)[:n]
        mask = np.asarray(self._mask[r].values, dtype=np.int8)[:n] != 0
        return ids, mask


@dataclass
class Batch:
    """One micro-step (module docstring, "Batch contract"). Tensors on the CPU; train.py moves them."""

    input_ids: object  # (S,) long
    loss_mask: object  # (S,) bool
    doc_ids: object  # (S,) long
    position_ids: object  # (S,) long
    anchors: object  # (N,) long, sorted
    doc_starts: list[int]
    doc_lengths: list[int]
    num_rows: int
    row_tokens: list[int] | None = None  # tokens of each packed row, in order
    documents: list[int] | None = None  # document numbers (DocIndex), in order

    @property
    def num_tokens(self) -> int:
        return int(sum(self.doc_lengths))


def make_batch(rows: list[np.ndarray], reader: ShardReader, num_anchors: int, seed: int, epoch: int) -> Batch:
    """Concatenate the documents of `rows` into one drafter row with per-document anchors."""
    import torch

    ids, masks, docs, pos, anchors, starts, lengths = [], [], [], [], [], [], []
    offset = 0
    for doc in (int(d) for row in rows for d in row):
        d_ids, d_mask = reader.document(doc)
        n = len(d_ids)
        a = sample_anchors(d_mask, num_anchors, seed, epoch, doc)
        assert len(a) > 0, "documents without anchor candidates are skipped by epoch_rows"
        ids.append(d_ids)
        masks.append(d_mask)
        docs.append(np.full(n, len(starts), dtype=np.int64))
        pos.append(np.arange(n, dtype=np.int64))
        anchors.append(a + offset)
        starts.append(offset)
        lengths.append(n)
        offset += n
    return Batch(
        input_ids=torch.from_numpy(np.concatenate(ids)),
        loss_mask=torch.from_numpy(np.concatenate(masks)),
        doc_ids=torch.from_numpy(np.concatenate(docs)),
        position_ids=torch.from_numpy(np.concatenate(pos)),
        anchors=torch.from_numpy(np.concatenate(anchors)),
        doc_starts=starts,
        doc_lengths=lengths,
        num_rows=len(rows),
        row_tokens=[int(reader.index.length[np.asarray(row, dtype=np.int64)].sum()) for row in rows],
        documents=[int(d) for row in rows for d in row],
    )


def docs_digest(documents: list[int]) -> int:
    """Sum of 31-bit codes of document numbers: an order-free fingerprint of the documents a step fed (the sum
    over all ranks is exact in float64 below 2**22 documents per step)."""
    return sum((int(d) * 2654435761 + 12345) % (1 << 31) for d in documents)


def shard_step(rows: list, batch_size: int, accum: int, world: int, rank: int) -> list[tuple[int, list]]:
    """This process's micro-steps of one optimizer step (module docstring, "Sharding"): [(slot, rows)], where
    `rows` are the step's `batch_size x accum x world` rows and slot s holds rows s*b .. s*b+b-1."""
    if len(rows) != batch_size * accum * world:
        raise ValueError(f"a step of {len(rows)} rows cannot be {accum} micro-steps x {world} x {batch_size} rows")
    slots = [m * world + rank for m in range(accum)]
    return [(s, rows[s * batch_size : (s + 1) * batch_size]) for s in slots]


# --------------------------------------------------------------------------------------------------- writing


def write_shard(path: str | Path, samples: list[tuple[list[int], list[int], int]], id_prefix: str = "s") -> None:
    """Write (input_ids, loss_mask, num_prompt_tokens) samples with the tokenize stage's exact schema."""
    rows = {
        "sample_id": [f"{id_prefix}{i}" for i in range(len(samples))],
        "conversation_id": [f"{id_prefix}c{i}" for i in range(len(samples))],
        "turn_index": [0] * len(samples),
        "input_ids": [list(s[0]) for s in samples],
        "loss_mask": [list(s[1]) for s in samples],
        "num_tokens": [len(s[0]) for s in samples],
        "num_loss_tokens": [int(sum(s[1])) for s in samples],
        "num_prompt_tokens": [int(s[2]) for s in samples],
    }

    write_arrow(path, pa.Table.from_pydict(rows, schema=SCHEMA))


__all__ = [
    "Batch",
    "DocIndex",
    "ShardReader",
    "docs_digest",
    "anchor_candidates",
    "epoch_rows",
    "make_batch",
    "pack_best_fit",
    "packing_efficiency",
    "sample_anchors",
    "scan_shards",
    "shard_step",
    "write_shard",
]
