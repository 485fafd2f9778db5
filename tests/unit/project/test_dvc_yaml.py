"""dvc.yaml stays consistent with params.yaml and the code layout."""

from __future__ import annotations

import re
from pathlib import Path

from dflash.core.loader import read_yaml
from tests.helpers import repo_params


def _lookup(data: dict, dotted: str):
    node = data
    for part in dotted.split("."):
        assert isinstance(node, dict) and part in node, f"params.yaml has no key {dotted!r}"
        node = node[part]
    return node


def _dvc(repo_root: Path) -> dict:
    return read_yaml(repo_root / "dvc.yaml", "dvc.yaml")  # DVC's own reading (YAML 1.2, duplicates refused)


def test_every_params_key_in_dvc_yaml_exists(repo_root):
    params = read_yaml(repo_root / "params.yaml")
    names = []
    for name, stage in _dvc(repo_root)["stages"].items():
        for entry in stage.get("params", []):
            keys = entry if isinstance(entry, str) else None
            assert keys is not None, f"stage {name}: params entries must be keys of params.yaml"
            _lookup(params, keys)
            names.append(keys)
    assert names, "dvc.yaml lists no params at all"


def test_every_interpolation_resolves(repo_root):
    params = read_yaml(repo_root / "params.yaml")
    text = (repo_root / "dvc.yaml").read_text()
    found = re.findall(r"\$\{([^}]+)\}", text)
    assert found
    for key in found:
        _lookup(params, key.strip())


def test_each_stage_runs_its_own_module_and_depends_on_it(repo_root):
    repo_params()  # the file the stages read is valid
    for name, stage in _dvc(repo_root)["stages"].items():
        module = re.search(r"python -m stages\.(\w+)", stage["cmd"])
        assert module, f"stage {name}: cmd must run `python -m stages.NAME`"
        dep = f"stages/{module.group(1)}.py"
        assert dep in stage.get("deps", []), f"stage {name}: {dep} missing from deps"
        for path in stage.get("deps", []):
            if "${" not in path and not path.startswith(("artifacts/", "reports/")):
                assert (repo_root / path).exists(), f"stage {name}: dep {path} does not exist"


def test_no_duplicate_keys_in_dvc_or_params_yaml(repo_root):
    """DVC refuses a file with two equal keys; so does our one YAML reading (a ParamsError naming the line)."""
    for name in ("dvc.yaml", "params.yaml"):
        read_yaml(repo_root / name, name)
