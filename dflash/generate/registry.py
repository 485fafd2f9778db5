"""The server registry: servers that come and go while the generate stage runs (`generate.server_registry`).

A folder on a filesystem every node sees holds one file per server, `<name>.url`, whose one line is the
server's base URL (`http://node7:8000/v1`). slurm/generate-servers.sbatch writes a task's file once its
server's /health answers and removes it when the task exits; anything else that keeps that contract works too
(a file is written whole: to a hidden temporary name, then renamed). The servers backend's dispatcher
(dflash/generate/servers_backend.py) reads the folder every POLL_S s for as long as the stage runs:

- a URL that appears is probed (/health, the model check, a one-token completion) and then served;
- a URL whose last file disappears is drained: it gets no new request, its in-flight requests finish there,
  and one that fails there moves to the other servers uncharged (never a failed turn);
- a file whose content is not an http(s) base URL is refused with one warning line naming the file (again only
  when its content changes); files not ending in `.url` are ignored (the writers' temporaries).

The servers' side of the contract (the server command, the file, the trap that withdraws it) is
slurm/generate-servers.sbatch with dflash/generate/serve_command.py.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from dflash.core.errors import ParamsError
from dflash.core.validate import check_server_url

log = logging.getLogger(__name__)

POLL_S = 2.0  # seconds between two reads of the registry folder
SUFFIX = ".url"


@dataclass
class ServerRegistry:
    """The registry folder and what was refused in it; `poll()` -> the URLs it lists now (or None: not due)."""

    folder: Path
    poll_s: float = POLL_S
    refused: dict[str, str] = field(default_factory=dict)  # file name -> the content refused (warned once)
    missing_warned: bool = False
    next_read: float = 0.0

    def read(self) -> dict[str, str]:
        """The valid URLs listed now: {base URL: the first file (by name) that holds it}."""
        if not self.folder.is_dir():
            if not self.missing_warned:
                log.warning("generate.server_registry: %s is not a folder (yet); waiting for servers", self.folder)
                self.missing_warned = True
            return {}
        urls: dict[str, str] = {}
        for path in sorted(self.folder.glob(f"*{SUFFIX}")):
            try:
                text = path.read_text(encoding="utf-8", errors="replace").strip()
            except OSError:  # withdrawn between the listing and the read
                continue
            url = text.rstrip("/")
            try:
                check_server_url(url, f"generate.server_registry: {path}")
            except ParamsError as exc:
                if self.refused.get(path.name) != text:
                    log.warning("%s; refused", exc)
                    self.refused[path.name] = text
                continue
            self.refused.pop(path.name, None)
            urls.setdefault(url, path.name)
        return urls

    def poll(self, now: float | None = None) -> dict[str, str] | None:
        """read() when POLL_S s have passed since the last read, else None."""
        now = time.monotonic() if now is None else now
        if now < self.next_read:
            return None
        self.next_read = now + self.poll_s
        return self.read()


@dataclass(frozen=True)
class RegistryChange:
    """What a read of the registry changes for the dispatcher."""

    joined: dict[str, str]  # URL -> file: listed now, never served in this run
    returned: list[str]  # listed again after being withdrawn (a requeued task on the same host and port)
    withdrawn: list[str]  # served or joining, no longer listed


def changes(listed: dict[str, str], active: set[str], withdrawn: set[str]) -> RegistryChange:
    """`listed`: the registry now (read()); `active`: the URLs served or joining; `withdrawn`: the ones left."""
    return RegistryChange(
        joined={u: f for u, f in listed.items() if u not in active and u not in withdrawn},
        returned=sorted(u for u in listed if u in withdrawn),
        withdrawn=sorted(active - set(listed)),
    )
