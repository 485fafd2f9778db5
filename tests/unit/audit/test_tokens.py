"""The audit's default token path (dflash/audit/tokens.py, counts.py) against the exhaustive one: the same
kept / rejected rows and reasons on prompts just below / at / above the limit in tokens, multi-byte text whose
bytes are far above the limit, tool calls and shapes the chat template refuses; the stated token sample; exact
prompt_tokens where counted; the premises of the byte bound (NFC never longer than NFD, tokens <= NFD bytes)
and of the cached piece counts."""

from __future__ import annotations

import json
import sys
import unicodedata
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash.audit import tokens as tokens_mod
from dflash.audit.counts import TokenCounter
from dflash.audit.run import run_audit
from dflash.core.chat import load_fast_chat, read_chat_template, template_kwargs
from dflash.core.errors import UserError
from dflash.core.io import read_arrow
from dflash.target.build import qwen3_tokenizer_dir
from tests.helpers import repo_params

LIMIT = 256
REFUSAL = (
    "{%- for m in messages %}{%- if m.role == 'system' and not loop.first %}"
    "{{- raise_exception('System message must be at the beginning.') }}{%- endif %}{%- endfor %}\n"
)
CJK = "数据质量检查会在训练之前发现问题😀。"


def _tokenizer(folder: Path, prefix: str = REFUSAL) -> Path:
    folder.mkdir()
    src = qwen3_tokenizer_dir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).symlink_to(src / name)
    (folder / "chat_template.jinja").write_text(prefix + read_chat_template(src)[0], encoding="utf-8")
    return folder


def _u(text):
    return {"role": "user", "content": text}


def _a(text):
    return {"role": "assistant", "content": text}


def _near_limit(chat, kwargs, unit: str, start: int) -> dict[int, list[dict]]:
    """Conversations whose prompt is LIMIT-1, LIMIT and LIMIT+1 tokens (found by counting)."""
    found: dict[int, list[dict]] = {}
    for k in range(start, start + 1500):  # one more character each time: the count rises by 0 or 1
        msgs = [_u((unit * 2000)[:k]), _a("fine")]
        n = len(chat.encode_batch([chat.render(msgs[:1], True, kwargs)])[0])
        if n in (LIMIT - 1, LIMIT, LIMIT + 1) and n not in found:
            found[n] = msgs
        if n > LIMIT + 1:
            break
    return found


@pytest.fixture(scope="module")
def crafted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tok")
    folder = _tokenizer(tmp / "tokenizer")
    chat = load_fast_chat(folder)
    base = repo_params([]).base
    kwargs = template_kwargs(base.enable_thinking, base.chat_template_kwargs)
    rows = []
    for i in range(30):  # ordinary rows, some with system prompts and multi-byte text
        msgs = [_u(f"question {i}: what is {i} + {i}?"), _a(f"{2 * i}")]
        if i % 3 == 0:
            msgs.insert(0, {"role": "system", "content": "Be brief. 简短回答。"})
        if i % 5 == 0:
            msgs[-2]["content"] += " 🚀🚀 " + CJK
        rows.append({"messages": msgs})
    near = {}
    for name, unit, start in (("en", "word ", 1150), ("cjk", CJK, 300), ("emoji", "😀🚀", 120)):
        found = _near_limit(chat, kwargs, unit, start)
        near[name] = found
        rows += [{"messages": m} for m in found.values()]
    for i in range(3):  # bytes far above the limit, tokens below it
        rows.append({"messages": [_u(f"{i} " + CJK * 6), _a("好")]})
    for i in range(4):  # the template refuses a late system turn (one structure: only its first row renders)
        rows.append({"messages": [_u(f"hi {i}"), {"role": "system", "content": f"late {i}"}, _a("x")]})
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": 1}'}}
    for i in range(3):
        rows.append(
            {
                "messages": [
                    _u(f"look {i} up " + "word " * (LIMIT - 40 + 20 * i)),
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "c1", "content": "42"},
                    _a("It is 42."),
                ],
                "tools": [{"type": "function", "function": {"name": "lookup", "parameters": {}}}],
            }
        )
    data = tmp / "crafted.jsonl"
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return tmp, data, folder, chat, kwargs, near


def _audit(out: Path, data: Path, folder: Path, *overrides: str) -> dict:
    params = repo_params(
        [
            f"audit.input={data}",
            f"audit.out={out}",
            f"audit.tokenizer={folder}",
            f"audit.max_prompt_tokens={LIMIT}",
            "audit.gates.rejected_frac.action=report",
            "audit.gates.duplicate_prompt_frac.action=report",
            *overrides,
        ],
    )
    return run_audit(params.audit, params.base)


def _outcome(out: Path) -> tuple[dict, list]:
    rejected = {}
    for line in (out / "rejected.jsonl").read_text(encoding="utf-8").splitlines():
        r = json.loads(line)
        rejected[r["source_row"]] = tuple(r["reasons"])
    kept = read_arrow(out / "conversations.arrow").to_pylist()
    return rejected, sorted((r["source_row"], r["conversation_id"]) for r in kept)


def _compare(tmp: Path, data: Path, folder: Path, tag: str) -> dict:
    """Default (token sample of 1 row) vs exhaustive: identical kept / rejected rows and reasons."""
    default = _audit(tmp / f"default-{tag}", data, folder, "audit.token_sample_rows=1")
    exhaustive = _audit(tmp / f"exhaustive-{tag}", data, folder, "audit.exhaustive_tokens=true")
    assert _outcome(tmp / f"default-{tag}") == _outcome(tmp / f"exhaustive-{tag}")
    assert default["rejected_by_reason"] == exhaustive["rejected_by_reason"]
    return default


