"""The house's figures: how typed, how long and how entangled the library's code is, measured from the source.

Purpose: the figures a structural change (issue "the house, second pass") is judged by, re-measured the same way
before and after it, on any checkout:
- typing share: annotated function arguments / all arguments, per package of dflash/ (`self` / `cls` of methods
  left out; *args and **kwargs counted; nested functions included, lambdas not);
- long functions: functions (and methods) of dflash/ and stages/ over 60 and over 100 lines (`def` line to last line);
- long files: Python files of dflash/, stages/, tests/ and benchmarks/ over 400 lines;
- wide calls: calls in dflash/ with 7 or more positional arguments, per package;
- string-key reads in the plan report: `x["key"]` subscripts with a string constant (and `.get("key")` calls) in
  dflash/plan/report.py and its report_*.py sections;
- the forwarding walk: a static walk of one training step's calls, starting at `Trainer.compute_gradients` (the
  class Trainer in dflash/train/), descending into every call it can resolve inside dflash/train/ (methods of
  `self`, of attributes typed on the class or assigned a constructor in `__init__`, of typed parameters; functions
  and classes imported from dflash.train modules), arguments before the call (as Python evaluates them), each
  function entered once per path. Control moves into a callee and back to the caller; the figure is how many
  times that sequence of files, kept to the Trainer's file and dflash/train/data.py, changes file.

Inputs: the checkout at --root (default: this repository). Nothing is imported or run; the source is parsed.
Outputs: the figures as a markdown table on stdout; with --json FILE also as JSON; with --list, the long functions,
long files and wide calls by name.

    python benchmarks/house_figures.py [--root DIR] [--json FILE] [--list]
"""

from __future__ import annotations

import argparse
import ast
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FUNCTION_LIMITS = (60, 100)
FILE_LIMIT = 400
WIDE_CALL = 7  # positional arguments
STEP_CLASS, STEP_METHOD = "Trainer", "compute_gradients"
DATA_FILE = "dflash/train/data.py"


@dataclass
class Figures:
    typed_share: dict[str, float]  # package -> annotated / all arguments (percent); "all" over dflash/
    typed_counts: dict[str, list[int]]  # package -> [annotated, all]
    functions_over: dict[str, list[str]]  # "60" / "100" -> "file:line name (N lines)"
    files_over: list[str]  # "file (N lines)"
    wide_calls: dict[str, list[str]]  # package -> "file:line callee (N positional)"
    plan_report_string_keys: int
    walk_alternations: int
    walk_files: list[str] = field(default_factory=list)  # the walk's file sequence (consecutive repeats merged)


def _functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _methods(tree: ast.AST) -> set[int]:
    """ids of the function nodes defined directly in a class body (their first argument is self / cls)."""
    return {
        id(item)
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        for item in node.body
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
    }


def typing_counts(path: Path) -> tuple[int, int]:
    tree = ast.parse(path.read_text())
    methods = _methods(tree)
    typed = total = 0
    for fn in _functions(tree):
        a = fn.args
        args = [*a.posonlyargs, *a.args, *a.kwonlyargs, *(x for x in (a.vararg, a.kwarg) if x)]
        static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)
        if id(fn) in methods and not static and args and args[0].arg in ("self", "cls"):
            args = args[1:]
        total += len(args)
        typed += sum(x.annotation is not None for x in args)
    return typed, total


def _py(root: Path, *folders: str) -> list[Path]:
    return sorted(p for f in folders for p in (root / f).rglob("*.py") if ".venv" not in p.parts)


