"""The drafter: config from params + target, validation, attention semantics, labels, inference consistency."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import Qwen3Config

from dflash.core.errors import UserError
from dflash.drafter.geometry import build_drafter_config, default_target_layer_ids
from dflash.drafter.masks import build_masks
from dflash.drafter.model import block_input_ids, block_labels, build_drafter, context_features, count_parameters
from dflash.drafter.session import DraftSession
from tests.helpers import repo_params
from tests.helpers.models import small_qwen3_config

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

VOCAB = 512
MASK = 500


@pytest.fixture(scope="module")
def params(repo_root):
    return repo_params()


def small_target(layers: int = 6, hidden: int = 64) -> Qwen3Config:
    return small_qwen3_config(layers, hidden, VOCAB)


def drafter_params(params, **changes):
    base = dict(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=6,
        block_size=4,
        mask_token_id=MASK,
        target_layer_ids=[0, 2, 4],
    )
    base.update(changes)
    return dataclasses.replace(params.drafter, **base)


QWEN36_TEXT = dict(
    hidden_size=5120,
    num_hidden_layers=64,
    vocab_size=248320,
    head_dim=256,
    num_attention_heads=24,
    num_key_value_heads=4,
)


def qwen36_drafter(params):
    return dataclasses.replace(
        params.drafter,
        num_hidden_layers=5,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=17408,
        layer_types=["sliding_attention"] * 4 + ["full_attention"],
        sliding_window=2048,
        rope_theta=1e7,
        block_size=16,
        mask_token_id=248070,
        target_layer_ids=[],
        num_target_features=5,
    )


# ---------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "n,k,ids",
    [(64, 5, [1, 16, 31, 46, 61]), (36, 5, [1, 9, 17, 25, 33]), (40, 5, [1, 10, 19, 28, 37]), (28, 3, [1, 13, 25])],
)
def test_default_target_layer_ids(n, k, ids):
    assert default_target_layer_ids(n, k) == ids


def test_drafter_geometry_is_its_own_not_the_targets(params):
    """The 27B regeneration case's bug: head_dim / heads / KV heads silently copied from a 256 / 24 / 4 target."""
    target = Qwen3Config(intermediate_size=17408, **QWEN36_TEXT)
    cfg = build_drafter_config(qwen36_drafter(params), target)
    assert (cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads) == (128, 32, 8)
    assert (cfg.hidden_size, cfg.vocab_size, cfg.num_target_layers) == (5120, 248320, 64)
    assert cfg.target_layer_ids == (1, 16, 31, 46, 61)
    model = build_drafter(cfg, device="meta")
    attn = model.layers[0].self_attn
    assert tuple(attn.q_proj.weight.shape) == (32 * 128, 5120)
    assert tuple(attn.k_proj.weight.shape) == (8 * 128, 5120)
    assert tuple(attn.q_norm.weight.shape) == (128,)
    assert tuple(model.fc.weight.shape) == (5120, 5 * 5120)


def test_qwen36_drafter_has_1_73b_trainable_parameters(params):
    from transformers import Qwen3_5TextConfig

    target = Qwen3_5TextConfig(**QWEN36_TEXT)
    cfg = build_drafter_config(qwen36_drafter(params), target)
    model = build_drafter(cfg, device="meta")
    assert all(p.is_meta for p in model.parameters())
    n = count_parameters(model)
    H, F, q, kv, hd = 5120, 17408, 32 * 128, 8 * 128, 128
    per_layer = H * q + 2 * H * kv + q * H + 2 * hd + 3 * H * F + 2 * H
    assert n == 5 * per_layer + 5 * H * H + 2 * H  # independent arithmetic: layers + fc + two norms
    assert abs(n - 1.73e9) < 0.01e9


def test_multimodal_target_config_uses_its_text_part(params):
    from transformers import Qwen3_5Config

    target = Qwen3_5Config(text_config=QWEN36_TEXT)
    cfg = build_drafter_config(qwen36_drafter(params), target)
    assert (cfg.hidden_size, cfg.vocab_size, cfg.num_target_layers) == (5120, 248320, 64)


