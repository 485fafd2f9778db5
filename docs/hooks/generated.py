"""mkdocs hook: the documentation pages whose content is generated at build time, from one source each.

A page asks for generated content with a marker line, `<!-- generated: KIND ARG... -->`; this hook replaces
the marker with markdown before mkdocs renders the page (so the generated links and anchors are checked by
the same strict validation as the rest of the site). Kinds:

    params                      the params reference: one table per params.yaml section, from the dataclasses
                                in dflash/core/params.py (key, type, the field's comment), the value in
                                params.yaml and the one in the GPU overlay params/gpu-qwen3.6-27b.yaml
    metrics DIR                 every stage's headline metrics file DIR/NAME.json as a table
    report FILE                 a committed markdown report (reports/eval.md), headings moved down two levels
    sweep FILE                  a pilot.json's concurrency sweep as a table
    plan-case                   the plan of the real job (the GPU overlay), computed now by the plan stage's
                                own code, for the overlay and the variants the guides discuss
    plan-report                 that plan's whole report (what `python -m stages.plan --overlay ...` prints)
    provenance FILE...          which commit last changed the files, and when (`git log -1`)
    layout dflash | packages    the library's map from its package docstrings: dflash/__init__.py's, or every
                                package's (core, drafter, then the stages in pipeline order), each verbatim

Anything it cannot read or parse (a field without a comment, a missing report, an unknown kind) stops the
build with an error naming the file: a generated page is never silently empty.

Wired in by mkdocs.yml (`hooks: [docs/hooks/generated.py]`); runs in `make docs` and tests/unit/project/test_docs_site.py.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import json
import re
import subprocess
import sys
import tokenize
import typing
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

REPO = Path(__file__).resolve().parents[2]
GPU_OVERLAY = "params/gpu-qwen3.6-27b.yaml"
MARKER = re.compile(r"^<!-- generated: ([\w-]+)((?: [^ \n]+)*) -->$", re.M)
STAGES = ["target", "audit", "pilot", "generate", "tokenize", "train", "eval", "plan"]


def on_config(config: Any) -> Any:
    """The renderers import the project's own params schema and plan code: put the repository on sys.path."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    return config


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    def replace(m: re.Match) -> str:
        kind, args = m.group(1), m.group(2).split()
        render = RENDERERS.get(kind)
        if render is None:
            raise PluginError(f"{page.file.src_path}: unknown generated block '{kind}' (known: {sorted(RENDERERS)})")
        try:
            return render(*args)
        except PluginError:
            raise
        except Exception as exc:  # a page must never be built half-generated
            raise PluginError(f"{page.file.src_path}: generated block '{m.group(0)}' failed: {exc!r}") from exc

    return MARKER.sub(replace, markdown)


# ---- small helpers -----------------------------------------------------------------------------------------


def _cell(value: Any, digits: int = 0) -> str:
    """A value as one markdown table cell, in code: strings as they are, the rest as JSON (true, null, [...]);
    `digits` > 0 rounds floats to that many significant digits (metrics), 0 keeps them as written (params)."""
    if isinstance(value, str):
        text = value
    elif isinstance(value, float) and digits:
        text = f"{value:.{digits}g}"
    else:
        text = json.dumps(value, separators=(", ", ": "))
    return f"`{text}`" if text else '`""`'


def _text(text: str) -> str:
    """Prose in a table cell: a bare | would start a new column (inside code spans it is fine)."""
    return text.replace("|", "\\|")


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _read(rel: str) -> str:
    path = REPO / rel
    if not path.is_file():
        raise PluginError(f"generated docs: {rel} does not exist (run the command the page names to produce it)")
    return path.read_text()


def provenance(*rels: str) -> str:
    """`git log -1` of the files: the commit that last changed them and its date."""
    out = subprocess.run(
        ["git", "log", "-1", "--format=%h %cs", "--", *rels], cwd=REPO, capture_output=True, text=True, check=False
    )
    names = ", ".join(f"`{r}`" for r in rels)
    if out.returncode != 0 or not out.stdout.strip():
        return f"Source: {names} (not committed yet: no commit or date to show)."
    commit, date = out.stdout.split()
    return f"Source: {names}, committed in `{commit}` on {date} (`git log -1 -- {' '.join(rels)}`)."


