"""The target stage's near-tie gate (target.tiny.gates.near_tie_frac): an untrained target fails the stage, naming
the figure, after reports/target.json is written; with action report the same figures and the stage succeeds."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO
from tests.helpers.models import NARROW_TARGET


def _stage(tmp_path, target, *overrides):
    cmd = [sys.executable, "-m", "stages.target", "--params", "params.yaml"]
    for o in ("target.tiny.steps=0", *NARROW_TARGET, "target.tiny.margin_prompts=2", "target.tiny.margin_max_tokens=4"):
        cmd += ["-S", o]
    cmd += ["-S", f"base.target_dir={target}", "-S", f"base.reports_dir={tmp_path / 'reports'}"]
    for o in overrides:
        cmd += ["-S", o]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # two stage runs (builds of ~90 MB targets)
def test_the_stage_fails_naming_the_near_tie_share_and_writes_the_report(tmp_path):
    proc = _stage(tmp_path, tmp_path / "target", "target.tiny.gates.near_tie_frac.action=fail")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    report = json.loads((tmp_path / "reports" / "target.json").read_text())
    assert report["near_tie_frac"] > 0.5 and report["margin_decisions"] == 8 and report["margin_prompts"] == 2
    assert f"gate target.tiny.gates.near_tie_frac failed: measured {report['near_tie_frac']:.4f} > max" in proc.stderr
    assert set(report["margin_below"]) == {"0.01", "0.1", "1.0"} and report["gate_failed"] == ["near_tie_frac"]
    # action report: the same figures, and the stage succeeds.
    ok = _stage(tmp_path, tmp_path / "target2", "target.tiny.gates.near_tie_frac.action=report")
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert json.loads((tmp_path / "reports" / "target.json").read_text())["gate_failed"] == []
