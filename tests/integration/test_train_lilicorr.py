"""LiLiCorr trained by the train stage's own Trainer (CPU), on tests/integration/test_train_kinds.py's target and data:
the loss falls, the correlator's teacher-forced picks learn the target's argmax (chance ~1/300), the export is vLLM's
LiLiCorr format and loads back, and the reference decodes with it: at temperature 0 exactly the target's greedy
output, with drafts accepted."""

from __future__ import annotations

import json

import pytest

from dflash.drafter.export import load_drafter
from tests.integration.test_train_kinds import _train, setup  # noqa: F401  (setup: the shared module fixture)

pytestmark = pytest.mark.slow


def test_lilicorr_trains_exports_and_decodes(setup, tmp_path):  # noqa: F811
    from transformers import Qwen3ForCausalLM

    from dflash.eval.reference import greedy_decode, reference_decode

    summary = _train(
        setup,
        tmp_path / "out",
        "drafter.kind=lilicorr",
        "drafter.lilicorr.candidate_top_k=8",
        "drafter.lilicorr.num_heads=2",
        "drafter.lilicorr.factor_dim=16",
    )
    assert summary["completed"] and summary["final_loss"] < 0.7 * summary["first_loss"], summary
    assert summary["final_accuracy_by_position"][0] > 0.1, summary  # the correlator's teacher-forced picks
    folder = tmp_path / "out/drafter"
    raw = json.loads((folder / "config.json").read_text())
    assert raw["architectures"] == ["LiLiCorrDraftModel"] and raw["block_size"] == 4
    assert raw["dflash_config"]["lilicorr_candidate_topk"] == 8 and raw["dflash_config"]["lilicorr_enabled"]
    model, cfg = load_drafter(folder)
    assert cfg.kind == "lilicorr" and model.lilicorr.relative_slot_bias.abs().sum() > 0  # the correlator learned
    target_dir, data = setup
    target = Qwen3ForCausalLM.from_pretrained(target_dir).eval()
    prompt = [12, 40, 77, 9, 150, 31]
    want = greedy_decode(target, prompt, 24)
    greedy = reference_decode(target, model.eval(), prompt, 24)
    assert greedy.tokens == want and greedy.drafts > 0
    sampled = reference_decode(target, model, prompt, 24, temperature=1.0, seed=3)
    assert len(sampled.tokens) == 24 and sampled.expected_per_pos is not None
    assert sampled.drafts > 0 and all(0 <= e <= sampled.drafts for e in sampled.expected_per_pos)