# ---- params reference ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class FieldDoc:
    annotation: str  # the type as written in dflash/core/params.py
    comment: str  # the field's comment (the same words as params.yaml's)


def field_docs(*paths: Path) -> tuple[dict[str, dict[str, FieldDoc]], dict[str, str]]:
    """dataclass name -> field -> FieldDoc, and dataclass name -> docstring, read from the source: a field's
    comment is every `#` comment inside its statement's lines (ruff may wrap a long annotation, putting the
    comment on a later line). A field without a comment is an error, unless its type is a section of its own
    (a dataclass of the file: its docstring says what it is)."""
    fields: dict[str, dict[str, FieldDoc]] = {}
    docs: dict[str, str] = {}
    trees = {path: ast.parse(path.read_text()).body for path in paths}  # the schema's files (params.py, params_plan.py)
    sections = {node.name for body in trees.values() for node in body if isinstance(node, ast.ClassDef)}
    for path, body in trees.items():
        _file_docs(path, body, sections, fields, docs)
    return fields, docs


def _file_docs(path: Path, body: list, sections: set[str], fields: dict, docs: dict) -> None:
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    classes = [node for node in body if isinstance(node, ast.ClassDef)]
    aliases = {  # EvalEngine = Literal[...]: the page shows what the name stands for
        node.targets[0].id: ast.unparse(node.value)
        for node in body
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
    }
    for node in classes:
        docs[node.name] = " ".join((ast.get_docstring(node) or "").split())
        fields[node.name] = {}
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            said = [comments[n] for n in range(stmt.lineno, stmt.end_lineno + 1) if n in comments]
            if not said and ast.unparse(stmt.annotation) not in sections:
                raise PluginError(
                    f"{path.relative_to(REPO)}:{stmt.lineno}: {node.name}.{stmt.target.id} has no comment"
                )
            annotation = re.sub(r"\b\w+\b", lambda m: aliases.get(m.group(0), m.group(0)), ast.unparse(stmt.annotation))
            fields[node.name][stmt.target.id] = FieldDoc(annotation, " ".join(said))


def _lookup(tree: Any, key: str) -> tuple[bool, Any]:
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return False, None
        tree = tree[part]
    return True, tree


def render_params() -> str:
    from dflash.core.loader import read_yaml
    from dflash.core.params import Params

    fields, docs = field_docs(REPO / "dflash/core/params.py", REPO / "dflash/core/params_plan.py")
    values, overlay = read_yaml(REPO / "params.yaml"), read_yaml(REPO / GPU_OVERLAY, "overlay file")
    out: list[str] = []

    def section(cls: type, prefix: str, level: int) -> None:
        hints = typing.get_type_hints(cls)
        rows, nested = [], []
        for f in dataclasses.fields(cls):
            key, doc = f"{prefix}{f.name}", fields[cls.__name__][f.name]
            found, value = _lookup(values, key)
            if not found:
                raise PluginError(f"params.yaml: {key} (a field of {cls.__name__}) is missing")
            tp = hints[f.name]
            item = typing.get_args(tp)[1] if typing.get_origin(tp) is dict else None
            if dataclasses.is_dataclass(tp):
                nested.append((tp, f"{key}.", doc.comment))
                continue
            if item is not None and dataclasses.is_dataclass(item):  # a mapping of named entries
                nested.append((item, f"{key}.<name>.", doc.comment))
            in_overlay, gpu = _lookup(overlay, key)
            rows.append(
                [f"`{key}`", f"`{doc.annotation}`", _cell(value), _cell(gpu) if in_overlay else "", _text(doc.comment)]
            )
        if rows:
            out.append(_table(["key", "type", "params.yaml", "GPU overlay", "what it is"], rows) + "\n")
        for tp, sub, comment in nested:
            about = " ".join(x for x in (f"{comment}." if comment else "", docs[tp.__name__]) if x)
            out.append(f"{'#' * level} `{sub.rstrip('.')}`\n\n{about}\n")
            if "<name>" in sub:  # the entries' fields, documented once; the values are the parent row's
                rows = [
                    [
                        f"`{g.name}`",
                        f"`{fields[tp.__name__][g.name].annotation}`",
                        _text(fields[tp.__name__][g.name].comment),
                    ]
                    for g in dataclasses.fields(tp)
                ]
                out.append(_table(["field of each entry", "type", "what it is"], rows) + "\n")
            else:
                section(tp, sub, min(level + 1, 6))

    for f in dataclasses.fields(Params):
        cls = typing.get_type_hints(Params)[f.name]
        out.append(f"## `{f.name}`\n\n{docs[cls.__name__]}\n")
        section(cls, f"{f.name}.", 3)
    text = "\n".join(out)
    if text.count("\n| `") < 150:  # the schema has ~250 keys: far fewer means the parse went wrong
        raise PluginError(f"params reference: only {text.count(chr(10) + '| `')} rows rendered")
    return text


