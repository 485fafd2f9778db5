"""Tokenize stage: exact input_ids / loss_mask with the real Qwen3 tokenizer and chat template (expected ids
written out from the template by hand), both sources, every filter, the held-out split, the loss-mask gate,
parallel == serial output, and no torch in the import chain.

    python -m pytest -q tests/unit/tokenize/test_tokenize.py
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from dflash.core.contracts import GENERATED_SCHEMA as GENERATE_SCHEMA
from dflash.core.contracts import SAMPLE_SCHEMA
from dflash.core.errors import UserError
from dflash.core.gates import evaluate_gates
from dflash.core.io import list_shards, read_arrow, read_json, write_arrow, write_json
from dflash.target.build import qwen3_tokenizer_dir
from tests.helpers import REPO, repo_params
from tests.helpers.inputs import write_conversations

IM_START, IM_END, NL, NL2, THINK, END_THINK = 151644, 151645, 198, 271, 151667, 151668
USER, ASSISTANT, SYSTEM = 872, 77091, 8948

# ------------------------------------------------------------------ hand-made conversations and their ids
# Qwen3 template, thinking on: a turn renders as <|im_start|>ROLE\nCONTENT<|im_end|>\n; the generation prompt
# is <|im_start|>assistant\n; the answered LAST turn renders <think>\nREASONING\n</think>\n\nCONTENT<|im_end|>
# (an empty reasoning gives <think>\n\n</think>\n\n); earlier assistant turns lose their reasoning.

ONE_TURN = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]
# <|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n
ONE_TURN_PROMPT = [IM_START, USER, NL, 3838, 374, 220, 17, 10, 17, 30, IM_END, NL, IM_START, ASSISTANT, NL]
ONE_TURN_COMPLETION = [THINK, NL2, END_THINK, NL2, 19, IM_END]  # <think>\n\n</think>\n\n4<|im_end|>

SYSTEM_CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
]
SYSTEM_PROMPT = [IM_START, SYSTEM, NL, 3430, 9814, 13, IM_END, NL, IM_START, USER, NL, 13048, IM_END, NL]
SYSTEM_PROMPT += [IM_START, ASSISTANT, NL]
SYSTEM_COMPLETION = [THINK, NL2, END_THINK, NL2, 9707, 0, IM_END]  # ... Hello ! <|im_end|>

MULTI = [
    {"role": "user", "content": "Name a color."},
    {"role": "assistant", "reasoning_content": "Pick one.", "content": "Red."},
    {"role": "user", "content": "Another?"},
    {"role": "assistant", "reasoning_content": "Not red.", "content": "Blue."},
]
MULTI_PROMPT_0 = [IM_START, USER, NL, 675, 264, 1894, 13, IM_END, NL, IM_START, ASSISTANT, NL]
MULTI_COMPLETION_0 = [THINK, NL, 36953, 825, 624, END_THINK, NL2, 6033, 13, IM_END]  # <think>\nPick one.\n</think>..
# turn 1: the history's answer "Red." WITHOUT its reasoning, then the new user turn
MULTI_PROMPT_1 = MULTI_PROMPT_0 + [6033, 13, IM_END, NL, IM_START, USER, NL, 14037, 30, IM_END, NL]
MULTI_PROMPT_1 += [IM_START, ASSISTANT, NL]
MULTI_COMPLETION_1 = [THINK, NL, 2623, 2518, 624, END_THINK, NL2, 10331, 13, IM_END]

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
CALL = {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TOOL_CONV = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
    {"role": "assistant", "content": "It is sunny."},
]
# <|im_start|>system\n# Tools\n\nYou may call ... <tools>\n{tool json}\n</tools>\n\nFor each function call, ...
# </tool_call><|im_end|>\n
TOOL_SYSTEM = [IM_START, SYSTEM, NL, 2, 13852, 271, 2610, 1231, 1618, 825, 476, 803, 5746, 311, 7789, 448, 279, 1196]
TOOL_SYSTEM += [3239, 382, 2610, 525, 3897, 448, 729, 32628, 2878, 366, 15918, 1472, 15918, 29, 11874, 9492, 510, 27]
TOOL_SYSTEM += [15918, 397, 4913, 1313, 788, 330, 1688, 497, 330, 1688, 788, 5212, 606, 788, 330, 455, 69364, 497]
TOOL_SYSTEM += [330, 13786, 788, 314, 3417, 532, 522, 15918, 1339, 2461, 1817, 729, 1618, 11, 470, 264, 2951, 1633]
TOOL_SYSTEM += [448, 729, 829, 323, 5977, 2878, 220, 151657, 151658, 11874, 9492, 510, 151657, 198, 4913, 606, 788]
TOOL_SYSTEM += [366, 1688, 11494, 8066, 330, 16370, 788, 366, 2116, 56080, 40432, 31296, 151658, IM_END, NL]
# <|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{"name": "get_weather",
# "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n
# </tool_response><|im_end|>\n<|im_start|>assistant\n
TOOL_PROMPT = TOOL_SYSTEM + [IM_START, USER, NL, 28981, 304, 12095, 30, IM_END, NL, IM_START, ASSISTANT, NL, 151657]
TOOL_PROMPT += [198, 4913, 606, 788, 330, 455, 69364, 497, 330, 16370, 788, 5212, 8926, 788, 330, 59604, 95642]
TOOL_PROMPT += [151658, IM_END, NL, IM_START, USER, NL, 151665, 198, 82, 27297, 198, 151666, IM_END, NL]
TOOL_PROMPT += [IM_START, ASSISTANT, NL]
TOOL_COMPLETION = [THINK, NL2, END_THINK, NL2, 2132, 374, 39698, 13, IM_END]  # ... It is sunny.<|im_end|>

# thinking off: the generation prompt itself closes an empty think block; the completion is the answer only
NO_THINK_PROMPT = ONE_TURN_PROMPT + [THINK, NL2, END_THINK, NL2]
NO_THINK_COMPLETION = [19, IM_END]


# ------------------------------------------------------------------ helpers


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A target folder whose target.json points at the real Qwen3 tokenizer (as for a real target)."""
    folder = tmp_path_factory.mktemp("target")
    write_json(folder / "target.json", {"source": "qwen3", "model": str(qwen3_tokenizer_dir()), "revision": ""})
    return folder


