"""Load params strictly: `params.yaml` (+ overlay files + `-S section.key=value` overrides) -> `Params`.

Inputs: a params file, overlay files (`--overlay FILE`, deep-merged on top) and `-S` overrides.
Output: a `Params` (dflash/core/params.py), or a `ParamsError` whose message names where the offending
value came from (the params file, the overlay file or the `-S` override), the full key path and the
problem: `params.yaml: train.lr: expected float, got str 'fast'`, `-S train.lr=fast: train.lr: ...`.

Files are read by dflash/core/yamlio.py, the ONE YAML reading (DVC's: YAML 1.2 core schema, duplicate
keys refused). `-S` values are parsed as `dvc exp run -S` parses them: Hydra's override grammar (`yes` is a string,
`6e-4` a float, `[a, b]` a list, `a,b` a sweep), applied as DVC applies them (a mapping value merges into
the mapping it replaces; `+key=` / `++key=` add, `~key` deletes). PyYAML is not used here.
"""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, NamedTuple, Union

from dflash.core.errors import ParamsError
from dflash.core.params import Params
from dflash.core.yamlio import load_yaml_text, read_text


def read_yaml(path: str | Path, what: str = "params file") -> dict:
    """A params-like YAML file whose top level is a mapping (an empty file reads as {})."""
    data = load_yaml_text(read_text(path, what), str(path))
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ParamsError(f"{path}: top level must be a mapping (key: value lines), got {_describe(data)}")
    return data


# Keys a params file, an overlay or a -S override may no longer name: key -> the one-line refusal naming what
# replaced it (each of its meanings got a knob of its own).
RETIRED = {
    "generate.max_unit_retries": "retired: its three meanings are three knobs now, generate.request_retries "
    "(servers: a request's retries), generate.unit_retries (engines: a unit's engine deaths with no request in it) "
    "and generate.engine_start_retries (engines: failed engine start-ups)",
}


def _refuse_retired(path: tuple) -> None:
    """The refusal of a retired key (RETIRED) at `path`, before the generic unknown-key one."""
    reason = RETIRED.get(".".join(str(p) for p in path))
    if reason is not None:
        raise _Bad(path, reason)


# --------------------------------------------------------------------------------------------
# Schema check
# --------------------------------------------------------------------------------------------

Path_ = tuple  # a key path: str keys and int list indexes, e.g. ("audit", "placeholder_texts", 4)


class _Bad(ParamsError):
    """A schema error at a key path; `from_dict` prefixes where the offending value came from."""

    def __init__(self, path: Path_, detail: str):
        super().__init__(f"{_where(path)}: {detail}")
        self.path, self.detail = path, detail


