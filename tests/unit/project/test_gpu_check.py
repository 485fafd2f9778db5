"""benchmarks/gpu_check.sh, the one GPU check for a GPU host: the script parses, and without --smoke on a CPU
every step skips fast. The whole script in --smoke mode: tests/integration/test_gpu_check.py.
"""

from __future__ import annotations

import json
import subprocess

from tests.helpers.gpu import GPU_CHECK_SCRIPT, run_gpu_check


def test_script_parses():
    assert subprocess.run(["bash", "-n", str(GPU_CHECK_SCRIPT)]).returncode == 0


def test_without_smoke_on_cpu_every_step_skips_fast(tmp_path):
    proc = run_gpu_check(tmp_path)
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert {s["status"] for s in result["steps"].values()} == {"SKIP"}
    assert all("no CUDA device" in s["line"] for s in result["steps"].values())
