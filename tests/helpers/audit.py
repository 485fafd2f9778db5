"""Audit inputs: rows, a `datasets` hub cache made offline, save_to_disk folders and the audit stage as a subprocess:
shared by tests/unit/audit/test_datasets.py and tests/integration/test_audit_hub_offline.py. The hub-format cache is
made without network by `datasets` itself: its packaged JSON builder (what `load_dataset` runs for a hub repo of JSONL
files) converts a local JSONL into Arrow under the names a hub load uses (dataset name = the id's name in snake case,
config `default`, builder hash = the commit), in a staging folder then moved to `<HF_DATASETS_CACHE>/<owner>___<name>`:
the folder `load_dataset(ID)` reads offline."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO

AUDIT_REPORT_ONLY = [
    f"audit.gates.{g}.action=report" for g in ("malformed_frac", "rejected_frac", "duplicate_prompt_frac")
]
HUB_COMMIT = "0123456789abcdef0123456789abcdef01234567"


def message(role: str, content: str | None) -> dict:
    return {"role": role, "content": content}


# Rows of one type (datasets needs that) that the audit judges every way it can: kept, each rejection reason.
JUDGED_CONVERSATIONS = [
    [message("user", "What is 2+2?"), message("assistant", "4")],  # 0 kept
    [message("user", "Name a colour."), message("assistant", "Blue.")],  # 1 kept
    [message("user", "What is 2+2?"), message("assistant", "Four.")],  # 2 duplicate_prompt of 0
    [message("user", "what is  2+2?"), message("assistant", "4")],  # 3 near_duplicate_prompt of 0
    [message("narrator", "Once upon a time"), message("user", "Go on"), message("assistant", "OK.")],  # 4 unknown_role
    [message("assistant", "Hi"), message("user", "Hello"), message("assistant", "Hey")],  # 5 first_turn_not_user
    [message("system", "Be brief."), message("assistant", "Hello")],  # 6 no_user_turn
    [message("user", "   "), message("assistant", "Nothing to say?")],  # 7 empty_prompt
    [
        message("user", "Tell a joke."),
        message("assistant", "A joke."),
        message("assistant", "Another."),
    ],  # 8 assistant_after_assistant
    [message("user", None), message("assistant", "?")],  # 9 malformed: missing content
    [
        message("user", "A long question: " + "word " * 120),
        message("assistant", "Short."),
    ],  # 10 prompt_too_long (64 tokens)
    [
        message("user", "One"),
        message("assistant", "two"),
        message("user", "three"),
        message("assistant", "four"),
    ],  # 11 kept, multi-turn
    [
        message("user", "Say ok."),
        message("assistant", "ok"),
    ],  # 12 kept (a placeholder answer is reported, not rejected)
]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def save_dataset_to_disk(folder: Path, rows: list[dict], shards: int = 3) -> Path:
    import datasets

    datasets.Dataset.from_list(rows).save_to_disk(str(folder), num_shards=shards)
    return folder


def hub_cache(cache: Path, dataset_id: str, revision: str, jsonl: Path) -> Path:
    """The `datasets` cache a hub load of `dataset_id` at `revision` (a repo holding `jsonl`) leaves, made
    offline (see the module docstring). Returns the cache folder of that revision."""
    from datasets.naming import camelcase_to_snakecase
    from datasets.packaged_modules.json.json import Json

    owner, name = dataset_id.split("/")
    name = camelcase_to_snakecase(name)
    staging = cache.parent / f"staging-{name}"
    builder = Json(
        cache_dir=str(staging),
        dataset_name=name,
        config_id="default",
        hash=revision,
        data_files={"train": [str(jsonl)]},
    )
    builder.download_and_prepare()
    cache.mkdir(parents=True, exist_ok=True)
    shutil.move(str(staging / name), str(cache / f"{owner}___{name}"))
    shutil.rmtree(staging, ignore_errors=True)
    return cache / f"{owner}___{name}" / "default" / "0.0.0" / revision


def run_audit_stage(tmp_path: Path, env: dict, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "stages.audit", "--params", "params.yaml", "-S", f"audit.out={tmp_path / 'out'}"]
    cmd += ["-S", f"base.reports_dir={tmp_path / 'reports'}", "-S", "audit.tokenizer=none"]
    cmd += [x for o in (*AUDIT_REPORT_ONLY, *overrides) for x in ("-S", o)]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)


def warm_hf_home(tmp_path: Path) -> tuple[Path, dict]:
    """An HF_HOME whose datasets cache holds someone/Chat-Data at HUB_COMMIT (made in a subprocess: `datasets` reads
    its settings from the environment when imported), and an environment without any HF_ setting but it."""
    home = tmp_path / "hf"
    jsonl = write_jsonl(tmp_path / "rows.jsonl", [{"messages": c} for c in JUDGED_CONVERSATIONS])
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from pathlib import Path; import tests.helpers.audit as t; "
        "t.hub_cache(Path(sys.argv[2]), 'someone/Chat-Data', t.HUB_COMMIT, Path(sys.argv[3]))"
    )
    base = {k: v for k, v in os.environ.items() if not k.startswith("HF_") and k != "TRANSFORMERS_OFFLINE"}
    base["HF_HOME"] = str(home)
    subprocess.run(
        [sys.executable, "-c", code, str(REPO), str(home / "datasets"), str(jsonl)],
        cwd=REPO,
        env={**base, "HF_HUB_OFFLINE": "1"},
        check=True,
        capture_output=True,
        timeout=180,
    )
    return home, base


def audit_stage_reads_cache_or_names_the_id(tmp_path: Path, env: dict) -> None:
    pinned = f"audit.hf_revision={HUB_COMMIT}"
    proc = run_audit_stage(tmp_path, env, "audit.input=hf:someone/Chat-Data", pinned)
    assert proc.returncode == 0, proc.stderr[-2000:]
    details = json.loads((tmp_path / "out" / "audit_details.json").read_text())
    assert (details["num_rows"], details["num_kept"]) == (len(JUDGED_CONVERSATIONS), 5)
    proc = run_audit_stage(tmp_path, env, "audit.input=hf:someone/Unknown", pinned)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert last.startswith("error: audit.input=hf:someone/Unknown: not in the datasets cache"), last
