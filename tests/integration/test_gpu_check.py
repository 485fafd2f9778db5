"""benchmarks/gpu_check.sh run whole on CPU: in --smoke mode every step ends as SKIP (never an OK carrying CPU
figures), each Python piece runs its tiny CPU smoke, the script exits 0 with a summary and OUT/gpu_check.json;
a step that fails says FAIL and why, and the script still exits 0 with the table. The fast checks of the
script: tests/unit/project/test_gpu_check.py.
"""

from __future__ import annotations

import json

import pytest

from dflash.drafter.kinds import KINDS
from tests.helpers.gpu import GPU_CHECK_STEPS, run_gpu_check


@pytest.mark.slow
def test_smoke_on_cpu_skips_cuda_steps_and_writes_figures(tmp_path):
    proc = run_gpu_check(tmp_path, "--smoke")
    assert proc.returncode == 0, proc.stderr
    summary = proc.stdout[proc.stdout.index("gpu_check summary") :]
    lines = {ln.split()[0]: ln for ln in summary.splitlines()[1:] if ln.split() and ln.split()[0] in GPU_CHECK_STEPS}
    assert set(lines) == set(GPU_CHECK_STEPS), summary
    assert (tmp_path / "summary.txt").read_text().strip() == summary.strip().split("\n\n")[0].strip()
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["cuda"] is False and set(result["steps"]) == set(GPU_CHECK_STEPS) - {"setup"}
    for name in ("tests", "flex", "mfu", "fla", "serve", "pilot"):
        step = result["steps"][name]
        assert step["status"] == "SKIP", (name, step)
        assert f"{name:<5}  SKIP" in lines[name]
    assert "needs a CUDA device" in result["steps"]["tests"]["line"]  # pytest ran: every gpu test skipped
    for name in ("flex", "mfu", "fla", "serve", "pilot"):  # the CPU smoke of each Python piece ran and left its figures
        assert result["steps"][name]["line"].startswith("no CUDA device; cpu smoke ok"), result["steps"][name]
    flex = result["steps"]["flex"]["figures"]
    assert flex["backends"]["sdpa"]["step_ms"] > 0 and "flex" in flex["backends"]
    assert result["steps"]["mfu"]["figures"]["flops_per_step"] > 0
    assert result["steps"]["fla"]["figures"]["torch_calls"] > 0  # the GatedDeltaNet layers ran the torch path
    serve = result["steps"]["serve"]["figures"]  # every kind trained, exported and decoded by the reference
    v2_only = {name for name, spec in KINDS.items() if not spec.v1_runner}  # dspark, dflash2, lilicorr
    assert set(serve["kinds"]) == v2_only and serve["served"] is False
    assert all(r["reference_equals_greedy"] and r["reference"]["num_drafts"] > 0 for r in serve["kinds"].values())
    pilot = result["steps"]["pilot"]["figures"]  # the training pilot ran its three phases on the tiny hybrid target
    assert pilot["verdict"] == "ok" and pilot["step_seconds"] > 0 and pilot["peak_memory_gb"] > 0
    assert pilot["linear_attention"]["fused"] is False and pilot["target"]["layers"] == 6


@pytest.mark.slow
def test_a_failing_step_says_fail_and_the_script_exits_0(tmp_path):
    """Steps cut short by their time budget (1 s) are FAIL lines saying so, the later steps still run, and the
    exit status stays 0. The smoke of every step was checked above: here the slow later ones are skipped by name."""
    proc = run_gpu_check(  # 1 s: tests and flex are cut short by their budget
        tmp_path, "--smoke", T_FLEX="1", T_TESTS="1", GPU_CHECK_SKIP="mfu serve pilot"
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    for name in ("tests", "flex"):
        assert result["steps"][name]["status"] == "FAIL" and "timed out" in result["steps"][name]["line"], result
    fla = result["steps"]["fla"]  # a later step still ran its CPU smoke
    assert fla["status"] == "SKIP" and fla["line"].startswith("no CUDA device; cpu smoke ok"), fla
    assert "FAIL" in (tmp_path / "summary.txt").read_text()