def test_default_path_gives_the_exhaustive_verdicts(crafted):
    tmp, data, folder, _, _, near = crafted
    for name in ("en", "cjk", "emoji"):
        assert set(near[name]) == {LIMIT - 1, LIMIT, LIMIT + 1}, (name, sorted(near[name]))
    m = _compare(tmp, data, folder, "main")
    ts = m["token_sample"]
    assert ts["mode"] == "bounded" and ts["sample_rows"] < ts["candidates"]
    assert 0 < ts["exact_prompt_counts"] < ts["candidates"]  # the bound spared most rows their count
    assert m["rejected_by_reason"]["prompt_too_long"] >= 3 and m["rejected_by_reason"]["template_error"] == 4
    rejected, _ = _outcome(tmp / "default-main")
    details = [json.loads(x)["detail"] for x in (tmp / "default-main" / "rejected.jsonl").read_text().splitlines()]
    assert any("System message must be at the beginning" in d for d in details)
    assert sum(r == ("prompt_too_long",) for r in rejected.values()) == m["rejected_by_reason"]["prompt_too_long"]


def test_a_too_small_bound_breaks_the_identity(crafted, monkeypatch):
    """Mutation: the comparison above must notice a bound below the rendered bytes."""
    tmp, data, folder, *_ = crafted
    real = tokens_mod.byte_lengths
    monkeypatch.setattr(tokens_mod, "TURN_SLACK", 0)
    monkeypatch.setattr(tokens_mod, "byte_lengths", lambda arr: real(arr) // 3)
    with pytest.raises((AssertionError, UserError)):
        _compare(tmp, data, folder, "mutant")


def test_sample_size_is_stated_and_counts_are_exact_where_given(crafted):
    tmp, data, folder, chat, kwargs, _ = crafted
    m = _audit(tmp / "sample", data, folder, "audit.token_sample_rows=5")
    ts = m["token_sample"]
    report = (tmp / "sample" / "report.md").read_text()
    assert f"seeded sample of **{ts['sample_rows']}** of {ts['candidates']} candidate rows" in report
    assert m["prompt_tokens"]["count"] <= ts["sample_rows"] <= ts["candidates"]
    kept = read_arrow(tmp / "sample" / "conversations.arrow").to_pylist()
    counted = [r for r in kept if r["prompt_tokens"] >= 0]
    assert counted and len(counted) < len(kept)
    for row in kept:
        tools = json.loads(row["tools"]) if row["tools"] else None
        exact = len(chat.encode_batch([chat.render(json.loads(row["prompt_messages"]), True, kwargs, tools)])[0])
        assert row["prompt_tokens"] in (-1, exact) and exact <= LIMIT, row
    small = _audit(tmp / "all", data, folder, "audit.token_sample_rows=100000")
    assert small["token_sample"]["sample_rows"] == small["token_sample"]["candidates"]  # small input: all counted
    assert all(r["prompt_tokens"] >= 0 for r in read_arrow(tmp / "all" / "conversations.arrow").to_pylist())


def test_content_dependent_refusal_stops_the_default_path(tmp_path):
    """Assumption R checked: a template whose refusal depends on the text is caught on a rendered row."""
    folder = _tokenizer(
        tmp_path / "tok",
        "{%- for m in messages %}{%- if 'forbidden' in m.content %}{{- raise_exception('no') }}{%- endif %}"
        "{%- endfor %}\n",
    )
    data = tmp_path / "d.jsonl"
    rows = [{"messages": [_u("fine"), _a("ok")]}, {"messages": [_u("forbidden"), _a("ok")]}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(UserError, match="audit.exhaustive_tokens: true"):
        _audit(tmp_path / "o", data, folder)
    m = _audit(tmp_path / "x", data, folder, "audit.exhaustive_tokens=true")
    assert m["rejected_by_reason"] == {"template_error": 1}


def test_nfc_never_has_more_bytes_than_nfd():
    """Premise 1: bytes(c) <= bytes(NFD(c)) for every character NFC keeps (so bytes(NFC(T)) <= bytes(NFD(T)))."""
    bad = []
    for code in range(sys.maxunicode + 1):
        if 0xD800 <= code <= 0xDFFF:
            continue
        c = chr(code)
        d = unicodedata.normalize("NFD", c)
        if d != c and unicodedata.normalize("NFC", c) == c and len(c.encode()) > len(d.encode()):
            bad.append(hex(code))
    assert not bad


PIECES = [
    *"ab Zz09 \n\t.,'\"!?-_()[]{}",
    "é",
    "e\u0301",
    "中",
    "文",
    "，",
    "。",
    "😀",
    "\u0344",
    "Å",
    "한",
    "'s",
    "'ll",
]
PIECES += ["<|im_start|>", "<|im_end|>", "<think>", "  ", "\n\n", "1.5", "don't", " word", "Word", "\u0301"]
TEXT = st.lists(st.sampled_from(PIECES), max_size=60).map("".join)


@pytest.fixture(scope="module")
def qwen():
    return load_fast_chat(qwen3_tokenizer_dir())


@settings(max_examples=150, deadline=None)
@given(texts=st.lists(TEXT, min_size=1, max_size=4))
def test_piece_counts_equal_whole_text_counts(qwen, texts):
    counter = TokenCounter(qwen.tokenizer)
    assert counter.split
    assert counter.counts(texts) == [len(ids) for ids in qwen.encode_batch(texts)]


@settings(max_examples=150, deadline=None)
@given(text=TEXT)
def test_tokens_at_most_nfd_bytes(qwen, text):
    import pyarrow as pa

    assert tokens_mod.fast_path_premise(qwen.tokenizer) is None
    assert len(qwen.encode_batch([text])[0]) <= tokens_mod.byte_lengths(pa.array([text]))[0]
