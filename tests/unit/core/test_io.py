"""dflash/core/io.py: atomic writes land whole, with the mode a plain write gives, and leave no temp file."""

from __future__ import annotations

import os

from dflash.core.io import atomic_write, read_json, write_json


def test_atomic_writes_get_the_umask_mode_not_mkstemps_private_one(tmp_path):
    old = os.umask(0o022)
    try:
        atomic_write(tmp_path / "a.txt", "x")
        write_json(tmp_path / "b.json", {"k": 1})
        os.umask(0o077)  # a stricter umask is honoured too
        atomic_write(tmp_path / "c.txt", b"y")
    finally:
        os.umask(old)
    assert (tmp_path / "a.txt").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "b.json").stat().st_mode & 0o777 == 0o644 and read_json(tmp_path / "b.json") == {"k": 1}
    assert (tmp_path / "c.txt").stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.json", "c.txt"]  # no .tmp left
