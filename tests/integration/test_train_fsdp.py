"""FSDP2 (`train.parallel: fsdp`) against DDP on CPU / gloo: the same loss curve, clip and export; resume across modes.

Two processes (torch.multiprocessing.spawn with torchrun's environment: RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR/PORT, as tests/integration/test_train_ddp.py; the small target and hand-made shards of tests/helpers/train.py) run, in ONE gloo process group, six training phases on the same data and seed:
  1-2. ddp and fsdp, each stopped (and checkpointed) at step K; then both folders are copied
  3-4. ddp and fsdp resumed to the end: the reference curves
  5-6. the ddp checkpoint resumed under fsdp, the fsdp checkpoint resumed under ddp, to the end

Tolerance: FSDP computes with the same full weights (all-gathered), and its gradient reduction of two addends
equals DDP's (a + b and a / 2 + b / 2 round alike); what differs is the gradient norm for clipping: FSDP sums
per-shard squares, DDP squares whole tensors, so the norm (and with clipping active, every update) differs in the
last bits (~1e-7 relative), and AdamW carries that forward. Over a dozen steps it stays below 1e-5 relative:
losses and grad norms agree to rel 1e-5, exported weights to atol 1e-5 (they are ~0.02-1 in size).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dflash.train import checkpoint, parallel
from dflash.train.loop import Trainer
from tests.helpers.train import free_port, rank_env, train_params

K = 5  # steps before the switch of mode


def _phases() -> list[tuple[str, str, str, int]]:
    """(name, mode, out folder, max_steps) in run order (max_steps 0 = to the end)."""
    return [
        ("ddp_k", "ddp", "ddp", K),
        ("fsdp_k", "fsdp", "fsdp", K),
        ("ddp", "ddp", "ddp", 0),
        ("fsdp", "fsdp", "fsdp", 0),
        ("ddp_to_fsdp", "fsdp", "ddp_to_fsdp", 0),
        ("fsdp_to_ddp", "ddp", "fsdp_to_ddp", 0),
    ]


def _worker(rank, world, port, target_dir, data_dir, root, result):
    rank_env(rank, world, port)
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")  # one group for every phase (Trainer reuses it)
    root, facts = Path(root), {}
    for name, mode, out, max_steps in _phases():
        if name == "ddp":  # both first halves are checkpointed: copy them for the cross-mode resumes
            if rank == 0:
                shutil.copytree(root / "ddp", root / "ddp_to_fsdp")
                shutil.copytree(root / "fsdp", root / "fsdp_to_ddp")
            torch.distributed.barrier()
        extra = [f"train.parallel={mode}", f"train.max_steps={max_steps}", "train.checkpoint_every=0"]
        trainer = Trainer(train_params(Path(target_dir), root / out, *extra), data_dir)
        local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in trainer.model.parameters())
        summary = trainer.run()
        facts[name] = {
            "sharded": parallel.is_sharded(trainer.model),
            "ddp": trainer.ddp is not None,
            "local_params": local,
            "params": summary["drafter_params"],
            "resumed": summary["resumed"],
            "steps": summary["steps"],
            "checkpoint_dir": summary["checkpoint_dir"],
        }
    if rank == 0:
        Path(result).write_text(json.dumps(facts))
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, train_target, train_data):  # noqa: F811
    import torch.multiprocessing as mp

    root = tmp_path_factory.mktemp("fsdp")
    port = free_port()
    result = root / "facts.json"
    mp.spawn(_worker, args=(2, port, str(train_target), str(train_data), str(root), str(result)), nprocs=2)
    return root, json.loads(result.read_text())


def _history(facts, name):
    return checkpoint.get_history(facts[name]["checkpoint_dir"])


def _export(root, name):
    from safetensors.torch import load_file

    return load_file(root / name / "drafter/model.safetensors")


@pytest.mark.slow  # the `runs` fixture: one spawn of 2 processes, 6 short training phases
def test_fsdp_shards_the_drafter_and_ddp_replicates_it(runs):
    _, facts = runs
    assert facts["fsdp"]["sharded"] and not facts["fsdp"]["ddp"]
    assert facts["ddp"]["ddp"] and not facts["ddp"]["sharded"]
    n = facts["ddp"]["params"]
    assert facts["fsdp"]["params"] == n and facts["ddp"]["local_params"] == n  # global count in both modes
    assert facts["fsdp"]["local_params"] <= n // 2 + 64  # each of 2 processes holds ~half (dim-0 shards)


@pytest.mark.slow
def test_fsdp_and_ddp_give_the_same_loss_curve_clip_and_export(runs):
    root, facts = runs
    ddp, fsdp = _history(facts, "ddp"), _history(facts, "fsdp")
    assert len(ddp) == len(fsdp) == facts["ddp"]["steps"] > K + 3
    for a, b in zip(ddp, fsdp, strict=True):
        assert a["step"] == b["step"] and a["tokens"] == b["tokens"] and a["weight"] == b["weight"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)  # the same clip
        assert a["lr"] == b["lr"]
    assert sum(h["grad_norm"] > 1.0 for h in ddp) >= 3  # grad_clip 1.0 was active: clipping is on the path
    assert ddp[-1]["loss"] < 0.8 * ddp[0]["loss"]  # it trains
    a, b = _export(root, "ddp"), _export(root, "fsdp")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5)


@pytest.mark.slow
def test_a_checkpoint_resumes_under_the_other_mode(runs):
    root, facts = runs
    for name, first, other in (("ddp_to_fsdp", "ddp", "fsdp"), ("fsdp_to_ddp", "fsdp", "ddp")):
        assert facts[name]["resumed"] and facts[name]["checkpoint_dir"] == facts[first]["checkpoint_dir"].replace(
            f"/{first}/", f"/{name}/"
        )  # the same config hash: the mode is outside it
        crossed, own = _history(facts, name), _history(facts, first)
        assert [h["loss"] for h in crossed[:K]] == [h["loss"] for h in own[:K]]  # the first K steps, as saved
        ref = _history(facts, other)
        assert len(crossed) == len(ref)
        for h, r in zip(crossed[K:], ref[K:], strict=True):
            assert h["loss"] == pytest.approx(r["loss"], rel=1e-5)
        exported, expected = _export(root, name), _export(root, first)
        for k in expected:
            torch.testing.assert_close(exported[k], expected[k], rtol=0, atol=1e-5)
    # the checkpoint format is mode-free: plain tensors, numbered optimizer params, weights_only-loadable
    for name in ("ddp", "fsdp"):
        state = torch.load(checkpoint.latest(facts[name]["checkpoint_dir"]) / checkpoint.STATE, weights_only=True)
        assert sorted(state["optimizer"]["state"]) == list(range(len(state["optimizer"]["state"])))
        assert all(type(v) is torch.Tensor for s in state["optimizer"]["state"].values() for v in s.values())
