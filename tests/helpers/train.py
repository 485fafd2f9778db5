"""The training tests' target, shards and params, torch's thread count (float sums in a fixed order), and the
environment torchrun gives a rank (the multi-process tests)."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import numpy as np

from dflash.core.params import Params
from tests.helpers import TEST_DEFAULTS, repo_params
from tests.helpers.models import small_qwen3_config


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


# A small random Qwen3 target (vocab 512, hidden 64, 4 layers; lm_head rows 300..511 zeroed so the exact zero-row
# softmax is on the training path) and hand-made shards in the tokenize stage's schema: a few random prompt tokens
# (loss 0), then a fixed token cycle the drafter can learn (loss 1) ending with token 305 (a zero lm_head row).
TRAIN_VOCAB, TRAIN_END, TRAIN_MASK = 512, 305, 511
TRAIN_SONG = (np.random.default_rng(123).permutation(48) + 10).tolist()  # the completions' fixed token cycle


@contextlib.contextmanager
def torch_threads(n: int):
    """Run the block with `n` intra-op threads (float reductions in an order fixed by `n`), then restore."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def one_thread():
    """Bitwise comparisons and the golden file: one intra-op thread (reductions in one fixed order)."""
    return torch_threads(1)


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
        *TEST_DEFAULTS,
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
