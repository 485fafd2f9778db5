"""Write a params overlay INTO params.yaml, for `dvc repro` (which reads params.yaml and nothing else).

The stages accept `--overlay FILE` for one-off runs, but DVC decides what to rerun from the values in
params.yaml and records them in dvc.lock, so a real-scale run must have its values there. This module
deep-merges an overlay (e.g. params/gpu-qwen3.6-27b.yaml) onto params.yaml with the same rules as
`--overlay` (`dflash.core.loader.merge_overlay`: sections merge key by key, lists and free-form mappings are
replaced whole, unknown keys are errors), checks the result strictly, and rewrites params.yaml in place
keeping its layout and every comment: only the values that change are touched. Applying the same overlay
twice changes nothing.

Both readings are DVC's (dflash/core/yamlio.py: YAML 1.2 core schema, duplicate keys refused), and the
rewrite is ruamel's round trip, so what DVC records is what the stages read. Values are written in
params.yaml's style: strings double-quoted (so that no reader, not even a YAML 1.1 one, turns `yes` or
`1e3` into something else), floats with a dot and a signed exponent (`1.0e-06`), lists and mappings in
flow style. The rewritten file is read back with the one reading and must equal the merge.

Command: python -m dflash.core.overlay params/gpu-qwen3.6-27b.yaml [--params params.yaml] [--check]
         (`make repro-gpu` runs it inside the container right before `dvc repro`; --check only reports)
"""

from __future__ import annotations

import argparse
import io
import json
import math
import sys
from pathlib import Path
from typing import Any

from dflash.core.errors import ParamsError
from dflash.core.io import atomic_write
from dflash.core.loader import from_dict, merge_overlay, read_yaml
from dflash.core.yamlio import load_yaml_text, read_text


def _yaml():
    # ruamel.yaml ships with DVC (its own YAML library), so it is present wherever dvc is.
    from ruamel.yaml import YAML

    y = YAML()  # round-trip mode: keeps comments, key order, quoting and flow styles of untouched values
    y.preserve_quotes = True
    y.width = 1 << 16  # never fold a long line (params.yaml has a long flow list)
    y.representer.add_representer(float, _represent_float)
    return y


def _represent_float(representer, value: float):
    if math.isnan(value):
        text = ".nan"
    elif math.isinf(value):
        text = ".inf" if value > 0 else "-.inf"
    else:
        text = repr(value)  # shortest text that reads back to the same float, e.g. "1e-06", "10000000.0"
        mantissa, e, exponent = text.partition("e")
        if e and "." not in mantissa:
            text = f"{mantissa}.0e{exponent}"  # params.yaml's style (YAML 1.1 tools read "1e-06" as a string)
    return representer.represent_scalar("tag:yaml.org,2002:float", text)


def _node(value: Any) -> Any:
    """A plain Python value as a ruamel node in params.yaml's style (quoted strings, flow collections)."""
    from ruamel.yaml.comments import CommentedMap, CommentedSeq
    from ruamel.yaml.scalarstring import DoubleQuotedScalarString

    if isinstance(value, str):
        return DoubleQuotedScalarString(value)
    if isinstance(value, list):
        seq = CommentedSeq(_node(v) for v in value)
        seq.fa.set_flow_style()
        return seq
    if isinstance(value, dict):
        mapping = CommentedMap((k, _node(v)) for k, v in value.items())
        mapping.fa.set_flow_style()
        return mapping
    return value  # bool, int, float (floats go through _represent_float)


def _same(old: Any, new: Any) -> bool:
    """Equal values of the same kind (True == 1 in Python; not here)."""
    if isinstance(old, bool) or isinstance(new, bool):
        return isinstance(old, bool) and isinstance(new, bool) and old == new
    if isinstance(old, dict) and isinstance(new, dict):
        return old.keys() == new.keys() and all(_same(old[k], new[k]) for k in old)
    if isinstance(old, list) and isinstance(new, list):
        return len(old) == len(new) and all(_same(a, b) for a, b in zip(old, new, strict=True))
    if isinstance(old, (dict, list)) or isinstance(new, (dict, list)):
        return False
    return old == new and isinstance(old, str) == isinstance(new, str)


def _is_block_mapping(node: Any) -> bool:
    from ruamel.yaml.comments import CommentedMap

    return isinstance(node, CommentedMap) and not node.fa.flow_style()


def _update(doc: Any, merged: dict, path: str, changes: list[str]) -> None:
    """Make the ruamel mapping `doc` equal `merged`, touching only the values that differ. Block
    mappings (params sections) are updated key by key so that their comments stay; anything else
    (scalars, flow lists, flow mappings) is replaced whole, keeping the key's end-of-line comment."""
    for key in [k for k in doc if k not in merged]:
        del doc[key]
        changes.append(f"{path}{key}: removed")
    for key, value in merged.items():
        here = f"{path}{key}"
        if key in doc and _is_block_mapping(doc[key]) and isinstance(value, dict):
            _update(doc[key], value, f"{here}.", changes)
        elif key not in doc or not _same(doc[key], value):
            old = "(absent)" if key not in doc else _short(doc[key])
            doc[key] = _node(value)
            changes.append(f"{here}: {old} -> {_short(value)}")


def _short(value: Any) -> str:
    text = json.dumps(_plain(value), ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):
        return str(value)
    return value


def apply_overlay_text(
    params_text: str, overlay: dict, source: str = "overlay", params_source: str = "params.yaml"
) -> tuple[str, list[str]]:
    """params.yaml text + overlay mapping -> (new params.yaml text, list of "key: old -> new")."""
    base = load_yaml_text(params_text, params_source) or {}
    if not isinstance(base, dict):
        raise ParamsError(f"{params_source}: top level must be a mapping of sections")
    origins: dict = {(): params_source}
    merged = merge_overlay(base, overlay, source, origins)
    from_dict(merged, params_source, origins)  # strict schema check of the result before writing

    y = _yaml()
    doc = y.load(params_text)
    changes: list[str] = []
    _update(doc, merged, "", changes)
    out = io.StringIO()
    y.dump(doc, out)
    text = out.getvalue()

    # Internal invariant: the one reading (DVC's, the stages') reads back exactly the merge.
    assert _same(load_yaml_text(text, params_source), merged), "overlay: the rewritten params read back differently"
    return text, changes


def apply_overlay(params_path: str | Path, overlay_path: str | Path, check: bool = False) -> list[str]:
    """Merge `overlay_path` into the file `params_path` in place (unless `check`); return the changes."""
    params_path = Path(params_path)
    overlay = read_yaml(overlay_path, "overlay file")
    text = read_text(params_path)
    new_text, changes = apply_overlay_text(text, overlay, str(overlay_path), str(params_path))
    if changes and not check:
        atomic_write(params_path, new_text)
    return changes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overlay", help="overlay params file, e.g. params/gpu-qwen3.6-27b.yaml")
    parser.add_argument("--params", default="params.yaml", help="params file rewritten in place (default params.yaml)")
    parser.add_argument("--check", action="store_true", help="only print what would change")
    args = parser.parse_args(argv)
    try:
        changes = apply_overlay(args.params, args.overlay, check=args.check)
    except ParamsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    verb = "would change" if args.check else "changed"
    print(f"{args.params}: {len(changes)} value(s) {verb} by {args.overlay}")
    for line in changes:
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
