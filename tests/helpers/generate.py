"""The generate stage from the tests: its command line on the tiny target, a worker config for fake servers."""

from __future__ import annotations

import sys

from tests.helpers import REPO


def generate_cmd(ws, target, *extra: str) -> list[str]:
    """`python -m stages.generate` on the tiny target with every folder inside the workspace `ws`
    (64-token completions; `extra`: more -S overrides, later ones win)."""
    overrides = [
        f"base.target_dir={target}",
        f"base.reports_dir={ws / 'reports'}",
        f"audit.out={ws / 'audit'}",
        f"generate.out={ws / 'generate'}",
        f"generate.pilot_out={ws / 'pilot'}",
        "generate.sampling.max_tokens=64",
        *extra,
    ]
    cmd = [sys.executable, "-m", "stages.generate", "--params", str(REPO / "params.yaml")]
    for o in overrides:
        cmd += ["-S", o]
    return cmd


def fake_worker_config(run_dir, g, vocab_size: int = 151936):
    """A generate WorkerConfig for a client run against fake servers (model "fake", thinking off, Qwen3's vocab)."""
    from dflash.core.chat import template_kwargs
    from dflash.generate.contract import WorkerConfig

    return WorkerConfig(
        gparams=g,
        model="fake",
        model_name="fake",
        revision="",
        seed=0,
        trust_remote_code=False,
        template_kwargs=template_kwargs(False, {}),
        run_dir=str(run_dir),
        run_hash="h",
        vocab_size=vocab_size,
    )