# ---- reports ------------------------------------------------------------------------------------------------


def _flatten(d: dict, prefix: str = "") -> list[tuple[str, Any]]:
    rows = []
    for k, v in d.items():
        if isinstance(v, dict) and v and all(not isinstance(x, (dict, list)) for x in v.values()):
            rows += _flatten(v, f"{prefix}{k}.")
        elif isinstance(v, (dict, list)) and len(json.dumps(v)) > 120:
            continue  # long structures (the sweep, per prompt set) have their own tables
        else:
            rows.append((f"{prefix}{k}", v))
    return rows


def render_metrics(folder: str) -> str:
    out = []
    for stage in STAGES:
        rel = f"{folder}/{stage}.json"
        data = json.loads(_read(rel))
        rows = [[f"`{k}`", _cell(v, digits=5)] for k, v in _flatten(data)]
        out.append(f"### {stage}\n\n{provenance(rel)}\n\n" + _table(["metric", "value"], rows) + "\n")
    return "\n".join(out)


def _lists_apart(text: str) -> str:
    """A blank line before a list that follows a paragraph line: GitHub renders the list without one, mkdocs's
    Markdown does not (it would join the items into the paragraph)."""
    return re.sub(r"^([^\n\-|#].*)\n(- )", r"\1\n\n\2", text, flags=re.M)


def _inline_images(text: str, folder: Path) -> str:
    """A report's pictures (PNGs beside it, e.g. reports/eval_acceptance.png) inside the page as data: URIs: the
    site shows them without copying files out of reports/, and one not committed yet is named, not a broken link."""
    import base64

    def image(m: re.Match) -> str:
        alt, target = m.group(1), m.group(2)
        if ":" in target:
            return m.group(0)
        path = folder / target
        if not path.is_file():
            return f"*(picture `{path.relative_to(REPO)}` not committed yet)*"
        return f"![{alt}](data:image/png;base64,{base64.b64encode(path.read_bytes()).decode('ascii')})"

    return re.sub(r"!\[([^\]]*)\]\(([^)\s]+)\)", image, text)


def render_report(rel: str) -> str:
    text = _inline_images(_lists_apart(_read(rel)), (REPO / rel).parent)
    text = re.sub(r"^(#{1,4}) ", lambda m: "#" * (len(m.group(1)) + 2) + " ", text, flags=re.M)
    return f"{provenance(rel)}\n\n{text}"


def render_sweep(rel: str) -> str:
    data = json.loads(_read(rel))
    sweep = data.get("sweep") or []
    if not sweep:
        raise PluginError(f"{rel}: no `sweep` (the pilot ran without generate.pilot_sweep)")
    cols = list(sweep[0])
    rows = [[_cell(level.get(c), digits=5) for c in cols] for level in sweep]
    knee = data.get("chosen_max_num_seqs")
    return (
        f"{provenance(rel)}\n\n"
        + _table([f"`{c}`" for c in cols], rows)
        + f"\n\nKnee (`chosen_max_num_seqs`): {knee}.\n"
    )


# ---- the plan of the real job -------------------------------------------------------------------------------

PLAN_VARIANTS = [  # (label, -S overrides): the overlay as committed, then what the guides discuss
    ("the overlay", []),
    ("generate.max_num_seqs=8 (vLLM's BF16 serving recipe)", ["generate.max_num_seqs=8"]),
    ("drafter.kind=dflash, train.position_weighting=dpace", ["drafter.kind=dflash", "train.position_weighting=dpace"]),
    (
        "drafter.kind=dflash, train.position_weighting=dpace, train.loss_target=tokens",
        ["drafter.kind=dflash", "train.position_weighting=dpace", "train.loss_target=tokens"],
    ),
    ("drafter.kind=dspark", ["drafter.kind=dspark"]),
    ("plan.deadline_hours=72", ["plan.deadline_hours=72"]),
    ("plan.deadline_hours=72, plan.internode_gbps=25", ["plan.deadline_hours=72", "plan.internode_gbps=25"]),
    ("plan.deadline_hours=72, plan.internode_gbps=12.5", ["plan.deadline_hours=72", "plan.internode_gbps=12.5"]),
]


