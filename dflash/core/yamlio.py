"""The ONE YAML reading of the pipeline: DVC's. Every params-like file (params.yaml, overlays,
params/hardware.yaml) and every tool or test that reads or writes one goes through here.

Inputs: a file path or YAML text. Outputs: plain Python data (dict / list / str / int / float / bool /
None, dates for YAML timestamps), or a `ParamsError` naming the file, the line and the key.

Reading is exactly DVC 3.x's reading of params files (`dvc.utils.serialize.load_yaml`): the file opened
as UTF-8 text with universal newlines, then ruamel.yaml's safe loader, i.e. the YAML 1.2 core schema:
`yes` / `on` / `no` are strings, `6e-4` and `1e3` are floats, `010` is 10, `0o10` is 8, and a duplicate
key is refused (DVC refuses such a file). On top: a folder, unreadable or non-UTF-8 file (byte offset),
a scalar its tag cannot hold (`2024-13-45`), nesting too deep and a self-containing alias are
ParamsErrors, never tracebacks. PyYAML (YAML 1.1) is never used for params.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from dflash.core.errors import ParamsError


def load_yaml_text(text: str, source: str) -> Any:
    """YAML text -> Python data, as DVC reads a params file (ruamel.yaml `YAML(typ="safe")`: YAML 1.2 core
    schema; duplicate keys refused). `None` for an empty document. Errors: ParamsError naming `source`,
    the line and (for a duplicate) the key path."""
    from ruamel.yaml import YAML
    from ruamel.yaml.constructor import DuplicateKeyError
    from ruamel.yaml.error import MarkedYAMLError, YAMLError

    try:
        data = YAML(typ="safe").load(text)
    except DuplicateKeyError as exc:
        raise ParamsError(_duplicate_key_message(text, exc, source)) from None
    except MarkedYAMLError as exc:
        where = f"line {exc.problem_mark.line + 1}, column {exc.problem_mark.column + 1}: " if exc.problem_mark else ""
        problem = " ".join("; ".join(filter(None, [exc.context, exc.problem])).split()) or str(exc)
        raise ParamsError(f"{source}: {where}not valid YAML: {problem}") from None
    except YAMLError as exc:  # e.g. a control character (ReaderError)
        raise ParamsError(f"{source}: not valid YAML: {' '.join(str(exc).split())}") from None
    except RecursionError:
        raise ParamsError(f"{source}: not valid here: values nested too deeply") from None
    except (ValueError, TypeError, OverflowError) as exc:  # a scalar its tag cannot hold: `2024-13-45`, `!!int x`
        raise ParamsError(f"{source}: {_bad_scalar_line(text)}not valid YAML: {exc}") from None
    _refuse_cycles(data, source, [])
    return data


def _duplicate_key_message(text: str, exc: Any, source: str) -> str:
    from ruamel.yaml import YAML
    from ruamel.yaml.nodes import MappingNode, ScalarNode, SequenceNode

    line = exc.problem_mark.line if exc.problem_mark else -1
    found: list[tuple[str, int, int]] = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, MappingNode):
            seen: dict[tuple, int] = {}
            for key, value in node.value:
                name = f"{path}.{key.value}" if path else str(key.value)
                if isinstance(key, ScalarNode):
                    ident = (key.tag, key.value)
                    if ident in seen:
                        found.append((name, key.start_mark.line, seen[ident]))
                    seen.setdefault(ident, key.start_mark.line)
                walk(value, name)
        elif isinstance(node, SequenceNode):
            for i, item in enumerate(node.value):
                walk(item, f"{path}[{i}]")

    try:
        walk(YAML(typ="safe").compose(text), "")
    except Exception:  # noqa: BLE001 - the message falls back to ruamel's own words
        found = []
    hits = [f for f in found if f[1] == line] or found
    if not hits:
        return f"{source}: line {line + 1}: not valid YAML: {' '.join(str(exc.problem).split())}"
    name, at, first = hits[0]
    return f"{source}: line {at + 1}: duplicate key {name} (first at line {first + 1}); DVC refuses the file: keep one"


def _bad_scalar_line(text: str) -> str:
    """'line N: ' of the first scalar that ruamel cannot construct (its constructors raise without a mark)."""
    from ruamel.yaml import YAML
    from ruamel.yaml.nodes import MappingNode, ScalarNode, SequenceNode

    y = YAML(typ="safe")
    try:
        root = y.compose(text)
    except Exception:  # noqa: BLE001
        return ""
    todo = [root]
    while todo:
        node = todo.pop(0)
        if isinstance(node, MappingNode):
            todo.extend(v for pair in node.value for v in pair)
        elif isinstance(node, SequenceNode):
            todo.extend(node.value)
        elif isinstance(node, ScalarNode):
            try:
                y.constructor.construct_object(node, deep=True)
            except Exception:  # noqa: BLE001
                return f"line {node.start_mark.line + 1}: "
    return ""


def _refuse_cycles(data: Any, source: str, stack: list[int]) -> None:
    if isinstance(data, (dict, list)):
        if id(data) in stack:
            raise ParamsError(f"{source}: not valid here: an alias (*name) refers to a value that contains it")
        stack.append(id(data))
        for item in data.values() if isinstance(data, dict) else data:
            _refuse_cycles(item, source, stack)
        stack.pop()


def read_text(path: str | Path, what: str = "params file") -> str:
    """A params-like file's text as DVC reads it (UTF-8, universal newlines). ParamsError for a missing file,
    a folder, an unreadable file or bytes that are not UTF-8 (naming the byte offset and line)."""
    path = Path(path)
    if path.is_dir():
        raise ParamsError(f"{path}: is a folder; the {what} must be a YAML file")
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ParamsError(f"{path}: {what} not found") from None
    except OSError as exc:
        raise ParamsError(f"{path}: cannot read the {what}: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ParamsError(
            f"{path}: not UTF-8 text (byte offset {exc.start}, line {line}: {data[exc.start : exc.start + 1]!r}); "
            "save the file as UTF-8"
        ) from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def dump_yaml_text(data: Any) -> str:
    """Plain data -> YAML 1.2 text that `load_yaml_text` (and DVC) read back equal (block style, key order
    kept). For tools and tests that write params copies; the overlay writer keeps comments instead."""
    from ruamel.yaml import YAML

    y = YAML(typ="safe")
    y.default_flow_style = False
    y.sort_base_mapping_type_on_output = False
    out = io.StringIO()
    y.dump(data, out)
    return out.getvalue()