def _where(path: Path_) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def _convert(value: Any, tp: Any, path: Path_, hints_cache: dict) -> Any:
    """Check `value` against type `tp`; return the converted value or raise _Bad(path)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)

    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for option in args:
            if option is type(None):
                continue
            try:
                return _convert(value, option, path, hints_cache)
            except _Bad:
                pass
        raise _Bad(path, f"expected {_type_name(tp)}, got {_describe(value)}")
    if origin is Literal:
        if value in args and type(value) in {type(a) for a in args}:
            return value
        choices = ", ".join(repr(a) for a in args)
        raise _Bad(path, f"expected one of {choices}, got {_describe(value)}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise _Bad(path, f"expected a mapping (section {tp.__name__}), got {_describe(value)}")
        return _build(tp, value, path, hints_cache)
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise _Bad(path, f"expected a list, got {_describe(value)}")
        item_tp = args[0] if args else Any
        items = [_convert(v, item_tp, (*path, i), hints_cache) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise _Bad(path, f"expected a mapping, got {_describe(value)}")
        key_tp, val_tp = args if args else (Any, Any)
        out = {}
        for k, v in value.items():
            if key_tp is str and not isinstance(k, str):
                raise _Bad(path, f"keys must be strings, got {_describe(k)}")
            out[k] = _convert(v, val_tp, (*path, k), hints_cache)
        return out
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _Bad(path, f"expected bool, got {_describe(value)}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _Bad(path, f"expected int, got {_describe(value)}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _Bad(path, f"expected float, got {_describe(value)}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise _Bad(path, f"expected str, got {_describe(value)}")
    raise TypeError(f"unsupported params type {tp!r} at {_where(path)}")  # a schema bug, not a user error


def _build(cls: type, raw: dict, path: Path_, hints_cache: dict) -> Any:
    if cls not in hints_cache:
        hints_cache[cls] = typing.get_type_hints(cls)
    hints = hints_cache[cls]
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in raw if k not in names]
    if unknown:
        _refuse_retired((*path, unknown[0]))
        raise _Bad((*path, unknown[0]), f"unknown key (section {cls.__name__} has: {', '.join(names)})")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            if f.default is not dataclasses.MISSING:
                kwargs[f.name] = f.default
                continue
            if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                kwargs[f.name] = f.default_factory()  # type: ignore[misc]
                continue
            raise _Bad((*path, f.name), "missing key")
        kwargs[f.name] = _convert(raw[f.name], hints[f.name], (*path, f.name), hints_cache)
    return cls(**kwargs)


# --------------------------------------------------------------------------------------------
# -S overrides: DVC's grammar (Hydra's) and DVC's way of applying them
# --------------------------------------------------------------------------------------------

_QUOTE_HINT = "quote a value holding a comma, #, !, &, ~, =, <, |, () or non-ASCII text: -S 'key=\"...\"'"


class Override(NamedTuple):
    text: str  # as given, e.g. "train.lr=6e-4"
    op: str  # "set" (key=v), "add" (+key=v), "force_add" (++key=v), "delete" (~key or ~key=v)
    keys: list[str]
    value: Any  # for "delete": the value the key must hold, or None


def _label(text: str) -> str:
    return f"-S {text}"


def parse_override(text: str) -> Override:
    """One `-S` value, parsed with the grammar `dvc exp run -S` uses (Hydra's override grammar)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ValueType
    from hydra.errors import HydraException

    label = _label(text)
    if "=" not in text and not text.startswith("~"):
        raise ParamsError(f"{label}: expected section.key=value")
    try:
        parsed = OverridesParser.create().parse_override(text)
    except HydraException as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ParamsError(f"{label}: not a valid -S value ({first}); {_QUOTE_HINT}") from None
    key = parsed.key_or_group
    if parsed.package is not None:
        raise ParamsError(f"{label}: `@package` is for Hydra config groups; write section.key=value")
    keys = key.split(".")
    if len(keys) < 2 or not all(keys):
        raise ParamsError(f"{label}: key must be section.key (dotted), got {key!r}")
    if parsed.value_type not in (None, ValueType.ELEMENT):
        raise ParamsError(
            f"{label}: a sweep (a,b / choice / range / glob) is for `dvc exp run --queue`; a stage takes one "
            f"value ({_QUOTE_HINT})"
        )
    value = parsed.value()
    if _has_interpolation(value):
        raise ParamsError(
            f"{label}: `${{...}}` is resolved by DVC (OmegaConf) when it writes params.yaml; write the value itself"
        )
    op = "set"
    if parsed.is_delete():
        op = "delete"
    elif parsed.is_force_add():
        op = "force_add"
    elif parsed.is_add():
        op = "add"
    return Override(text, op, keys, value)


def _has_interpolation(value: Any) -> bool:
    if isinstance(value, str):
        return "${" in value
    if isinstance(value, dict):
        return any(_has_interpolation(k) or _has_interpolation(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_interpolation(v) for v in value)
    return False


def _set_origin(origins: dict | None, path: Path_, source: str) -> None:
    if origins is not None:
        for p in [p for p in origins if p[: len(path)] == path]:
            del origins[p]
        origins[path] = source


def _merge_value(dst: dict, key: Any, value: Any, path: Path_, add: bool, ov: Override, origins: dict | None) -> None:
    """OmegaConf.update(merge=True) on plain data: a mapping merges key by key into a mapping (new keys only
    with +/++), anything else replaces the old value whole."""
    old = dst.get(key) if isinstance(dst, dict) else dst[key]
    if isinstance(value, dict) and isinstance(old, dict):
        for k, v in value.items():
            if k not in old and not add:
                raise ParamsError(
                    f"{_label(ov.text)}: unknown key {_where((*path, k))!r} (DVC refuses it too; `++{ov.text}` adds keys)"
                )
            _merge_value(old, k, v, (*path, k), add, ov, origins)
        return
    if isinstance(old, list) and isinstance(value, dict):
        raise ParamsError(f"{_label(ov.text)}: {_where(path)} is a list; a mapping cannot merge into it")
    dst[key] = copy.deepcopy(value)
    _set_origin(origins, path, _label(ov.text))


def apply_overrides(
    raw: dict, overrides: list[str] | tuple[str, ...], source: str, origins: dict | None = None
) -> dict:
    """Return a deep copy of `raw` with each `-S` override applied as `dvc exp run -S` applies it to
    params.yaml. Unknown paths are errors; `origins` (key path -> source) records what each one set."""
    data = copy.deepcopy(raw)
    for text in overrides:
        ov = parse_override(text)
        label = _label(text)
        node: Any = data
        path: Path_ = ()
        for depth, part in enumerate(ov.keys):
            last = depth == len(ov.keys) - 1
            if isinstance(node, list) and part.isdigit() and int(part) < len(node):
                key: Any = int(part)
            elif isinstance(node, dict) and (part in node or (last and ov.op in ("add", "force_add"))):
                key = part
            elif last:
                if ".".join(ov.keys) in RETIRED:
                    raise ParamsError(f"{label}: {'.'.join(ov.keys)}: {RETIRED['.'.join(ov.keys)]}")
                raise ParamsError(f"{label}: unknown key {'.'.join(ov.keys)!r} in {source}")
            else:
                raise ParamsError(f"{label}: no section {'.'.join(ov.keys[: depth + 1])!r} in {source}")
            path = (*path, key)
            if not last:
                node = node[key]
        present = isinstance(node, list) or key in node
        if ov.op == "delete":
            if not present or node[key] is None:
                raise ParamsError(f"{label}: cannot delete {_where(path)!r}: it is not set in {source}")
            if ov.value is not None and ov.value != node[key]:
                raise ParamsError(f"{label}: cannot delete {_where(path)!r}: its value is {node[key]!r}")
            del node[key]
            _set_origin(origins, path, label)
        elif ov.op == "add" and present and node[key] is not None and not isinstance(ov.value, (dict, list)):
            raise ParamsError(f"{label}: {_where(path)!r} is already set; write {text[1:]!r} to change it")
        else:
            _merge_value(node, key, ov.value, path, ov.op != "set", ov, origins)
    return data


# --------------------------------------------------------------------------------------------
# Overlays and the whole load
# --------------------------------------------------------------------------------------------


def merge_overlay(base: dict, overlay: dict, source: str = "overlay", origins: dict | None = None) -> dict:
    """Deep-merge an overlay params file onto a base one, guided by the schema: sections merge key
    by key, every other value (lists, free-form mappings) is replaced whole. Unknown keys are errors."""

    out = copy.deepcopy(base)

    def walk(dst: dict, src: dict, cls: type, path: Path_) -> None:
        hints = typing.get_type_hints(cls)
        for k, v in src.items():
            here = (*path, k)
            if k not in hints:
                if _where(here) in RETIRED:
                    raise ParamsError(f"{source}: {_where(here)}: {RETIRED[_where(here)]}")
                raise ParamsError(f"{source}: {_where(here)}: unknown key (section {cls.__name__})")
            tp = hints[k]
            if dataclasses.is_dataclass(tp) and isinstance(v, dict) and isinstance(dst.get(k), dict):
                walk(dst[k], v, tp, here)
            else:
                dst[k] = copy.deepcopy(v)
                _set_origin(origins, here, source)

    walk(out, overlay, Params, ())
    return out


def _origin_of(origins: dict | None, path: Path_, default: str) -> str:
    for n in range(len(path), -1, -1):
        if origins and path[:n] in origins:
            return origins[path[:n]]
    return default


def from_dict(raw: dict, source: str = "params", origins: dict | None = None) -> Params:
    """Build `Params` strictly. An error names where its value came from (`origins`: key path -> params
    file, overlay file or `-S` override; `source` when unknown), then the key path."""
    try:
        return _build(Params, raw, (), {})
    except _Bad as exc:
        raise ParamsError(f"{_origin_of(origins, exc.path, source)}: {exc}") from None


def load_params(
    path: str | Path = "params.yaml",
    overrides: list[str] | tuple[str, ...] = (),
    overlays: list[str | Path] | tuple[str | Path, ...] = (),
) -> Params:
    """Load `path`, deep-merge each overlay file, apply `-S` overrides, and build `Params` strictly."""
    raw = read_yaml(path)
    origins: dict = {(): str(path)}
    for overlay in overlays:
        raw = merge_overlay(raw, read_yaml(overlay, "overlay file"), str(overlay), origins)
    raw = apply_overrides(raw, list(overrides), str(path), origins)
    return from_dict(raw, str(path), origins)


def as_dict(obj: Any) -> Any:
    """Params (or a section) back to plain dicts/lists, e.g. for provenance files and hashing."""
    if dataclasses.is_dataclass(obj):
        return {f.name: as_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [as_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: as_dict(v) for k, v in obj.items()}
    return obj
