"""Training over a pruned draft vocabulary (drafter.draft_vocab_size; dflash/train/draft_vocab.py): the vocabulary
comes from the tokenize stage's counts beside the shards, labels outside it are masked and counted, train.json
reports its coverage, and the export carries the vocabulary the run trained with."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from dflash.core.errors import UserError
from dflash.core.io import iter_arrow_batches, read_json, write_json
from dflash.drafter.vocab import COUNTS_FILE, TokenCounts, count_loss_tokens, coverage, select
from dflash.train.loop import train
from tests.helpers.train import TRAIN_END, TRAIN_VOCAB, one_thread, train_params


def _tokenized(tmp_path, train_data):
    """A tokenize output folder: the shards under train/ and the counts file the tokenize stage writes."""
    out = tmp_path / "tok"
    shutil.copytree(train_data, out / "train")
    counts: dict[int, int] = {}
    for path in sorted((out / "train").glob("shard-*.arrow")):
        for b in iter_arrow_batches(path):
            ids = b.column("input_ids").flatten().to_numpy(zero_copy_only=False)
            mask = b.column("loss_mask").flatten().to_numpy(zero_copy_only=False)
            for k, v in count_loss_tokens(ids, mask).items():
                counts[k] = counts.get(k, 0) + v
    tc = TokenCounts(counts, (TRAIN_END,))
    write_json(out / COUNTS_FILE, tc.to_json())
    return out / "train", tc


def test_training_over_a_pruned_vocabulary_masks_counts_and_exports_it(tmp_path, train_target, train_data):
    from dflash.drafter.export import load_draft_head, read_config

    data, tc = _tokenized(tmp_path, train_data)
    size = 30  # of the 49 distinct loss tokens: some labels fall outside
    with one_thread():
        summary = train(train_params(train_target, tmp_path / "out", f"drafter.draft_vocab_size={size}"), data)
    ids = select(tc.counts, tc.always_in, size, TRAIN_VOCAB)
    assert summary["completed"] and summary["final_loss"] < summary["first_loss"]
    assert summary["draft_vocab_size"] == size
    assert summary["draft_vocab_coverage"] == pytest.approx(coverage(tc.counts, ids), abs=1e-6)
    assert 0 < summary["draft_vocab_coverage"] < 1
    assert summary["draft_vocab_outside_slots"] > 0 and 0 < summary["draft_vocab_outside_frac"] < 1
    folder = tmp_path / "out" / "drafter"
    assert read_json(folder / "config.json")["draft_vocab_size"] == size
    head = load_draft_head(folder, read_config(folder))
    assert head.token_ids.tolist() == ids.tolist() and TRAIN_END in ids.tolist()
    assert np.array_equal(np.sort(ids), ids)


def test_a_pruned_vocabulary_without_the_counts_file_names_the_stage(tmp_path, train_target, train_data):
    with pytest.raises(UserError, match="token_counts.json not found .*tokenize"):
        train(train_params(train_target, tmp_path / "out", "drafter.draft_vocab_size=30"), train_data)
