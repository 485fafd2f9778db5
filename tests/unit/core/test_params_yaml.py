"""One YAML reading everywhere, DVC's: params files, overlays, the hardware file and `-S` values mean the same
to the stages as to DVC (which records them in dvc.lock), and bad params-like files are errors naming the file,
never tracebacks.

DVC's own functions are the reference: `dvc.utils.serialize.load_yaml` (how `dvc repro` / `dvc params` read a
params file) and `dvc.utils.hydra.apply_overrides` (how `dvc exp run -S` rewrites params.yaml).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dflash.core.errors import ParamsError
from dflash.core.loader import apply_overrides, load_params, read_yaml
from dflash.core.yamlio import dump_yaml_text, load_yaml_text
from tests.helpers import REPO, repo_params

PARAMS_FILES = ["params.yaml", *sorted(str(p.relative_to(REPO)) for p in (REPO / "params").rglob("*.yaml"))]

# Scalars on which YAML 1.1 (PyYAML) and YAML 1.2 (DVC's ruamel) disagree, and a few on which they agree.
TRICKY = """\
a:
  yes_: yes
  on_: on
  off_: Off
  no_: NO
  exp: 6e-4
  exp_big: 1e3
  octal_old: 010
  octal_new: 0o10
  hex: 0x1f
  sexagesimal: 12:30
  underscore: 1_000
  dot: .5
  tilde: ~
  null_: Null
  date: 2001-12-14
  quoted_yes: "yes"
  list: [yes, no, on, 1e3, "6e-4"]
  map: {y: n, on: off}
