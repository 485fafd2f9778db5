"""Online training: anchors, packing, features, the chunked zero-row loss, exact resume, golden losses.

Everything runs on the small random Qwen3 target and hand-made shards of tests/helpers/train.py (vocab 512, hidden 64,
4 layers; lm_head rows 300..511 zeroed so the exact zero-row softmax is on the training path; documents of a few
random prompt tokens (loss 0), then a fixed token cycle the drafter can learn (loss 1) ending with token 305, a
zero lm_head row). DDP / FSDP / torchrun: tests/integration/ (test_train_ddp, test_train_fsdp, test_train_multinode).

Golden file: tests/golden/train_tiny.json holds the per-step losses of the seeded run below on one CPU thread,
one curve per CPU type it was recorded on; the test demands exact equality on a recorded CPU type (another
instruction set rounds the last bits differently: there, 1e-5 relative to every recorded curve). To record this
machine's CPU type, or after a deliberate change to the training numerics (then delete the old curves first),
run the following and commit the diff with the reason:
    DFLASH_UPDATE_GOLDEN=1 python -m pytest -q tests/unit/train/test_train.py -k golden
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash.core.errors import UserError
from dflash.core.hf import load_target_model as load_target
from dflash.drafter.model import context_features
from dflash.train import checkpoint
from dflash.train.data import (
    ShardReader,
    anchor_candidates,
    epoch_rows,
    make_batch,
    pack_best_fit,
    packing_efficiency,
    sample_anchors,
    scan_shards,
    write_shard,
)
from dflash.train.features import TargetFeatures
from dflash.train.loop import Trainer, train
from dflash.train.loss import LMHead, block_loss, slot_weights, tau_hat
from dflash.train.parts import lr_factor
from tests.helpers import REPO, TEST_DEFAULTS, repo_params
from tests.helpers.train import one_thread, train_documents, train_overrides, train_params

GOLDEN = REPO / "tests/golden/train_tiny.json"
TRAIN_VOCAB, TRAIN_END, TRAIN_MASK = 512, 305, 511


# ------------------------------------------------------------------------------------------ anchors, packing


def _holey_shard(folder: Path) -> Path:
    """Loss masks with holes: the candidates are exactly the t with mask[t] = mask[t+1] = 1."""
    masks = [
        [0, 0, 1, 1, 0, 1, 1, 1, 0, 1],  # candidates 2, 5, 6 (9 is last: no next token)
        [0, 1, 0, 1, 0, 1, 0, 1],  # none: skipped
        [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0],  # 0..10
        [0, 0, 0, 1, 1],  # 3
    ] * 5
    samples = [(list(range(20, 20 + len(m))), m, 2) for m in masks]
    write_shard(folder / "shard-00000.arrow", samples)
    return folder


def test_anchor_candidates_follow_the_loss_mask(tmp_path):
    index = scan_shards(_holey_shard(tmp_path), max_length=64)
    assert index.candidates[:4].tolist() == [3, 0, 11, 1]
    assert anchor_candidates(np.array([0, 0, 1, 1, 0, 1, 1, 1, 0, 1])).tolist() == [2, 5, 6]
    cut = scan_shards(tmp_path, max_length=6)  # the cut removes candidates whose next token is cut off
    assert cut.candidates[:4].tolist() == [1, 0, 5, 1] and cut.length[:4].tolist() == [6, 6, 6, 5]


def test_anchors_never_cross_documents_or_pick_unsupervised_next_tokens(tmp_path):
    index = scan_shards(_holey_shard(tmp_path), max_length=64)
    reader = ShardReader(index)
    seen = set()
    for epoch in range(4):
        rows = epoch_rows(index, seed=3, epoch=epoch, capacity=32, window=8)
        docs = [int(d) for r in rows for d in r]
        assert sorted(docs) == index.usable.tolist()  # each usable document once per epoch, unusable never
        batch = make_batch(rows[:3], reader, num_anchors=4, seed=3, epoch=epoch)
        ids, mask, doc = batch.input_ids, batch.loss_mask, batch.doc_ids
        a = batch.anchors
        assert torch.all(a[1:] > a[:-1])  # sorted, no duplicates
        assert torch.all(a + 1 < ids.numel())
        assert torch.all(mask[a]) and torch.all(mask[a + 1])  # the anchor and its next token are supervised
        assert torch.all(doc[a] == doc[a + 1])  # ... and in the same document
        for d in range(len(batch.doc_starts)):  # per document: min(num_anchors, candidates) anchors
            n_cand = len(anchor_candidates(mask[doc == d].numpy()))
            assert int((doc[a] == d).sum()) == min(4, n_cand)
        assert torch.equal(
            batch.position_ids[torch.tensor(batch.doc_starts)], torch.zeros(len(batch.doc_starts)).long()
        )
        seen.add(tuple(a.tolist()))
    # fixed (seed, epoch, document) -> same draw; a new epoch re-samples
    m = np.ones(40, dtype=np.int8)
    assert np.array_equal(sample_anchors(m, 5, 0, 1, 7), sample_anchors(m, 5, 0, 1, 7))
    assert not np.array_equal(sample_anchors(m, 5, 0, 1, 7), sample_anchors(m, 5, 0, 2, 7))


def test_anchor_draw_is_uniform_without_replacement():
    mask = np.array([0, 0] + [1] * 11)  # candidates 2..11 (10 of them)
    counts = np.zeros(13)
    trials = 3000
    for epoch in range(trials):
        a = sample_anchors(mask, 3, seed=0, epoch=epoch, doc=0)
        assert len(set(a.tolist())) == 3 and a.min() >= 2 and a.max() <= 11
        counts[a] += 1
    expected = trials * 3 / 10
    sigma = (trials * 0.3 * 0.7) ** 0.5
    assert np.all(np.abs(counts[2:12] - expected) < 4 * sigma), counts


def test_batch_holds_the_documents_and_packing_respects_capacity(train_data):
    index = scan_shards(train_data, max_length=64)
    rows = epoch_rows(index, seed=0, epoch=0, capacity=128, window=64)
    assert all(index.length[r].sum() <= 128 for r in rows)
    assert packing_efficiency(index, rows, 128) > 0.85
    reader = ShardReader(index)
    batch = make_batch(rows[:2], reader, num_anchors=6, seed=0, epoch=0)
    docs = [int(d) for r in rows[:2] for d in r]
    for d, (start, n) in zip(docs, zip(batch.doc_starts, batch.doc_lengths, strict=True), strict=True):
        ids, mask = reader.document(d)
        assert torch.equal(batch.input_ids[start : start + n], torch.from_numpy(ids))
        assert torch.equal(batch.loss_mask[start : start + n], torch.from_numpy(mask))
        assert torch.equal(batch.position_ids[start : start + n], torch.arange(n))
    rng = np.random.default_rng(0)
    lengths = rng.integers(50, 131, 2000)  # demo-like documents
    packed = pack_best_fit(lengths, 1024)
    assert sorted(i for r in packed for i in r) == list(range(2000))
    assert lengths.sum() / (len(packed) * 1024) >= 0.95


def test_scan_refuses_bad_data(tmp_path):
    write_shard(tmp_path / "shard-00000.arrow", [([1, 2, 3], [0, 1, 1], 1), ([4, TRAIN_VOCAB, 5], [0, 1, 1], 1)])
    with pytest.raises(UserError, match=r"shard-00000\.arrow: row 1: input_ids holds 512, outside"):
        scan_shards(tmp_path, 64, vocab_size=TRAIN_VOCAB)
    write_shard(tmp_path / "shard-00000.arrow", [([1, 2, 3], [0, 1, 1], 1), ([4, TRAIN_MASK, 5], [0, 1, 1], 1)])
    with pytest.raises(UserError, match=r"row 1: input_ids holds the drafter's mask token 511"):
        scan_shards(tmp_path, 64, vocab_size=TRAIN_VOCAB, mask_token_id=TRAIN_MASK)
    scan_shards(tmp_path, 1, vocab_size=TRAIN_VOCAB, mask_token_id=TRAIN_MASK)  # cut away: never trained on, accepted
    with pytest.raises(UserError, match="no shard"):
        scan_shards(tmp_path / "missing", 64)


# ------------------------------------------------------------------------------------------------ loss


def _head(vocab=300, hidden=16, zero=(slice(100, 250), 5)):
    torch.manual_seed(0)
    lin = torch.nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        for z in zero:
            lin.weight[z] = 0
    return lin


def test_zero_row_loss_equals_the_full_vocabulary_loss():
    lin = _head()
    head = LMHead.from_linear(lin)
    assert head.num_zero == 151 and head.first_zero == 5 and head.weight.shape == (149, 16)
    n, b = 24, 4
    h = torch.randn(n * b, 16)
    h[:8] *= -0.0  # zero hidden: every logit is 0, the argmax tie goes to token 0 (a kept row)
    h = h.requires_grad_()
    labels = torch.randint(0, 300, (n * b,))
    labels[8:16] = 120  # labels on zero rows
    valid = torch.rand(n * b, generator=torch.Generator().manual_seed(1)) > 0.2
    valid.view(n, b)[:, 0] = False
    w = slot_weights(b, 4.0)
    out = block_loss(h, labels, valid, head, slot_w=w, normaliser=3.7, chunk_rows=5)
    out.loss.backward()
    grad = h.grad.clone()
    h.grad = None
    logits = h @ lin.weight.T  # the full-vocabulary reference
    ce = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    ref = (ce * w[torch.arange(n * b) % b] * valid).sum() / 3.7
    ref.backward()
    torch.testing.assert_close(out.loss, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, h.grad, rtol=1e-5, atol=1e-7)
    slot = torch.arange(n * b) % b
    hit = valid & (logits.argmax(1) == labels)
    assert torch.equal(out.correct, torch.bincount(slot[hit], minlength=b))
    assert torch.equal(out.counted, torch.bincount(slot[valid], minlength=b))
    assert out.weight_sum == pytest.approx(float((w[slot] * valid).sum()))


def test_argmax_falls_to_the_first_zero_row_when_every_kept_logit_is_negative():
    lin = _head(vocab=10, hidden=2, zero=(slice(6, 10), 0))
    with torch.no_grad():
        lin.weight[1:6] = torch.tensor([[1.0, 0.0]]).repeat(5, 1)  # kept rows 1..5: logit = h[0]
    head = LMHead.from_linear(lin)
    h = torch.tensor([[-1.0, 0.0], [2.0, 0.0], [0.0, 0.0]] * 2)  # negative -> token 0 (zero row); positive -> 1
    labels = torch.tensor([0, 1, 0, 6, 2, 0])
    valid = torch.tensor([False, True, True, False, True, True])
    out = block_loss(h, labels, valid, head, slot_w=torch.tensor([0.0, 1.0, 1.0]), normaliser=1.0, chunk_rows=2)
    full = h @ lin.weight.T
    hits = (full.argmax(1) == labels) & valid
    slot = torch.arange(6) % 3
    assert torch.equal(out.correct, torch.bincount(slot[hits], minlength=3))
    assert int(out.correct.sum()) == 3  # rows 1 (token 1), 2 (all zero logits: tie -> id 0), 5 (tie -> 0)


def test_real_heads_are_untouched_and_chunking_does_not_change_the_loss():
    lin = _head(zero=())
    head = LMHead.from_linear(lin)
    assert head.num_zero == 0 and head.remap is None and head.weight.data_ptr() == lin.weight.data_ptr()
    h = torch.randn(40, 16)
    labels = torch.randint(0, 300, (40,))
    valid = torch.ones(40, dtype=torch.bool)
    w = slot_weights(4, 7.0)
    a = block_loss(h, labels, valid, head, slot_w=w, normaliser=1.0, chunk_rows=1).loss
    b = block_loss(h, labels, valid, head, slot_w=w, normaliser=1.0, chunk_rows=1000).loss
    torch.testing.assert_close(a, b)
    assert w[0] == 0 and w[1] == 1 and float(w[3]) == pytest.approx(np.exp(-2 / 7))


def test_tau_hat_and_schedule():
    assert tau_hat([1.0, 1.0, 1.0]) == 4.0 and tau_hat([0.0, 1.0]) == 1.0
    assert tau_hat([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    lrs = [lr_factor(s, 100, 4, 0.1) for s in range(100)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0] and lrs[4] == 1.0
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:], strict=False)) and lrs[-1] > 0.1
    assert lr_factor(100, 100, 4, 0.1) == pytest.approx(0.1)


# -------------------------------------------------------------------------------------------- features


def test_hooked_features_equal_hidden_states_and_stop_early(train_target):
    model = load_target(train_target, torch.float32, torch.device("cpu"), False)
    ran = []
    model.model.layers[3].register_forward_hook(lambda *_: ran.append(3))
    feats = TargetFeatures(model, [0, 2], 4, batch_tokens=64)
    docs = train_documents(5, 1)
    ids = torch.tensor([t for d in docs for t in d[0]])
    starts = np.cumsum([0] + [len(d[0]) for d in docs[:-1]]).tolist()
    out = feats(ids, starts, [len(d[0]) for d in docs])  # several padded groups (batch_tokens 64)
    assert not ran  # the layers after the deepest feature layer never run
    for (d_ids, _, _), s in zip(docs, starts, strict=True):
        with torch.no_grad():
            hs = model(torch.tensor([d_ids]), output_hidden_states=True).hidden_states
        ref = context_features(hs, [0, 2])[0]  # HF hidden_states[id + 1], one document alone
        torch.testing.assert_close(out[s : s + len(d_ids)], ref, rtol=1e-5, atol=1e-5)


def test_hybrid_qwen3_5_target_with_text_config(tmp_path):
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from dflash.core.hf import target_config_dict
    from dflash.core.loader import load_params as lp
    from dflash.drafter.geometry import build_drafter_config

    text = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16,
    )  # fmt: skip
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64)
    torch.manual_seed(0)
    Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)).save_pretrained(tmp_path)
    (tmp_path / "target.json").write_text(json.dumps({"source": "test", "model": str(tmp_path), "revision": ""}))
    params = lp(
        REPO / "params.yaml", [*TEST_DEFAULTS, "drafter.mask_token_id=255", "drafter.target_layer_ids=[0, 1, 2]"]
    )
    cfg = build_drafter_config(params.drafter, target_config_dict(tmp_path, False))  # reads text_config
    assert (cfg.hidden_size, cfg.vocab_size, cfg.num_target_layers) == (64, 256, 4)
    model = load_target(tmp_path, torch.float32, torch.device("cpu"), False)
    assert model.get_input_embeddings().weight.shape == (256, 64)
    feats = TargetFeatures(model, [0, 1, 2], 4, batch_tokens=32)
    ids = torch.randint(0, 250, (30,))
    out = feats(ids, [0, 12], [12, 18])
    for s, n in ((0, 12), (12, 18)):
        with torch.no_grad():
            hs = model(ids[None, s : s + n], output_hidden_states=True).hidden_states
        torch.testing.assert_close(out[s : s + n], context_features(hs, [0, 1, 2])[0], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------- params, training


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("drafter.target_layer_ids=[0, 3]", r"drafter\.target_layer_ids: .*last layer"),
        ("drafter.target_layer_ids=[0, 7]", r"drafter\.target_layer_ids: \[0, 7\] out of range"),
        ("drafter.num_key_value_heads=3", r"drafter\.num_key_value_heads"),
        ("drafter.mask_token_id=600", r"drafter\.mask_token_id: 600 is outside"),
        ("train.max_tokens_per_row=32", r"train\.max_tokens_per_row: .*must be >= train\.max_length"),
        ("train.num_anchors=0", r"train\.num_anchors"),
        ("drafter.mask_token_id=20", r"row \d+: input_ids holds the drafter's mask token 20"),
    ],
)
def test_bad_params_fail_before_the_target_loads(tmp_path, train_target, train_data, override, message):
    bare = tmp_path / "config_only"  # config.json + target.json, no weights: loading them would fail
    bare.mkdir()
    shutil.copy(train_target / "config.json", bare / "config.json")
    (bare / "target.json").write_text(json.dumps({"source": "test", "model": str(bare), "revision": ""}))
    with pytest.raises(UserError, match=message):
        Trainer(train_params(bare, tmp_path / "out", override), train_data)
    with pytest.raises(OSError):  # the same folder with good params gets as far as loading the weights
        Trainer(train_params(bare, tmp_path / "out"), train_data)


def test_loss_decreases_and_dvclive_records_it(tmp_path, train_target, train_data):
    live = tmp_path / "live"
    with one_thread():
        summary = train(
            train_params(train_target, tmp_path / "out", "train.epochs=4", f"train.live_dir={live}"), train_data
        )
    assert summary["completed"] and summary["lm_head_zero_rows"] == TRAIN_VOCAB - 300
    assert summary["final_loss"] < 0.6 * summary["first_loss"]
    assert summary["final_accuracy_by_position"][0] > 0.1 and summary["final_tau_hat"] > 1.15  # chance: 1/48
    metrics = json.loads((live / "metrics.json").read_text())
    assert metrics["step"] == summary["total_steps"] and set(metrics["acc"]) == {"pos_1", "pos_2", "pos_3"}
    loss_tsv = (live / "plots/metrics/train/loss.tsv").read_text().splitlines()
    assert loss_tsv[0].split("\t") == ["step", "loss"] and len(loss_tsv) > 10
    assert json.loads((live / "plots/custom/accuracy_by_position.json").read_text())
    export = tmp_path / "out/drafter"
    assert {p.name for p in export.iterdir()} == {"config.json", "model.safetensors", "run_info.json"}
    from dflash.drafter.export import load_drafter

    model, cfg = load_drafter(export, target_config=json.loads((train_target / "config.json").read_text()))
    assert cfg.target_layer_ids == (0, 2) and cfg.block_size == 4


@pytest.mark.parametrize("loss_target, weighting", [("target_kl", "dpace"), ("target_argmax", "decay")])
def test_target_loss_targets_train_through_the_trainer(tmp_path, train_target, train_data, loss_target, weighting):
    """The trainer runs the whole target (final hidden states) for the target_* losses, learns the target's
    greedy choices (accuracy is against them), and the run is another checkpoint configuration."""
    model = load_target(train_target, torch.float32, torch.device("cpu"), False)
    ran = []
    model.model.layers[3].register_forward_hook(lambda *_: ran.append(3))
    feats, final = TargetFeatures(model, [0, 2], 4, batch_tokens=64, final=True)(torch.tensor([5, 6, 7]), [0], [3])
    assert ran and final.shape == (3, model.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(model.lm_head(final), model(torch.tensor([[5, 6, 7]])).logits[0])
    extra = [f"train.loss_target={loss_target}", f"train.position_weighting={weighting}", "train.epochs=4"]
    with one_thread():
        summary = train(train_params(train_target, tmp_path / "out", *extra), train_data)
    assert summary["completed"] and summary["final_loss"] < 0.7 * summary["first_loss"]
    assert summary["final_accuracy_by_position"][0] > 0.1  # vs the target's argmax (chance ~1/300)
    info = json.loads((tmp_path / "out/drafter/run_info.json").read_text())
    assert info["params"]["train"]["loss_target"] == loss_target


def test_stage_writes_metrics_and_reports_bad_params_without_a_traceback(tmp_path, train_target, train_data, capsys):
    from dflash.core import cli
    from stages import train as stage

    if not hasattr(repo_params(), "tokenize"):
        pytest.skip("needs the tokenize params section (from the tokenize branch)")
    shutil.copytree(train_data, tmp_path / "tok/train")
    common = [f"tokenize.out={tmp_path / 'tok'}", f"base.reports_dir={tmp_path / 'reports'}", "train.epochs=1"]

    def stage_run(*extra):
        argv = [a for o in train_overrides(train_target, tmp_path / "out", *common, *extra) for a in ("-S", o)]
        try:
            cli.run(stage.main, "train", argv, add_args=stage.add_args)
        except SystemExit as exc:
            return exc.code, capsys.readouterr().err
        return 0, capsys.readouterr().err

    code, err = stage_run("drafter.target_layer_ids=[0, 9]")
    assert code == 2 and "drafter.target_layer_ids: [0, 9] out of range" in err and "Traceback" not in err
    code, err = stage_run()
    metrics = json.loads((tmp_path / "reports/train.json").read_text())
    assert code == 0 and metrics["completed"] and (tmp_path / "out/drafter/model.safetensors").exists()


def _run(train_target, train_data, out, *extra):
    with one_thread():
        return train(
            train_params(train_target, out, "train.checkpoint_every=5", "train.keep_checkpoints=2", *extra), train_data
        )


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, train_target, train_data):
    out = tmp_path_factory.mktemp("uninterrupted")
    summary = _run(train_target, train_data, out)
    return out, summary, checkpoint.get_history(summary["checkpoint_dir"])


def _curve(history):
    return [(h["step"], h["loss"], h["grad_norm"], h["correct"]) for h in history]


def test_kill_and_resume_equals_the_uninterrupted_run_bitwise(tmp_path, train_target, train_data, uninterrupted):
    ref_out, ref, ref_history = uninterrupted
    out = tmp_path / "run"
    first = _run(train_target, train_data, out, "train.max_steps=13")  # stops (and checkpoints) at step 13
    assert not first["completed"] and first["steps"] == 13 and not (out / "drafter").exists()
    folder = Path(first["checkpoint_dir"])
    assert [p.name for p in checkpoint.checkpoints(folder)] == ["step-00000010", "step-00000013"]
    # what a kill during step 14's checkpoint leaves: the last complete one is 10, plus a torn temp folder
    shutil.rmtree(folder / "step-00000013")
    (folder / ".tmp-step-00000015").mkdir()
    (folder / ".tmp-step-00000015/model.safetensors").write_bytes(b"torn")
    second = _run(train_target, train_data, out)
    assert second["resumed"] and second["completed"] and second["steps"] == ref["total_steps"]
    assert second["resumed_code_changes"] == []  # the same code wrote the checkpoint: nothing to say
    assert _curve(checkpoint.get_history(folder)) == _curve(ref_history)  # exact: every loss, grad norm and count
    from safetensors.torch import load_file

    a, b = load_file(ref_out / "drafter/model.safetensors"), load_file(out / "drafter/model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not list(folder.glob(".tmp-*"))


def _cpu_type() -> str:
    """The CPU type a golden curve was recorded on: the model name and instruction-set flags (float rounding of
    the matmul and reduction kernels follows the instruction set they dispatch to)."""
    import hashlib
    import platform

    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else platform.processor()
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return hashlib.sha256("\n".join(sorted(set(lines))).encode()).hexdigest()[:16]


def test_golden_losses(uninterrupted):
    """Exact equality with the curve recorded on this CPU type; on a CPU type with no recorded curve (another
    instruction set rounds the last bit differently) every recorded curve must still agree to 1e-5 relative,
    far below what a real change to the numerics moves (a different anchor, weight or loss shifts them by > 1e-3)."""
    _, summary, history = uninterrupted
    losses = [h["loss"] for h in history]
    assert len(losses) == summary["total_steps"] > 20
    golden = json.loads(GOLDEN.read_text())
    runs = {r["cpu"]: r["loss"] for r in golden["runs"]}
    if os.environ.get("DFLASH_UPDATE_GOLDEN"):  # record (or replace) this CPU type's curve
        runs[_cpu_type()] = losses
        runs = {cpu: curve for cpu, curve in runs.items() if cpu == _cpu_type() or curve != losses}
        doc = {"torch": torch.__version__, "runs": [{"cpu": cpu, "loss": curve} for cpu, curve in runs.items()]}
        GOLDEN.write_text(json.dumps(doc, indent=1) + "\n")
    assert golden["torch"] == torch.__version__, "golden losses of another torch version: regenerate them"
    if _cpu_type() in runs:
        assert losses == runs[_cpu_type()], "training numerics changed; see the module docstring to regenerate"
    for cpu, curve in runs.items():
        assert losses == pytest.approx(curve, rel=1e-5), f"training numerics changed (curve of CPU type {cpu})"


def test_checkpoint_folder_follows_the_config(tmp_path, train_target, train_data, uninterrupted):
    ref_out, ref, _ = uninterrupted
    folder = Path(ref["checkpoint_dir"])
    state = torch.load(checkpoint.latest(folder) / checkpoint.STATE, weights_only=True)  # plain data only
    assert state["step"] == ref["total_steps"] and "optimizer" in state and "torch" in state["rng"]
    info = json.loads((checkpoint.latest(folder) / checkpoint.RUN_INFO).read_text())
    assert info["params"]["train"]["lr"] == 3e-3 and info["packages"]["torch"] == torch.__version__
    # an operational change resumes the same folder (nothing left to do), a result-changing one starts afresh
    same = Trainer(train_params(train_target, ref_out, "train.checkpoint_every=5", "train.log_every=7"), train_data)
    other = Trainer(train_params(train_target, ref_out, "train.lr=1e-3"), train_data)
    assert same.ckpt_dir == folder and other.ckpt_dir != folder
    assert checkpoint.latest(other.ckpt_dir) is None


def test_a_checkpoint_of_other_code_is_named_when_resumed(tmp_path, train_target, train_data, uninterrupted, caplog):
    """The checkpoint hash covers params, data and target, not the code: a rerun after a code change resumes the
    finished checkpoint and exports its weights without a step. The run names the files that changed and says so."""
    ref_out, ref, _ = uninterrupted
    info = json.loads((checkpoint.latest(ref["checkpoint_dir"]) / checkpoint.RUN_INFO).read_text())
    assert "dflash/train/loop.py" in info["code"] and "dflash/drafter/model.py" in info["code"]
    assert checkpoint.code_changes(checkpoint.latest(ref["checkpoint_dir"])) == []  # the code that wrote it
    out = tmp_path / "run"
    shutil.copytree(ref_out, out)  # train.out is outside the hash: the copy resumes the same configuration
    latest = checkpoint.latest(next((out / "checkpoints").iterdir()))
    info["code"]["dflash/train/loop.py"] = "0" * 16  # as if written by an earlier loop.py
    (latest / checkpoint.RUN_INFO).write_text(json.dumps(info))
    with caplog.at_level("WARNING", logger="dflash.train.loop"):
        summary = _run(train_target, train_data, out)
    assert summary["resumed"] and summary["steps"] == ref["total_steps"]
    assert summary["resumed_code_changes"] == ["dflash/train/loop.py"]
    warning = " ".join(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert "dflash/train/loop.py changed since" in warning and "trains no step" in warning
