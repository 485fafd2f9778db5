"""The code layout keeps its promises: imports run one way, dvc.yaml deps follow the imports exactly, and
the heavy libraries stay where the package docstrings say.

Imports are read from the source (ast), every `import` / `from ... import` anywhere in a file counts,
lazy ones inside functions included, since they run as soon as that code path does.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO

# Plumbing every stage uses that does not shape any output: the params schema and loader, the CLI, the
# error type. Changing them cannot change what a stage writes for given params, so no dep lists them.
# plumbing of every stage that changes no output: the CLI, the params schema and loader, the error type, and the
# output-path check that runs before any stage
EXEMPT = {
    "dflash/core/cli.py",
    "dflash/core/params.py",
    "dflash/core/params_plan.py",
    "dflash/core/loader.py",
    "dflash/core/yamlio.py",  # the loader's YAML reading (DVC's)
    "dflash/core/errors.py",
    "dflash/core/paths.py",
}
STAGE_PACKAGES = ("target", "audit", "generate", "tokenize", "train", "eval", "plan", "report")
# package -> the packages of ours it may import (besides itself), each its own: what it needs, and exactly what its
# __init__ docstring's "May import:" names
ALLOWED = {
    "core": set(),
    "drafter": {"core"},
    "target": {"core"},
    "audit": {"core"},
    "generate": {"core"},
    "tokenize": {"core", "drafter"},  # the draft vocabulary's token counts (dflash/drafter/vocab.py)
    "train": {"core", "drafter"},
    "eval": {"core", "drafter"},
    "plan": {"core", "drafter"},  # the drafter's torch-free geometry and FLOPs
    "report": {"core"},
}
HEAVY = ("torch", "transformers", "vllm")
TORCH_FREE_STAGES = ("audit", "tokenize", "plan", "report")  # they run on data boxes without torch
VLLM_PACKAGES = ("generate", "eval")


def module_files() -> dict[str, Path]:
    """dotted module name -> file, for dflash/ and stages/ (packages by their __init__.py)."""
    out = {}
    for top in ("dflash", "stages"):
        for path in sorted((REPO / top).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = module_files()


def imports_of(path: Path) -> tuple[set[str], set[str]]:
    """(our modules imported, top-level third-party names imported) anywhere in a file."""
    ours, theirs = set(), set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: relative import (write dflash.x.y in full)"
            names = [(node.module, a.name) for a in node.names]
        else:
            continue
        for module, attr in names:
            if module.split(".")[0] not in ("dflash", "stages"):
                theirs.add(module.split(".")[0])
                continue
            # a package and everything on the way to the module is imported too
            parts = module.split(".")
            ours.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
            if attr and f"{module}.{attr}" in MODULES:  # `from dflash.core import cli`
                ours.add(f"{module}.{attr}")
    missing = sorted(m for m in ours if m not in MODULES)
    assert not missing, f"{path}: imports {missing}, which do not exist"
    return ours, theirs


GRAPH = {name: imports_of(path) for name, path in MODULES.items()}


def closure(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(GRAPH[m][0])
    return seen


def rel(module: str) -> str:
    return str(MODULES[module].relative_to(REPO))


def package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "dflash" and len(parts) > 1 else None


def is_docstring_only(path: Path) -> bool:
    body = ast.parse(path.read_text()).body
    return len(body) == 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)


def stage_code_deps() -> dict[str, tuple[str, list[str]]]:
    """dvc stage -> (its stages/NAME module, the code paths among its deps)."""
    out = {}
    for name, stage in yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"].items():
        module = stage["cmd"].split("python -m ")[1].split()[0]
        deps = [d for d in stage.get("deps", []) if d.startswith(("dflash", "stages"))]
        out[name] = (module, deps)
    return out


def test_every_package_init_is_a_docstring_naming_its_modules_and_imports():
    """Each package's docstring is its map (docs/design/code-layout.md is generated from them): it names every module
    of the package and exactly the packages of ours ALLOWED to it after "May import:"; the top one names every
    package."""
    assert set(ALLOWED) == {p.parent.name for p in (REPO / "dflash").glob("*/__init__.py")}
    for name in ["dflash", *(f"dflash.{p}" for p in ALLOWED)]:
        path = MODULES[name]
        assert is_docstring_only(path), f"{rel(name)}: an __init__ holds only its docstring (no re-exports)"
        doc = ast.get_docstring(ast.parse(path.read_text()))
        if name == "dflash":
            unnamed = sorted(p for p in ALLOWED if f"{p}/" not in doc)
            assert not unnamed, f"dflash/__init__.py: the docstring does not name {unnamed}"
            continue
        assert "May import:" in doc, f"{rel(name)}: the docstring must say what the package may import"
        pkg = name.split(".")[1]
        may = set(re.findall(r"\bdflash\.(\w+)", doc.split("May import:", 1)[1])) - {pkg}  # itself: always
        assert may == ALLOWED[pkg], f"{rel(name)}: May import names {sorted(may)}, not {sorted(ALLOWED[pkg])}"
        files = sorted(p.name for p in path.parent.glob("*.py") if p.name != "__init__.py")
        unnamed = [f for f in files if not re.search(rf"(?<![\w.]){re.escape(f)}(?!\w)", doc)]
        assert not unnamed, f"{rel(name)}: the docstring does not name {unnamed}"


def test_imports_run_one_way():
    """core imports only core; drafter only core; a stage package only core, drafter and itself; the library
    never imports stages/."""
    for module, (ours, _) in GRAPH.items():
        pkg = package_of(module)
        if module.startswith("stages") or pkg is None:
            continue
        for dep in ours:
            assert not dep.startswith("stages"), f"{rel(module)} imports {dep}: the library never imports stages/"
            other = package_of(dep)
            if other is None or other == pkg:
                continue
            assert other in ALLOWED[pkg], f"{rel(module)} imports {dep}: dflash.{pkg} may import only {ALLOWED[pkg]}"


def test_no_import_cycles():
    """Over every module of dflash/, lazy imports included (a cycle there is only a deferred crash)."""
    edges = {m: GRAPH[m][0] - {m} for m in GRAPH}
    state: dict[str, int] = defaultdict(int)  # 0 new, 1 on the stack, 2 done

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(edges[m]):
            if state[d] == 1:
                cycle = stack[stack.index(d) :] + [d] if d in stack else [m, d]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if state[d] == 0:
                visit(d, [*stack, d])
        state[m] = 2

    for m in sorted(edges):
        if state[m] == 0:
            visit(m, [m])


@pytest.mark.parametrize("stage", list(stage_code_deps()))
def test_dvc_deps_cover_exactly_the_imported_code(stage):
    """Every file in the import closure of stages/NAME.py is a dep (itself or its folder), and every code dep is
    imported: a folder dep only when the stage imports every file in it, so the DAG reruns exactly what a code
    change shapes. EXEMPT files and docstring-only __init__ files need no dep."""
    module, deps = stage_code_deps()[stage]
    used = {rel(m) for m in closure(module)}
    needed = {f for f in used if f not in EXEMPT and not (f.endswith("__init__.py") and is_docstring_only(REPO / f))}
    for f in sorted(needed):
        covered = [d for d in deps if f == d or f.startswith(d.rstrip("/") + "/")]
        assert covered, f"dvc.yaml stage {stage}: imports {f}, which no dep covers"
    for d in deps:
        path = REPO / d
        assert path.exists(), f"dvc.yaml stage {stage}: dep {d} does not exist"
        files = {str(p.relative_to(REPO)) for p in path.rglob("*.py")} if path.is_dir() else {d}
        files = {f for f in files if not (f.endswith("__init__.py") and is_docstring_only(REPO / f))}
        unused = sorted(files - used)
        assert not unused, f"dvc.yaml stage {stage}: dep {d} covers {unused}, which the stage never imports"


@pytest.mark.parametrize("stage", TORCH_FREE_STAGES)
def test_data_stages_import_no_torch(stage):
    for module in sorted(closure(f"stages.{stage}")):
        heavy = sorted(GRAPH[module][1] & set(HEAVY))
        assert not heavy, f"stages/{stage}.py reaches {rel(module)}, which imports {heavy}"


def test_only_generate_and_eval_import_vllm():
    for module, (_, theirs) in GRAPH.items():
        if "vllm" in theirs:
            assert package_of(module) in VLLM_PACKAGES, f"{rel(module)} imports vllm"


def test_no_module_over_500_lines():
    for module, path in MODULES.items():
        lines = len(path.read_text().splitlines())
        assert lines <= 500, f"{rel(module)}: {lines} lines; split it by concept (~500 at most)"


def test_every_path_and_design_section_named_in_the_repo_exists():
    """Docs and comments name files of this repo (docs/design/*.md pages included): all of them must exist (the
    repo stands on its own: nothing points outside it)."""
    import subprocess

    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True).stdout.split()
    texts = [f for f in files if f.endswith((".py", ".md", ".yaml", ".sh")) or f in ("Makefile", ".ci/run")]
    texts.remove("tests/unit/project/test_layout.py")  # its regular expressions are not paths
    path_re = re.compile(
        r"(?<![\w/.~-])((?:dflash|stages|tests|benchmarks|docs|params|docker|requirements)/[\w./-]*\w)"
    )
    for f in texts:
        text = (REPO / f).read_text()
        outside = [w for w in (".." + "/shared", "DESIGN" + ".md") if w in text]  # spelled apart: not a match here
        assert not outside, f"{f}: points outside the repository ({outside})"
        for path in path_re.findall(text):
            if any(c in path for c in "*<>{$") or re.search(r"\b[A-Z]+\b", path):  # a pattern: stages/NAME.py
                continue
            assert (REPO / path).exists() or (REPO / path).with_suffix("").exists(), f"{f}: names {path}, absent"


def _top_level_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def test_every_name_imported_from_dflash_exists():
    """`from dflash.x import y` anywhere (library, stages, benchmarks, tests; lazy imports included) names a
    module or a top-level name that exists: a moved or renamed function fails here, not in a rarely-run script."""
    for folder in ("dflash", "stages", "benchmarks", "tests"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith(("dflash", "stages")):
                    continue
                assert node.module in MODULES, f"{path.relative_to(REPO)}:{node.lineno}: no module {node.module}"
                for alias in node.names:
                    if f"{node.module}.{alias.name}" in MODULES:
                        continue
                    defined = _top_level_names(MODULES[node.module])
                    assert alias.name in defined, (
                        f"{path.relative_to(REPO)}:{node.lineno}: {node.module} has no {alias.name}"
                    )
