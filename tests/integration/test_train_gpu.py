"""Training on CUDA: bf16 autocast over fp32 master weights, the flex BlockMask against the dense SDPA mask,
the split layout (target and drafter on different devices), a compiled drafter. Skipped without a GPU.

Same small target and shards as the unit training tests (tests/helpers/train.py).
"""

from __future__ import annotations

import pytest
import torch

from dflash.train.loop import Trainer, train
from tests.helpers.train import train_params

pytestmark = pytest.mark.gpu
CUDA = ["train.target_device=cuda", "train.drafter_device=cuda", "train.dtype=bfloat16"]


def _step(trainer):
    metrics = trainer.compute_gradients(0)
    return metrics, torch.cat([p.grad.float().flatten() for p in trainer.model.parameters()])


def _close(a, b):
    (ma, ga), (mb, gb) = a, b
    assert ma["loss"] == pytest.approx(mb["loss"], rel=2e-2)
    assert torch.nn.functional.cosine_similarity(ga, gb, dim=0) > 0.99


@pytest.fixture(scope="module")
def flex_step(tmp_path_factory, train_target, train_data):  # noqa: F811
    flex = Trainer(
        train_params(train_target, tmp_path_factory.mktemp("flex"), *CUDA, "train.attention=flex"), train_data
    )
    assert flex.model.fc.weight.dtype == torch.float32 and flex.backend == "flex"  # fp32 master weights
    return _step(flex)


def test_flex_matches_sdpa(tmp_path, train_target, train_data, flex_step):  # noqa: F811
    _close(flex_step, _step(Trainer(train_params(train_target, tmp_path, *CUDA, "train.attention=sdpa"), train_data)))


def test_split_layout_matches_one_gpu(tmp_path, train_target, train_data, flex_step):  # noqa: F811
    split = Trainer(
        train_params(train_target, tmp_path, *CUDA, "train.attention=flex", "train.target_device=cpu"), train_data
    )
    assert split.target_device.type == "cpu" and split.embed.weight.device.type == "cuda"
    _close(flex_step, _step(split))


def test_compiled_drafter_matches_eager(tmp_path, train_target, train_data, flex_step):  # noqa: F811
    _close(flex_step, _step(Trainer(train_params(train_target, tmp_path, *CUDA, "train.compile=true"), train_data)))


def test_gpu_training_decreases_the_loss_and_exports_bf16(tmp_path, train_target, train_data):  # noqa: F811
    summary = train(train_params(train_target, tmp_path / "out", *CUDA, "train.epochs=4"), train_data)
    assert summary["completed"] and summary["dtype"] == "bfloat16" and summary["attention"] == "flex"
    assert summary["final_loss"] < 0.6 * summary["first_loss"]
    from dflash.drafter.export import load_drafter

    model, _ = load_drafter(tmp_path / "out/drafter")
    assert model.fc.weight.dtype == torch.bfloat16  # export_dtype auto = the compute dtype
