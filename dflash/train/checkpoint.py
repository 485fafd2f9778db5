"""Training checkpoints: atomic folders under a config-hashed directory, exact resume, provenance.

Layout (`${train.out}/checkpoints/`, kept outside DVC's outs so that it survives a killed `dvc repro`):
  <hash>/                   one folder per training configuration: sha256 of config.json below, so a run
                            never resumes a checkpoint of other params, another target or other data
    config.json             what the hash covers, readable
    step-00000120/          one checkpoint; written as .tmp-step-00000120/ and renamed into place only when
                            complete (a killed write leaves a .tmp-* folder, ignored and removed next time)
      model.safetensors     the drafter's fp32 master weights (the body; the same keys as the z-lab export)
      state.pt              optimizer, scheduler, RNG states, step, epoch, position in the epoch, metric history:
                            tensors / numbers / strings only, read back with torch.load(weights_only=True)
      run_info.json         provenance: git SHA, package versions, argv, params, and `code`: a hash of every source
                            file of dflash/ and stages/ the writing process had loaded (see `code_changes`)
Only the newest `keep` checkpoints stay. Folders of other configurations are left alone (listed in the log).

Multi-node: only global rank 0 writes (config.json, every checkpoint), then all ranks pass a barrier, so no
rank ever lists a half-written checkpoint (and the .tmp-* rename makes one invisible anyway); to resume, rank 0
picks the latest checkpoint and every rank loads that same one (train.out on a filesystem all nodes share).
The hash covers the global batch (rows per optimizer step), not the world size: a run resumes on another world
size when train.global_batch keeps its rows per step; `other_batch` finds the folder of the same run under a
different global batch, so that a world-size change without it is refused instead of silently starting afresh.
The hash does not cover the code: a run resumes across a code fix (a crash, a patch, the same schedule). A resumed
checkpoint written by other code is said out loud (`code_changes`: the files that differ), above all a finished one,
whose weights the run then exports without training a step.
"""

from __future__ import annotations

import logging
import os
import platform
import random
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from dflash.core.errors import UserError
from dflash.core.io import canonical_json, config_hash, file_sha256, read_json, write_json

log = logging.getLogger(__name__)

WEIGHTS, STATE, RUN_INFO, CONFIG = "model.safetensors", "state.pt", "run_info.json", "config.json"
_PREFIX = "step-"
PACKAGES = ("torch", "transformers", "safetensors", "numpy", "pyarrow", "dvclive", "dvc", "tqdm")


def config_folder(root: str | Path, key: dict, write: bool = True) -> Path:
    """root/<hash of key>/ with key written to config.json (once; an existing one must match). Only one
    process writes (write=True); the others just compute the name."""
    folder = Path(root) / config_hash(key, 16)
    if not write:
        return folder
    path = folder / CONFIG
    if path.exists():
        if canonical_json(read_json(path)) != canonical_json(key):
            raise UserError(
                f"{path}: does not match its folder's hash (edited by hand?); delete {folder} to start over"
            )
    else:
        write_json(path, key)
    others = [p.name for p in Path(root).iterdir() if p.is_dir() and p != folder]
    if others:
        log.info("checkpoints of other configurations in %s (not used): %s", root, ", ".join(sorted(others)))
    return folder


def other_batch(root: str | Path, key: dict) -> list[tuple[Path, int]]:
    """(folder, its rows per step) of configurations equal to `key` except in rows_per_step that hold checkpoints."""
    root, want = Path(root), {k: v for k, v in key.items() if k != "rows_per_step"}
    found = []
    if not root.exists():
        return found
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        try:
            other = read_json(folder / CONFIG)
        except (OSError, ValueError):
            continue
        rows = other.pop("rows_per_step", None) if isinstance(other, dict) else None
        if rows != key.get("rows_per_step") and canonical_json(other) == canonical_json(want) and latest(folder):
            found.append((folder, int(rows)))
    return found


def refuse_other_batch(root: str | Path, key: dict, split: str) -> None:
    """UserError when `other_batch` finds this run under another global batch (called when this run's own folder
    holds no checkpoint): resuming there needs train.global_batch, starting afresh needs the folder moved."""
    found = other_batch(root, key)
    if found:
        folder, rows = found[0]
        raise UserError(
            f"{folder}: checkpoints of this run with {rows} rows per optimizer step; this run takes "
            f"{key['rows_per_step']} ({split}): set train.global_batch={rows} to resume it on this world size, "
            f"or move {folder} away to start afresh"
        )


def checkpoints(folder: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    folder = Path(folder)
    if not folder.exists():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and p.name.startswith(_PREFIX)]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX) :]))