@pytest.mark.parametrize(
    "changes,key",
    [
        (dict(target_layer_ids=[0, 2, 6]), "drafter.target_layer_ids"),  # out of range (6 layers: 0..5)
        (dict(target_layer_ids=[-1, 2]), "drafter.target_layer_ids"),
        (dict(target_layer_ids=[2, 0, 4]), "drafter.target_layer_ids"),  # unsorted
        (dict(target_layer_ids=[0, 2, 2]), "drafter.target_layer_ids"),  # duplicated
        (dict(target_layer_ids=[0, 2, 5]), "drafter.target_layer_ids"),  # the last layer (final norm applied)
        (dict(target_layer_ids=[], num_target_features=5), "drafter.num_target_features"),  # 6 layers: 1..3
        (dict(mask_token_id=VOCAB), "drafter.mask_token_id"),
        (dict(mask_token_id=-1), "drafter.mask_token_id"),
        (dict(block_size=1), "drafter.block_size"),
        (dict(num_attention_heads=6, num_key_value_heads=4), "drafter.num_key_value_heads"),
        (dict(head_dim=15), "drafter.head_dim"),
        (dict(sliding_window=0), "drafter.sliding_window"),
        (dict(layer_types=["full_attention"]), "drafter.layer_types"),
        (dict(layer_types=["full_attention", "global"]), "drafter.layer_types"),
        (dict(num_hidden_layers=0, layer_types=[]), "drafter.num_hidden_layers"),
    ],
)
def test_bad_params_are_refused_naming_the_param(params, changes, key):
    with pytest.raises(UserError, match=key.replace(".", r"\.") + ":"):
        build_drafter_config(drafter_params(params, **changes), small_target())


def test_good_params_pass_and_last_layer_minus_one_is_allowed(params):
    cfg = build_drafter_config(drafter_params(params, target_layer_ids=[0, 4]), small_target())
    assert cfg.target_layer_ids == (0, 4)
    assert cfg.layer_types == ("sliding_attention", "full_attention")
    cfg = build_drafter_config(drafter_params(params, layer_types=[]), small_target())
    assert cfg.layer_types == ("full_attention", "full_attention")  # [] = all full attention


def test_mask_token_used_by_the_tokenizer_is_refused(params, qwen_tokenizer):
    target = Qwen3Config(vocab_size=151936, hidden_size=64, num_hidden_layers=6, head_dim=32, num_attention_heads=2)
    ok = build_drafter_config(drafter_params(params, mask_token_id=151669), target, qwen_tokenizer)
    assert ok.mask_token_id == 151669  # Qwen3's padded row, past the tokenizer
    for bad in (100, 151645, 151668):  # a text token, <|im_end|> (eos), </think> (in the chat template)
        with pytest.raises(UserError, match=r"drafter\.mask_token_id:"):
            build_drafter_config(drafter_params(params, mask_token_id=bad), target, qwen_tokenizer)
    with pytest.raises(UserError, match=r"drafter\.mask_token_id:"):
        build_drafter_config(drafter_params(params, mask_token_id=151000), target, 151669)  # just a vocab size
    assert build_drafter_config(drafter_params(params, mask_token_id=151669), target, 151669).mask_token_id == 151669


# ---------------------------------------------------------------------------------------------- forward


def _row(cfg, seed=0, S=48):
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(S, cfg.num_target_features * cfg.hidden_size, generator=g)
    input_ids = torch.randint(0, 400, (S,), generator=g)
    doc_ids = torch.tensor([0] * 20 + [1] * (S - 20))
    anchors = torch.tensor([0, 3, 11, 19, 20, 26, 33, 47])
    return features, input_ids, doc_ids, anchors


@pytest.fixture(scope="module")
def tiny(params):
    cfg = build_drafter_config(drafter_params(params), small_target())
    torch.manual_seed(0)
    model = build_drafter(cfg).eval()
    embed = torch.nn.Embedding(VOCAB, cfg.hidden_size)
    return cfg, model, embed