"""


def typed(value):
    """Data with every scalar tagged by its type, so that True == 1 == 1.0 compare unequal."""
    if isinstance(value, dict):
        return {"dict": sorted(((repr(typed(k)), typed(v)) for k, v in value.items()), key=repr)}
    if isinstance(value, (list, tuple)):
        return {"list": [typed(v) for v in value]}
    if isinstance(value, float) and math.isnan(value):
        return ("float", "nan")
    return (type(value).__name__, value)


def dvc_load(path: Path):
    from dvc.utils.serialize import load_yaml

    return load_yaml(str(path))


# ----------------------------------------------------------------------------------- reading files


@pytest.mark.parametrize("name", PARAMS_FILES)
def test_shipped_params_files_read_as_dvc_reads_them(name):
    assert typed(read_yaml(REPO / name)) == typed(dvc_load(REPO / name))


def test_yaml_1_1_and_1_2_differences_read_as_dvc_reads_them(tmp_path):
    path = tmp_path / "tricky.yaml"
    path.write_text(TRICKY)
    ours, dvc = read_yaml(path), dvc_load(path)
    assert typed(ours) == typed(dvc)
    a = ours["a"]  # the YAML 1.2 core schema, spelled out
    assert (a["yes_"], a["on_"], a["off_"], a["no_"], a["quoted_yes"]) == ("yes", "on", "Off", "NO", "yes")
    assert (a["exp"], a["exp_big"], a["octal_old"], a["octal_new"], a["hex"]) == (6e-4, 1000.0, 10, 8, 31)
    assert a["sexagesimal"] == "12:30" and a["date"] == datetime.date(2001, 12, 14)
    assert a["list"] == ["yes", "no", "on", 1000.0, "6e-4"] and a["map"] == {"y": "n", "on": "off"}


def test_crlf_and_bom_read_as_dvc_reads_them(tmp_path):
    path = tmp_path / "crlf.yaml"
    path.write_bytes(b"\xef\xbb\xbfa:\r\n  b: |\r\n    x\r\n    y\r\n  c: 'p\rq'\r\n")
    assert typed(read_yaml(path)) == typed(dvc_load(path))


def test_duplicate_key_is_refused_naming_line_and_key_path(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("base:\n  seed: 0\ntrain:\n  lr: 1.0\n  epochs: 2\n  lr: 2.0\n")
    with pytest.raises(ParamsError, match=r"dup\.yaml: line 6: duplicate key train\.lr \(first at line 4\)"):
        read_yaml(path)
    with pytest.raises(Exception, match="corrupted"):  # DVC refuses it too
        dvc_load(path)


@pytest.mark.parametrize(
    "data,expected",
    [
        (b"base:\n  seed: \xff\n", r"x\.yaml: not UTF-8 text \(byte offset 14, line 2: b.\\xff."),
        (b"a: 2024-13-45\n", r"x\.yaml: line 1: not valid YAML: month must be in 1\.\.12"),
        (b"a: 1\nb: !!int abc\n", r"x\.yaml: line 2: not valid YAML"),
        (b"a: 1\n---\nb: 2\n", r"x\.yaml: line 2, column 1: not valid YAML: expected a single document"),
        (b"a: \x07\n", r"x\.yaml: not valid YAML: unacceptable character"),
        (b"a: &x [*x]\n", r"x\.yaml: not valid here: an alias"),
        (b"a: " + b"[" * 5000 + b"]" * 5000 + b"\n", r"x\.yaml: not valid here: values nested too deeply"),
        (b"- a\n- b\n", r"x\.yaml: top level must be a mapping"),
    ],
)
def test_bad_params_file_is_a_params_error_naming_the_file(tmp_path, data, expected):
    path = tmp_path / "x.yaml"
    path.write_bytes(data)
    with pytest.raises(ParamsError, match=expected):
        read_yaml(path)


def test_folder_as_params_or_overlay_is_a_params_error(tmp_path):
    (tmp_path / "dir.yaml").mkdir()
    with pytest.raises(ParamsError, match=r"dir\.yaml: is a folder; the params file must be a YAML file"):
        load_params(tmp_path / "dir.yaml")
    with pytest.raises(ParamsError, match=r"dir\.yaml: is a folder; the overlay file must be a YAML file"):
        repo_params(overlays=[tmp_path / "dir.yaml"])


def test_stage_cli_prints_a_folder_params_error_without_traceback(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "stages.plan", "--params", str(tmp_path)], cwd=REPO, capture_output=True, text=True
    )
    assert out.returncode == 2, out.stderr
    assert (
        f"error: {tmp_path}: is a folder; the params file must be a YAML file" in out.stderr
        and "Traceback" not in out.stderr
    )


@pytest.mark.parametrize(
    "text,expected",
    [
        ("- rtx-pro-6000\n", r"hw\.yaml: top level must be a mapping"),
        ("profiles: [rtx-pro-6000]\n", r"hw\.yaml: expected a top-level `profiles:` mapping"),
        ("profiles:\n  rtx-pro-6000: [1, 2]\n", r"hw\.yaml: profiles\.rtx-pro-6000: expected a mapping"),
        ("profiles:\n  a: {1: x, zz: y}\n", r"hw\.yaml: profiles\.a\.1: unknown key"),
        ("profiles:\n  a: {}\n  a: {}\n", r"hw\.yaml: line 3: duplicate key profiles\.a"),
    ],
)
def test_bad_hardware_file_is_an_error_naming_the_file(tmp_path, text, expected):
    from dflash.core.errors import UserError
    from dflash.plan.inputs import load_hardware

    path = tmp_path / "hw.yaml"
    path.write_text(text)
    with pytest.raises(UserError, match=expected):
        load_hardware(path)
    (tmp_path / "hwdir").mkdir()
    with pytest.raises(UserError, match=r"hwdir: is a folder; the GPU profiles file \(plan\.hardware_file\) must be"):
        load_hardware(tmp_path / "hwdir")


def test_dump_reads_back_equal():
    data = read_yaml(REPO / "params.yaml")
    assert typed(load_yaml_text(dump_yaml_text(data), "dump")) == typed(data)


# ------------------------------------------------------------------------------------- -S values

# The same -S as `dvc exp run -S`: parsed with its grammar (Hydra's), applied as it applies them.
OVERRIDES = [
    "plan.num_gpus=2",
    "audit.placeholder_texts=[ok, yes, on, no, 'off', 1e3]",
    "base.enable_thinking=yes",  # a string in both (the schema then refuses it)
    "base.enable_thinking=True",
    "target.tiny.lr=6e-4",
    "target.tiny.lr=1e3",
    "target.tiny.lr=nan",
    "target.tiny.steps=1_000",
    "target.revision=0x10",
    "target.revision=010",
    "target.revision=2024-01-01",
    "target.revision=12:30",
    "target.revision=",
    "target.revision=null",
    "target.revision='yes'",
    "target.source=Qwen/Qwen3-0.6B",
    'audit.input="a b, c"',
    "generate.sampling.stop=['</s>', 'a,b']",
    "generate.sampling={top_k: 5, stop: [x]}",  # a mapping merges into the section
    "drafter.target_layer_ids.0=2",
    "++base.chat_template_kwargs={a: 1}",
    "~plan.gpu_counts",
    # refused by both:
    "base.chat_template_kwargs={a: 1}",  # a new key needs ++
    "base.seed=1,2",  # a sweep
    "base.sed=1",
    "bsae.seed=1",
    "base.seed=[1",
    "drafter.target_layer_ids.9=2",
    "generate.sampling.stop={a: 1}",
]


@pytest.mark.parametrize("override", OVERRIDES)
def test_overrides_mean_what_dvc_exp_run_makes_of_them(tmp_path, override):
    from dvc.utils.hydra import apply_overrides as dvc_apply_overrides

    path = tmp_path / "params.yaml"
    shutil.copy(REPO / "params.yaml", path)
    try:
        dvc_apply_overrides(str(path), [override])
    except Exception as exc:  # noqa: BLE001 - DVC refuses it: so must we
        with pytest.raises(ParamsError, match=r"^-S "):
            apply_overrides(read_yaml(REPO / "params.yaml"), [override], "params.yaml")
        assert "Invalid" in str(exc) or "unable" in str(exc), exc
        return
    ours = apply_overrides(read_yaml(REPO / "params.yaml"), [override], "params.yaml")
    assert typed(ours) == typed(dvc_load(path))  # what we make of the -S == what DVC wrote
    assert typed(read_yaml(path)) == typed(ours)  # and what the stages then read from DVC's rewrite


def test_error_names_the_override_the_value_came_from(tmp_path):
    with pytest.raises(ParamsError, match=r"^-S train\.lr=fast: train\.lr: expected float, got str 'fast'$"):
        repo_params(["train.lr=fast"])
    with pytest.raises(ParamsError, match=r"^-S audit\.placeholder_texts=\[a, 1\]: audit\.placeholder_texts\[1\]: "):
        repo_params(["audit.placeholder_texts=[a, 1]"])
    # a bad value in params.yaml is still params.yaml's, even with an unrelated -S
    params = tmp_path / "params.yaml"
    params.write_text((REPO / "params.yaml").read_text().replace("  seed: 0 ", '  seed: "zero" ', 1))
    with pytest.raises(ParamsError, match=r"^.*params\.yaml: base\.seed: expected int"):
        load_params(params, ["train.lr=1.0"])


def test_error_names_the_overlay_the_value_came_from(tmp_path):
    overlay = tmp_path / "gpu.yaml"
    overlay.write_text("plan:\n  num_gpus: two\n  gpu_counts: [1, x]\n")
    with pytest.raises(ParamsError, match=rf"^{tmp_path}/gpu\.yaml: plan\.num_gpus: expected int, got str 'two'$"):
        repo_params(overlays=[overlay])
    overlay.write_text("plan:\n  gpu_counts: [1, x]\n")
    with pytest.raises(ParamsError, match=rf"^{tmp_path}/gpu\.yaml: plan\.gpu_counts\[1\]: expected int"):
        repo_params(overlays=[overlay])
    # the -S given last wins, and is named
    with pytest.raises(ParamsError, match=r"^-S plan\.gpu_counts=\[y\]: plan\.gpu_counts\[0\]"):
        repo_params(["plan.gpu_counts=[y]"], overlays=[overlay])


def test_stage_cli_names_the_override(repo_root):
    out = subprocess.run(
        [sys.executable, "-m", "stages.plan", "-S", "train.lr=fast"], cwd=repo_root, capture_output=True, text=True
    )
    assert out.returncode == 2
    assert "error: -S train.lr=fast: train.lr: expected float, got str 'fast'" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


# --------------------------------------------------------------------------- a real dvc exp run -S


def _env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # this venv's python + dvc
    env.update(
        DVC_NO_ANALYTICS="1",
        DVC_SITE_CACHE_DIR=str(tmp_path / "dvc-site-cache"),
        GIT_AUTHOR_NAME="test",
        GIT_AUTHOR_EMAIL="test@example.invalid",
        GIT_COMMITTER_NAME="test",
        GIT_COMMITTER_EMAIL="test@example.invalid",
        GIT_CONFIG_NOSYSTEM="1",
    )
    return env


def _copy_sources(dest: Path) -> None:
    """This checkout's plan-stage sources (tracked and not-yet-tracked files, as they are now) into `dest`."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "dflash", "stages", "params"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\0")
    for rel in [*filter(None, listed), "params.yaml"]:
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


