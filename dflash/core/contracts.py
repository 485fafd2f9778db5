"""The data that crosses stage boundaries: one Arrow schema per hand-over, defined once.

  audit    -> generate, tokenize   `${audit.out}/conversations.arrow`      CONVERSATIONS_SCHEMA
  generate -> tokenize             `${generate.out}/run-<hash>/unit-*.arrow` GENERATED_SCHEMA (+ current.json)
  tokenize -> train, eval          `${tokenize.out}/{train,eval}/shard-*.arrow` SAMPLE_SCHEMA
The producing stage writes exactly this schema; consumers read the columns they need by these names.
Every column is listed with its meaning, so a reader needs no other file to use the data.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from dflash.core.errors import UserError
from dflash.core.io import read_json

CONVERSATIONS_FILE = "conversations.arrow"
CURRENT_RUN_FILE = "current.json"

# One row per conversation the audit kept. `messages` / `prompt_messages` / `tools` are canonical JSON text
# (sorted keys, no spaces, UTF-8 kept), so `conversation_id` can be recomputed from them.
# `prompt_messages` = `messages` minus the trailing assistant turn(s). prompt_tokens = -1 without a tokenizer or
# where the audit did not count the row (audit.exhaustive_tokens: false counts the token sample and the prompts
# over its byte bound; every other kept prompt is provably <= audit.max_prompt_tokens).
CONVERSATIONS_SCHEMA = pa.schema(
    [
        ("conversation_id", pa.string()),  # first 16 hex of sha256(canonical {"messages", "tools"})
        ("source_file", pa.string()),  # path as given
        ("source_row", pa.int64()),  # JSONL: 1-based line; JSON array: 0-based index; parquet: row index
        ("messages", pa.string()),  # JSON list of normalized OpenAI messages
        ("prompt_messages", pa.string()),  # JSON list: messages without the trailing assistant turn(s)
        ("tools", pa.string()),  # JSON list of tool definitions, or ""
        ("num_user_turns", pa.int32()),
        ("num_assistant_turns", pa.int32()),
        ("has_system", pa.bool_()),
        ("has_tool_calls", pa.bool_()),  # an assistant tool call or a tool turn
        ("prompt_chars", pa.int64()),  # characters of content in prompt_messages
        ("prompt_tokens", pa.int64()),  # tokens of the prompt rendered with the generation prompt; -1: not counted
        ("placeholder_turns", pa.int32()),  # assistant turns that are placeholders or empty
        ("response_chars", pa.int64()),  # characters of the recorded trailing assistant turn(s)
    ]
)

# One row per regenerated assistant turn (generate's unit shards).
GENERATED_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),  # "<conversation_id>:<turn_index>"
        ("conversation_id", pa.string()),
        ("turn_index", pa.int32()),  # k-th assistant turn without tool calls
        ("status", pa.string()),  # completed | skipped
        ("skip_reason", pa.string()),  # "" when completed
        ("prompt_ids", pa.list_(pa.int32())),  # the exact rendered prompt the engine saw
        ("completion_ids", pa.list_(pa.int32())),  # sampled ids verbatim, incl. the end-of-turn token when it stopped
        ("text", pa.string()),  # the completion's text
        ("reasoning", pa.string()),  # text before </think>
        ("answer", pa.string()),  # text after </think> (all of it without one)
        ("finish_reason", pa.string()),  # stop | length
        ("has_think_end", pa.bool_()),
        ("num_prompt_tokens", pa.int32()),
        ("num_completion_tokens", pa.int32()),
        ("messages", pa.string()),  # JSON: the prompt messages of this turn (earlier turns regenerated)
        ("tools", pa.string()),  # JSON or ""
        ("model", pa.string()),
        ("revision", pa.string()),
        ("run_hash", pa.string()),
        ("engine_version", pa.string()),
        ("request_seed", pa.int64()),
    ]
)

# One row per training / held-out sample. The prompt is input_ids[:num_prompt_tokens]; loss_mask is 0 there, 1 after.
SAMPLE_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),  # "<conversation_id>:<turn_index>"
        ("conversation_id", pa.string()),
        ("turn_index", pa.int32()),  # k-th assistant turn without tool calls
        ("input_ids", pa.list_(pa.int32())),  # prompt ids + completion ids (incl. the end-of-turn token)
        ("loss_mask", pa.list_(pa.int8())),  # same length; 1 on the supervised completion
        ("num_tokens", pa.int32()),
        ("num_loss_tokens", pa.int32()),
        ("num_prompt_tokens", pa.int32()),
    ]
)


def current_run_dir(out: str | Path) -> Path:
    """The run folder the last successful full generate run committed (`${generate.out}/current.json`)."""
    out = Path(out)
    path = out / CURRENT_RUN_FILE
    if not path.exists():
        raise UserError(
            f"{path}: missing; run the generate stage first (dvc repro generate), "
            "or set tokenize.source: recorded to train on the recorded responses"
        )
    return out / read_json(path)["run_dir"]