def test_flex_and_sdpa_forward_match(tiny):
    cfg, model, embed = tiny
    features, input_ids, doc_ids, anchors = _row(cfg)
    block_embeds = embed(block_input_ids(input_ids, anchors, cfg.block_size, cfg.mask_token_id))
    with torch.no_grad():
        sdpa = model(features, block_embeds, anchors, doc_ids, backend="sdpa")
        flex = model(features, block_embeds, anchors, doc_ids, backend="flex")
    assert sdpa.shape == (anchors.numel() * cfg.block_size, cfg.hidden_size)
    torch.testing.assert_close(flex, sdpa, rtol=1e-5, atol=1e-5)


def test_forward_sees_exactly_what_the_rule_allows(tiny):
    """Perturb inputs the block must not see (context at/after its anchor, other documents, other blocks):
    its output is unchanged; perturb the context just before the anchor: it changes."""
    cfg, model, embed = tiny
    features, input_ids, doc_ids, anchors = _row(cfg)
    B, j, a = cfg.block_size, 5, 26  # block 5, anchor 26, document 1 (positions 20..47)
    block_embeds = embed(block_input_ids(input_ids, anchors, B, cfg.mask_token_id)).detach()

    def out(f, e):
        with torch.no_grad():
            return model(f, e, anchors, doc_ids)[j * B : (j + 1) * B]

    base = out(features, block_embeds)
    hidden = features.clone()
    hidden[a:] += 5.0  # the anchor's own feature and everything after it
    hidden[:20] += 5.0  # document 0
    other = block_embeds.clone()
    other[: j * B] += 5.0
    other[(j + 1) * B :] += 5.0
    torch.testing.assert_close(out(hidden, other), base, rtol=0, atol=1e-6)
    seen = features.clone()
    seen[a - 1] += 5.0  # the last visible context position
    assert (out(seen, block_embeds) - base).abs().max() > 1e-3


def test_full_layers_bidirectional_sliding_layers_causal(params):
    """Slot 1 depends on slot 3 through a full layer, never through sliding-only layers."""
    for types, expect_change in ((["sliding_attention"] * 2, False), (["sliding_attention", "full_attention"], True)):
        cfg = build_drafter_config(drafter_params(params, layer_types=types), small_target())
        torch.manual_seed(0)
        model = build_drafter(cfg).eval()
        features, _, doc_ids, anchors = _row(cfg)
        e = torch.randn(anchors.numel() * cfg.block_size, cfg.hidden_size)
        with torch.no_grad():
            base = model(features, e, anchors, doc_ids)
            e2 = e.clone()
            e2[3] += 5.0  # block 0, slot 3
            moved = (model(features, e2, anchors, doc_ids)[1] - base[1]).abs().max()
        assert (moved > 1e-3) == expect_change


def test_backward_reaches_every_trainable_parameter(tiny):
    cfg, model, embed = tiny
    features, input_ids, doc_ids, anchors = _row(cfg)
    block_embeds = embed(block_input_ids(input_ids, anchors, cfg.block_size, cfg.mask_token_id)).detach()
    model.zero_grad()
    model(features, block_embeds, anchors, doc_ids).square().mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    model.zero_grad()


# ---------------------------------------------------------------------------------------------- data helpers