PLAN_ONLY_DVC_YAML = """\
stages:
  plan:
    cmd: python -m stages.plan --params params.yaml -S plan.target_config=params/targets/qwen3.6-27b.config.json
    deps: [stages/plan.py, dflash/plan, params/hardware.yaml, params/targets]
    params: [plan, audit.placeholder_texts]
    metrics:
      - reports/plan.json:
          cache: false
"""


def test_dvc_exp_run_set_param_reruns_the_plan(tmp_path):
    """The documented experiment workflow (docs/getting-started.md) on the plan stage: `dvc exp run -S` makes DVC rewrite params.yaml with
    ruamel (YAML 1.2: the quoted "yes" placeholder text comes back unquoted); the stage must read it as DVC does.
    A copy of the plan stage's sources in a throw-away git + DVC repo (~4 s: no target, no model)."""
    repo = tmp_path / "repo"
    _copy_sources(repo)
    (repo / "dvc.yaml").write_text(PLAN_ONLY_DVC_YAML)
    env = _env(tmp_path)

    def run(*cmd: str) -> str:
        out = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
        assert out.returncode == 0, f"{' '.join(cmd)} failed:\n{(out.stdout + out.stderr)[-3000:]}"
        return out.stdout

    run("git", "init", "-q")
    run("dvc", "init", "-q")
    run("git", "add", "-A")
    run("git", "-c", "commit.gpgsign=false", "commit", "-q", "-m", "plan only")
    run("dvc", "repro")
    assert json.loads((repo / "reports/plan.json").read_text())["num_gpus"] == 1
    run("git", "add", "-A")
    run("git", "-c", "commit.gpgsign=false", "commit", "-q", "-m", "plan run")

    run("dvc", "exp", "run", "-S", "plan.num_gpus=2")
    rewritten = (repo / "params.yaml").read_text()
    assert "- yes" in rewritten or " yes," in rewritten or "yes]" in rewritten, "DVC no longer unquotes: rethink"
    assert json.loads((repo / "reports/plan.json").read_text())["num_gpus"] == 2
    assert read_yaml(repo / "params.yaml")["plan"]["num_gpus"] == 2
    assert typed(read_yaml(repo / "params.yaml")) == typed(dvc_load(repo / "params.yaml"))