def _days(hours: float) -> str:
    return f"{hours:,.1f} h ({hours / 24:.1f} d)"


def _plan(overrides: list[str]) -> Any:
    """The plan (dflash/plan/result.py `Plan`) of the overlay with `overrides`, held against the published runs."""
    from dflash.core.loader import load_params
    from dflash.plan.estimate import build_plan
    from dflash.plan.published import PublishedRuns

    empty = ["plan.audit_json=", "plan.tokenize_json=", "plan.pilot_json="]  # no demo metrics: another target
    params = load_params(REPO / "params.yaml", overrides=[*empty, *overrides], overlays=[REPO / GPU_OVERLAY])
    return build_plan(params, published=PublishedRuns.beside(REPO / "params.yaml"))


def render_plan_report() -> str:
    """The whole plan.md of the overlay as committed, headings moved down two levels."""
    from dflash.core.figures import data_uri, render_png
    from dflash.plan.report import FIGURE, render_markdown, time_vs_gpus

    plan = _plan([])
    text = _lists_apart(render_markdown(plan))
    text = text.replace(f"]({FIGURE})", f"]({data_uri(render_png(time_vs_gpus(plan.scaling)))})")  # drawn now
    return re.sub(r"^(#{1,4}) ", lambda m: "#" * (len(m.group(1)) + 2) + " ", text, flags=re.M)


def render_plan_case() -> str:
    rows = []
    for label, overrides in PLAN_VARIANTS:
        p = _plan(overrides)
        gen, train, deadline = p.generation, p.training, p.deadline
        drafter_gpu = train.headline.per_gpu.get("drafter_gpu")
        cluster = ""
        if deadline is not None and deadline.met:
            cluster = (
                f"{deadline.gpus} GPUs = {deadline.nodes} x {deadline.gpus_per_node}: {deadline.total_hours:.1f} h"
            )
        elif deadline is not None:
            cluster = f"not met (best {deadline.best_hours:.1f} h)"
        rows.append(
            [
                label,
                f"{_days(gen.wall_hours.mid)}, {gen.memory.batch} seqs / engine",
                f"{train.layout}: {_days(train.headline.total_hours)}",
                f"{train.flops_per_sequence.total:.3g}",
                f"{drafter_gpu.need_gb:.1f} GB" if drafter_gpu is not None else "",
                cluster,
            ]
        )
    header = ["-S", "generation", "training", "FLOPs / seq", "drafter GPU", "deadline cluster"]
    return _table(header, rows) + "\n"


# ---- the library's map ------------------------------------------------------------------------------------

LAYOUT_ORDER = ["core", "drafter", "target", "audit", "generate", "tokenize", "train", "eval", "plan", "report"]


def _package_doc(folder: Path) -> str:
    doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text()))
    if not doc:
        raise PluginError(f"{folder.relative_to(REPO)}/__init__.py: no docstring")
    return doc


def render_layout(which: str) -> str:
    """`dflash`: the top package's docstring; `packages`: one section per package with its docstring (every package
    of dflash/, in LAYOUT_ORDER, any other after them)."""
    root = REPO / "dflash"
    if which == "dflash":
        return f"```text\n{_package_doc(root)}\n```\n"
    if which != "packages":
        raise PluginError(f"layout: expected `dflash` or `packages`, got {which!r}")
    found = sorted(p.parent.name for p in root.glob("*/__init__.py"))
    order = [p for p in LAYOUT_ORDER if p in found] + [p for p in found if p not in LAYOUT_ORDER]
    return "\n".join(f"### `dflash/{p}/`\n\n```text\n{_package_doc(root / p)}\n```\n" for p in order)


RENDERERS = {
    "params": render_params,
    "metrics": render_metrics,
    "report": render_report,
    "sweep": render_sweep,
    "plan-case": render_plan_case,
    "plan-report": render_plan_report,
    "provenance": provenance,
    "layout": render_layout,
}