def params_for(tmp_path: Path, target_dir: Path, *overrides: str):
    base = [
        f"base.target_dir={target_dir}",
        f"base.reports_dir={tmp_path / 'reports'}",
        f"audit.out={tmp_path / 'audit'}",
        f"generate.out={tmp_path / 'generate'}",
        f"tokenize.out={tmp_path / 'tokenized'}",
        "tokenize.source=recorded",
        "tokenize.num_workers=1",
        "tokenize.eval_count=0",
        "tokenize.eval_fraction=0.0",
        "tokenize.min_loss_tokens=1",
    ]
    return repo_params([*base, *overrides])


def read_split(out: Path, split: str) -> list[dict]:
    rows = []
    for shard in list_shards(out / split):
        rows += read_arrow(shard).to_pylist()
    return rows


def run_tokenize(params) -> dict:
    from dflash.tokenize import stage as tokenize

    return tokenize.run(params)


def by_id(rows: list[dict]) -> dict[str, dict]:
    return {r["sample_id"]: r for r in rows}


# ------------------------------------------------------------------ recorded source: exact ids


def test_recorded_exact_ids_and_masks(tmp_path, target_dir):
    cids = write_conversations(
        tmp_path / "audit/conversations.arrow", [ONE_TURN, SYSTEM_CONV, MULTI, TOOL_CONV], tools={3: TOOLS}
    )
    m = run_tokenize(params_for(tmp_path, target_dir))
    rows = by_id(read_split(tmp_path / "tokenized", "train"))
    expected = {
        f"{cids[0]}:0": (ONE_TURN_PROMPT, ONE_TURN_COMPLETION),
        f"{cids[1]}:0": (SYSTEM_PROMPT, SYSTEM_COMPLETION),
        f"{cids[2]}:0": (MULTI_PROMPT_0, MULTI_COMPLETION_0),
        f"{cids[2]}:1": (MULTI_PROMPT_1, MULTI_COMPLETION_1),
        f"{cids[3]}:0": (TOOL_PROMPT, TOOL_COMPLETION),  # the tool-call turn is history, not a sample
    }
    assert sorted(rows) == sorted(expected)
    for sid, (prompt, completion) in expected.items():
        r = rows[sid]
        assert r["input_ids"] == prompt + completion, sid
        assert r["loss_mask"] == [0] * len(prompt) + [1] * len(completion), sid
        assert (r["num_prompt_tokens"], r["num_loss_tokens"], r["num_tokens"]) == (
            len(prompt),
            len(completion),
            len(prompt) + len(completion),
        )
    assert m["num_input"] == m["num_samples"] == 5 and m["tool_call_turns"] == 1
    assert m["loss_tokens"] == sum(len(c) for _, c in expected.values())
    assert m["total_tokens"] == sum(len(p) + len(c) for p, c in expected.values())


