"""One place per drafter kind: outside the kind's own modules, nothing branches on a kind's name.

A kind is its modules (the drafter class's file, its loss module in dflash/train) plus its line in the registry,
dflash/drafter/kinds.py. Every other file asks the kind's spec (`spec_for(kind)`, `KINDS[kind]`), so adding a
kind touches only those. A "kind branch" here is, in code (docstrings and comments do not count):
  - a comparison with a kind's name or constant on a side (`kind == "dspark"`, `kind in (DSPARK, DFLASH2)`); the
    name "dflash" is also the eval engine of the trained drafter, so a bare "dflash" counts only when the other
    side names a kind (`drafter_kind != "dflash"`);
  - a dict keyed by kinds (`{"dspark": ..., "dflash2": ...}`, `{DFLASH: ...}`);
  - a tuple / list / set of two or more kinds (`("dspark", "dflash2")`, `choices=["dflash", "dspark"]`);
  - a subscript by a kind (`ARCHITECTURES[DSPARK]`).

Print the count per file: `.venv/bin/python -m tests.unit.project.test_kind_dispatch`.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

from tests.helpers import REPO

NAMES = {"dflash", "dspark", "dflash2"}  # the kinds' names as written in params (drafter.kind)
CONSTANTS = {"DFLASH", "DSPARK", "DFLASH2"}
SCANNED = ("dflash", "stages", "benchmarks")
# the params schema declares drafter.kind's values and each kind's params section; dflash.core cannot import the
# registry (tests/unit/drafter/test_kinds_geometry.py holds the two lists equal)
SCHEMA = "dflash/core/params.py"


def _token(node: ast.AST) -> str | None:
    """The kind a node names ("dflash" / "dspark" / "dflash2", or the constant's name), else None."""
    if isinstance(node, ast.Constant) and node.value in NAMES:
        return node.value
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    return name if name in CONSTANTS else None


def _tokens(node: ast.AST) -> list[str]:
    """Kinds named by a node or by the elements of a tuple / list / set it is."""
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return [t for e in node.elts if (t := _token(e))]
    return [t] if (t := _token(node)) else []


def _is_kind(tokens: list[str], other_sides: list[ast.AST]) -> bool:
    """A bare "dflash" is a kind only beside an expression that names a kind (else it is the eval engine)."""
    if any(t != "dflash" for t in tokens):
        return True
    return bool(tokens) and any("kind" in ast.unparse(n).lower() for n in other_sides)


def kind_branches(path: Path) -> int:
    """Kind branches in one Python file (module docstring)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    counted: set[int] = set()  # collections already counted as part of a comparison
    n = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            for side in sides:
                tokens = _tokens(side)
                if _is_kind(tokens, [s for s in sides if s is not side]):
                    n += 1
                    counted.update(id(s) for s in sides)
                    break
        elif isinstance(node, ast.Dict):
            keys = [t for k in node.keys if k is not None and (t := _token(k))]
            if keys and (len(keys) > 1 or keys[0] != "dflash"):
                n += 1
        elif isinstance(node, ast.Tuple | ast.List | ast.Set) and id(node) not in counted:
            if len(_tokens(node)) > 1:
                n += 1
        elif isinstance(node, ast.Subscript) and (t := _token(node.slice)) and t != "dflash":
            n += 1
    return n


def allowed_files() -> set[str]:
    """The registry and every kind's own modules (its drafter class's file, its loss module), from the registry."""
    from dflash.drafter.kinds import KINDS

    out = {"dflash/drafter/kinds.py"}
    for spec in KINDS.values():
        for dotted in (spec.drafter_class, spec.loss):
            out.add(dotted.rpartition(":")[0].replace(".", "/") + ".py")
    return out


def counts() -> Counter:
    """Kind branches per file (repository-relative paths) over dflash/, stages/ and benchmarks/."""
    out: Counter = Counter()
    for top in SCANNED:
        for path in sorted((REPO / top).rglob("*.py")):
            if n := kind_branches(path):
                out[str(path.relative_to(REPO))] = n
    return out


def test_the_counter_sees_each_form_of_kind_branch(tmp_path):
    src = tmp_path / "x.py"
    src.write_text(
        "a = kind == 'dspark'\n"  # 1
        "b = cfg.kind in (DSPARK, DFLASH2)\n"  # 2
        "c = {'dspark': 1, 'dflash2': 2}.get(kind)\n"  # 3
        "d = drafter_kind != 'dflash'\n"  # 4
        "e = ARCHITECTURES[DSPARK]\n"  # 5
        "f = ['dflash', 'dspark']\n"  # 6
        "g = engines.get('dflash')\n"  # the eval engine: not a kind
        "h = name in ('dflash', 'untrained')\n"  # engines: not a kind
        "i = spec_for(kind).query_slots(8)\n"  # the registry: not a branch
    )
    assert kind_branches(src) == 6


def test_only_a_kinds_own_modules_branch_on_kind_names():
    allowed = allowed_files() | {SCHEMA}
    assert "dflash/drafter/dspark.py" in allowed and "dflash/train/loss_dflash2.py" in allowed
    outside = {f: n for f, n in counts().items() if f not in allowed}
    assert not outside, f"files that branch on a drafter kind's name (ask dflash.drafter.kinds.spec_for): {outside}"


if __name__ == "__main__":
    found = counts()
    for name, n in sorted(found.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"{n:3d}  {name}")
    print(f"{sum(found.values()):3d}  total in {len(found)} files")
