"""benchmarks/gpu_check.sh, the one GPU check for a GPU host or a lent device, run in --smoke mode on CPU.

Without CUDA every step must end as a SKIP line (never an OK carrying CPU figures), each Python piece must
still run its tiny CPU smoke (the flex / mfu / fla steps say "cpu smoke ok"), the script must exit 0, print
a summary naming every step and write OUT/gpu_check.json with the figures. A step that fails says FAIL and
why, and the script still exits 0 with the table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks/gpu_check.sh"
STEPS = ("setup", "tests", "flex", "mfu", "fla", "pilot")


def _run(out: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "GPU_CHECK_INSTALL": "0", **env}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=environ, timeout=400)


def test_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


@pytest.mark.slow
def test_smoke_on_cpu_skips_cuda_steps_and_writes_figures(tmp_path):
    proc = _run(tmp_path, "--smoke")
    assert proc.returncode == 0, proc.stderr
    summary = proc.stdout[proc.stdout.index("gpu_check summary") :]
    lines = {ln.split()[0]: ln for ln in summary.splitlines()[1:] if ln.split() and ln.split()[0] in STEPS}
    assert set(lines) == set(STEPS), summary
    assert (tmp_path / "summary.txt").read_text().strip() == summary.strip().split("\n\n")[0].strip()
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["cuda"] is False and set(result["steps"]) == set(STEPS) - {"setup"}
    for name in ("tests", "flex", "mfu", "fla", "pilot"):
        step = result["steps"][name]
        assert step["status"] == "SKIP", (name, step)
        assert f"{name:<5}  SKIP" in lines[name]
    assert "needs a CUDA device" in result["steps"]["tests"]["line"]  # pytest ran: every gpu test skipped
    for name in ("flex", "mfu", "fla", "pilot"):  # the CPU smoke of each Python piece ran and left its figures
        assert result["steps"][name]["line"].startswith("no CUDA device; cpu smoke ok"), result["steps"][name]
    flex = result["steps"]["flex"]["figures"]
    assert flex["backends"]["sdpa"]["step_ms"] > 0 and "flex" in flex["backends"]
    assert result["steps"]["mfu"]["figures"]["flops_per_step"] > 0
    assert result["steps"]["fla"]["figures"]["torch_calls"] > 0  # the GatedDeltaNet layers ran the torch path
    pilot = result["steps"]["pilot"]["figures"]  # the training pilot ran its three phases on the tiny hybrid target
    assert pilot["verdict"] == "ok" and pilot["step_seconds"] > 0 and pilot["peak_memory_gb"] > 0
    assert pilot["linear_attention"]["fused"] is False and pilot["target"]["layers"] == 6


def test_without_smoke_on_cpu_every_step_skips_fast(tmp_path):
    proc = _run(tmp_path)
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert {s["status"] for s in result["steps"].values()} == {"SKIP"}
    assert all("no CUDA device" in s["line"] for s in result["steps"].values())


@pytest.mark.slow
def test_a_failing_step_says_fail_and_the_script_exits_0(tmp_path):
    """Steps cut short by their time budget (1 s) are FAIL lines saying so, the later steps still run, and the
    exit status stays 0."""
    proc = _run(tmp_path, "--smoke", T_FLEX="1", T_TESTS="1")  # 1 s: both are cut short by their budget
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    for name in ("tests", "flex"):
        assert result["steps"][name]["status"] == "FAIL" and "timed out" in result["steps"][name]["line"], result
    assert result["steps"]["fla"]["status"] == "SKIP"  # later steps still ran
    assert "FAIL" in (tmp_path / "summary.txt").read_text()
