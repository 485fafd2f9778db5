"""DSpark and DFlash2 trained by the train stage's own Trainer (CPU): the loss falls, the drafter learns its
drafts (the target's argmax, as tests/unit/train/test_train.py's target losses: chance ~1/300), the export is the kind's vLLM format and loads back, and DSpark's tied zero-row W2 rows stay tied.

The target and data follow tests/unit/train/test_train.py's recipe in small: a random Qwen3 (vocab 512, hidden 64, 4 layers,
lm_head rows 300..511 zeroed, so the exact zero-row softmax is on the training path), documents of random prompt
tokens (loss 0) then a fixed token cycle the drafter can learn (loss 1) ending with token 305 (a zero lm_head row:
a data label: DSpark keeps its W2 row apart).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dflash.drafter.export import load_drafter
from dflash.train.data import write_shard
from dflash.train.loop import train
from tests.helpers import repo_params
from tests.helpers.models import small_qwen3_config

pytestmark = pytest.mark.slow
VOCAB, END, MASK, ZERO_FROM = 512, 305, 511, 300


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import Qwen3ForCausalLM

    root = tmp_path_factory.mktemp("successors_train")
    torch.manual_seed(0)
    cfg = small_qwen3_config(4, vocab=VOCAB, max_position_embeddings=512, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.3)
        model.lm_head.weight[ZERO_FROM:] = 0
    target = root / "target"
    model.save_pretrained(target)
    (target / "target.json").write_text(json.dumps({"source": "test", "model": str(target), "revision": ""}))
    rng = np.random.default_rng(0)
    cycle = (rng.permutation(48) + 10).tolist()
    docs = []
    for _ in range(64):
        prompt = rng.integers(10, 210, rng.integers(4, 12)).tolist()
        start, length = int(rng.integers(0, 48)), int(rng.integers(8, 40))
        completion = [cycle[(start + i) % 48] for i in range(length)] + [END]
        docs.append((prompt + completion, [0] * len(prompt) + [1] * len(completion), len(prompt)))
    data = root / "data"
    write_shard(data / "shard-00000.arrow", docs[:40], "a")
    write_shard(data / "shard-00001.arrow", docs[40:], "b")
    return target, data


def _train(setup, out, *extra: str) -> dict:
    target, data = setup
    overrides = [
        f"base.target_dir={target}",
        "drafter.num_hidden_layers=1",
        "drafter.num_attention_heads=2",
        "drafter.num_key_value_heads=1",
        "drafter.head_dim=32",
        "drafter.intermediate_size=128",
        "drafter.block_size=4",
        f"drafter.mask_token_id={MASK}",
        "drafter.target_layer_ids=[0, 2]",
        "drafter.max_position_embeddings=512",
        "drafter.dspark.markov_rank=8",
        "drafter.dflash2.selector_rank=8",
        "drafter.dflash2.selector_top_k=8",
        f"train.out={out}",
        "train.target_device=cpu",
        "train.drafter_device=cpu",
        "train.live_dir=",
        "train.max_length=64",
        "train.max_tokens_per_row=128",
        "train.pack_window=64",
        "train.num_anchors=6",
        "train.epochs=4",
        "train.loss_target=target_argmax",  # the random target's argmax is what both kinds' heads learn
        "train.lr=3e-3",
        "train.warmup_ratio=0.1",
        "train.logits_chunk_blocks=8",
        "train.checkpoint_every=0",
        *extra,
    ]
    return train(repo_params(overrides), data)


def test_dspark_trains_and_exports_its_vllm_format(setup, tmp_path):
    from safetensors.torch import load_file

    # data tokens as the CE label (END, a zero lm_head row, is one: its W2 row must be its own), CE at weight 1
    # so the drafter learns the cycle beside the L1 pull toward the random target's distribution
    summary = _train(
        setup, tmp_path / "out", "drafter.kind=dspark", "train.loss_target=tokens", "train.dspark_loss.ce=1.0"
    )
    # (the confidence BCE against a soft label keeps a floor: its label's entropy)
    assert summary["completed"] and summary["final_loss"] < 0.8 * summary["first_loss"], summary
    # the Markov-corrected draft's teacher-forced accuracy against the data (chance ~1/48)
    assert summary["final_accuracy_by_position"][0] > 0.1, summary
    folder = tmp_path / "out/drafter"
    raw = json.loads((folder / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3DSparkModel"] and raw["block_size"] == 3  # drafter.block_size 4 - 1
    assert raw["markov_rank"] == 8 and raw["confidence_head_with_markov"] is True
    model, cfg = load_drafter(folder)
    assert cfg.kind == "dspark" and cfg.query_slots == 3 and model.confidence_head is not None
    w2 = load_file(str(folder / "model.safetensors"))["markov_head.markov_w2.weight"]
    # the zero lm_head rows that are no label share one W2 row; END, a label, learned its own
    tied = [t for t in range(ZERO_FROM, VOCAB) if t not in (ZERO_FROM, END)]
    assert torch.equal(w2[tied], w2[tied[:1]].expand(len(tied), -1))
    assert not torch.equal(w2[END], w2[tied[0]]) and w2[:ZERO_FROM].abs().sum() > 0


def test_dflash2_trains_and_exports_its_vllm_format(setup, tmp_path):
    summary = _train(setup, tmp_path / "out", "drafter.kind=dflash2")
    assert summary["completed"] and summary["final_loss"] < 0.7 * summary["first_loss"], summary
    assert summary["final_accuracy_by_position"][0] > 0.1, summary  # the selector's teacher-forced picks
    folder = tmp_path / "out/drafter"
    raw = json.loads((folder / "config.json").read_text())
    assert raw["architectures"] == ["DFlash2DraftModel"] and raw["block_size"] == 4
    assert raw["dflash_config"]["selector_top_k"] == 8 and raw["dflash_config"]["conv_kernel_size"] == 2
    model, cfg = load_drafter(folder)
    assert cfg.kind == "dflash2"
    conv = model.layers[0].attention_conv
    assert conv.kernel_projection.weight.abs().sum() > 0  # the convs left the identity
    assert model.candidate_selector.successor_codebook.abs().sum() > 0  # and the selector learned
