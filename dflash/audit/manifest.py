"""The identity of `audit.input` as one small JSON file, so that DVC can tell when the audit must rerun.

DVC hashes only paths it is given; `audit.input` may also be a glob or `hf:DATASET_ID`, which no `deps:` entry
can name (and dvc.yaml's templating has no conditionals). So the `audit_input` stage (stages/audit_input.py,
`always_changed`: it runs on every `dvc repro`) writes this manifest, the audit stage depends on the manifest
instead of on the input, and DVC reruns the audit exactly when the manifest's bytes change.

Input: AuditParams. Output (`input_manifest`), written with sorted keys:
- a file, a folder or a glob: `files`, every file the audit reads (the files of a save_to_disk folder included)
  and every file of a folder it skips (the report lists those), sorted, each with its size and sha256; the
  paths as the input spells them (relative stays relative, so a clone elsewhere writes the same bytes);
- `hf:ID`: the dataset id, `audit.hf_split`, the pinned `audit.hf_revision` and `audit.hf_columns`. The pinned
  commit fixes the rows; the bytes of the cached Arrow files are not recorded: they depend on the machine (a
  clone that pulls the audit's outputs has no cache, and another `datasets` / pyarrow writes other bytes for the
  same rows), and recording them would rerun the audit, and download the dataset, where nothing changed.
Nothing here reads rows: what the audit does with the files is dflash/audit/run.py's.

Hashing a large input on every `dvc repro` would cost seconds per GB, so a file's sha256 is cached keyed by its
resolved path, size, mtime_ns and inode (DVC's own rule for skipping a rehash), in `HashCache.default()`
(`$XDG_CACHE_HOME/dflash/input-hashes.json`, else ~/.cache/...): a file rewritten in place changes its mtime and
is hashed again; a cache that cannot be read or written only costs the hashing.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from dflash.audit.files import resolve_inputs, scan_inputs
from dflash.audit.hub import PREFIX, HubSpec, check_hub_params, is_hub
from dflash.core.io import atomic_write, file_sha256

log = logging.getLogger(__name__)

CACHE_NAME = "input-hashes.json"


@dataclass
class HashCache:
    """sha256 of files by (resolved path -> [size, mtime_ns, inode, sha256]), loaded from and saved to `path`."""

    path: Path
    entries: dict[str, list] = field(default_factory=dict)
    hashed: int = 0  # files hashed (not found in the cache) since loading: what the tests and the log count

    @classmethod
    def default(cls) -> HashCache:
        root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        return cls.load(Path(root) / "dflash" / CACHE_NAME)

    @classmethod
    def load(cls, path: Path) -> HashCache:
        try:
            entries = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(entries, dict):
                entries = {}
        except (OSError, ValueError):  # absent or damaged: start over (it only saves time)
            entries = {}
        return cls(path, entries)

    def sha256(self, path: Path) -> str:
        st = path.stat()
        key, stamp = str(path.resolve()), [st.st_size, st.st_mtime_ns, st.st_ino]
        entry = self.entries.get(key)
        if isinstance(entry, list) and len(entry) == 4 and entry[:3] == stamp:
            return entry[3]
        digest = file_sha256(path)
        self.entries[key] = [*stamp, digest]
        self.hashed += 1
        return digest

    def save(self) -> None:
        """Write the entries of files that still exist (so the cache does not grow with deleted inputs)."""
        kept = {k: v for k, v in self.entries.items() if os.path.exists(k)}
        try:
            atomic_write(self.path, json.dumps(kept, sort_keys=True))
        except OSError as exc:  # a read-only home: the next run hashes again, nothing else changes
            log.warning("input hash cache %s not written (%s); inputs are hashed again next time", self.path, exc)


def input_files(spec: str) -> list[Path]:
    """Every file whose bytes shape the audit of a file / folder / glob input, sorted; UserError when the
    input matches nothing the audit reads (the audit's own message)."""
    inputs, skipped = scan_inputs(spec)
    if not inputs:
        resolve_inputs(spec)  # raises, naming the input and what was skipped
    files = set(skipped)
    for path in inputs:
        if path.is_dir():  # a save_to_disk folder: its Arrow files and state.json decide the rows
            files.update(f for f in path.rglob("*") if f.is_file())
        else:
            files.add(path)
    return sorted(files)


def input_manifest(p, cache: HashCache) -> dict:
    """The manifest of `p.audit`'s input (see the module docstring); `p` is AuditParams."""
    if is_hub(p.input):
        check_hub_params(p)
        hub = HubSpec.from_params(p)
        return {
            "input": p.input,
            "dataset": hub.dataset,
            "split": hub.split,
            "revision": hub.revision,
            "columns": dict(sorted(hub.columns.items())),
        }
    files = [{"path": str(f), "size": f.stat().st_size, "sha256": cache.sha256(f)} for f in input_files(p.input)]
    return {"input": p.input, "files": files}


def describe(manifest: dict) -> str:
    """One line for the log: what the manifest pins."""
    if manifest["input"].startswith(PREFIX):
        return f"{manifest['input']} split {manifest['split']} revision {manifest['revision']}"
    size = sum(f["size"] for f in manifest["files"])
    return f"{manifest['input']}: {len(manifest['files'])} files, {size:,} bytes"
