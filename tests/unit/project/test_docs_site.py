"""The README and the documentation site: every link resolves, the site builds strictly, figures stay in results.

- `mkdocs build --strict` of the whole site (mkdocs.yml: a broken link or anchor, a page outside the nav, or a
  generated page that cannot be generated fails it), into a temp folder; the generated pages hold their content.
- Every relative link in README.md resolves to a file of the repo (and its #anchor to a heading of that page).
- README.md stays short, its headline tau is the committed reports/eval.json's, and it carries no dates or commit
  hashes: dated figures live only in docs/results/.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _without_code(text: str) -> str:
    """Markdown text without fenced code blocks and inline code (links there are not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def _anchors(page: Path) -> set[str]:
    """The anchors mkdocs gives a page's headings (the toc extension's default slugs)."""
    from markdown.extensions.toc import slugify

    headings = re.findall(r"^#{1,6} (.+?)\s*$", _without_code(page.read_text()), flags=re.M)
    return {slugify(h.replace("`", ""), "-") for h in headings}


def broken_links(markdown_file: Path, repo: Path) -> list[str]:
    """Relative links of a markdown file that do not resolve to a file of the repo (or to an anchor of it)."""
    broken = []
    for target in LINK.findall(_without_code(markdown_file.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ... are not checked here
            continue
        path, _, anchor = target.partition("#")
        dest = (markdown_file.parent / path).resolve() if path else markdown_file
        if not dest.is_file() or repo.resolve() not in dest.parents:
            broken.append(f"{target}: no such file in the repository")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(repo.resolve())}")
    return broken


def test_readme_links_resolve(repo_root):
    assert broken_links(repo_root / "README.md", repo_root) == []


def test_a_broken_readme_link_is_found(repo_root, tmp_path):
    """The checker itself: a link to a missing page and one to a missing anchor are both reported."""
    (tmp_path / "pages").mkdir()
    (tmp_path / "pages/page.md").write_text("# Page\n\n## Real section\n")
    (tmp_path / "README.md").write_text(
        "[ok](pages/page.md#real-section) [gone](pages/nope.md) [bad anchor](pages/page.md#nope) `[code](x.md)`\n"
    )
    assert broken_links(tmp_path / "README.md", tmp_path) == [
        "pages/nope.md: no such file in the repository",
        "pages/page.md#nope: no heading with anchor #nope in pages/page.md",
    ]


def test_readme_is_short_and_undated(repo_root):
    text = (repo_root / "README.md").read_text()
    assert len(text.splitlines()) <= 200, "README.md: over 200 lines; move the detail into docs/"
    prose = _without_code(text)
    assert not re.findall(r"\b20\d\d-\d\d-\d\d\b", prose), "README.md: a dated figure; it belongs in docs/results/"
    hashes = [h for h in re.findall(r"\b[0-9a-f]{7,40}\b", text) if re.search(r"\d", h) and re.search(r"[a-f]", h)]
    assert not hashes, f"README.md: commit hashes {hashes}; measured figures belong in docs/results/"


def test_dates_appear_only_in_results(repo_root):
    """Outside docs/results/, the site's pages carry no dated figures."""
    dated = [
        f"{page.relative_to(repo_root)}: {m}"
        for page in sorted((repo_root / "docs").rglob("*.md"))
        if "results" not in page.relative_to(repo_root / "docs").parts
        for m in re.findall(r"\b20\d\d-\d\d-\d\d\b", page.read_text())
    ]
    assert dated == []


def committed_eval_report(repo_root: Path) -> dict:
    """reports/eval.json as committed (`git show HEAD:reports/eval.json`): a `make demo` rewrites the working copy
    with this machine's figures, and the README quotes the committed run. Without git (or outside a checkout),
    the working copy."""
    try:
        out = subprocess.run(
            ["git", "show", "HEAD:reports/eval.json"], cwd=repo_root, capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.SubprocessError):
        out = None
    if out is not None and out.returncode == 0:
        return json.loads(out.stdout)
    return json.loads((repo_root / "reports/eval.json").read_text())


def test_readme_headline_is_the_committed_eval_report(repo_root):
    """The README's headline tau and speedup figures are read from the committed reports/eval.json, not remembered (a demo run
    that rewrote the working copy does not change what the README quotes)."""
    text = (repo_root / "README.md").read_text()
    report = committed_eval_report(repo_root)
    headline = text[text.index("**Headline result**") :].split("\n\n")[0]
    for key in ("tau", "tau_reference", "tau_untrained", "tau_ngram", "speedup"):
        assert f"{report[key]}" in headline, f"README.md headline: {key} {report[key]} (reports/eval.json) missing"


def test_the_committed_report_is_read_past_a_rewritten_working_copy(tmp_path):
    reports = tmp_path / "reports"
    reports.mkdir()
    (reports / "eval.json").write_text(json.dumps({"tau": 2.5}))
    assert committed_eval_report(tmp_path) == {"tau": 2.5}  # no git checkout: the working copy
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@127.0.0.1", "-c", "commit.gpgsign=false"]
    for cmd in (["init", "-q"], ["add", "reports/eval.json"], ["commit", "-qm", "report"]):
        subprocess.run([*git, *cmd], cwd=tmp_path, check=True, capture_output=True)
    (reports / "eval.json").write_text(json.dumps({"tau": 3.6}))  # what a demo on another machine writes
    assert committed_eval_report(tmp_path) == {"tau": 2.5}


def test_nothing_points_outside_the_repository(repo_root):
    needles = ["/work/" + "shared", ".." + "/shared"]  # spelled apart: this file is tracked too
    out = subprocess.run(
        ["git", "grep", "-n", "-F", *sum((["-e", n] for n in needles), [])],
        cwd=repo_root,
        capture_output=True,
        text=True,
    )
    assert out.stdout == "", out.stdout


def test_mkdocs_build_strict(repo_root, tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is in requirements/cpu.txt (make setup); not in the GPU image")
    site = tmp_path / "site"
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=repo_root,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    # The generated pages hold what they are generated from.
    params_page = (site / "reference/params.html").read_text()
    assert "train.loss_target" in params_page and "target_argmax" in params_page  # key and its GPU overlay value
    demo_page = (site / "results/demo.html").read_text()
    assert (
        "reports/eval.json" in demo_page
        and str(json.loads((repo_root / "reports/eval.json").read_text())["tau"]) in demo_page
    )
    assert "deadline cluster" in (site / "results/plan.html").read_text()