def test_recorded_thinking_off(tmp_path, target_dir):
    write_conversations(tmp_path / "audit/conversations.arrow", [ONE_TURN])
    run_tokenize(params_for(tmp_path, target_dir, "base.enable_thinking=false"))
    (r,) = read_split(tmp_path / "tokenized", "train")
    assert r["input_ids"] == NO_THINK_PROMPT + NO_THINK_COMPLETION
    assert r["loss_mask"] == [0] * len(NO_THINK_PROMPT) + [1] * len(NO_THINK_COMPLETION)


def test_masked_tokens_decode_to_the_completion_plus_end_token(tmp_path, target_dir, qwen_tokenizer):
    cids = write_conversations(tmp_path / "audit/conversations.arrow", [MULTI, TOOL_CONV], tools={1: TOOLS})
    run_tokenize(params_for(tmp_path, target_dir))
    rows = by_id(read_split(tmp_path / "tokenized", "train"))
    expected = {
        f"{cids[0]}:0": "<think>\nPick one.\n</think>\n\nRed.<|im_end|>",
        f"{cids[0]}:1": "<think>\nNot red.\n</think>\n\nBlue.<|im_end|>",
        f"{cids[1]}:0": "<think>\n\n</think>\n\nIt is sunny.<|im_end|>",
    }
    for sid, text in expected.items():
        r = rows[sid]
        masked = [t for t, k in zip(r["input_ids"], r["loss_mask"], strict=True) if k]
        assert qwen_tokenizer.decode(masked) == text
        # and the unmasked part is exactly the prompt the engine is given
        prompt = qwen_tokenizer.decode(r["input_ids"][: r["num_prompt_tokens"]])
        assert prompt.endswith("<|im_start|>assistant\n") and 0 not in r["loss_mask"][r["num_prompt_tokens"] :]


def test_recorded_last_turn_only(tmp_path, target_dir):
    cids = write_conversations(tmp_path / "audit/conversations.arrow", [MULTI])
    m = run_tokenize(params_for(tmp_path, target_dir, "tokenize.recorded_turns=last"))
    (r,) = read_split(tmp_path / "tokenized", "train")
    assert r["sample_id"] == f"{cids[0]}:1" and r["input_ids"] == MULTI_PROMPT_1 + MULTI_COMPLETION_1
    assert m["num_input"] == 1


def test_recorded_unstable_prefix_drops_that_turn_naming_the_row(tmp_path, target_dir):
    # thinking off + recorded reasoning: the prompt ends with an EMPTY think block, the full render with the
    # recorded one, so the prompt is not a prefix of the full render: that turn is dropped, the rest is kept
    ok = ONE_TURN
    bad = [{"role": "user", "content": "Hi"}, {"role": "assistant", "reasoning_content": "hmm", "content": "Yo"}]
    cids = write_conversations(tmp_path / "audit/conversations.arrow", [ok, bad])
    m = run_tokenize(params_for(tmp_path, target_dir, "base.enable_thinking=false"))
    assert (m["num_input"], m["num_samples"], m["dropped_by_reason"]["unstable_render"]) == (2, 1, 1)
    (example,) = m["dropped_examples"]["unstable_render"]
    assert f"conversations.arrow: row 1 (conversation {cids[1]}), assistant message 1" in example
    assert "not a prefix" in example
    (r,) = read_split(tmp_path / "tokenized", "train")
    assert r["sample_id"] == f"{cids[0]}:0"


