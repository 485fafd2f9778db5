"""Load params strictly: `params.yaml` (+ overlay files + `-S section.key=value` overrides) -> `Params`.

Loading is strict: an unknown key, a missing key or a value of the wrong type is a `ParamsError` whose
message names the file and the full key path (`params.yaml: train.lr: expected float, got str 'fast'`).
Overrides use the spelling of `dvc exp run -S`: `-S section.key=value` (the value is parsed as YAML, then
checked against the field's type). Overlays (`--overlay FILE`) deep-merge a second params file on top.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from dflash.core.errors import ParamsError
from dflash.core.params import Params

_FLOAT_RE = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def _convert(value: Any, tp: Any, where: str, hints_cache: dict) -> Any:
    """Check `value` against type `tp`; return the converted value or raise ParamsError(where)."""
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
                return _convert(value, option, where, hints_cache)
            except ParamsError:
                pass
        raise ParamsError(f"{where}: expected {_type_name(tp)}, got {_describe(value)}")
    if origin is Literal:
        if value in args:
            return value
        choices = ", ".join(repr(a) for a in args)
        raise ParamsError(f"{where}: expected one of {choices}, got {_describe(value)}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ParamsError(f"{where}: expected a mapping (section {tp.__name__}), got {_describe(value)}")
        return _build(tp, value, where, hints_cache)
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise ParamsError(f"{where}: expected a list, got {_describe(value)}")
        item_tp = args[0] if args else Any
        items = [_convert(v, item_tp, f"{where}[{i}]", hints_cache) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ParamsError(f"{where}: expected a mapping, got {_describe(value)}")
        key_tp, val_tp = args if args else (Any, Any)
        out = {}
        for k, v in value.items():
            if key_tp is str and not isinstance(k, str):
                raise ParamsError(f"{where}: keys must be strings, got {_describe(k)}")
            out[k] = _convert(v, val_tp, f"{where}.{k}", hints_cache)
        return out
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ParamsError(f"{where}: expected bool, got {_describe(value)}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ParamsError(f"{where}: expected int, got {_describe(value)}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        # PyYAML (YAML 1.1) reads `6e-4` as a string; DVC (YAML 1.2) reads it as a float. Agree with DVC.
        if isinstance(value, str) and _FLOAT_RE.match(value.strip()):
            return float(value)
        raise ParamsError(f"{where}: expected float, got {_describe(value)}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ParamsError(f"{where}: expected str, got {_describe(value)}")
    raise TypeError(f"unsupported params type {tp!r} at {where}")  # a schema bug, not a user error


def _build(cls: type, raw: dict, where: str, hints_cache: dict) -> Any:
    if cls not in hints_cache:
        hints_cache[cls] = typing.get_type_hints(cls)
    hints = hints_cache[cls]
    names = [f.name for f in dataclasses.fields(cls)]
    prefix = f"{where}." if where else ""
    unknown = [k for k in raw if k not in names]
    if unknown:
        raise ParamsError(f"{prefix}{unknown[0]}: unknown key (section {cls.__name__} has: {', '.join(names)})")
    kwargs = {}
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        if f.name not in raw:
            if f.default is not dataclasses.MISSING:
                kwargs[f.name] = f.default
                continue
            if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                kwargs[f.name] = f.default_factory()  # type: ignore[misc]
                continue
            raise ParamsError(f"{path}: missing key")
        kwargs[f.name] = _convert(raw[f.name], hints[f.name], path, hints_cache)
    return cls(**kwargs)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`section.key=value` -> (["section", "key"], parsed value). The value is read as YAML."""
    if "=" not in text:
        raise ParamsError(f"override {text!r}: expected section.key=value")
    key, _, raw_value = text.partition("=")
    parts = key.strip().split(".")
    if len(parts) < 2 or not all(parts):
        raise ParamsError(f"override {text!r}: key must be section.key (dotted), got {key!r}")
    try:
        value = yaml.safe_load(raw_value) if raw_value.strip() != "" else ""
    except yaml.YAMLError as exc:
        raise ParamsError(f"override {text!r}: value is not valid YAML ({exc})") from exc
    return parts, value


def apply_overrides(raw: dict, overrides: list[str] | tuple[str, ...], source: str) -> dict:
    """Return a deep copy of `raw` with each `section.key=value` applied. Unknown paths are errors."""

    data = copy.deepcopy(raw)
    for text in overrides:
        parts, value = parse_override(text)
        node = data
        for depth, part in enumerate(parts[:-1]):
            if not isinstance(node, dict) or part not in node:
                where = ".".join(parts[: depth + 1])
                raise ParamsError(f"{source}: override {text!r}: no section {where!r} in params")
            node = node[part]
        if not isinstance(node, dict) or parts[-1] not in node:
            raise ParamsError(f"{source}: override {text!r}: unknown key {'.'.join(parts)!r}")
        node[parts[-1]] = value
    return data


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ParamsError(f"{path}: params file not found") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ParamsError(f"{path}: not valid YAML: {exc}") from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ParamsError(f"{path}: top level must be a mapping of sections, got {_describe(data)}")
    return data


def merge_overlay(base: dict, overlay: dict, source: str = "overlay") -> dict:
    """Deep-merge an overlay params file onto a base one, guided by the schema: sections merge key
    by key, every other value (lists, free-form mappings) is replaced whole. Unknown keys are errors."""

    out = copy.deepcopy(base)

    def walk(dst: dict, src: dict, cls: type, path: str) -> None:
        hints = typing.get_type_hints(cls)
        for k, v in src.items():
            here = f"{path}.{k}" if path else k
            if k not in hints:
                raise ParamsError(f"{source}: {here}: unknown key (section {cls.__name__})")
            tp = hints[k]
            if dataclasses.is_dataclass(tp) and isinstance(v, dict) and isinstance(dst.get(k), dict):
                walk(dst[k], v, tp, here)
            else:
                dst[k] = copy.deepcopy(v)

    walk(out, overlay, Params, "")
    return out


def from_dict(raw: dict, source: str = "params") -> Params:
    try:
        return _build(Params, raw, "", {})
    except ParamsError as exc:
        raise ParamsError(f"{source}: {exc}") from None


def load_params(
    path: str | Path = "params.yaml",
    overrides: list[str] | tuple[str, ...] = (),
    overlays: list[str | Path] | tuple[str | Path, ...] = (),
) -> Params:
    """Load `path`, deep-merge each overlay file, apply `-S` overrides, and build `Params` strictly."""
    raw = read_yaml(path)
    source = str(path)
    for overlay in overlays:
        raw = merge_overlay(raw, read_yaml(overlay), str(overlay))
        source = f"{source} + {overlay}"
    raw = apply_overrides(raw, list(overrides), source)
    return from_dict(raw, source)


def as_dict(obj: Any) -> Any:
    """Params (or a section) back to plain dicts/lists, e.g. for provenance files and hashing."""
    if dataclasses.is_dataclass(obj):
        return {f.name: as_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [as_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: as_dict(v) for k, v in obj.items()}
    return obj
