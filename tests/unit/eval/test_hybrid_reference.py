"""The PyTorch reference on a Gated DeltaNet hybrid (Qwen3-Next geometry, random small weights): cropping the
cache after a rejection (right for attention layers) leaves the rejected drafts inside the recurrent state and
diverges from a full recompute; and the train stage's target features of a document in a right-padded batch
equal the document's features alone. Restore equals recompute: tests/integration/test_hybrid_reference.py.
"""

from __future__ import annotations

import random

import torch
from transformers import DynamicCache

from dflash.eval.reference import _Target


def _full_logits(target, ids):
    with torch.no_grad():
        return target(torch.tensor([ids]), use_cache=False).logits[0].float()


def test_crop_only_keeps_rejected_drafts_in_the_recurrent_state(hybrid_and_drafter):
    """The naive rollback (transformers' own crop, past recording on): conv windows are cut back, the recurrent
    state is not, so the next token's logits differ from a recompute of the committed sequence."""
    target, _, prompts, _ = hybrid_and_drafter
    prompt, block, keep, nxt = prompts[0], [7, 8, 9, 10], 2, [11]
    cache = DynamicCache(config=target.config)
    cache.activate_past_recording()
    with torch.no_grad():
        target(torch.tensor([prompt]), past_key_values=cache, use_cache=True)
        target(torch.tensor([block]), past_key_values=cache, use_cache=True)
        cache.crop(-(len(block) - keep))
        naive = target(torch.tensor([nxt]), past_key_values=cache, use_cache=True).logits[0, -1].float()
    truth = _full_logits(target, prompt + block[:keep] + nxt)[-1]
    assert (naive - truth).abs().max() > 1e-2

    # Cache mode: snapshot before the verify pass, restore + re-feed the verified tokens after it.
    tgt = _Target(target, [0, 2], "cache")
    tgt.forward(prompt)
    tgt.commit(prompt, len(prompt))
    tgt.forward(block)
    tgt.commit(block, keep)
    logits, _ = tgt.forward(nxt)
    torch.testing.assert_close(logits[-1], truth, atol=1e-4, rtol=1e-4)
    assert tgt.refed_tokens == keep


def test_features_of_a_document_do_not_depend_on_its_batch(hybrid_and_drafter):
    """Right padding: a short document batched with a long one gets the features it gets alone (the pads come
    after its tokens, so they never enter its recurrent state)."""
    from dflash.train.features import TargetFeatures

    target = hybrid_and_drafter[0]
    feats = TargetFeatures(target, [0, 2], target.config.num_hidden_layers, batch_tokens=4096)
    rng = random.Random(1)
    docs = [[rng.randrange(500) for _ in range(n)] for n in (23, 9, 15)]
    ids = torch.tensor([t for d in docs for t in d])
    starts = [0, 23, 32]
    together = feats(ids, starts, [len(d) for d in docs])  # one padded batch of 3 rows
    for d, s in zip(docs, starts, strict=True):
        alone = feats(torch.tensor(d), [0], [len(d)])
        torch.testing.assert_close(together[s : s + len(d)], alone, atol=1e-5, rtol=1e-5)
