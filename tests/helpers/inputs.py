"""Hand-made stage inputs: conversations in the audit's contract, eval shards in the tokenize stage's, and the
bundled sample's distinct conversations (the end-to-end tests' small inputs)."""

from __future__ import annotations

import json

from tests.helpers import REPO


def write_conversations(path, conversations, tools=None):
    """Write hand-made conversations in the audit stage's conversations.arrow contract (for tests of
    later stages that must not depend on the audit implementation)."""

    import pyarrow as pa

    from dflash.core.io import canonical_json, sha256_text, write_arrow

    rows = []
    for i, messages in enumerate(conversations):
        t = (tools or {}).get(i)
        cid = sha256_text(canonical_json({"messages": messages, "tools": t}))[:16]
        prompt = list(messages)
        while prompt and prompt[-1]["role"] == "assistant":
            prompt.pop()
        rows.append(
            {
                "conversation_id": cid,
                "source_file": "test",
                "source_row": i,
                "messages": json.dumps(messages),
                "prompt_messages": json.dumps(prompt),
                "tools": json.dumps(t) if t else "",
                "num_user_turns": sum(m["role"] == "user" for m in messages),
                "num_assistant_turns": sum(m["role"] == "assistant" for m in messages),
                "has_system": any(m["role"] == "system" for m in messages),
                "has_tool_calls": any(m.get("tool_calls") for m in messages),
                "prompt_chars": sum(len(m.get("content") or "") for m in prompt),
                "prompt_tokens": -1,
                "placeholder_turns": 0,
            }
        )
    write_arrow(path, pa.Table.from_pylist(rows))
    return [r["conversation_id"] for r in rows]


def distinct_sample_rows(n: int) -> list[dict]:
    """The first n well-formed conversations of the bundled sample (data/sample/messages.jsonl) with distinct
    first user prompts, as {"id", "messages"} rows: the small inputs of the end-to-end pipeline tests."""

    rows, seen = [], set()
    for line in (REPO / "data/sample/messages.jsonl").read_bytes().splitlines():
        try:
            row = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue
        msgs = row.get("messages") if isinstance(row, dict) else None
        if not (isinstance(msgs, list) and msgs and all(isinstance(m, dict) and "content" in m for m in msgs)):
            continue
        first = next((m["content"] for m in msgs if m.get("role") == "user"), None)
        if first is None or first in seen:
            continue
        seen.add(first)
        rows.append({"id": row.get("id"), "messages": msgs})
        if len(rows) == n:
            break
    return rows


def write_eval_shard(path, samples):
    """samples: (sample_id, prompt ids, completion ids) -> one shard in the tokenize stage's schema."""
    import pyarrow as pa

    from dflash.core.contracts import SAMPLE_SCHEMA  # the tokenize stage's shard contract
    from dflash.core.io import write_arrow

    rows = []
    for sid, prompt, completion in samples:
        ids = list(prompt) + list(completion)
        rows.append(
            {
                "sample_id": sid,
                "conversation_id": sid.split(":")[0],
                "turn_index": 0,
                "input_ids": ids,
                "loss_mask": [0] * len(prompt) + [1] * len(completion),
                "num_tokens": len(ids),
                "num_loss_tokens": len(completion),
                "num_prompt_tokens": len(prompt),
            }
        )
    write_arrow(path, pa.Table.from_pylist(rows, schema=SAMPLE_SCHEMA))
