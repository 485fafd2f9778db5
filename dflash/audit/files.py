"""Which files are audit inputs, by their names, for dflash/audit/readers.py (how each is read, from its bytes:
dflash/audit/forms.py).

Input: `audit.input`, a file, a folder or a glob (a hub dataset, `hf:ID`, is dflash/audit/hub.py's). A
folder contributes every file below it whose name ends (case-insensitively) in `.jsonl`, `.ndjson`, `.json`,
`.parquet` or `.arrow`, the text formats also with `.gz` or `.zst` after it, and every `datasets` folder:
- a `save_to_disk` folder (a `state.json`, whose `_data_files` names its Arrow files, beside a
  `dataset_info.json`; a DatasetDict holds one per split below its `dataset_dict.json`) is ONE input, read
  through the Arrow files state.json lists, in that order; nothing else in it is read;
- `dataset_info.json`, `state.json` and `dataset_dict.json` beside Arrow files (a `datasets` cache folder) or
  at a DatasetDict's root are metadata: never rows, never listed as skipped.
Every other file in the folder is returned as skipped (the report lists them). A file named explicitly, or
matched by a glob, is read whatever its name; a glob may also match save_to_disk folders.
Output: paths (files, and save_to_disk folders) and the `kind` a path's name declares (`jsonl`, `json`,
`parquet`, `arrow`; records.row_ref says what a row number means for each); forms.sniff reads the bytes and
decides. A broken state.json is a UserError naming the file; nothing here reads rows.
"""

from __future__ import annotations

import glob
import json
from pathlib import Path

from dflash.core.errors import UserError

SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
COMPRESSED = (".gz", ".zst")  # text formats only (parquet and Arrow compress their own buffers)
BINARY = ("parquet", "arrow")
SAVED_STATE = "state.json"  # save_to_disk's: which Arrow files hold the rows, in order
DATASET_INFO = "dataset_info.json"  # features, splits... (save_to_disk folders and the datasets cache)
METADATA = (DATASET_INFO, SAVED_STATE, "dataset_dict.json")  # `datasets` metadata, never rows


def input_kind(path: Path) -> str | None:
    """The format a folder file's name declares (case-insensitive), `arrow` for a save_to_disk folder, or
    None when it is not an input."""
    if path.is_dir():
        return "arrow" if is_saved_dataset(path) else None
    name = path.name.lower()
    compressed = name.endswith(COMPRESSED)
    if compressed:
        name = name[: name.rfind(".")]
    kind = next((k for s, k in SUFFIXES.items() if name.endswith(s)), None)
    return None if kind in BINARY and compressed else kind


def is_saved_dataset(folder: Path) -> bool:
    """A save_to_disk folder: its state.json beside its dataset_info.json."""
    return (folder / SAVED_STATE).is_file() and (folder / DATASET_INFO).is_file()


def saved_files(folder: Path) -> list[Path]:
    """The Arrow files of a save_to_disk folder, in row order (its state.json's `_data_files`)."""
    state = folder / SAVED_STATE
    try:
        data = json.loads(state.read_text(encoding="utf-8"))
        names = [entry["filename"] for entry in data["_data_files"]]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise UserError(
            f"{state}: not a `datasets` save_to_disk state (`_data_files` unreadable: {type(exc).__name__}: {exc}); "
            "re-save the dataset with `save_to_disk`"
        ) from None
    if data.get("_indices_data_files"):
        raise UserError(
            f"{state}: the dataset was saved with an indices mapping (older `datasets`); re-save it flat: "
            f"`datasets.load_from_disk('{folder}').flatten_indices().save_to_disk(NEW_FOLDER)`"
        )
    files = [folder / name for name in names]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise UserError(f"{state}: lists {len(missing)} Arrow files that are not there: {', '.join(missing[:3])}")
    return files


def _is_metadata(path: Path) -> bool:
    """`datasets` metadata: the JSON files beside Arrow files (a cache folder) or at a DatasetDict's root."""
    name = path.name.lower()
    if name not in METADATA:
        return False
    return name == "dataset_dict.json" or any(p.suffix.lower() == ".arrow" for p in path.parent.iterdir())


def scan_inputs(spec: str) -> tuple[list[Path], list[Path]]:
    """(inputs: files and save_to_disk folders, folder files skipped because they are not inputs), sorted."""
    path = Path(spec)
    if path.is_file():
        return [path], []
    if path.is_dir():
        saved = sorted({p.parent for p in path.rglob(SAVED_STATE) if is_saved_dataset(p.parent)})
        found = sorted(p for p in path.rglob("*") if p.is_file() and not any(d in p.parents for d in saved))
        files = [p for p in found if input_kind(p) and not _is_metadata(p)]
        skipped = [p for p in found if not input_kind(p) and not _is_metadata(p)]
        return sorted(files + saved), skipped
    matched = [Path(p) for p in glob.glob(spec, recursive=True)]
    return sorted(p for p in matched if p.is_file() or input_kind(p)), []


def resolve_inputs(spec: str) -> list[Path]:
    """A file, a folder (every input below it, sorted) or a glob -> inputs; UserError when none."""
    files, skipped = scan_inputs(spec)
    if not files:
        names = ", ".join(str(p) for p in skipped[:5]) + (f" and {len(skipped) - 5} more" if len(skipped) > 5 else "")
        seen = f"; skipped {len(skipped)} other files: {names}" if skipped else ""
        raise UserError(
            f"audit.input={spec!r}: no .json / .jsonl / .parquet files found, nor .arrow files or save_to_disk "
            f"folders (also read: .ndjson, any case, the text formats with .gz or .zst after them, and hf:DATASET_ID){seen}"
        )
    return files
