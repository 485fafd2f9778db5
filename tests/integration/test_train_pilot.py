"""The training pilot (dflash/train/pilot.py) and train.activation_checkpointing.

A small random Qwen3 target (vocab 512, hidden 64, 4 layers) and hand-made shards: mostly short documents, a few
long ones (the worst rows must hold them) and a few short, fully supervised ones (the most anchors per token).
The pilot runs in-process on the real trainer; the out-of-memory test runs the stage in a subprocess under an
address-space limit (RLIMIT_AS), as an OOM would stop it on a real host.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash.train import parts
from dflash.train.data import pack_best_fit, scan_shards, write_shard
from dflash.train.loop import Trainer
from dflash.train.pilot import run_pilot
from dflash.train.pilot_data import PHASES, longest_rows, most_anchor_rows, row_anchors
from tests.helpers import REPO, TEST_DEFAULTS, repo_params
from tests.helpers.models import small_qwen3_config

VOCAB, MASK = 512, 511
LONG = (150, 190, 230)  # the long documents' lengths (tokens), the longest last


def _target(folder: Path) -> Path:
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(1)
    model = Qwen3ForCausalLM(
        small_qwen3_config(4, vocab=VOCAB, max_position_embeddings=1024, tie_word_embeddings=False)
    )
    model.save_pretrained(folder)
    (folder / "target.json").write_text(json.dumps({"source": "test", "model": str(folder), "revision": ""}))
    return folder


def _doc(rng, prompt: int, completion: int) -> tuple[list[int], list[int], int]:
    ids = rng.integers(10, 500, prompt + completion).tolist()
    return ids, [0] * prompt + [1] * completion, prompt


def _shards(folder: Path) -> Path:
    rng = np.random.default_rng(7)
    docs = [_doc(rng, int(rng.integers(8, 20)), int(rng.integers(20, 60))) for _ in range(70)]
    docs += [_doc(rng, 100, n - 100) for n in LONG]  # long prompts: few anchors per token
    docs += [_doc(rng, 1, 15) for _ in range(6)]  # short, supervised from the 2nd token: the most anchors per token
    order = rng.permutation(len(docs))
    docs = [docs[i] for i in order]
    write_shard(folder / "shard-00000.arrow", docs[:40], "a")
    write_shard(folder / "shard-00001.arrow", docs[40:], "b")
    return folder


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("pilot")
    return _target(root / "target"), _shards(root / "data" / "train")


def _overrides(target: Path, out: Path, *extra: str) -> list[str]:
    return [
        *TEST_DEFAULTS,
        f"base.target_dir={target}",
        f"base.reports_dir={out / 'reports'}",
        "drafter.num_hidden_layers=2",
        "drafter.num_attention_heads=2",
        "drafter.num_key_value_heads=1",
        "drafter.head_dim=32",
        "drafter.intermediate_size=128",
        "drafter.block_size=4",
        f"drafter.mask_token_id={MASK}",
        "drafter.target_layer_ids=[0, 2]",
        "drafter.max_position_embeddings=1024",
        f"train.out={out / 'train'}",
        "train.live_dir=",
        "train.target_device=cpu",
        "train.drafter_device=cpu",
        "train.max_length=256",
        "train.max_tokens_per_row=256",
        "train.num_anchors=8",
        "train.epochs=2",
        "train.logits_chunk_blocks=8",
        "train.pilot_warmup_steps=1",
        "train.pilot_steps=2",
        "plan.hardware_file=params/hardware-host.yaml",
        "plan.hardware=cpu-host",
        *extra,
    ]


def _params(target: Path, out: Path, *extra: str):
    return repo_params(_overrides(target, out, *extra))


# ------------------------------------------------------------------------------------------ the worst rows


def test_worst_rows_are_the_longest_the_data_holds(setup):
    _, data = setup
    index = scan_shards(data, max_length=256)
    rows = longest_rows(index, capacity=256, rows=2)
    assert int(index.length[rows[0]].max()) == max(LONG) == int(index.length.max())  # the longest document first
    assert int(index.length[rows[1]].max()) == sorted(LONG)[-2]  # then the next longest
    assert all(int(index.length[r].sum()) <= 256 for r in rows)
    # no packing of the data holds a row with a longer document, and the first row is as full as any holding it
    plan = pack_best_fit(index.length[index.usable], 256)
    assert max(int(index.length[index.usable[r]].max()) for r in plan) == int(index.length[rows[0]].max())


def test_most_anchor_rows_carry_the_most_anchors(setup):
    _, data = setup
    index = scan_shards(data, max_length=256)
    best = most_anchor_rows(index, capacity=256, num_anchors=8, rows=1)[0]
    longest = longest_rows(index, capacity=256, rows=1)[0]
    ordinary = [index.usable[r] for r in pack_best_fit(index.length[index.usable], 256)]
    assert row_anchors(index, best, 8) >= max(row_anchors(index, r, 8) for r in ordinary)
    assert row_anchors(index, best, 8) > row_anchors(index, longest, 8)


# ------------------------------------------------------------------------------------------ the pilot


def test_pilot_measures_the_real_trainer(setup, tmp_path):
    target, data = setup
    report = run_pilot(_params(target, tmp_path), data)
    assert report["verdict"] == "ok" and report["problem"] is None
    assert set(report["phases"]) == set(PHASES)
    assert report["phases"]["longest"]["longest_document"] == max(LONG)  # the worst rows ran, longest included
    assert (
        report["max_row_anchors"] == report["phases"]["anchors"]["anchors"] >= report["phases"]["ordinary"]["anchors"]
    )
    for phase in report["phases"].values():
        recs = phase["records"]
        assert [r["warmup"] for r in recs] == [True, False, False]
        measured = [r for r in recs if not r["warmup"]]
        # time-weighted: summed tokens / summed seconds, never a mean of per-step rates
        assert phase["tokens_per_s"] == pytest.approx(
            sum(r["tokens"] for r in measured) / sum(r["seconds"] for r in measured)
        )
        for r in recs:
            parts = r["data_s"] + r["target_s"] + r["drafter_s"] + r["optimizer_s"]
            assert r["target_s"] > 0 and r["drafter_s"] > 0 and parts == pytest.approx(r["seconds"], rel=0.05)
    assert report["peak_memory_gb"] > 0.05 and report["device_memory_gb"] > report["peak_memory_gb"]
    assert report["achieved_tflops"] > 0 and 0 < report["mfu"] < 1 and "cpu-host" in report["peak_source"]
    assert report["lm_head_rows"] == VOCAB  # no exactly-zero rows in this target: the loss computes them all
    assert report["first_loss_ok"] and abs(report["first_loss"] - math.log(VOCAB)) < 0.25 * math.log(VOCAB)
    assert len(report["feature_rms"]) == 2 and report["min_feature_rms"] > 0
    assert report["attention_path"]["backend"] == "sdpa" and report["linear_attention"] is None
    assert report["layout"] == "single" and report["steps_per_epoch"] > 0
    mix = report["anchors_per_row"]  # the epoch's mix of rows: the drafter's part scaled, the rest as measured
    drafter = report["step_seconds"] * report["phases"]["ordinary"]["share"]["drafter"]
    epoch_step = report["step_seconds"] + drafter * (mix["epoch"] / mix["measured"] - 1)
    assert report["epoch_step_seconds"] == pytest.approx(epoch_step) and mix["epoch"] > 0 and mix["measured"] > 0
    assert report["train_seconds_estimate"] == pytest.approx(epoch_step * 2 * report["steps_per_epoch"])
    assert not (tmp_path / "train" / "drafter").exists()  # nothing trained for keeps
    assert not list((tmp_path / "train").rglob("step-*"))


def test_a_target_layer_giving_zeros_is_refused_naming_it(setup, tmp_path, monkeypatch):
    """A hook on the target's layer 2 returns zeros (as hybrid extraction bugs did): the pilot names layer 2."""
    target, data = setup
    real = parts.load_target_model

    def zeroed(*args, **kwargs):
        model = real(*args, **kwargs)
        layer = model.model.layers[2]
        layer.register_forward_hook(lambda _m, _a, out: torch.zeros_like(out[0] if isinstance(out, tuple) else out))
        return model

    monkeypatch.setattr(parts, "load_target_model", zeroed)
    report = run_pilot(_params(target, tmp_path), data)
    assert report["verdict"] == "bad_features"
    assert "target layer 2 (drafter.target_layer_ids[1]) gives all-zero hidden states" in report["problem"]
    assert "target layer 0" not in report["problem"]