def test_recorded_user_assistant_assistant_keeps_what_renders_stably(tmp_path, target_dir):
    # issue: u -> a -> a stopped the whole recorded tokenize. The template renders the first answer without
    # its (empty) think block once a second answer follows, so only the second turn is unstable.
    uaa = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "One."},
        {"role": "assistant", "content": "Two."},
    ]
    cids = write_conversations(tmp_path / "audit/conversations.arrow", [ONE_TURN, uaa])
    m = run_tokenize(params_for(tmp_path, target_dir, "base.enable_thinking=false"))
    assert m["num_input"] == 3 and m["dropped_by_reason"]["unstable_render"] == 1
    assert sorted(r["sample_id"] for r in read_split(tmp_path / "tokenized", "train")) == sorted(
        [f"{cids[0]}:0", f"{cids[1]}:0"]
    )
    assert f"row 1 (conversation {cids[1]}), assistant message 2" in m["dropped_examples"]["unstable_render"][0]


def test_recorded_template_error_drops_the_turn(tmp_path, target_dir):
    # a template that refuses tool turns (as some do for shapes they do not support)
    tok = tmp_path / "tok"
    tok.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tok / name).symlink_to(qwen3_tokenizer_dir() / name)
    (tok / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m.content == 'refuse me' %}{{ raise_exception('not this one') }}{% endif %}"
        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    target = tmp_path / "target"
    write_json(target / "target.json", {"source": "qwen3", "model": str(tok), "revision": ""})
    refused = [{"role": "user", "content": "refuse me"}, {"role": "assistant", "content": "A"}]
    cids = write_conversations(tmp_path / "audit/conversations.arrow", [ONE_TURN, refused])
    m = run_tokenize(params_for(tmp_path, target))
    assert m["num_samples"] == 1 and m["dropped_by_reason"]["template_error"] == 1
    (example,) = m["dropped_examples"]["template_error"]
    assert f"row 1 (conversation {cids[1]}), assistant message 1: chat template error: not this one" in example


# ------------------------------------------------------------------ generated source


def gen_row(cid: str, turn: int, prompt: list[int], completion: list[int], **kw) -> dict:
    row = {
        "sample_id": f"{cid}:{turn}",
        "conversation_id": cid,
        "turn_index": turn,
        "status": "completed",
        "skip_reason": "",
        "prompt_ids": prompt,
        "completion_ids": completion,
        "text": "",
        "reasoning": "",
        "answer": "",
        "finish_reason": "stop",
        "has_think_end": True,
        "num_prompt_tokens": len(prompt),
        "num_completion_tokens": len(completion),
        "messages": "[]",
        "tools": "",
        "model": "fake",
        "revision": "",
        "run_hash": "abc",
        "engine_version": "0",
        "request_seed": 0,
    }
    row.update(kw)
    return row


def write_generate_run(out: Path, units: list[list[dict]]) -> Path:
    run_dir = out / "run-abc"
    for i, rows in enumerate(units):
        write_arrow(run_dir / f"unit-{i:05d}-x.arrow", pa.Table.from_pylist(rows, schema=GENERATE_SCHEMA))
    write_json(out / "current.json", {"run_dir": run_dir.name, "run_hash": "abc", "num_units": len(units)})
    (out / "run-old").mkdir()  # a stale run folder must be ignored
    write_arrow(
        out / "run-old/unit-00000-y.arrow",
        pa.Table.from_pylist([gen_row("zz", 0, [1], [2, 3])], schema=GENERATE_SCHEMA),
    )
    return run_dir


FILTER_ROWS = [
    gen_row("a", 0, [1, 2, 3], [10, 11, 12, IM_END]),  # kept as is
    gen_row("a", 1, [1, 2, 3, 10, 11, 12, IM_END, 4], [13, 14, IM_END]),  # kept (second turn of "a")
    gen_row("b", 0, [], [], status="skipped", skip_reason="prompt_too_long"),  # not_completed
    gen_row("c", 0, [5, 6], [20, 21, 22, 23], finish_reason="length"),  # truncated
    gen_row("d", 0, [5, 6], [THINK, 24, 25, 26], has_think_end=False),  # missing_think_end
    gen_row("e", 0, [7] * 10, [30, 31, 32, 33, 34, IM_END]),  # 16 tokens > max_length 12: overlong
    gen_row("f", 0, [8, 9], [40, IM_END]),  # 2 supervised < min_loss_tokens 3
    gen_row("g", 0, [8, 9, 9], [IM_END]),  # 1 supervised: no adjacent pair (min_loss_tokens 1)
]


