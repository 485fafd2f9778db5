"""What identifies a run, for the report page: the commit, the machine, the params that differ from the defaults,
and the dvc.lock identity of each stage.

Defaults: the params file as committed (`git show HEAD:params.yaml`), loaded as the stages load it; the run's
params are what this stage was given (params.yaml + overlays + `-S`), so `dvc exp run -S ...` values and an
overlay written into params.yaml (`make repro-gpu`) both show. Without git the page says so.
A stage's identity: the first 12 hex digits of the sha256 of its dvc.lock entry (command, dep and out hashes,
params) as canonical JSON; equal identities = the same stage run on the same inputs with the same outputs.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash.core.errors import UserError
from dflash.core.loader import as_dict, from_dict
from dflash.core.params import Params
from dflash.core.yamlio import load_yaml_text


@dataclass(frozen=True)
class StageIdentity:
    stage: str
    cmd: str
    identity: str  # sha256 of the canonical lock entry, 12 hex digits
    num_deps: int
    outs: list[tuple[str, str]]  # (path, md5 as dvc.lock has it: 12 hex digits, ".dir" kept)


@dataclass(frozen=True)
class ParamsDiff:
    baseline: str  # where the defaults came from, or why there are none
    changes: list[tuple[str, Any, Any]] = field(default_factory=list)  # (dotted key, default, this run's)
    available: bool = True


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def commit(outputs: tuple[str, ...] = ()) -> str:
    """The checkout's commit (12 digits), and whether tracked files differ from it, leaving out `outputs` (dvc.lock
    and the reports, which the run itself rewrites before they are committed); "no git checkout" without git."""
    head = _git("rev-parse", "HEAD")
    if head is None:
        return "no git checkout"
    inside = [p for p in outputs if not Path(p).is_absolute() or Path(p).resolve().is_relative_to(Path.cwd())]
    dirty = _git("status", "--porcelain", "--untracked-files=no", "--", ".", *(f":(exclude){p}" for p in inside))
    return head.strip()[:12] + (" + uncommitted changes" if dirty else "")


def machine() -> str:
    """OS, CPU architecture and count: what the demo's timings depend on (no host name)."""
    return f"{platform.system()} {platform.release()}, {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict) and obj:
        out: dict[str, Any] = {}
        for key, value in obj.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): obj}


def params_diff(params: Params, params_file: str | Path) -> ParamsDiff:
    """Every key whose value in this run differs from the committed params file's."""
    rel = Path(params_file)
    text = _git("show", f"HEAD:{rel.as_posix()}")
    if text is None:
        return ParamsDiff(f"no committed {rel} (not a git checkout, or the file is new): nothing to compare", [], False)
    try:
        default = as_dict(from_dict(load_yaml_text(text, f"HEAD:{rel}"), f"HEAD:{rel}"))
    except UserError as exc:  # committed under an older schema: compare what both have
        return ParamsDiff(f"HEAD:{rel} does not load under this code's schema ({exc})", [], False)
    ours, theirs = _flatten(as_dict(params)), _flatten(default)
    keys = sorted(set(ours) | set(theirs))
    changes = [(k, theirs.get(k), ours.get(k)) for k in keys if ours.get(k) != theirs.get(k)]
    return ParamsDiff(f"{rel} as committed (git HEAD)", changes)


def lock_identities(lock_file: str | Path, skip: tuple[str, ...] = ()) -> list[StageIdentity]:
    """One row per stage in dvc.lock (in its order), leaving out `skip` (the report stage's own, still old)."""
    path = Path(lock_file)
    if not path.is_file():
        return []
    stages = load_yaml_text(path.read_text(encoding="utf-8"), str(path)).get("stages", {})
    out = []
    for name, entry in stages.items():
        if name in skip:
            continue
        digest = hashlib.sha256(json.dumps(entry, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
        outs = [
            (o["path"], str(o.get("md5", "?"))[:12] + (".dir" if str(o.get("md5", "")).endswith(".dir") else ""))
            for o in entry.get("outs", [])
        ]
        out.append(StageIdentity(name, entry.get("cmd", ""), digest[:12], len(entry.get("deps", [])), outs))
    return out


__all__ = ["ParamsDiff", "StageIdentity", "commit", "lock_identities", "machine", "params_diff"]
