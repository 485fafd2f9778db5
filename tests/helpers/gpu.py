"""benchmarks/gpu_check.sh run from a test (tests/unit/project/test_gpu_check.py, tests/integration/test_gpu_check.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO

GPU_CHECK_SCRIPT = REPO / "benchmarks/gpu_check.sh"
GPU_CHECK_STEPS = (
    "setup",
    "tests",
    "flex",
    "mfu",
    "fla",
    "serve",
    "pilot",
)  # the steps benchmarks/gpu_check.sh reports


def run_gpu_check(out: Path, *args: str, **env: str):
    """benchmarks/gpu_check.sh with OUT=out and this interpreter, installing nothing (GPU_CHECK_INSTALL=0)."""

    environ = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "GPU_CHECK_INSTALL": "0", **env}
    return subprocess.run(
        ["bash", str(GPU_CHECK_SCRIPT), *args], capture_output=True, text=True, env=environ, timeout=400
    )