def test_generated_exact_samples_and_each_filter(tmp_path, target_dir):
    write_generate_run(tmp_path / "generate", [FILTER_ROWS[:4], FILTER_ROWS[4:]])
    common = ("tokenize.source=generated", "tokenize.max_length=12")

    m = run_tokenize(params_for(tmp_path, target_dir, *common, "tokenize.overlong=drop", "tokenize.min_loss_tokens=3"))
    rows = by_id(read_split(tmp_path / "tokenized", "train"))
    assert sorted(rows) == ["a:0", "a:1"]
    assert rows["a:0"]["input_ids"] == [1, 2, 3, 10, 11, 12, IM_END]
    assert rows["a:0"]["loss_mask"] == [0, 0, 0, 1, 1, 1, 1]
    assert rows["a:1"]["input_ids"] == [1, 2, 3, 10, 11, 12, IM_END, 4, 13, 14, IM_END]
    assert rows["a:1"]["loss_mask"] == [0] * 8 + [1, 1, 1]
    assert m["dropped_by_reason"] == {
        "not_completed": 1,
        "truncated": 1,
        "missing_think_end": 1,
        "overlong": 1,
        "few_loss_tokens": 2,  # "f" (2 tokens) and "g" (1 token: min_loss_tokens comes first)
        "no_anchor_pair": 0,
        "template_error": 0,
        "unstable_render": 0,
    }
    assert m["num_input"] == 8 == m["num_samples"] + m["num_dropped"] and m["kept_plus_dropped_equals_input"]
    assert m["input"].endswith("run-abc")

    # each filter switched off (or relaxed) lets its rows through; truncate cuts "e" to max_length
    m = run_tokenize(
        params_for(
            tmp_path,
            target_dir,
            *common,
            "tokenize.overlong=truncate",
            "tokenize.min_loss_tokens=1",
            "tokenize.drop_truncated=false",
            "tokenize.drop_missing_think_end=false",
        )
    )
    rows = by_id(read_split(tmp_path / "tokenized", "train"))
    assert sorted(rows) == ["a:0", "a:1", "c:0", "d:0", "e:0", "f:0"]
    assert rows["e:0"]["input_ids"] == [7] * 10 + [30, 31] and rows["e:0"]["loss_mask"] == [0] * 10 + [1, 1]
    assert rows["e:0"]["num_loss_tokens"] == 2 and m["truncated_to_max_length"] == 1
    assert m["dropped_by_reason"]["no_anchor_pair"] == 1 and m["dropped_by_reason"]["not_completed"] == 1
    assert m["num_dropped"] == 2

    m = run_tokenize(params_for(tmp_path, target_dir, *common, "tokenize.require_anchor_pair=false"))
    assert "g:0" in by_id(read_split(tmp_path / "tokenized", "train"))
    # thinking off: a completion without </think> is normal (the prompt closed the think block)
    m = run_tokenize(params_for(tmp_path, target_dir, *common, "base.enable_thinking=false"))
    assert m["dropped_by_reason"]["missing_think_end"] == 0


def test_generated_counts_the_training_loss_tokens_and_reports_coverage(tmp_path, target_dir):
    """token_counts.json holds exactly the train split's supervised ids (eval ones never), and the coverage table
    is the share of them inside the always-in tokens + the most frequent ones."""
    from dflash.drafter.vocab import COUNTS_FILE, TokenCounts

    rows = [
        gen_row("a", 0, [1, 2, 3], [10, 10, 10, 11, IM_END]),  # 10 x3, 11 x1, IM_END x1
        gen_row("b", 0, [5, 6], [12, 10, IM_END]),  # 12, 10, IM_END
    ]
    write_generate_run(tmp_path / "generate", [rows])
    m = run_tokenize(params_for(tmp_path, target_dir, "tokenize.source=generated"))
    counts = TokenCounts.read(tmp_path / "tokenized" / COUNTS_FILE)
    assert counts.counts == {10: 4, 11: 1, 12: 1, IM_END: 2}  # prompt ids (1, 2, 3, 5, 6) are never counted
    assert IM_END in counts.always_in and len(counts.always_in) > 20  # Qwen3's added tokens (specials, <think>)
    assert m["train_loss_distinct_tokens"] == 4 and m["train_loss_tokens"] == 8
    # 64 tokens: every added token (IM_END among them) + the most frequent: 10, then 11 (tie with 12: smaller id)
    assert m["draft_vocab_coverage"]["64"] == 1.0


