"""`audit.input: hf:DATASET_ID`: one split of a hub dataset, read through the `datasets` library's cache.

Inputs: the dataset id, `audit.hf_split`, `audit.hf_revision` (a commit, so that the data cannot move under
the DVC stage) and `audit.hf_columns` (RAW field -> the dataset's column, where they are named otherwise).
`datasets.load_dataset(ID, split=S, revision=R)` downloads the split and converts it into Arrow files in its
cache (`HF_DATASETS_CACHE`, by default ~/.cache/huggingface/datasets) the first time; every later run, and
every run with `HF_DATASETS_OFFLINE=1` or `HF_HUB_OFFLINE=1`, reads that cache without the network.
Output: HubSplit: the split's cached Arrow files in row order and its row count, which
dflash/audit/tables.py reads batch by batch, memory-mapped (1M rows never sit in memory at once). A row is
named `hf:ID split S row N`: `load_dataset(ID, split=S, revision=R)[N]`.

Offline, `datasets` falls back to the latest cached version of a dataset whatever revision is asked for: the
cache folder read is checked against the pinned commit, and another one is an error saying which it holds.
Errors a user can fix are one-line UserErrors naming the id and the param: neither network nor cache, no such
dataset (or no access), no such revision, no such split, several configurations, a cache `datasets` cannot
read (damaged files: the folder to delete), `datasets` not installed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from dflash.core.errors import ParamsError, UserError

PREFIX = "hf:"
COMMIT = re.compile(r"[0-9a-f]{40}")
DATASET_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")
SPLIT = re.compile(r"\w+(\.\w+)*")  # what `datasets` names a split; slices like train[:10%] are refused
HUB_FIELDS = ("messages", "conversations", "system", "tools")  # what audit.hf_columns may rename


def is_hub(spec: str) -> bool:
    return spec.startswith(PREFIX)


@dataclass(frozen=True)
class HubSpec:
    """One split of a hub dataset at one revision, and the columns holding each RAW field."""

    dataset: str
    split: str = "train"
    revision: str = ""
    columns: dict[str, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """What row references and `source_file` name: `hf:ID split S`."""
        return f"{PREFIX}{self.dataset} split {self.split}"

    @classmethod
    def from_params(cls, p) -> HubSpec:
        """From AuditParams whose input is `hf:ID`."""
        return cls(p.input[len(PREFIX) :], p.hf_split, p.hf_revision, dict(p.hf_columns))


def check_hub_params(p) -> None:
    """ParamsError naming the key for hub params that cannot load a pinned split (only when input is hf:)."""
    if not is_hub(p.input):
        return
    dataset = p.input[len(PREFIX) :]
    if not DATASET_ID.fullmatch(dataset):
        raise ParamsError(f"audit.input={p.input!r}: expected hf:OWNER/NAME (or hf:NAME), the hub dataset id")
    if not COMMIT.fullmatch(p.hf_revision):
        raise ParamsError(
            f"audit.hf_revision={p.hf_revision!r}: {p.input} needs a pinned commit (40 hex characters) so that the "
            'audit reads the same rows every time; find the current one with `python -c "import huggingface_hub; '
            f"print(huggingface_hub.dataset_info('{dataset}').sha)\"` or on the dataset page's commit history"
        )
    if not SPLIT.fullmatch(p.hf_split):
        raise ParamsError(
            f"audit.hf_split={p.hf_split!r}: expected a split name such as train (slices like train[:10%] are not "
            "read: the audit reads whole splits)"
        )
    unknown = sorted(set(p.hf_columns) - set(HUB_FIELDS))
    if unknown:
        raise ParamsError(
            f"audit.hf_columns.{unknown[0]}: unknown field; the keys are {', '.join(HUB_FIELDS)} and each value is "
            "the dataset's column holding it"
        )
    for key, column in p.hf_columns.items():
        if not column:
            raise ParamsError(f"audit.hf_columns.{key}: expected the name of a column, got ''")
    if len(set(p.hf_columns.values())) != len(p.hf_columns):
        raise ParamsError(f"audit.hf_columns={dict(p.hf_columns)}: one column cannot hold two fields")


@dataclass(frozen=True)
class HubSplit:
    label: str  # `hf:ID split S`
    files: tuple[Path, ...]  # the cached Arrow files of the split, in row order
    num_rows: int
    revision: str  # the commit the cache folder holds
    cache: str  # that folder


_LOADED: dict[tuple[str, str, str], HubSplit] = {}  # one load per process (the token sample counts rows first)


def load_split(hub: HubSpec) -> HubSplit:
    """The cached Arrow files of the split (downloaded and converted first when not cached and online)."""
    key = (hub.dataset, hub.split, hub.revision)
    if key not in _LOADED:
        _LOADED[key] = _load(hub)
    return _LOADED[key]


def _load(hub: HubSpec) -> HubSplit:
    where = f"audit.input={PREFIX}{hub.dataset}"
    try:
        import datasets
    except ImportError:
        raise UserError(
            f"{where}: the `datasets` package is not installed (requirements/cpu.txt pins it; `make setup`)"
        ) from None
    try:
        ds = datasets.load_dataset(hub.dataset, split=hub.split, revision=hub.revision or None)
    except Exception as exc:  # the library's errors for what the user can fix; anything else is re-raised
        error = _user_error(hub, exc, where, datasets.config.HF_DATASETS_CACHE)
        if error is None:
            raise
        raise error from None
    files = tuple(Path(f["filename"]) for f in ds.cache_files)
    if not files:  # load_dataset always caches a hub split; an in-memory one would mean another code path
        raise RuntimeError(f"{hub.label}: `datasets` returned no cache files")
    folder = files[0].parent
    cached = folder.name
    if COMMIT.fullmatch(hub.revision) and cached != hub.revision:
        raise UserError(
            f"{where}: the datasets cache holds revision {cached} ({folder}), not the pinned "
            f"audit.hf_revision={hub.revision} (offline, `datasets` reads the latest cached version); run once with "
            f"network to cache the pinned commit, or set audit.hf_revision={cached} if those are the rows you mean"
        )
    return HubSplit(hub.label, files, ds.num_rows, cached, str(folder))


def _user_error(hub: HubSpec, exc: Exception, where: str, cache: object) -> UserError | None:
    """The UserError for a load_dataset failure a user can fix, or None (a bug: keep the traceback)."""
    text = " ".join(str(exc).split())
    name = type(exc).__name__
    if isinstance(exc, ConnectionError) or (isinstance(exc, ValueError) and "Couldn't find cache for" in text):
        return UserError(
            f"{where}: not in the datasets cache ({cache}) and the hub cannot be reached ({text}); run once with "
            "network to download it, point HF_HOME / HF_DATASETS_CACHE at a cache that holds it, or save it "
            "elsewhere with save_to_disk and set audit.input to that folder"
        )
    if name == "DatasetNotFoundError":
        if "Revision" in text:
            return UserError(
                f"{where}: no revision {hub.revision!r} on the hub ({text}); set audit.hf_revision to a commit of "
                f"the dataset (its page's commit history lists them)"
            )
        return UserError(
            f"{where}: no such dataset on the hub, or no access to it ({text}); check the id, and for a private or "
            "gated dataset log in (`hf auth login` or HF_TOKEN)"
        )
    if isinstance(exc, ValueError) and text.startswith("Unknown split"):
        return UserError(f"audit.hf_split={hub.split!r}: {text} ({hub.label[len(PREFIX) :]})")
    if isinstance(exc, ValueError) and "Config name is missing" in text:
        return UserError(
            f"{where}: the dataset has several configurations ({text}); the audit reads a dataset's default "
            "configuration only: save the one you want with save_to_disk and set audit.input to that folder"
        )
    if isinstance(exc, (OSError, ValueError)):  # pyarrow's errors are these too: the cached files cannot be read
        owner, _, short = hub.dataset.rpartition("/")
        folder = Path(str(cache)) / (f"{owner}___{short}" if owner else short)
        return UserError(
            f"{where}: `datasets` cannot read it ({name}: {text[:300]}); if its cache is damaged, delete {folder} "
            "(its name in lower case) and run again with network"
        )
    return None
