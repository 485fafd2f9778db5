"""dflash/train/pilot.py: the ordinary step time for the epoch's mix of rows (the drafter's part scales with the
blocks a row carries; the target forward, optimizer and data wait stay as measured)."""

from __future__ import annotations

import pytest

from dflash.train.pilot_data import AnchorMix, epoch_step_seconds

ORDINARY = {"step_seconds": 1.0, "share": {"drafter": 0.8, "target": 0.15, "optimizer": 0.04, "data": 0.01}}


def test_rows_with_fewer_blocks_than_the_sample_shorten_only_the_drafters_part():
    assert epoch_step_seconds(ORDINARY, AnchorMix(sample_per_row=500.0, epoch_per_row=250.0)) == pytest.approx(0.6)
    assert epoch_step_seconds(ORDINARY, AnchorMix(sample_per_row=250.0, epoch_per_row=500.0)) == pytest.approx(1.8)


def test_a_representative_sample_keeps_the_measured_step():
    assert epoch_step_seconds(ORDINARY, AnchorMix(sample_per_row=393.0, epoch_per_row=393.0)) == 1.0
    assert epoch_step_seconds(ORDINARY, AnchorMix(sample_per_row=0.0, epoch_per_row=393.0)) == 1.0
