"""Eval prompt sets (dflash/eval/prompt_sets.py): every local source format, the thinking mode per set, errors
that name the set, file and row, and the table of eval.md. The per-set measurement through vLLM: test_eval.py."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash.core.errors import ParamsError, UserError
from dflash.core.hf import load_tokenizer
from dflash.core.params import PromptSet
from dflash.core.validate import check_eval
from dflash.eval.prompt_sets import load_prompt_set, table
from dflash.target.build import qwen3_tokenizer_dir
from tests.helpers import repo_params


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(qwen3_tokenizer_dir())


def _spec(source, **kw) -> PromptSet:
    return PromptSet(
        **{"source": str(source), "split": "", "column": "", "num_prompts": 0, "enable_thinking": True, **kw}
    )


def test_every_local_format_gives_the_same_rendered_prompts(tmp_path, tok):
    convs = [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Count to {i}."}] for i in range(3)
    ]
    rows = [
        {"messages": [*c, {"role": "assistant", "content": "1 2 3"}, {"role": "user", "content": "again"}]}
        for c in convs
    ]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "a.json").write_text(json.dumps(rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet")
    got = [load_prompt_set("s", _spec(tmp_path / f"a.{ext}"), tok, {}) for ext in ("jsonl", "json", "parquet")]
    assert got[0] == got[1] == got[2]
    want = tok.apply_chat_template(convs[1], tokenize=False, add_generation_prompt=True, enable_thinking=True)
    assert tok.decode(got[0][1]["prompt_ids"]) == want  # the prompt stops before the first assistant turn
    assert [p["sample_id"] for p in got[0]] == ["s:0", "s:1", "s:2"]


def test_prompt_texts_thinking_mode_and_count(tmp_path, tok):
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"question": f"What is {i} + 1?"}) + "\n" for i in range(5)))
    on = load_prompt_set("s", _spec(tmp_path / "p.jsonl", column="question", num_prompts=2), tok, {})
    off = load_prompt_set("s", _spec(tmp_path / "p.jsonl", column="question", enable_thinking=False), tok, {})
    assert len(on) == 2 and len(off) == 5
    assert tok.decode(off[0]["prompt_ids"]).endswith("<think>\n\n</think>\n\n")  # thinking off: empty think block
    assert not tok.decode(on[0]["prompt_ids"]).endswith("</think>\n\n")


@pytest.mark.parametrize(
    "content, column, message",
    [
        ('{"messages": [{"role": "user", "content": "hi"}]}\n{"nope": 1}\n', "", r"p\.jsonl:line 2: no 'prompt' field"),
        ('{"messages": [{"role": "user", "content": "hi"}]}\n{bad json\n', "", r"p\.jsonl: not valid JSON"),
        (
            '{"messages": [{"role": "assistant", "content": "x"}]}\n',
            "",
            r"p\.jsonl:line 1: 'messages' has no user message",
        ),
        ('{"messages": "hi"}\n{"messages": 3}\n', "", r"p\.jsonl:line 2: 'messages' must be a prompt text or a list"),
        ("\n\n", "", r"eval\.prompt_sets\.s: .*holds no prompts"),
    ],
)
def test_bad_rows_name_the_file_and_row(tmp_path, tok, content, column, message):
    (tmp_path / "p.jsonl").write_text(content)
    with pytest.raises(UserError, match=message):
        load_prompt_set("s", _spec(tmp_path / "p.jsonl", column=column), tok, {})


def test_bad_sources_name_the_param(tmp_path, tok):
    with pytest.raises(UserError, match=r"eval\.prompt_sets\.s\.source: .*missing\.jsonl: not a"):
        load_prompt_set("s", _spec(tmp_path / "missing.jsonl"), tok, {})
    with pytest.raises(UserError, match=r"eval\.prompt_sets\.s\.source: hf:org/set: a hub dataset needs .*column"):
        load_prompt_set("s", _spec("hf:org/set"), tok, {})


def test_set_params_are_checked(repo_root):
    good = "{source: data/eval/tasks.jsonl, split: '', column: '', num_prompts: 2, enable_thinking: true}"
    only = ["~eval.prompt_sets"]  # -S as dvc exp run -S: delete the shipped sets, then add (++) new ones
    params = repo_params([*only, f"++eval.prompt_sets={{x: {good}}}"])
    check_eval(params)
    assert list(params.eval.prompt_sets) == ["x"] and params.eval.prompt_sets["x"].num_prompts == 2
    with pytest.raises(ParamsError, match=r"eval\.prompt_sets\.heldout: the name is taken"):
        check_eval(repo_params([*only, f"++eval.prompt_sets={{heldout: {good}}}"]))
    with pytest.raises(ParamsError, match=r"eval\.prompt_sets\.x\.num_prompts"):
        bad = good.replace("2", "-1")
        check_eval(repo_params([*only, f"++eval.prompt_sets={{x: {bad}}}"]))


def test_the_table_has_one_row_per_set_and_one_column_per_engine():
    rows = {
        "heldout": {
            "num_prompts": 48,
            "enable_thinking": True,
            "tau_reference": 3.6,
            "engines": {"dflash": {"tau": 3.61}, "none": {"tau": None}},
        },
        "tasks": {
            "num_prompts": 24,
            "enable_thinking": False,
            "tau_reference": 2.0,
            "engines": {"dflash": {"tau": 2.01}, "none": {"tau": None}},
        },
    }
    lines = table(rows)
    assert lines[0] == "| prompt set | prompts | thinking | tau dflash | tau none | tau reference |"
    assert lines[2:] == ["| heldout | 48 | on | 3.61 | - | 3.60 |", "| tasks | 24 | off | 2.01 | - | 2.00 |"]