@pytest.mark.slow
def test_out_of_memory_is_a_one_line_verdict(setup, tmp_path):
    """The stage in a subprocess whose address space is capped a little above what it holds once its libraries are
    loaded: the first step on the longest row (one 4,000-token document, ~4,000 anchors x 8 slots) cannot get its
    attention mask. Exit 1, one line naming the rows, the memory and the knobs, no traceback, the report written."""
    target, _ = setup
    rng = np.random.default_rng(0)
    data = tmp_path / "tok" / "train"
    data.mkdir(parents=True)
    write_shard(data / "shard-00000.arrow", [_doc(rng, 1, 3999), _doc(rng, 1, 60), _doc(rng, 1, 60)], "z")
    driver = (
        "import resource, runpy, sys, torch, transformers, dflash.train.pilot, dflash.core.loader\n"
        "import transformers.models.qwen3.modeling_qwen3\n"
        "vm = [int(x.split()[1]) * 1024 for x in open('/proc/self/status') if x.startswith('VmSize')][0]\n"
        "resource.setrlimit(resource.RLIMIT_AS, (vm + 700 * 2**20, resource.RLIM_INFINITY))\n"
        "sys.argv = ['stages.train', *sys.argv[1:]]\n"
        "runpy.run_module('stages.train', run_name='__main__')\n"
    )
    overrides = _overrides(
        target,
        tmp_path,
        f"tokenize.out={tmp_path / 'tok'}",
        "train.max_length=4000",
        "train.max_tokens_per_row=4096",
        "train.num_anchors=4000",
        "train.epochs=1",
        "train.pilot_warmup_steps=0",
        "train.pilot_steps=1",
        "drafter.block_size=8",
        "drafter.max_position_embeddings=8192",
    )
    args = ["--params", "params.yaml", *(a for o in overrides for a in ("-S", o)), "--pilot"]
    env = {
        **os.environ,
        "MALLOC_ARENA_MAX": "1",
        "OMP_NUM_THREADS": "1",
    }  # one malloc arena, one thread: VM stays small
    proc = subprocess.run(
        [sys.executable, "-c", driver, *args], cwd=REPO, capture_output=True, text=True, env=env, timeout=300
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and len(errors) == 1, proc.stderr[-3000:]
    line = errors[0]
    assert "out of memory on the longest rows" in line and "longest document 4000" in line
    assert "GB resident, address space limited to" in line
    for knob in ("train.max_tokens_per_row", "train.activation_checkpointing: true", "train.parallel: fsdp"):
        assert knob in line
    assert json.loads((tmp_path / "reports" / "train_pilot.json").read_text())["verdict"] == "out_of_memory"


# ------------------------------------------------------------------------------------------ activation checkpointing


def _gradients(target: Path, data: Path, out: Path, checkpointing: bool) -> tuple[dict, int]:
    """The drafter's gradients of the first step (same seed, same rows) and the bytes autograd kept for backward."""
    trainer = Trainer(_params(target, out, f"train.activation_checkpointing={str(checkpointing).lower()}"), data)
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            trainer.compute_gradients(0)
        grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()}
    finally:
        trainer.close()
    return grads, saved[0]


def test_activation_checkpointing_gives_the_same_gradients_and_keeps_less(setup, tmp_path):
    target, data = setup
    plain, kept_plain = _gradients(target, data, tmp_path / "a", False)
    ckpt, kept_ckpt = _gradients(target, data, tmp_path / "b", True)
    assert plain.keys() == ckpt.keys()
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], rtol=1e-5, atol=1e-7, msg=name)
    assert kept_ckpt < 0.8 * kept_plain  # the layers' activations were not kept: they are recomputed in backward
