"""DVC in a throw-away repo: tests/integration/test_repro.py (the whole pipeline) and
tests/integration/test_audit_input_repro.py (the audit's input tracking) run real `dvc` commands in temporary git
repos; report_run gives the report stage's tests a run's folders."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from tests.helpers import REPO


def dvc_env(**extra: str) -> dict[str, str]:
    """This environment with this venv's python and dvc first on PATH, no analytics and a fixed git identity."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["DVC_NO_ANALYTICS"] = "1"
    env.update(
        GIT_AUTHOR_NAME="test",
        GIT_AUTHOR_EMAIL="test@example.invalid",
        GIT_COMMITTER_NAME="test",
        GIT_COMMITTER_EMAIL="test@example.invalid",
        GIT_CONFIG_NOSYSTEM="1",
    )
    env.update(extra)
    return env


def write_params(repo: Path, overrides: list[str]) -> None:
    """repo/params.yaml with `-S`-style overrides applied, as `dvc exp run -S` would, checked against the schema."""
    from dflash.core.loader import apply_overrides, from_dict, read_yaml
    from dflash.core.yamlio import dump_yaml_text

    raw = apply_overrides(read_yaml(repo / "params.yaml"), overrides, "test params")
    from_dict(raw, "test params")
    (repo / "params.yaml").write_text(dump_yaml_text(raw))  # YAML 1.2, read back as DVC and the stages read it


def changed_stages(status: dict) -> dict:
    """`dvc status --json` without the stages DVC reports only because dvc.yaml marks them `always_changed`
    (audit_input: it looks at audit.input on every repro; whether the audit reruns is what matters)."""
    return {name: why for name, why in status.items() if why != ["always changed"]}


def report_run(root: Path) -> list[str]:
    """A run's folders under `root` from the committed reports, plus an audit folder and the plan figure (what
    those stages draw); returns the -S overrides that point a stage at them (the report stage's tests)."""

    from dflash.core.figures import bar_chart, write_png

    shutil.copytree(REPO / "reports", root / "reports", ignore=shutil.ignore_patterns("hybrid", "*.png", "*.html"))
    audit = root / "audit"
    (audit / "plots").mkdir(parents=True)
    for name in ("response_lengths", "loss_mask_sums"):
        rows = [{"v": v, "n": (v * 7) % 11} for v in range(1, 40)]
        write_png(audit / "plots" / f"{name}.png", bar_chart(rows, x="v", y="n", title=name, x_title="v", y_title="n"))
        (audit / "plots" / f"{name}.csv").write_text("v,n\n1,2\n")
    (audit / "report.md").write_text(
        "# Data audit\n\n| gate | result |\n|---|---|\n| spike | crossed |\n\n"
        "![Response lengths](plots/response_lengths.png)\n\n![gone](plots/missing.png)\n\n[details](audit_details.json)\n"
    )
    (audit / "audit_details.json").write_text("{}\n")
    rows = [{"v": g, "n": 1 / g} for g in (1, 2, 4)]
    write_png(
        root / "reports/plan_time_vs_gpus.png", bar_chart(rows, x="v", y="n", title="p", x_title="g", y_title="h")
    )
    return [
        f"base.reports_dir={root / 'reports'}",
        f"audit.out={audit}",
        f"train.live_dir={root / 'reports/train_live'}",
    ]
