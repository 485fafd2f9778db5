"""Where the stages write, checked before any of them runs: outputs never overlap each other or an input.

A stage replaces its output folder as a whole (dflash.core.io.staged_folder): the new folder is built beside
the old one and swapped in at the end. That is safe only when no two stages share a folder, when no output
folder holds an input (the audit would read its own reports as conversations, tokenize would delete the
audit's conversations it is reading), and when no output folder holds the working tree or the params file.
`check_paths` refuses every such layout up front, naming both keys and the paths; `cli.run` calls it for
every stage, so a bad `-S tokenize.out=...` fails before any work (and without deleting anything).
"""

from __future__ import annotations

import glob
from pathlib import Path

from dflash.core.errors import ParamsError
from dflash.core.params import Params


def output_folders(p: Params) -> dict[str, str]:
    """Param key -> folder of every folder a stage replaces or owns (not the shared reports folder)."""
    return {
        "base.target_dir": p.base.target_dir,
        "audit.out": p.audit.out,
        "generate.out": p.generate.out,
        "generate.pilot_out": p.generate.pilot_out,
        "tokenize.out": p.tokenize.out,
        "train.out": p.train.out,
    }


def _input_root(spec: str) -> str:
    """A file, a folder or a glob -> the path that holds everything it can match."""
    if not glob.has_magic(spec):
        return spec
    parts = Path(spec).parts
    first_magic = next(i for i, part in enumerate(parts) if glob.has_magic(part))
    return str(Path(*parts[:first_magic])) if first_magic else "."


def _within(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def check_paths(p: Params, params_file: str | Path = "params.yaml") -> None:
    """ParamsError when an output folder equals or nests with another, holds or lies inside an input, or
    holds the working directory or the params file (all compared as absolute, resolved paths)."""
    for key, value in output_folders(p).items():
        if not str(value).strip():
            raise ParamsError(f"{key}: empty path; every stage needs its own output folder")
    outs = {key: Path(value).resolve() for key, value in output_folders(p).items()}
    here = Path.cwd().resolve()
    others = {
        "base.reports_dir": p.base.reports_dir,
        "train.live_dir": p.train.live_dir,
        "params file": str(params_file),
        "the working directory": str(here),
    }
    for key, path in outs.items():
        for other, value in others.items():
            if _within(Path(value).resolve(), path):
                raise ParamsError(
                    f"{key}={output_folders(p)[key]} holds {other} ({value}): the stage replaces that folder as a "
                    "whole; choose an output folder of its own"
                )
    keys = list(outs)
    for i, a in enumerate(keys):
        for b in keys[i + 1 :]:
            if _within(outs[a], outs[b]) or _within(outs[b], outs[a]):
                raise ParamsError(
                    f"{a}={output_folders(p)[a]} and {b}={output_folders(p)[b]} overlap: each stage replaces its "
                    "output folder as a whole, so one would delete the other's; give them separate folders"
                )
    source = Path(_input_root(p.audit.input)).resolve()
    for key, path in outs.items():
        if _within(source, path) or _within(path, source):
            raise ParamsError(
                f"audit.input={p.audit.input} and {key}={output_folders(p)[key]} overlap: an input must not lie "
                "inside an output folder (it would be replaced) nor hold one (the audit would read that stage's "
                "files as conversations); move one of them"
            )