def long_functions(root: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {str(n): [] for n in FUNCTION_LIMITS}
    for path in _py(root, "dflash", "stages"):
        for fn in _functions(ast.parse(path.read_text())):
            n = fn.end_lineno - fn.lineno + 1
            for limit in FUNCTION_LIMITS:
                if n > limit:
                    out[str(limit)].append(f"{path.relative_to(root)}:{fn.lineno} {fn.name} ({n} lines)")
    return out


def long_files(root: Path) -> list[str]:
    out = []
    for path in _py(root, "dflash", "stages", "tests", "benchmarks"):
        n = len(path.read_text().splitlines())
        if n > FILE_LIMIT:
            out.append(f"{path.relative_to(root)} ({n} lines)")
    return out


def wide_calls(root: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for path in _py(root, "dflash"):
        pkg = path.relative_to(root / "dflash").parts[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                positional = [a for a in node.args if not isinstance(a, ast.Starred)]
                if len(positional) >= WIDE_CALL:
                    name = ast.unparse(node.func)
                    out.setdefault(pkg, []).append(f"{path.relative_to(root)}:{node.lineno} {name} ({len(positional)})")
    return out


def plan_report_string_keys(root: Path) -> int:
    n = 0
    for path in sorted((root / "dflash/plan").glob("report*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
                n += isinstance(node.slice.value, str)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
                n += bool(node.args) and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
    return n


# --------------------------------------------------------------------------------------------------- the walk


@dataclass
class _Module:
    path: str  # relative to the root
    tree: ast.Module
    functions: dict[str, ast.FunctionDef] = field(default_factory=dict)
    classes: dict[str, ast.ClassDef] = field(default_factory=dict)
    imported: dict[str, tuple[str, str | None]] = field(default_factory=dict)  # alias -> (module, name or None)


class Walk:
    """The static call walk of the module docstring, over dflash/train/."""

    def __init__(self, root: Path):
        self.modules: dict[str, _Module] = {}
        for path in _py(root, "dflash/train"):
            rel = str(path.relative_to(root))
            name = rel.removesuffix(".py").replace("/", ".")
            tree = ast.parse(path.read_text())
            mod = _Module(rel, tree)
            for node in tree.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    mod.functions[node.name] = node
                elif isinstance(node, ast.ClassDef):
                    mod.classes[node.name] = node
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dflash"):
                    for a in node.names:
                        mod.imported[a.asname or a.name] = (node.module, a.name)
                elif isinstance(node, ast.Import):
                    for a in node.names:
                        if a.name.startswith("dflash"):
                            mod.imported[a.asname or a.name] = (a.name, None)
            self.modules[name] = mod
        self.sequence: list[str] = []

    # -- resolution
    def _module_of(self, module: str, name: str | None) -> tuple[str, str | None]:
        """(module, attribute) of an import: `from dflash.train import data` names the module data."""
        if name is not None and f"{module}.{name}" in self.modules:
            return f"{module}.{name}", None
        return module, name

    def _symbol(self, mod: str, name: str) -> tuple[str, ast.AST] | None:
        m = self.modules.get(mod)
        if m is None:
            return None
        if name in m.functions:
            return mod, m.functions[name]
        if name in m.classes:
            return mod, m.classes[name]
        if name in m.imported:
            target, attr = self._module_of(*m.imported[name])
            if attr is not None:
                return self._symbol(target, attr)
        return None

    def _class(self, mod: str, annotation: ast.AST | None) -> tuple[str, ast.ClassDef] | None:
        if annotation is None:
            return None
        if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
            annotation = ast.parse(annotation.value, mode="eval").body
        for node in ast.walk(annotation):
            if isinstance(node, ast.Name):
                found = self._symbol(mod, node.id)
                if found and isinstance(found[1], ast.ClassDef):
                    return found
        return None

    def _method(self, mod: str, cls: ast.ClassDef, name: str) -> tuple[str, ast.AST] | None:
        for item in cls.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == name:
                return mod, item
        for base in cls.bases:
            found = self._class(mod, base)
            if found:
                hit = self._method(*found, name)
                if hit:
                    return hit
        return None

    def _attribute_class(self, mod: str, cls: ast.ClassDef, attr: str) -> tuple[str, ast.ClassDef] | None:
        for item in cls.body:  # declared on the class
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.target.id == attr:
                return self._class(mod, item.annotation)
        for item in ast.walk(cls):  # self.attr: T = ... / self.attr = Cls(...) anywhere in its methods
            if isinstance(item, ast.AnnAssign) and ast.unparse(item.target) == f"self.{attr}":
                return self._class(mod, item.annotation)
            assigned = isinstance(item, ast.Assign) and any(ast.unparse(t) == f"self.{attr}" for t in item.targets)
            if assigned and isinstance(item.value, ast.Call):
                found = self._class(mod, item.value.func)
                if found:
                    return found
        for base in cls.bases:
            found = self._class(mod, base)
            if found:
                hit = self._attribute_class(*found, attr)
                if hit:
                    return hit
        return None

    def _resolve(self, mod: str, cls, fn, call: ast.Call):
        f = call.func
        if isinstance(f, ast.Name):
            found = self._symbol(mod, f.id)
            if found and isinstance(found[1], ast.ClassDef):
                return self._method(*found, "__init__")
            return found
        if not isinstance(f, ast.Attribute):
            return None
        owner = f.value
        if isinstance(owner, ast.Name) and owner.id == "self" and cls is not None:
            return self._method(*cls, f.attr)
        if isinstance(owner, ast.Attribute) and isinstance(owner.value, ast.Name) and owner.value.id == "self":
            typed = self._attribute_class(*cls, owner.attr) if cls is not None else None
            return self._method(*typed, f.attr) if typed else None
        if isinstance(owner, ast.Name):
            m = self.modules[mod]
            if owner.id in m.imported:
                target, attr = self._module_of(*m.imported[owner.id])
                if attr is None:
                    return self._symbol(target, f.attr)
            found = self._symbol(mod, owner.id)
            if found and isinstance(found[1], ast.ClassDef):
                return self._method(*found, f.attr)
            for a in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]:
                if a.arg == owner.id:
                    typed = self._class(mod, a.annotation)
                    return self._method(*typed, f.attr) if typed else None
        return None

    # -- the walk
    @staticmethod
    def _calls(node: ast.AST):
        """Calls inside `node` in evaluation order (arguments first; comprehensions: their iterables first)."""
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            return
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            children = [*node.generators, *(getattr(node, k) for k in ("key", "value", "elt") if hasattr(node, k))]
        else:
            children = list(ast.iter_child_nodes(node))
        for child in children:
            yield from Walk._calls(child)
        if isinstance(node, ast.Call):
            yield node

    def _class_of(self, mod: str, fn: ast.AST) -> tuple[str, ast.ClassDef] | None:
        for cls in self.modules[mod].classes.values():
            if fn in cls.body:
                return mod, cls
        return None

    def visit(self, mod: str, fn, stack: tuple) -> None:
        here = self.modules[mod].path
        self.sequence.append(here)
        cls = self._class_of(mod, fn)
        for stmt in fn.body:
            for call in self._calls(stmt):
                target = self._resolve(mod, cls, fn, call)
                if target is None or id(target[1]) in stack:
                    continue
                self.visit(target[0], target[1], (*stack, id(target[1])))
                self.sequence.append(here)

    def step(self) -> list[str]:
        for name, m in self.modules.items():
            if STEP_CLASS in m.classes:
                found = self._method(name, m.classes[STEP_CLASS], STEP_METHOD)
                if found:
                    self.visit(*found, (id(found[1]),))
                    return self.sequence
        raise SystemExit(f"no {STEP_CLASS}.{STEP_METHOD} in dflash/train/")


def forwarding_walk(root: Path) -> tuple[int, list[str]]:
    walk = Walk(root)
    seq = walk.step()
    trainer_file = seq[0]
    kept = [f for f in seq if f in (trainer_file, DATA_FILE)]
    merged = [f for i, f in enumerate(seq) if i == 0 or f != seq[i - 1]]
    return sum(a != b for a, b in zip(kept, kept[1:], strict=False)), merged


def measure(root: Path) -> Figures:
    counts: dict[str, list[int]] = {}
    for path in _py(root, "dflash"):
        parts = path.relative_to(root / "dflash").parts
        if len(parts) < 2:
            continue
        typed, total = typing_counts(path)
        c = counts.setdefault(parts[0], [0, 0])
        c[0] += typed
        c[1] += total
    counts = dict(sorted(counts.items()))
    counts["all"] = [sum(c[0] for c in counts.values()), sum(c[1] for c in counts.values())]
    alternations, files = forwarding_walk(root)
    return Figures(
        typed_share={k: round(100 * a / n, 1) if n else 100.0 for k, (a, n) in counts.items()},
        typed_counts=counts,
        functions_over=long_functions(root),
        files_over=long_files(root),
        wide_calls=wide_calls(root),
        plan_report_string_keys=plan_report_string_keys(root),
        walk_alternations=alternations,
        walk_files=files,
    )


def markdown(f: Figures, listing: bool) -> str:
    rows = [
        f"| typed arguments, dflash/{k} | {v}% ({f.typed_counts[k][0]} / {f.typed_counts[k][1]}) |"
        for k, v in f.typed_share.items()
        if k != "all"
    ]
    rows += [
        f"| typed arguments, all of dflash/ | {f.typed_share['all']}% |",
        *(f"| functions over {k} lines (dflash/, stages/) | {len(v)} |" for k, v in f.functions_over.items()),
        f"| files over {FILE_LIMIT} lines (dflash/, stages/, tests/, benchmarks/) | {len(f.files_over)} |",
        *(
            f"| calls with >= {WIDE_CALL} positional arguments, dflash/{k} | {len(v)} |"
            for k, v in f.wide_calls.items()
        ),
        f"| string-key reads in the plan report (report.py, report_*.py) | {f.plan_report_string_keys} |",
        f"| forwarding walk: file changes between the Trainer's file and data.py in one step | {f.walk_alternations} |",
    ]
    out = ["| figure | value |", "|---|---|", *rows]
    if listing:
        for k, v in f.functions_over.items():
            out += ["", f"Functions over {k} lines:", *(f"- {x}" for x in v)]
        out += ["", f"Files over {FILE_LIMIT} lines:", *(f"- {x}" for x in f.files_over)]
        for k, v in f.wide_calls.items():
            out += ["", f"Wide calls in dflash/{k}:", *(f"- {x}" for x in v)]
        out += ["", "The walk's files:", " -> ".join(Path(x).name for x in f.walk_files)]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=REPO, help="the checkout to measure (default: this one)")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON here")
    parser.add_argument("--list", action="store_true", help="name the long functions, long files and wide calls")
    args = parser.parse_args()
    figures = measure(args.root.resolve())
    print(markdown(figures, args.list))
    if args.json:
        args.json.write_text(json.dumps(asdict(figures), indent=2) + "\n")


if __name__ == "__main__":
    main()
