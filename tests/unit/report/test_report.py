"""The report stage (dflash/report): the model stages' figures from their plot data, and one self-contained HTML
page of the run built from the committed reports: every image inline, every link local, a CSP, the params that
differ from the committed params.yaml, the dvc.lock identity of each stage. The page in a real browser:
tests/integration/test_report_html.py."""

from __future__ import annotations

import base64
import json
import re
from html.parser import HTMLParser

import pytest
import yaml

from dflash.core.figures import PNG_MAGIC
from dflash.eval.prompt_sets import set_rows
from dflash.report import charts
from dflash.report.page import CSP
from dflash.report.stage import run
from tests.helpers import REPO, repo_params
from tests.helpers.dvc import report_run

MODEL_FIGURES = ("pilot_sweep.png", "train_loss.png", "train_acceptance.png", "eval_acceptance.png")


class _Tags(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def _tags(text: str) -> list[tuple[str, dict]]:
    p = _Tags()
    p.feed(text)
    return p.tags


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    overrides = report_run(root)
    out = run(repo_params(overrides), "params.yaml", REPO / "dvc.lock")
    return out, out.read_text(encoding="utf-8")


def test_the_model_stages_figures_are_written_beside_the_reports(page):
    out, _ = page
    for name in MODEL_FIGURES:
        png = (out.parent / name).read_bytes()
        assert png.startswith(PNG_MAGIC) and len(png) > 10_000, name


def test_every_image_is_inline_and_nothing_is_fetched(page):
    out, text = page
    tags = _tags(text)
    images = [a["src"] for t, a in tags if t == "img"]
    # 7 figures (2 audit, pilot, 2 train, eval, plan) + the markdown reports' own pictures (one of them missing)
    shown = sum(p.read_text().count("![") for p in (out.parent / "eval.md", out.parent / "plan.md"))
    assert len(images) == 7 + 2 + shown, len(images)
    inline = [s for s in images if s]
    assert len(inline) == len(images) - 1, "the missing picture of the audit report is dropped, never fetched"
    for src in inline:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1]).startswith(PNG_MAGIC)
    assert not [t for t, _ in tags if t in ("script", "link", "iframe", "object", "embed")]
    assert not re.search(r"""(src|href)=["']?(https?:|//)""", text)
    assert f'content="{CSP}"' in text and "default-src 'none'" in CSP and "img-src data:" in CSP


def test_every_link_is_local_and_resolves(page):
    out, text = page
    hrefs = [a["href"] for t, a in _tags(text) if t == "a"]
    files = [h for h in hrefs if not h.startswith("#")]
    assert len(files) > 20
    for href in files:
        assert (out.parent / href).exists(), f"{href} does not resolve from {out.parent}"
    anchors = {a["id"] for _, a in _tags(text) if "id" in a}
    assert {h[1:] for h in hrefs if h.startswith("#")} <= anchors


def test_headline_metrics_params_and_stage_identities(page):
    out, text = page
    tau = json.loads((REPO / "reports/eval.json").read_text())["tau"]
    assert f"{tau:.3f}" in text and "tau in vLLM (trained drafter)" in text  # reports/eval.json's tau
    params = text[text.index('id="params"') : text.index('id="lock"')]
    assert "params.yaml as committed (git HEAD)" in params
    assert "<code>base.reports_dir</code>" in params and str(out.parent) in params
    assert "<code>train.epochs</code>" not in params  # only what differs
    lock = yaml.safe_load((REPO / "dvc.lock").read_text())["stages"]
    section = text[text.index('id="lock"') : text.index('id="files"')]
    for name in lock:
        if name != "report":
            assert re.search(rf"<td>{name}</td><td><code>[0-9a-f]{{12}}</code>", section), name
    # the markdown reports' tables came through as tables
    assert "<th>gate</th>" in text and "<td>crossed</td>" in text


def test_eval_figure_has_a_line_per_engine_and_the_reference_per_prompt_set(tmp_path):
    """From the engines' per-set counters (set_rows in dflash/eval/prompt_sets.py) to the figure's series."""

    def counters(acc):
        return {"tau": 1 + sum(acc), "num_drafts": 10, "num_accepted_tokens": 5, "acceptance_per_position": acc}

    def engine(acc):
        result = {"counters": counters(acc) if acc else counters([]), "output_tokens": 9, "tokens": [[1]]}
        return {"sets": {"heldout": result, "tasks": result}}

    engines = {"dflash": engine([0.8, 0.5]), "untrained": engine([0.0, 0.0]), "ngram": engine([0.4, 0.1])}
    engines["none"] = engine(None)
    reference = {
        "sets": {s: {**counters([0.8, 0.5]), "num_accepted_tokens_per_pos": [8, 5]} for s in ("heldout", "tasks")}
    }
    for s in engines.values():
        for r in s["sets"].values():
            r["counters"]["num_accepted_tokens_per_pos"] = [1, 1]
    meta = {s: {"source": s, "num_prompts": 1, "num_skipped": 0, "enable_thinking": True} for s in ("heldout", "tasks")}
    details = set_rows(meta, engines, reference, greedy=True)
    (tmp_path / "eval_details.json").write_text(__import__("json").dumps({"prompt_set_details": details}))
    fig = charts.eval_acceptance(repo_params([f"base.reports_dir={tmp_path}"]))
    rows = fig.spec["data"]["values"]
    series = {(r["prompt set"], r["engine"]) for r in rows}
    expected = {"dflash", "untrained", "ngram", "reference"}  # `none` drafts nothing: no line
    assert series == {(s, e) for s in ("heldout", "tasks") for e in expected}
    assert {r["measured by"] for r in rows if r["engine"] == "reference"} == {"PyTorch reference"}
    assert len(rows) == 2 * 4 * 2
    assert fig.spec["facet"]["column"]["field"] == "prompt set"


def test_a_run_without_outputs_still_gets_every_file(tmp_path):
    """Before any stage has run: the figures say they are empty, the page says what is missing; no crash."""
    params = repo_params(
        [f"base.reports_dir={tmp_path / 'r'}", f"audit.out={tmp_path / 'a'}", f"train.live_dir={tmp_path / 'l'}"]
    )
    (tmp_path / "r").mkdir()
    out = run(params, "params.yaml", tmp_path / "no.lock")
    for name in MODEL_FIGURES:
        assert (tmp_path / "r" / name).read_bytes().startswith(PNG_MAGIC)
    for fig in charts.model_figures(params):
        assert fig.spec["title"]["subtitle"].startswith("empty: "), fig.name
    text = out.read_text()
    assert "No stage has written its metrics yet" in text and "No dvc.lock" in text
    assert "Not drawn yet (their stages have not run): the audit&#x27;s response lengths" in text
    assert "the plan&#x27;s time vs GPU count." in text
