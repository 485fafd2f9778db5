"""Command-line plumbing shared by every `stages/*.py` entry point.

Each stage accepts `--params FILE` (default `params.yaml`), `--overlay FILE` (a second params file
deep-merged on top, e.g. the GPU profile) and repeated `-S section.key=value` overrides, the spelling
that `dvc exp run -S` uses. A `UserError` (bad params, bad input, a crossed gate: dflash.core.errors)
prints one clear message and exits non-zero without a traceback; any other exception is a bug and
keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

from dflash.core.errors import UserError
from dflash.core.loader import load_params
from dflash.core.params import Params
from dflash.core.paths import check_paths


def parse_stage_args(
    description: str,
    argv: list[str] | None = None,
    add_args: Callable[[argparse.ArgumentParser], None] | None = None,
) -> tuple[Params, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    parser.add_argument(
        "--overlay",
        action="append",
        default=[],
        metavar="FILE",
        help="second params file merged on top (repeatable), e.g. params/gpu-qwen3.6-27b.yaml",
    )
    parser.add_argument(
        "-S",
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one param (repeatable), as in `dvc exp run -S`",
    )
    if add_args is not None:
        add_args(parser)
    args = parser.parse_args(argv)
    params = load_params(args.params, args.overrides, args.overlay)
    check_paths(params, args.params)  # before any work: outputs that overlap each other or an input
    return params, args


def run(
    main: Callable[..., object],
    description: str,
    argv: list[str] | None = None,
    add_args: Callable[[argparse.ArgumentParser], None] | None = None,
    *,
    with_args: bool = False,
) -> None:
    """Parse args, run `main(params)` (or `main(params, args)` when the stage adds its own flags via
    `add_args`, or asks for the parsed arguments with `with_args`: the params file's path), and turn a UserError
    into its message and exit code."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        params, args = parse_stage_args(description, argv, add_args)
        if add_args is None and not with_args:
            main(params)
        else:
            main(params, args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
