"""Generate stage without an engine: which turns are regenerated, request seeds, unit names, the reasoning
split, refusal of duplicate conversation ids, and a run identity that follows outputs, not engine sizing.
Real vLLM runs (kill / resume, crash / retry): tests/integration/test_generate_engines.py.
"""

from __future__ import annotations

import pytest

from dflash.core.errors import UserError
from dflash.generate import contract
from dflash.generate import stage as gen
from dflash.generate.units import make_units, run_identity
from tests.helpers import repo_params
from tests.helpers.inputs import write_conversations

U = {"role": "user", "content": "What is 2 + 2?"}
A = {"role": "assistant", "content": "OK."}
S = {"role": "system", "content": "Be brief."}
CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
}
TOOL = {"role": "tool", "tool_call_id": "c1", "content": "{}"}


# ---------------------------------------------------------------------------------------------- policy


@pytest.mark.parametrize(
    "messages,expected",
    [
        ([U], [1]),  # prompt only: one final turn
        ([U, A], [1]),  # the recorded placeholder is replaced
        ([S, U, A, U, A], [2, 4]),  # every assistant turn, in order
        ([U, A, U], [1, 3]),  # ends with a user turn: a final turn is appended
        ([U, CALL, TOOL, A], [3]),  # the tool-call turn is kept as recorded; the answer after it is regenerated
        ([U, CALL, TOOL], [3]),  # ends with a tool result: the model answers it
    ],
)
def test_generation_targets(messages, expected):
    assert contract.generation_targets(messages) == expected


def test_request_seed_is_stable_and_distinct():
    assert contract.request_seed(0, "abc:0") == contract.request_seed(0, "abc:0")
    assert contract.request_seed(0, "abc:0") != contract.request_seed(0, "abc:1")
    assert contract.request_seed(0, "abc:0") != contract.request_seed(1, "abc:0")


def test_unit_names_follow_their_members():
    convs = [{"conversation_id": f"c{i}", "messages": [U], "tools": None} for i in range(10)]
    a = make_units(convs, 4)
    changed = convs[:5] + [{"conversation_id": "new", "messages": [U], "tools": None}] + convs[6:]
    b = make_units(changed, 4)
    assert [u.name for u in a][0] == [u.name for u in b][0]  # untouched unit: reused on resume
    assert a[1].name != b[1].name  # a changed member: never reuses the stale shard
    assert a[2].name == b[2].name


def test_split_reasoning_at_think_end(qwen_tokenizer):
    ids = qwen_tokenizer("<think>\nadd them\n</think>\n\nThe answer is 4.<|im_end|>", add_special_tokens=False)[
        "input_ids"
    ]
    end = qwen_tokenizer.convert_tokens_to_ids("</think>")
    assert contract.split_reasoning(qwen_tokenizer, ids, end) == ("add them", "The answer is 4.", True)
    cut = ids[: ids.index(end)]  # truncated before </think>
    assert contract.split_reasoning(qwen_tokenizer, cut, end)[2] is False


def test_duplicate_conversation_ids_are_refused(tmp_path):
    path = tmp_path / "conversations.arrow"
    write_conversations(path, [[U, A], [S, U], [U, A]])
    with pytest.raises(UserError, match=r"conversations\.arrow: conversation_id \w+ appears at rows 0 and 2"):
        gen.load_conversations(path)


def test_run_identity_changes_with_outputs_not_with_engine_sizing(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"w")
    (tmp_path / "tokenizer.json").write_text("{}")
    info = {"source": "tiny", "model": str(tmp_path)}

    def ident(*overrides):
        return run_identity(repo_params(list(overrides)), info, tmp_path)

    base = ident()
    assert ident("generate.num_engines=4", "generate.max_num_seqs=8") == base
    assert ident("generate.sampling.temperature=0.7") != base
    assert ident("base.enable_thinking=false") != base
    (tmp_path / "model.safetensors").write_bytes(b"other weights")
    assert ident() != base
