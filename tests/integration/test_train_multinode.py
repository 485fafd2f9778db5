"""Multi-node training under torchrun on localhost, and resume on another world size (dflash/train/distributed.py).

Two torchrun agents (`--nnodes 2 --node-rank 0|1 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint
127.0.0.1:PORT`, gloo) are started together, each in its own working directory (relative live_dir and
reports_dir: node-local), sharing train.out (the shared filesystem). World 4 runs step 0's gradients (compared
with one process on the same global batch) and then the stage to train.max_steps; a 1 x 2 torchrun resumes it
to the end and is compared with an uninterrupted one-process run: same step, lr, documents per step (digest),
losses within float-summation tolerance. Same small target and shards as the unit training tests (tests/helpers/train.py).

This file is also the torchrun worker: `python tests/integration/test_train_multinode.py MODE TARGET DATA OUT RESULT -S...`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash.core.errors import UserError
from dflash.train import checkpoint
from dflash.train.loop import Trainer, train
from tests.helpers import REPO, repo_params
from tests.helpers.train import free_port, one_thread, train_overrides

STEPS_FIRST = 5  # the world-4 run stops here (train.max_steps); the resumed run goes on from it
COMMON = [  # global batch 4 rows on every world size; per-row feature noise on (it must not depend on the split)
    "train.global_batch=4",
    "train.batch_size=1",
    "train.checkpoint_every=2",
    "train.keep_checkpoints=10",
    "train.feature_noise=0.05",
    "train.live_dir=live",  # relative: inside each node's working directory
    "base.reports_dir=reports",
]


# ------------------------------------------------------------------------------------------ torchrun runs


def _torchrun(nodes: int, procs: int, cwd_root: Path, args: list[str], timeout: float = 400) -> None:
    """`nodes` torchrun agents started together on localhost (c10d), node n working in cwd_root/node{n}."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    launched = []
    for n in range(nodes):
        cwd = cwd_root / f"node{n}"
        cwd.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node-rank", str(n)]
        cmd += ["--nproc-per-node", str(procs), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
        cmd += ["--rdzv-id", f"test{port}", "--local-addr", "127.0.0.1", "--max-restarts", "0"]
        cmd += [str(Path(__file__).resolve()), *args]
        log = open(cwd / "torchrun.log", "w")  # noqa: SIM115 (closed below)
        launched.append((subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT), log, cwd))
    codes = []
    for proc, log, _ in launched:
        try:
            codes.append(proc.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(proc.wait())
        log.close()
    if any(codes):
        logs = "\n".join(
            f"--- node {n}:\n{(c / 'torchrun.log').read_text()[-6000:]}" for n, (_, _, c) in enumerate(launched)
        )
        raise AssertionError(f"torchrun exit codes {codes}\n{logs}")


def _stage_overrides(train_target: Path, tmp: Path, *extra: str) -> list[str]:
    return train_overrides(train_target, tmp / "out", f"tokenize.out={tmp / 'tok'}", *COMMON, *extra)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, train_target, train_data):
    """world 4 (2 nodes x 2) to step STEPS_FIRST, resumed on world 2 (1 x 2) to the end; the uninterrupted world 1."""
    tmp = tmp_path_factory.mktemp("multinode")
    shutil.copytree(train_data, tmp / "tok/train")
    first = [a for o in _stage_overrides(train_target, tmp, f"train.max_steps={STEPS_FIRST}") for a in ("-S", o)]
    _torchrun(2, 2, tmp / "first", ["grads", str(tmp / "tok/train"), str(tmp / "grads"), *first])
    resumed = [a for o in _stage_overrides(train_target, tmp) for a in ("-S", o)]
    _torchrun(1, 2, tmp / "resumed", ["stage", str(tmp / "tok/train"), str(tmp / "grads"), *resumed])
    with one_thread():
        ref = train(repo_params(_stage_overrides(train_target, tmp / "ref", "train.live_dir=")), train_data)
    return tmp, ref


def _history(folder: Path) -> list[dict]:
    return checkpoint.get_history(folder)