def test_block_labels_slot_k_is_the_token_at_anchor_plus_k():
    S, B = 30, 4
    input_ids = torch.arange(100, 100 + S)  # token value = 100 + position: alignment is readable
    loss_mask = torch.ones(S, dtype=torch.bool)
    loss_mask[12] = False
    doc_ids = torch.tensor([0] * 15 + [1] * 15)
    anchors = torch.tensor([2, 10, 13, 28])
    ids = block_input_ids(input_ids, anchors, B, MASK).view(-1, B)
    assert ids[:, 0].tolist() == [102, 110, 113, 128] and (ids[:, 1:] == MASK).all()
    labels, valid = block_labels(input_ids, loss_mask, anchors, B, doc_ids)
    labels, valid = labels.view(-1, B), valid.view(-1, B)
    assert labels[0].tolist() == [0, 103, 104, 105]  # slot k -> position a + k, slot 0 has no loss
    assert valid[0].tolist() == [False, True, True, True]
    assert valid[1].tolist() == [False, True, False, True]  # position 12 is not supervised
    assert valid[2].tolist() == [False, True, False, False]  # positions 15, 16 belong to document 1
    assert valid[3].tolist() == [False, True, False, False]  # positions 30, 31 are past the row
    assert labels[3, 1] == 129 and (labels[~valid] == 0).all()


def test_context_features_are_the_outputs_of_target_layers():
    """Feature i == the output of decoder layer target_layer_ids[i] (HF hidden_states[id + 1])."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    target = Qwen3ForCausalLM(small_target(layers=4)).eval()
    outputs = {}

    def hook(i):
        def save(_module, _args, out):
            outputs[i] = out[0] if isinstance(out, tuple) else out

        return save

    handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(target.model.layers)]
    ids = torch.randint(0, 400, (1, 9))
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
    for h in handles:
        h.remove()
    layer_ids = [0, 2]
    feats = context_features(hs, layer_ids)  # (1, 9, 2H)
    H = target.config.hidden_size
    for i, layer in enumerate(layer_ids):
        torch.testing.assert_close(feats[..., i * H : (i + 1) * H], outputs[layer], rtol=0, atol=0)
    assert not torch.allclose(hs[-1], outputs[3])  # why the last layer is refused: HF normed that entry


# ---------------------------------------------------------------------------------------------- inference


def test_incremental_drafting_equals_training_forward(params):
    """The inference path (cached context K/V, extended in pieces) reproduces the training forward."""
    cfg = build_drafter_config(drafter_params(params, sliding_window=5), small_target())
    torch.manual_seed(1)
    model = build_drafter(cfg).eval()
    embed = torch.nn.Embedding(VOCAB, cfg.hidden_size)
    head = torch.nn.Linear(cfg.hidden_size, VOCAB, bias=False)
    features, input_ids, doc_ids, anchors = _row(cfg)
    positions = torch.cat([torch.arange(20), torch.arange(features.shape[0] - 20)])  # restart per document
    block_embeds = embed(block_input_ids(input_ids, anchors, cfg.block_size, cfg.mask_token_id))
    with torch.no_grad():
        train = model(features, block_embeds, anchors, doc_ids, positions)
    B = cfg.block_size
    for j, a in enumerate(anchors.tolist()):
        start = 0 if a < 20 else 20
        session = DraftSession(model, embed, head)
        cut = start + (a - start) // 2
        session.extend(features[start:cut])  # prompt ...
        session.extend(features[cut:a], torch.arange(cut - start, a - start))  # ... then accepted tokens
        got = session.draft_hidden(int(input_ids[a]), a - start)
        torch.testing.assert_close(got, train[j * B : (j + 1) * B], rtol=1e-5, atol=1e-5)
        with torch.no_grad():
            greedy = head(train[j * B + 1 : (j + 1) * B]).argmax(-1).tolist()
        assert session.draft(int(input_ids[a]), a - start) == greedy
        assert len(greedy) == B - 1
    with pytest.raises(ValueError, match="start_position"):
        session.draft(0, session.length + 1)


def test_masks_can_be_built_once_and_reused(tiny):
    cfg, model, embed = tiny
    features, input_ids, doc_ids, anchors = _row(cfg)
    e = embed(block_input_ids(input_ids, anchors, cfg.block_size, cfg.mask_token_id))
    masks = build_masks(cfg.layer_types, anchors, features.shape[0], cfg.block_size, cfg.sliding_window, doc_ids)
    with torch.no_grad():
        torch.testing.assert_close(
            model(features, e, anchors, doc_ids, masks=masks), model(features, e, anchors, doc_ids)
        )