def test_generated_decodes_to_completion_text_plus_end_token(tmp_path, target_dir, qwen_tokenizer):
    from dflash.core.chat import load_fast_chat

    chat = load_fast_chat(qwen3_tokenizer_dir())
    prompt = chat.encode_batch([chat.render(ONE_TURN[:1], True, {"enable_thinking": True})])[0]
    text = "<think>\nAdd them.\n</think>\n\n4"  # what vLLM returns as text (the stop token is not in it)
    completion = chat.encode_batch([text])[0] + [IM_END]
    write_generate_run(tmp_path / "generate", [[gen_row("a", 0, prompt, completion, text=text)]])
    run_tokenize(params_for(tmp_path, target_dir, "tokenize.source=generated"))
    (r,) = read_split(tmp_path / "tokenized", "train")
    assert r["input_ids"] == prompt + completion and prompt == ONE_TURN_PROMPT
    masked = [t for t, k in zip(r["input_ids"], r["loss_mask"], strict=True) if k]
    assert qwen_tokenizer.decode(masked) == text + "<|im_end|>"


def test_generated_missing_run_is_a_stage_error(tmp_path, target_dir):
    from stages.tokenize import main

    with pytest.raises(UserError, match="current.json: missing; run the generate stage first"):
        main(params_for(tmp_path, target_dir, "tokenize.source=generated"))


# ------------------------------------------------------------------ split, shards, parallel


def test_held_out_split_is_by_conversation_and_disjoint(tmp_path, target_dir):
    units = []
    for u in range(4):  # 4 unit shards x 10 conversations x 3 turns
        units.append(
            [gen_row(f"c{u}-{i}", t, [1, 2, 3], [10 + t, 11, 12, IM_END]) for i in range(10) for t in range(3)]
        )
    write_generate_run(tmp_path / "generate", units)
    m = run_tokenize(
        params_for(tmp_path, target_dir, "tokenize.source=generated", "tokenize.eval_count=7", "tokenize.chunk_rows=8")
    )
    train, held = read_split(tmp_path / "tokenized", "train"), read_split(tmp_path / "tokenized", "eval")
    train_ids, eval_ids = {r["conversation_id"] for r in train}, {r["conversation_id"] for r in held}
    assert len(eval_ids) == 7 and not train_ids & eval_ids and len(train_ids | eval_ids) == 40
    assert len(held) == 21 and all(sum(r["conversation_id"] == c for r in held) == 3 for c in eval_ids)
    assert (m["train_conversations"], m["eval_conversations"], m["train_samples"], m["eval_samples"]) == (33, 7, 99, 21)

    # same seed -> same split; another seed -> another one; eval_fraction mode is disjoint too
    run_tokenize(params_for(tmp_path, target_dir, "tokenize.source=generated", "tokenize.eval_count=7"))
    assert {r["conversation_id"] for r in read_split(tmp_path / "tokenized", "eval")} == eval_ids
    run_tokenize(params_for(tmp_path, target_dir, "tokenize.source=generated", "tokenize.eval_count=7", "base.seed=1"))
    assert {r["conversation_id"] for r in read_split(tmp_path / "tokenized", "eval")} != eval_ids
    m = run_tokenize(params_for(tmp_path, target_dir, "tokenize.source=generated", "tokenize.eval_fraction=0.3"))
    train, held = read_split(tmp_path / "tokenized", "train"), read_split(tmp_path / "tokenized", "eval")
    assert 3 <= m["eval_conversations"] <= 25 and m["eval_conversations"] + m["train_conversations"] == 40
    assert not {r["conversation_id"] for r in train} & {r["conversation_id"] for r in held}


def test_parallel_output_equals_serial_and_shards_hold_rows_per_shard(tmp_path, target_dir, sample_conversations):
    write_conversations(tmp_path / "audit/conversations.arrow", sample_conversations)
    outs = {}
    for workers in (1, 2):
        out = tmp_path / f"tok{workers}"
        m = run_tokenize(
            params_for(
                tmp_path,
                target_dir,
                f"tokenize.out={out}",
                f"tokenize.num_workers={workers}",
                "tokenize.chunk_rows=16",
                "tokenize.rows_per_shard=50",
                "tokenize.eval_count=10",
            )
        )
        outs[workers] = {s: [read_arrow(f) for f in list_shards(out / s)] for s in ("train", "eval")}
        sizes = [t.num_rows for t in outs[workers]["train"]]
        assert all(n == 50 for n in sizes[:-1]) and 0 < sizes[-1] <= 50 and sum(sizes) == m["train_samples"]
        assert read_arrow(list_shards(out / "train")[0]).schema.equals(SAMPLE_SCHEMA)
        assert read_json(out / "manifest.json")["num_train_shards"] == len(sizes)
    for split in ("train", "eval"):
        assert [t.to_pylist() for t in outs[1][split]] == [t.to_pylist() for t in outs[2][split]]