@pytest.mark.slow
def test_two_nodes_give_one_process_gradients_and_write_once(runs, train_target, train_data):
    tmp, _ = runs
    shards = [torch.load(tmp / f"grads-{r}.pt", weights_only=True) for r in range(4)]
    assert sorted(s["dist"]["rank"] for s in shards) == [0, 1, 2, 3]
    assert sorted(s["dist"]["local_rank"] for s in shards) == [0, 0, 1, 1]
    assert {s["dist"]["nodes"] for s in shards} == {2}
    with one_thread():
        single = Trainer(repo_params(_stage_overrides(train_target, tmp / "single")), train_data)
        metrics = single.compute_gradients(0)
    # sharding by the global rank: the four ranks' documents are disjoint and together the global batch
    docs = [d for s in shards for d in s["docs"]]
    step_docs = sorted(int(d) for row in single.data.step_rows(0) for d in row)
    assert sorted(docs) == step_docs and len(set(docs)) == len(docs)
    main = next(s for s in shards if s["dist"]["rank"] == 0)
    assert main["metrics"]["tokens"] == metrics["tokens"] and main["metrics"]["counted"] == metrics["counted"]
    assert main["metrics"]["correct"] == metrics["correct"]
    assert main["metrics"]["loss"] == pytest.approx(metrics["loss"], rel=1e-6)
    for g, p in zip(main["grads"], single.model.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-7)
    # one writer: one config folder, its checkpoints once, dvclive and the stage metrics on one node only
    folders = [p for p in (tmp / "out/checkpoints").iterdir() if p.is_dir()]
    assert len(folders) == 1
    steps = [int(p.name.split("-")[1]) for p in checkpoint.checkpoints(folders[0])]
    assert steps[:3] == [2, 4, STEPS_FIRST]
    info = json.loads((folders[0] / f"step-{STEPS_FIRST:08d}" / checkpoint.RUN_INFO).read_text())
    assert (info["rank"], info["world_size"], info["nodes"]) == (0, 4, 2)
    live = [n for n in ("node0", "node1") if (tmp / "first" / n / "live").exists()]
    reports = [n for n in ("node0", "node1") if (tmp / "first" / n / "reports/train.json").exists()]
    assert len(live) == 1 and reports == live
    assert not list((tmp / "out/checkpoints").rglob(".tmp-*"))


@pytest.mark.slow
def test_resume_on_another_world_size_continues_the_schedule(runs):
    tmp, ref = runs
    folder = tmp / "out/checkpoints" / Path(ref["checkpoint_dir"]).name
    assert folder.exists()  # the same config hash for world 4, world 2 and world 1 (global batch kept)
    final = [p.name for p in checkpoint.checkpoints(folder)]
    assert final.count(f"step-{ref['total_steps']:08d}") == 1 and final[-1] == f"step-{ref['total_steps']:08d}"
    summary = json.loads((tmp / "resumed/node0/reports/train_details.json").read_text())
    assert summary["resumed"] and summary["completed"] and summary["world_size"] == 2
    assert (tmp / "out/drafter/model.safetensors").exists()
    got, want = _history(folder), _history(ref["checkpoint_dir"])
    assert [h["step"] for h in got] == [h["step"] for h in want] == list(range(1, ref["total_steps"] + 1))
    for g, w in zip(got, want, strict=True):
        assert g["lr"] == w["lr"]  # (a) the schedule position: same lr at every step, exactly
        assert (g["docs_digest"], g["tokens"], g["counted"]) == (w["docs_digest"], w["tokens"], w["counted"])  # (b)
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-4)  # (c) only the float summation order differs
    from safetensors.torch import load_file

    a, b = load_file(tmp / "out/drafter/model.safetensors"), load_file(tmp / "ref/out/drafter/model.safetensors")
    assert all(torch.allclose(a[k], b[k], rtol=1e-3, atol=1e-4) for k in a)


# ------------------------------------------------------------------------------------------------ worker


def _worker(argv: list[str]) -> None:
    """torchrun worker: MODE (grads: step 0's gradients saved per rank first; stage: only the stage) DATA RESULT
    then -S overrides; then the train stage itself (stopping at train.max_steps is not an error here)."""
    from stages import train as stage

    mode, data_dir, result, *rest = argv
    overrides = [rest[i + 1] for i in range(0, len(rest), 2)]
    torch.set_num_threads(1)
    params = repo_params(overrides)
    if mode == "grads":
        trainer = Trainer(params, data_dir)
        metrics = trainer.compute_gradients(0)
        docs = [d for _, b in trainer.data.micro_batches(0) for d in b.documents]
        grads = [p.grad.clone() for p in trainer.model.parameters()] if trainer.dist.is_main else []
        info = dataclasses.asdict(trainer.dist) | {"nodes": trainer.dist.nodes}
        torch.save({"dist": info, "docs": docs, "metrics": metrics, "grads": grads}, f"{result}-{trainer.rank}.pt")
    try:
        stage.main(params)
    except UserError as exc:
        if "train.max_steps" not in str(exc):
            raise
        print(exc)


if __name__ == "__main__":
    _worker(sys.argv[1:])
