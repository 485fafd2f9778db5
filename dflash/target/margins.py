"""How decided the tiny target's greedy choices are: the margin (top-1 minus top-2 logit) of every greedy decision
over a fixed prompt sample of its own task families, and the share of decisions below a few margins.

A greedy decision whose two best logits differ by less than the last bits a float sum can change (a different
kernel path, thread count or CPU type) can flip: the conversation diverges from there, and every later stage
follows. The target stage reports these shares and gates on the share of near-ties (params
`target.tiny.margin_prompts`, `margin_max_tokens`, `gates.near_tie_frac`).

May import: torch and transformers (lazily), dflash.target.synthetic, dflash.core (chat, hf).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dflash.core.chat import render_text
from dflash.target.synthetic import conversation

MARGIN_BOUNDS = (0.01, 0.1, 1.0)  # the shares reported: decisions whose margin is below each
NEAR_TIE_MARGIN = 0.1  # a decision below this margin is a near-tie (the gate's figure, near_tie_frac)
SAMPLE_SEED_OFFSET = 7919  # the margin sample's own seed (base.seed + this): not the pre-training corpus's prompts
BATCH = 16  # prompts decoded together (left-padded)


@dataclass(frozen=True)
class MarginReport:
    """The margins of the greedy decisions of one margin sample."""

    prompts: int  # prompts decoded
    decisions: int  # greedy decisions measured (every generated token up to and including EOS)
    shares_below: dict[str, float]  # margin bound (as text) -> share of decisions below it
    near_tie_frac: float  # share of decisions below NEAR_TIE_MARGIN
    min_margin: float  # the smallest margin seen
    median_margin: float

    def metrics(self) -> dict[str, Any]:
        """The report's figures as target.json holds them."""
        return {
            "margin_prompts": self.prompts,
            "margin_decisions": self.decisions,
            "margin_below": self.shares_below,
            "near_tie_frac": self.near_tie_frac,
            "margin_min": self.min_margin,
            "margin_median": self.median_margin,
        }


def margin_prompts(n: int, seed: int) -> list[list[dict]]:
    """`n` single-turn prompts (messages without the answer) of the synthetic task families, fixed by `seed`."""
    rng = random.Random(seed + SAMPLE_SEED_OFFSET)
    prompts = []
    for _ in range(n):
        messages = conversation(rng, turns=1, system=rng.random() < 0.2)
        prompts.append([m for m in messages if m["role"] != "assistant"])
    return prompts


def top2_margins(logits: Any) -> Any:
    """Top-1 minus top-2 logit of each row of `logits` (..., vocab), as a float tensor (...)."""
    import torch

    top = torch.topk(logits.float(), k=2, dim=-1).values
    return top[..., 0] - top[..., 1]


def summarize(margins: Sequence[float], prompts: int) -> MarginReport:
    """The shares below each bound of MARGIN_BOUNDS, the near-tie share, the minimum and median."""
    values = sorted(float(m) for m in margins)
    n = len(values)

    def below(bound: float) -> float:
        return round(sum(v < bound for v in values) / n, 4) if n else 0.0

    return MarginReport(
        prompts=prompts,
        decisions=n,
        shares_below={str(b): below(b) for b in MARGIN_BOUNDS},
        near_tie_frac=below(NEAR_TIE_MARGIN),
        min_margin=round(values[0], 6) if n else 0.0,
        median_margin=round(values[n // 2], 4) if n else 0.0,
    )


def greedy_margins(model: Any, tokenizer: Any, prompts: list[list[dict]], max_tokens: int, chat: dict) -> list[float]:
    """The margin of every greedy decision when `model` completes each prompt (chat template with the keyword
    arguments `chat`, generation prompt), up to EOS or `max_tokens`; the decisions after a sequence's EOS are not
    counted. Decodes BATCH prompts at a time (left-padded, with the KV cache), keeping one step's logits only."""
    import torch

    eos, pad = model.config.eos_token_id, model.config.pad_token_id
    out: list[float] = []
    with torch.inference_mode():
        for start in range(0, len(prompts), BATCH):
            out.extend(_batch_margins(model, tokenizer, prompts[start : start + BATCH], max_tokens, chat, eos, pad))
    return out


def _batch_margins(model: Any, tokenizer: Any, batch: list, max_tokens: int, chat: dict, eos: int, pad: int) -> list:
    """greedy_margins of one left-padded batch."""
    import torch

    out: list[float] = []
    ids = [tokenizer(render_text(tokenizer, p, True, chat), add_special_tokens=False)["input_ids"] for p in batch]
    width = max(len(i) for i in ids)
    tokens = torch.tensor([[pad] * (width - len(i)) + i for i in ids])
    mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
    step = model(
        input_ids=tokens,
        attention_mask=mask,
        position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
        use_cache=True,
        logits_to_keep=1,
    )
    alive = torch.ones(len(ids), dtype=torch.bool)
    for _ in range(max_tokens):
        logits = step.logits[:, -1]
        margins, chosen = top2_margins(logits), logits.argmax(-1)
        out.extend(float(m) for m in margins[alive])
        alive &= chosen != eos
        if not alive.any():
            break
        mask = torch.cat([mask, torch.ones(len(ids), 1, dtype=mask.dtype)], dim=1)
        step = model(
            input_ids=chosen[:, None],
            attention_mask=mask,
            position_ids=mask.sum(-1, keepdim=True) - 1,
            past_key_values=step.past_key_values,
            use_cache=True,
        )
    return out


def measure(model: Any, tokenizer: Any, n_prompts: int, max_tokens: int, seed: int, chat: dict) -> MarginReport:
    """The margin report of `model` over the fixed sample of `n_prompts` prompts."""
    prompts = margin_prompts(n_prompts, seed)
    return summarize(greedy_margins(model, tokenizer, prompts, max_tokens, chat), prompts=len(prompts))


def measure_saved(target_dir: Any, n_prompts: int, max_tokens: int, seed: int, chat: dict) -> MarginReport:
    """The margin report of the target saved in `target_dir` (loaded in its saved dtype, on the CPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    from dflash.core.hf import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype="auto").eval()
    with torch.inference_mode():
        return measure(model, load_tokenizer(target_dir), n_prompts, max_tokens, seed, chat)