def latest(folder: str | Path) -> Path | None:
    found = checkpoints(folder)
    return found[-1] if found else None


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, _, gauss = random.getstate()
    random.setstate((version, tuple(state["python"]), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(folder: str | Path, step: int, model_state: dict, state: dict, run_info: dict, keep: int) -> Path:
    """Write one checkpoint atomically (module docstring) and prune to the newest `keep`."""
    from safetensors.torch import save_file

    folder = Path(folder)
    final = folder / f"{_PREFIX}{step:08d}"
    tmp = folder / f".tmp-{final.name}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in model_state.items()}
    save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
    torch.save(state, tmp / STATE)
    write_json(tmp / RUN_INFO, run_info)
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if final.exists():  # the same step written again (a resumed run that stopped at the same place)
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in checkpoints(folder)[: -max(1, keep)]:
        shutil.rmtree(old)
    for stale in folder.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    return final


def load(path: str | Path, device: str | torch.device = "cpu") -> tuple[dict, dict]:
    """(model state dict, training state) of one checkpoint folder."""
    from safetensors.torch import load_file

    path = Path(path)
    weights = load_file(str(path / WEIGHTS), device=str(device))
    state = torch.load(path / STATE, map_location="cpu", weights_only=True)
    return weights, state


_HISTORY_FLOATS = ("loss", "grad_norm", "lr", "seconds", "weight")
_HISTORY_INTS = ("step", "epoch", "tokens", "docs_digest")


def pack_history(history: list[dict]) -> dict[str, torch.Tensor]:
    """Per-step metrics as a few tensors (compact, exact: float64 holds Python floats) for state.pt."""
    out = {k: torch.tensor([h[k] for h in history], dtype=torch.float64) for k in _HISTORY_FLOATS}
    out |= {k: torch.tensor([h.get(k, 0) for h in history], dtype=torch.long) for k in _HISTORY_INTS}
    for k in ("correct", "counted"):
        out[k] = torch.tensor([h[k] for h in history], dtype=torch.long).view(len(history), -1)
    return out


def unpack_history(packed: dict[str, torch.Tensor]) -> list[dict]:
    n = len(packed["step"])
    cols = {k: v.tolist() for k, v in packed.items()}
    return [{k: cols[k][i] for k in cols} for i in range(n)]


def get_history(checkpoint_dir: str | Path) -> list[dict]:
    """The per-step metrics saved in a checkpoint folder's latest checkpoint (tests, analysis)."""
    path = latest(checkpoint_dir)
    if path is None:
        return []
    return unpack_history(torch.load(Path(path) / STATE, weights_only=True)["history"])


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def run_info(params: dict, extra: dict | None = None) -> dict:
    """Provenance written beside each checkpoint and the export: what produced these weights."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    status = _git("status", "--porcelain")
    return {
        "git_sha": _git("rev-parse", "HEAD"),
        "git_dirty": bool(status) if status is not None else None,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": versions,
        "cuda": torch.version.cuda,
        "argv": list(sys.argv),
        "params": params,
        "code": code_fingerprint(),
        **(extra or {}),
    }


REPO = Path(__file__).resolve().parents[2]
CODE_PACKAGES = ("dflash", "stages")


def _file_hash(path: Path) -> str | None:
    try:
        return file_sha256(path)[:16]
    except OSError:
        return None


def code_fingerprint() -> dict[str, str]:
    """{path relative to the repository: sha256 (16 hex)} of every source file of this project's packages loaded in
    this process: the code that trained the weights a checkpoint holds."""
    files = {}
    for module in list(sys.modules.values()):
        name = getattr(module, "__file__", None)
        if not name or not name.endswith(".py"):
            continue
        path = Path(name).resolve()
        if path.is_relative_to(REPO) and path.relative_to(REPO).parts[0] in CODE_PACKAGES:
            digest = _file_hash(path)
            if digest:
                files[path.relative_to(REPO).as_posix()] = digest
    return dict(sorted(files.items()))


def code_changes(folder: str | Path) -> list[str]:
    """The source files that differ now (changed or gone) from the code that wrote checkpoint `folder`, as its
    run_info.json records it; [] when they are the same or the checkpoint predates the record."""
    path = Path(folder) / RUN_INFO
    written = read_json(path).get("code") if path.exists() else None
    return sorted(f for f, digest in (written or {}).items() if _file_hash(REPO / f) != digest)


def code_change_warning(folder: str | Path, changed: list[str], finished: bool) -> str:
    """What a run that resumed checkpoint `folder`, written by other code (`changed`: code_changes), tells the user."""
    files = ", ".join(changed[:6]) + (" ..." if len(changed) > 6 else "")
    if finished:
        then = (
            "This run trains no step: the drafter it exports holds the weights the earlier code trained. "
            f"To train with this code, delete {Path(folder).parent} (or change a train param) and run again."
        )
    else:
        then = "The rest of the run trains with this code."
    return f"{folder} was written by other code ({files} changed since). {then}"


def describe(state: dict[str, Any]) -> str:
    return f"step {state['step']} (epoch {state['epoch']}, step {state['epoch_step']} of it)"


__all__ = [
    "checkpoints",
    "code_change_warning",
    "code_changes",
    "code_fingerprint",
    "config_folder",
    "get_history",
    "latest",
    "load",
    "other_batch",
    "refuse_other_batch",
    "pack_history",
    "rng_state",
    "run_info",
    "save",
    "set_rng_state",
    "unpack_history",
]
