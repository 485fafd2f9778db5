"""z-lab native export: exact key set and config, identical logits after a round trip, refusal of a drafter
built for another target, tensor shapes checked against the config. vLLM serving it:
tests/integration/test_export_vllm.py.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from transformers import Qwen3Config

from dflash.core.errors import UserError
from dflash.drafter.export import load_drafter, save_drafter
from dflash.drafter.geometry import build_drafter_config
from dflash.drafter.model import build_drafter
from tests.helpers import repo_params

VOCAB = 512


def _target(hidden: int = 64, layers: int = 6) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2, head_dim=32
    )


@pytest.fixture(scope="module")
def small(repo_root):
    params = repo_params()
    dp = dataclasses.replace(
        params.drafter,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        sliding_window=5,
        block_size=4,
        mask_token_id=VOCAB - 1,
        target_layer_ids=[1, 3],
    )
    cfg = build_drafter_config(dp, _target())
    torch.manual_seed(0)
    return cfg, build_drafter(cfg).eval()


def test_checkpoint_holds_exactly_the_body(small, tmp_path):
    from safetensors import safe_open

    cfg, model = small
    save_drafter(model, cfg, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        fc_shape = tuple(f.get_tensor("fc.weight").shape)
    want = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(3):  # docs/design/checkpoint-serving.md, spelled out independently of export.body_keys
        want |= {
            f"layers.{i}.self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
        }
        want |= {f"layers.{i}.mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}
        want |= {f"layers.{i}.input_layernorm.weight", f"layers.{i}.post_attention_layernorm.weight"}
    assert keys == want  # in particular: no embed_tokens, no lm_head
    assert fc_shape == (64, 2 * 64)  # [H, K*H]


def test_config_json_is_the_z_lab_format(small, tmp_path):
    from transformers import AutoConfig

    cfg, model = small
    save_drafter(model, cfg, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["model_type"] == "qwen3"
    assert raw["dflash_config"] == {"mask_token_id": VOCAB - 1, "target_layer_ids": [1, 3]}  # z-lab convention
    assert (raw["block_size"], raw["num_target_layers"], raw["sliding_window"]) == (4, 6, 5)
    assert raw["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention"]
    assert raw["use_sliding_window"] is True
    assert (raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"]) == (4, 2, 16)
    assert "embed_tokens" not in json.dumps(raw) and raw["tie_word_embeddings"] is False
    hf = AutoConfig.from_pretrained(tmp_path)  # what vLLM / SGLang parse first
    assert (
        hf.sliding_window == 5
        and hf.layer_types == raw["layer_types"]
        and hf.dflash_config["target_layer_ids"] == [1, 3]
    )
    assert hf.rope_parameters["rope_theta"] == cfg.rope_theta


def test_round_trip_gives_identical_outputs(small, tmp_path):
    cfg, model = small
    save_drafter(model, cfg, tmp_path)
    loaded, loaded_cfg = load_drafter(tmp_path, target_config=_target())
    assert loaded_cfg == cfg
    g = torch.Generator().manual_seed(0)
    S = 30
    features = torch.randn(S, 2 * 64, generator=g)
    anchors = torch.tensor([0, 4, 17, 29])
    embeds = torch.randn(anchors.numel() * cfg.block_size, 64, generator=g)
    docs = torch.tensor([0] * 10 + [1] * 20)
    with torch.no_grad():
        assert torch.equal(loaded(features, embeds, anchors, docs), model(features, embeds, anchors, docs))
    bf16, _ = load_drafter(tmp_path, dtype=torch.bfloat16)
    assert bf16.fc.weight.dtype == torch.bfloat16


def test_loading_for_another_target_is_refused(small, tmp_path):
    cfg, model = small
    save_drafter(model, cfg, tmp_path)
    with pytest.raises(UserError, match=r"config\.json: hidden_size: drafter hidden size 64 != target hidden size 128"):
        load_drafter(tmp_path, target_config=_target(hidden=128))
    with pytest.raises(UserError, match=r"config\.json: num_target_layers:"):
        load_drafter(tmp_path, target_config=_target(layers=8))
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["dflash_config"]["target_layer_ids"] = [1, 5]  # the target's last layer
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UserError, match=r"dflash_config\.target_layer_ids: .*last layer"):
        load_drafter(tmp_path)


def test_tensor_shapes_must_match_the_config(small, tmp_path):
    cfg, model = small
    save_drafter(model, cfg, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["dflash_config"]["target_layer_ids"] = [1, 2, 3]  # fc would need K=3
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UserError, match="fc.weight has shape"):
        load_drafter(tmp_path)