# ------------------------------------------------------------------ the loss-mask gate


def test_placeholder_sample_fails_the_gate(tmp_path, target_dir, sample_conversations):
    """The bundled sample's answers are placeholders ("OK.", "Done."...): most samples supervise the same
    handful of tokens, and the shipped gate fails the stage after writing everything."""
    write_conversations(tmp_path / "audit/conversations.arrow", sample_conversations)
    from stages.tokenize import main

    with pytest.raises(UserError, match=r"gate tokenize.gates.loss_mask_sum_mode_frac failed"):
        main(params_for(tmp_path, target_dir))
    m = read_json(tmp_path / "reports/tokenize.json")
    assert m["gate_failed"] and m["loss_mask_sum_mode"] <= 8 and m["loss_mask_sum_mode_frac"] > 0.5
    assert list_shards(tmp_path / "tokenized/train")  # everything was written first
    hist = (tmp_path / "reports/tokenize_loss_mask_sums.csv").read_text().splitlines()
    assert hist[0] == "loss_mask_tokens,samples"
    assert sum(int(line.split(",")[1]) for line in hist[1:]) == m["num_samples"]


def test_placeholder_spike_fails_and_varied_lengths_pass(tmp_path, target_dir):
    gates = repo_params().tokenize.gates
    (spike,) = [
        g for g in evaluate_gates({"loss_mask_sum_mode_frac": 0.87, "dropped_frac": 0.0}, gates) if g["crossed"]
    ]
    assert spike["name"] == "loss_mask_sum_mode_frac" and spike["action"] == "fail"

    # the same shape as the 27B regeneration case's data through the stage: 87% of samples supervise exactly 6 tokens
    rows = [gen_row(f"s{i}", 0, [1, 2], [5] * 5 + [IM_END]) for i in range(87)]
    rows += [gen_row(f"t{i}", 0, [1, 2], [5] * (7 + i) + [IM_END]) for i in range(13)]
    write_generate_run(tmp_path / "generate", [rows])
    from stages.tokenize import main

    with pytest.raises(UserError, match="measured 0.8700 > max"):
        main(params_for(tmp_path, target_dir, "tokenize.source=generated"))
    m = read_json(tmp_path / "reports/tokenize.json")
    assert (m["loss_mask_sum_mode"], m["loss_mask_sum_mode_frac"]) == (6, 0.87)

    varied = [gen_row(f"v{i}", 0, [1, 2], [5] * (3 + i % 40) + [IM_END]) for i in range(100)]
    write_generate_run(tmp_path / "generate2", [varied])
    main(params_for(tmp_path, target_dir, "tokenize.source=generated", f"generate.out={tmp_path / 'generate2'}"))
    assert not read_json(tmp_path / "reports/tokenize.json")["gate_failed"]


# ------------------------------------------------------------------ no torch


def test_no_torch_in_the_import_chain(tmp_path, target_dir):
    """tokenize runs on data boxes without torch: neither torch nor transformers may be imported."""
    write_conversations(tmp_path / "audit/conversations.arrow", [ONE_TURN, MULTI])
    overrides = [
        f"base.target_dir={target_dir}",
        f"base.reports_dir={tmp_path / 'reports'}",
        f"audit.out={tmp_path / 'audit'}",
        f"tokenize.out={tmp_path / 'tokenized'}",
        "tokenize.source=recorded",
        "tokenize.num_workers=1",
    ]
    code = (
        "import sys\n"
        "import stages.tokenize, dflash.tokenize.stage, dflash.tokenize.samples\n"
        "from dflash.core.loader import load_params\n"
        f"m = dflash.tokenize.stage.run(load_params('params.yaml', {overrides!r}))\n"
        "assert m['num_samples'] == 3, m\n"
        "bad = [k for k in ('torch', 'transformers', 'vllm') if k in sys.modules]\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
