"""Shared test helpers (plain functions and constants; the fixtures are in tests/conftest.py).

Import them as `from tests.helpers import NAME`. Builders of small models and hand-made inputs, the command
lines of stages run as subprocesses, and the torchrun environment of the multi-process tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import numpy as np

from dflash.core.loader import load_params
from dflash.core.params import Params

REPO = Path(__file__).resolve().parents[1]  # the repository root
PARAMS = REPO / "params.yaml"
GPU_OVERLAY = REPO / "params/gpu-qwen3.6-27b.yaml"
HYBRID_OVERLAY = REPO / "params/demo-hybrid.yaml"


def repo_params(overrides=(), overlays=()) -> Params:
    """params.yaml of this checkout with `-S`-style `overrides` and overlay files applied (what a stage reads)."""
    return load_params(PARAMS, list(overrides), [Path(o) for o in overlays])


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

    from dflash.drafter.geometry import build_drafter_config

    dp = dataclasses.replace(
        repo_params().drafter,
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


# ------------------------------------------------------------------------------------------ training tests
# A small random Qwen3 target (vocab 512, hidden 64, 4 layers; lm_head rows 300..511 zeroed so the exact zero-row
# softmax is on the training path) and hand-made shards in the tokenize stage's schema: a few random prompt tokens
# (loss 0), then a fixed token cycle the drafter can learn (loss 1) ending with token 305 (a zero lm_head row).
TRAIN_VOCAB, TRAIN_END, TRAIN_MASK = 512, 305, 511
TRAIN_SONG = (np.random.default_rng(123).permutation(48) + 10).tolist()  # the completions' fixed token cycle


@contextlib.contextmanager
def one_thread():
    """Bitwise comparisons and the golden file: one intra-op thread (reductions in one fixed order)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def save_train_target(folder: Path) -> Path:
    """The training tests' target, saved with a target.json like the target stage writes."""
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = small_qwen3_config(4, vocab=TRAIN_VOCAB, max_position_embeddings=512, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.3)  # a trained head's scale: confident logits are reachable
        model.lm_head.weight[300:] = 0  # "never seen" rows, as in the demo's tiny target
    model.save_pretrained(folder)
    (folder / "target.json").write_text(json.dumps({"source": "test", "model": str(folder), "revision": ""}))
    return folder


def train_documents(n: int, seed: int) -> list[tuple[list[int], list[int], int]]:
    """n (input_ids, loss_mask, prompt length) documents: random prompt, then a stretch of TRAIN_SONG + TRAIN_END."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n):
        prompt = rng.integers(10, 210, rng.integers(4, 12)).tolist()
        start, length = int(rng.integers(0, len(TRAIN_SONG))), int(rng.integers(8, 40))
        completion = [TRAIN_SONG[(start + i) % len(TRAIN_SONG)] for i in range(length)] + [TRAIN_END]
        docs.append((prompt + completion, [0] * len(prompt) + [1] * len(completion), len(prompt)))
    return docs


def train_overrides(target: Path, out: Path, *extra: str) -> list[str]:
    """The training tests' params: a 1-layer drafter over the train target, block 4, 2 epochs, CPU, no live dir."""
    return [
        f"base.target_dir={target}",
        "drafter.num_hidden_layers=1",
        "drafter.num_attention_heads=2",
        "drafter.num_key_value_heads=1",
        "drafter.head_dim=32",
        "drafter.intermediate_size=128",
        "drafter.block_size=4",
        f"drafter.mask_token_id={TRAIN_MASK}",
        "drafter.target_layer_ids=[0, 2]",
        "drafter.max_position_embeddings=512",
        f"train.out={out}",
        "train.target_device=cpu",  # CPU tests (bitwise checks, golden file) also on GPU hosts
        "train.drafter_device=cpu",
        "train.live_dir=",
        "train.max_length=64",
        "train.max_tokens_per_row=128",
        "train.pack_window=64",
        "train.num_anchors=6",
        "train.epochs=2",
        "train.lr=3e-3",
        "train.warmup_ratio=0.1",
        "train.loss_gamma=4.0",
        "train.logits_chunk_blocks=8",
        "train.checkpoint_every=0",
        "train.log_every=2",
        *extra,
    ]


def train_params(target: Path, out: Path, *extra: str) -> Params:
    return repo_params(train_overrides(target, out, *extra))


# ------------------------------------------------------------------------------------------ eval, gpu check
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


GPU_CHECK_SCRIPT = REPO / "benchmarks/gpu_check.sh"
GPU_CHECK_STEPS = ("setup", "tests", "flex", "mfu", "fla")  # the steps benchmarks/gpu_check.sh reports


def run_gpu_check(out: Path, *args: str, **env: str):
    """benchmarks/gpu_check.sh with OUT=out and this interpreter, installing nothing (GPU_CHECK_INSTALL=0)."""
    import subprocess

    environ = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "GPU_CHECK_INSTALL": "0", **env}
    return subprocess.run(
        ["bash", str(GPU_CHECK_SCRIPT), *args], capture_output=True, text=True, env=environ, timeout=400
    )


def report_run(root: Path) -> list[str]:
    """A run's folders under `root` from the committed reports, plus an audit folder and the plan figure (what
    those stages draw); returns the -S overrides that point a stage at them (the report stage's tests)."""
    import shutil

    from dflash.core.figures import bar_chart, write_png

    shutil.copytree(REPO / "reports", root / "reports", ignore=shutil.ignore_patterns("hybrid", "*.png", "*.html"))
    audit = root / "audit"
    (audit / "plots").mkdir(parents=True)
    for name in ("response_lengths", "loss_mask_sums"):
        rows = [{"v": v, "n": (v * 7) % 11} for v in range(1, 40)]
        write_png(audit / "plots" / f"{name}.png", bar_chart(rows, x="v", y="n", title=name, x_title="v", y_title="n"))
        (audit / "plots" / f"{name}.csv").write_text("v,n\n1,2\n")
    (audit / "report.md").write_text(
        "# Data audit\n\n| gate | result |\n|---|---|\n| spike | crossed |\n\n"
        "![Response lengths](plots/response_lengths.png)\n\n![gone](plots/missing.png)\n\n[details](audit_details.json)\n"
    )
    (audit / "audit_details.json").write_text("{}\n")
    rows = [{"v": g, "n": 1 / g} for g in (1, 2, 4)]
    write_png(
        root / "reports/plan_time_vs_gpus.png", bar_chart(rows, x="v", y="n", title="p", x_title="g", y_title="h")
    )
    return [
        f"base.reports_dir={root / 'reports'}",
        f"audit.out={audit}",
        f"train.live_dir={root / 'reports/train_live'}",
    ]
