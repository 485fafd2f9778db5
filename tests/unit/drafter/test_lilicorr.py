"""LiLiCorr: the module's shapes and its DFlash body, the correlator against a direct computation of its definition,
the geometry checks (vLLM's rules), the export round trip, the reference's proposal step, and the transition loss
against a direct full-vocabulary computation (zero lm_head rows included) and decreasing on a tiny batch."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from dflash.core.errors import ParamsError
from dflash.drafter.build import build_drafter
from dflash.drafter.export import hf_config, load_drafter, save_drafter
from dflash.drafter.geometry import build_drafter_config
from dflash.drafter.lilicorr import lattice_walk, propose_step, ranked_candidates
from dflash.drafter.model import block_labels
from dflash.drafter.session import DraftSession
from dflash.train.loss import LMHead, normaliser_share, slot_weights
from dflash.train.loss_lilicorr import correlator_loss
from tests.helpers import repo_params
from tests.helpers.models import kind_drafter_params, small_qwen3_config

V, H, B = 512, 64, 4


def _config(**lilicorr):
    d = kind_drafter_params("lilicorr", lilicorr=lilicorr)
    return build_drafter_config(d, small_qwen3_config(4))


def _random(model: torch.nn.Module, seed: int = 1, std: float = 0.3) -> torch.nn.Module:
    """Every weight random (the attention biases and embeddings start at zero, which would hide a swap)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.lilicorr.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def _direct_scores(cor, embeds, log_probs, hidden, anchor, valid):
    """The module docstring's formulas, one request, loops over slots and candidates, float64."""
    n, k = log_probs.shape
    w = cor.pass_hidden_proj.out_features
    x = torch.zeros(n, k, w, dtype=torch.float64)
    for s in range(n):
        best = log_probs[s].max()
        for j in range(k):
            f = torch.stack([log_probs[s, j], log_probs[s, j].exp(), log_probs[s, j] - best])
            f = torch.cat([f, f.new_tensor([j / max(k - 1, 1), float(j == 0)])])
            tok = cor.token_proj(embeds[s, j]) if hasattr(cor, "token_proj") else embeds[s, j]
            x[s, j] = tok + cor.pass_hidden_proj(hidden[s]) + cor.feature_mlp(cor.feature_norm(f))
            x[s, j] += cor.slot_embedding[0, 0, s, 0] + cor.rank_embedding[0, 0, 0, j]
    x = x.reshape(n * k, w)
    heads = cor.same_slot_bias.numel()
    slot = [i // k for i in range(n * k)]
    bias = torch.zeros(heads, n * k, n * k, dtype=torch.float64)
    for q in range(n * k):
        for kk in range(n * k):
            bias[:, q, kk] = cor.relative_slot_bias[:, slot[q] - slot[kk] + cor.block_size - 1]
            bias[:, q, kk] += cor.same_slot_bias * (slot[q] == slot[kk])
    for layer in cor.layers:
        y = layer.attn_norm(x)
        qkv = y @ layer.attn.in_proj_weight.T + layer.attn.in_proj_bias
        q, kv_k, v = qkv.split(w, dim=-1)
        hd = w // heads
        outs = []
        for hh in range(heads):
            sl = slice(hh * hd, (hh + 1) * hd)
            att = torch.softmax(q[:, sl] @ kv_k[:, sl].T / math.sqrt(hd) + bias[hh], dim=-1)
            outs.append(att @ v[:, sl])
        x = x + layer.attn.out_proj(torch.cat(outs, dim=-1))
        x = x + layer.mlp(layer.mlp_norm(x))
    x = cor.output_norm(x).reshape(n, k, w)
    a = cor.anchor_norm(cor.context_proj(anchor) * float(valid))
    u = F.silu(cor.factor_input_proj(torch.cat([x, a.expand_as(x), x * a], dim=-1)))
    out_v = cor.out_head(u) / cor.out_head(u).norm(dim=-1, keepdim=True)
    in_v = cor.in_head(u) / cor.in_head(u).norm(dim=-1, keepdim=True)
    st = cor.anchor_out_head(a) / cor.anchor_out_head(a).norm()
    start = cor.logit_scale * (in_v[0] @ st)
    pairs = torch.stack([cor.logit_scale * out_v[s] @ in_v[s + 1].T for s in range(n - 1)])
    return start, pairs


@pytest.mark.parametrize("width", [0, 32])
def test_the_correlator_is_its_definition(width):
    cfg = _config(hidden_size=width, num_layers=2)
    torch.manual_seed(0)
    model = _random(build_drafter(cfg)).double().eval()
    cor, k, n = model.lilicorr, cfg.lilicorr.candidate_top_k, B - 1
    assert hasattr(cor, "token_proj") == (width == 32)
    g = torch.Generator().manual_seed(2)
    embeds = torch.randn(2, n, k, H, generator=g, dtype=torch.float64)
    lp = torch.log_softmax(torch.randn(2, n, 9, generator=g, dtype=torch.float64), -1)[..., :k]
    hidden = torch.randn(2, n, H, generator=g, dtype=torch.float64)
    anchor = torch.randn(2, H, generator=g, dtype=torch.float64)
    valid = torch.tensor([True, False])
    with torch.no_grad():
        start, pairs = cor(embeds, lp, hidden, anchor, valid)
        assert start.shape == (2, k) and pairs.shape == (2, n - 1, k, k)
        for r in range(2):
            ws, wp = _direct_scores(cor, embeds[r], lp[r], hidden[r], anchor[r], bool(valid[r]))
            torch.testing.assert_close(start[r], ws, rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(pairs[r], wp, rtol=1e-10, atol=1e-10)
        short = cor(embeds[:1, :2], lp[:1, :2], hidden[:1, :2], anchor[:1], valid[:1])  # a shorter draft
        ws, wp = _direct_scores(cor, embeds[0, :2], lp[0, :2], hidden[0, :2], anchor[0], True)
        torch.testing.assert_close(short[1][0], wp, rtol=1e-10, atol=1e-10)


def test_the_body_is_dflashs_and_the_training_forward_has_its_shape():
    cfg = _config()
    torch.manual_seed(0)
    dflash = build_drafter(dataclasses.replace(cfg, kind="dflash", lilicorr=None)).eval()
    torch.manual_seed(0)
    model = build_drafter(cfg).eval()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in dflash.state_dict().items())
    feats, embeds, anchors = torch.randn(30, 2 * H), torch.randn(3 * B, H), torch.tensor([2, 9, 20])
    with torch.no_grad():
        out = model(feats, embeds, anchors)
    assert out.shape == (3 * B, H) and torch.equal(out, dflash(feats, embeds, anchors))


@pytest.mark.parametrize(
    ("lilicorr", "message"),
    [
        ({"candidate_top_k": 3}, r"^drafter\.lilicorr\.candidate_top_k: must be a power of two <= 16"),
        ({"candidate_top_k": 32}, r"^drafter\.lilicorr\.candidate_top_k: must be a power of two <= 16"),
        ({"num_heads": 3}, r"^drafter\.lilicorr\.num_heads: 3 does not divide the correlator width 64"),
        ({"conv_kernel_size": 2}, r"^drafter\.lilicorr\.conv_kernel_size: 2 taps with group size 0"),
        ({"conv_kernel_size": 2, "conv_group_size": 24}, r"^drafter\.lilicorr\.conv_group_size: 24 does not divide"),
        ({"factor_dim": 0}, r"^drafter\.lilicorr\.factor_dim: must be >= 1"),
        ({"logit_scale": 0.0}, r"^drafter\.lilicorr\.logit_scale: must be > 0"),
    ],
)
def test_the_geometry_refuses_what_vllm_refuses(lilicorr, message):
    with pytest.raises(ParamsError, match=message):
        _config(**lilicorr)


def test_params_accept_lilicorr_and_its_loss_weight_is_checked():
    from dflash.core.validate import check_train

    check_train(repo_params(["drafter.kind=lilicorr"]))
    with pytest.raises(ParamsError, match=r"^train\.lilicorr_loss\.correlator: must be >= 0"):
        check_train(repo_params(["drafter.kind=lilicorr", "train.lilicorr_loss.correlator=-1"]))


@pytest.mark.parametrize("convs", [(0, 0), (2, 16)])
def test_the_export_round_trips(tmp_path, convs):
    cfg = _config(conv_kernel_size=convs[0], conv_group_size=convs[1], hidden_size=32)
    torch.manual_seed(0)
    model = _random(build_drafter(cfg))
    save_drafter(model, cfg, tmp_path)
    loaded, read = load_drafter(tmp_path, small_qwen3_config(4))
    assert read == cfg
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
    raw = hf_config(cfg, torch.float32)
    assert raw["architectures"] == ["LiLiCorrDraftModel"]
    assert raw["dflash_config"]["lilicorr_candidate_topk"] == 4 and raw["dflash_config"]["lilicorr_enabled"]
    assert any(".attention_conv." in k for k in model.state_dict()) == bool(convs[0])


def test_the_reference_step_walks_the_correlators_scores_after_the_last_verified_context():
    cfg = _config()
    torch.manual_seed(0)
    model = _random(build_drafter(cfg)).eval()
    embed, head = torch.nn.Embedding(V, H), torch.nn.Linear(H, V, bias=False)
    torch.nn.init.normal_(head.weight, std=0.5)
    feats = torch.randn(17, 2 * H)
    session = DraftSession(model, embed, head)
    session.extend(feats[:12])
    session.extend(feats[12:])
    with torch.no_grad():
        hidden = session.draft_hidden(7, 17)
        drafts, logits = propose_step(session, hidden, head, lambda row, j: int(row.argmax()))
        # by hand: vLLM's walk over the (n, K, K) scores, the anchor = context feature of position 16
        cand, lp = ranked_candidates(head(hidden[1:]), 4)
        anchor = model.context(feats)[16]
        start, pairs = model.lilicorr(embed(cand)[None], lp[None], hidden[1:][None], anchor[None], torch.tensor([True]))
        want, prev = [], None
        for s in range(B - 1):
            row = start[0] if s == 0 else pairs[0, s - 1, prev]
            prev = int(row.argmax())
            want.append(int(cand[s, prev]))
    assert drafts == want
    assert torch.isfinite(logits).sum(dim=1).tolist() == [4] * (B - 1)
    differs = 0
    for seed in range(10):  # the correlator really reorders the lm_head's candidates
        g = torch.Generator().manual_seed(seed)
        h = torch.randn(B - 1, H, generator=g)
        walked, _ = lattice_walk(model, h, head(h), embed, anchor, lambda row, j: int(row.argmax()))
        differs += walked != head(h).argmax(-1).tolist()
    assert differs > 3


def _loss_inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lm = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        lm.weight.copy_(torch.randn(V, H, generator=g))
        lm.weight[400:] = 0
    s, anchors = 30, torch.tensor([0, 8, 15, 24])
    ids = torch.randint(0, V, (s,), generator=g)
    docs = torch.tensor([0] * 15 + [1] * 15)
    labels, valid = block_labels(ids, torch.ones(s, dtype=torch.bool), anchors, B, docs)
    hidden = torch.randn(anchors.numel() * B, H, generator=g)
    final = torch.randn(s, H, generator=g)
    for n, a in enumerate(anchors.tolist()[:3]):  # these blocks' labels are the drafter's own top-1 (present)
        final[a : a + B - 1] = hidden[n * B + 1 : (n + 1) * B]
    return g, lm, anchors, docs, valid, hidden, final


def test_the_transition_loss_equals_a_direct_full_vocabulary_computation():
    cfg = _config()
    torch.manual_seed(0)
    model = _random(build_drafter(cfg), std=0.2)
    g, lm, anchors, docs, valid, hidden, final = _loss_inputs()
    embed = torch.nn.Embedding(V, H)
    head = LMHead.from_linear(lm)
    hidden.requires_grad_(True)
    feats = torch.randn(30, 2 * H, generator=g)
    w = slot_weights(B, 4.0)
    norm = normaliser_share(valid, w)
    common = {"drafter": model, "embed": embed, "features": feats, "doc_ids": docs, "anchors": anchors}
    loss, correct, counted = correlator_loss(
        hidden, valid, head, **common, target_hidden=final, slot_w=w, normaliser=norm, chunk_rows=5
    )
    params = [hidden, *model.parameters()]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    # direct: per block, the full logits, torch.topk, log_softmax; a slot whose label is no candidate has no term
    cor, k = model.lilicorr, 4
    want, want_correct, want_counted, absent = 0.0, [0] * B, [0] * B, 0
    ctx = model.context(feats)
    for n, a in enumerate(anchors.tolist()):
        h = hidden[n * B + 1 : (n + 1) * B]
        full = h @ lm.weight.T
        cand = full.detach().topk(k, dim=1).indices
        label = (final[a : a + B - 1] @ lm.weight.T).argmax(1)
        ok = valid[n * B + 1 : (n + 1) * B]
        present = (cand == label[:, None]).any(1)
        pos = (cand == label[:, None]).float().argmax(1)
        lp = torch.log_softmax(full.detach(), dim=1).gather(1, cand)
        has = a >= 1 and docs[a - 1] == docs[a]
        start, pairs = cor(embed(cand)[None].detach(), lp[None], h[None], ctx[max(a - 1, 0)][None], torch.tensor([has]))
        for s in range(B - 1):
            if not ok[s] or (s > 0 and not (ok[s - 1] and present[s - 1])):
                continue
            want_counted[s + 1] += 1
            if not present[s]:
                absent += 1
                continue
            row = start[0] if s == 0 else pairs[0, s - 1, pos[s - 1]]
            want = want + F.cross_entropy(row[None], pos[s : s + 1]) * w[s + 1] / norm
            want_correct[s + 1] += int(int(row.argmax()) == int(pos[s]))
    want_grads = torch.autograd.grad(want, params, allow_unused=True)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, want_grads, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert correct.tolist() == want_correct and counted.tolist() == want_counted
    assert 0 < absent < sum(want_counted)  # both cases (label in the top-K or not) occurred


def test_the_transition_loss_decreases_on_a_tiny_batch():
    cfg = _config()
    torch.manual_seed(0)
    model = build_drafter(cfg)
    g, lm, anchors, docs, valid, hidden, final = _loss_inputs(1)
    embed, head = torch.nn.Embedding(V, H), LMHead.from_linear(lm)
    feats = torch.randn(30, 2 * H, generator=g)
    w = slot_weights(B, 4.0)
    norm = normaliser_share(valid, w)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    common = {"drafter": model, "embed": embed, "features": feats, "doc_ids": docs, "anchors": anchors}
    losses = []
    for _ in range(40):
        loss, correct, counted = correlator_loss(
            hidden, valid, head, **common, target_hidden=final, slot_w=w, normaliser=norm, chunk_rows=8
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0]
    assert int(correct.sum()) >= 6  # it learnt the paths whose labels are candidates (3 blocks x 3 slots)
