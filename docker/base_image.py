"""The GPU image's base: check that docker/Dockerfile's FROM line is the pinned reference, or re-pin it.

The pin lives in docker/base-image.digest (comment lines + one `repo:tag@sha256:<64 hex>` line) so
that the digest is data, reviewed in git, and the Dockerfile cannot drift from it unnoticed.

Commands (standard library only: runs on any host, before any environment is set up):
    python3 docker/base_image.py check          # exit 1 unless FROM == the pin (make image, make lint)
    python3 docker/base_image.py tag            # print the pinned repo:tag
    python3 docker/base_image.py pin [REPO:TAG] # docker pull + docker inspect RepoDigests -> rewrite the pin
                                                # file and the FROM line (make image-pin; needs Docker)
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PIN_FILE = HERE / "base-image.digest"
DOCKERFILE = HERE / "Dockerfile"
REF = re.compile(
    r"^(?P<repo>[a-z0-9]+(?:[._/-][a-z0-9]+)*):(?P<tag>[A-Za-z0-9_][A-Za-z0-9._-]{0,127})@(?P<digest>sha256:[0-9a-f]{64})$"
)
FROM = re.compile(r"^FROM\s+(?P<ref>\S+)(?:\s+AS\s+\S+)?\s*$", re.IGNORECASE | re.MULTILINE)


class PinError(ValueError):
    """The pin file, the Dockerfile or Docker's answer is not what it must be. The message says why."""


def read_pin(path: Path = PIN_FILE) -> str:
    lines = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines()]
    refs = [ln for ln in lines if ln and not ln.startswith("#")]
    if len(refs) != 1:
        raise PinError(f"{path}: expected exactly one non-comment line (repo:tag@sha256:digest), found {len(refs)}")
    if not REF.match(refs[0]):
        raise PinError(f"{path}: {refs[0]!r} is not repo:tag@sha256:<64 hex digits>")
    return refs[0]


def from_refs(path: Path = DOCKERFILE) -> list[str]:
    return [m.group("ref") for m in FROM.finditer(path.read_text(encoding="utf-8"))]


def check(pin_file: Path = PIN_FILE, dockerfile: Path = DOCKERFILE) -> str:
    """Return the pinned reference when the Dockerfile's (single) FROM equals it; raise PinError otherwise."""
    pin = read_pin(pin_file)
    refs = from_refs(dockerfile)
    if len(refs) != 1:
        raise PinError(f"{dockerfile}: expected exactly one FROM line, found {len(refs)}")
    if refs[0] != pin:
        raise PinError(
            f"{dockerfile}: FROM {refs[0]} does not match the pin in {pin_file.name}: {pin}\n"
            "Edit one to match the other, or re-pin on a host with Docker: make image-pin"
        )
    return pin


def pinned_tag(pin_file: Path = PIN_FILE) -> str:
    return read_pin(pin_file).split("@", 1)[0]


def docker_digest(tag_ref: str) -> str:
    """`docker pull` the tag, then its registry digest from `docker inspect` (RepoDigests)."""
    repo = tag_ref.rsplit(":", 1)[0]
    subprocess.run(["docker", "pull", tag_ref], check=True)
    out = subprocess.run(
        ["docker", "inspect", "--format", "{{json .RepoDigests}}", tag_ref], check=True, capture_output=True, text=True
    ).stdout
    # RepoDigests holds one `repo@sha256:...` per registry name the image was pulled as; take this repo's.
    digests = [d.split("@", 1)[1] for d in json.loads(out) if d.split("@", 1)[0] in (repo, f"docker.io/{repo}")]
    if not digests:
        raise PinError(f"docker inspect {tag_ref}: no RepoDigests entry for {repo} (got {out.strip()})")
    return digests[0]


def write_pin(reference: str, pin_file: Path = PIN_FILE, dockerfile: Path = DOCKERFILE) -> None:
    if not REF.match(reference):
        raise PinError(f"{reference!r} is not repo:tag@sha256:<64 hex digits>")
    stamp = time.strftime("%Y-%m-%d", time.gmtime())  # (datetime.UTC needs Python 3.11; hosts may be older)
    pin_file.write_text(
        "# The GPU image's base, pinned by tag AND digest; docker/Dockerfile's FROM line must equal the line below.\n"
        f"# Written by `make image-pin` on {stamp}: docker pull + docker inspect RepoDigests of the tag.\n"
        f"{reference}\n",
        encoding="utf-8",
    )
    text = dockerfile.read_text(encoding="utf-8")
    new_text, count = FROM.subn(lambda m: m.group(0).replace(m.group("ref"), reference), text)
    if count != 1:
        raise PinError(f"{dockerfile}: expected exactly one FROM line, found {count}")
    dockerfile.write_text(new_text, encoding="utf-8")


def main(argv: list[str]) -> int:
    command = argv[0] if argv else "check"
    try:
        if command == "check":
            print(f"base image ok: {check()}")
        elif command == "tag":
            print(pinned_tag())
        elif command == "pin":
            tag_ref = argv[1] if len(argv) > 1 else pinned_tag()
            if "@" in tag_ref or ":" not in tag_ref.rsplit("/", 1)[-1]:
                raise PinError(f"pin: give repo:tag (e.g. vllm/vllm-openai:v0.31.0), got {tag_ref!r}")
            reference = f"{tag_ref}@{docker_digest(tag_ref)}"
            write_pin(reference)
            print(f"pinned {reference} in {PIN_FILE.name} and the Dockerfile's FROM line")
        else:
            print(__doc__, file=sys.stderr)
            return 2
    except (PinError, FileNotFoundError, subprocess.CalledProcessError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
