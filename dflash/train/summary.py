"""What a training run reports: the typed summary of a run (its figures from the step history) and the headline
keys of reports/train.json (the DVC metrics; the whole summary is reports/train_details.json).

Inputs: the run's step history (one dict per optimizer step: loss, correct / counted per block slot, tokens,
seconds, epoch; loop.py `Trainer.compute_gradients`) and the run's facts. Output: `TrainSummary`, each value under
one key; `as_json()` is what the stage writes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from dflash.train.loss import tau_hat

HEADLINE = (  # reports/train.json, the DVC metrics (the whole summary: reports/train_details.json)
    "completed",
    "steps",
    "epochs",
    "first_loss",
    "final_loss",
    "final_tau_hat",
    "tokens_per_s",
    "packing_efficiency",
    "drafter_params",
    "wall_seconds",
    "steps_seconds",
)


@dataclass(frozen=True)
class HistoryFigures:
    """The summary's figures from the step history: the first loss, the last epoch's loss and accuracy by block slot,
    the run's tokens per second."""

    first_loss: float | None
    final_loss: float | None  # mean over the last epoch's steps
    final_accuracy_by_position: list[float]  # slots 1 .. block_size - 1, over the last epoch
    final_tau_hat: float
    tokens_per_s: float | None  # every step of the run, resumed invocations included
    steps_seconds: float  # the summed seconds of every optimizer step of the run

    @classmethod
    def of(cls, history: list[dict], block_size: int) -> HistoryFigures:
        last_epoch = [h for h in history if h["epoch"] == history[-1]["epoch"]] if history else []
        correct = [sum(h["correct"][k] for h in last_epoch) for k in range(1, block_size)]
        counted = [sum(h["counted"][k] for h in last_epoch) for k in range(1, block_size)]
        acc = [a / n if n else 0.0 for a, n in zip(correct, counted, strict=True)]
        tail = history[-max(1, len(last_epoch)) :]
        run_tokens = sum(h["tokens"] for h in history)
        run_seconds = sum(h["seconds"] for h in history)
        return cls(
            first_loss=history[0]["loss"] if history else None,
            final_loss=sum(h["loss"] for h in tail) / len(tail) if tail else None,
            final_accuracy_by_position=acc,
            final_tau_hat=tau_hat(acc),
            tokens_per_s=run_tokens / run_seconds if run_seconds else None,
            steps_seconds=run_seconds,
        )


@dataclass(frozen=True)
class TrainSummary:
    """One training run (module docstring); the order of the fields is train_details.json's."""

    completed: bool  # every planned step ran (not stopped by train.max_steps)
    resumed: bool
    steps: int
    total_steps: int
    epochs: int
    world_size: int
    nodes: int
    global_batch_rows: int  # packed rows per optimizer step
    device: str  # the drafter's
    target_device: str
    dtype: str
    attention: str  # sdpa | flex
    documents: int
    documents_used: int  # documents with an anchor candidate
    train_tokens_per_epoch: int
    packing_efficiency: float
    drafter_params: int
    lm_head_zero_rows: int
    first_loss: float | None
    final_loss: float | None
    final_accuracy_by_position: list[float]
    final_tau_hat: float
    tokens_per_s: float | None
    wall_seconds: float  # this invocation's loop (a resumed run: only the steps it ran)
    steps_seconds: float  # every optimizer step of the run, resumed invocations included
    checkpoint_dir: str
    resumed_code_changes: list[str]  # the code files changed since the resumed checkpoint (checkpoint.code_changes)
    draft_vocab: dict[str, Any]  # draft_vocab_size, _coverage, _outside_slots, _outside_frac (draft_vocab.py)

    def as_json(self) -> dict[str, Any]:
        """train_details.json: every field, the draft vocabulary's lines inline."""
        out = dataclasses.asdict(self)
        vocab = out.pop("draft_vocab")
        return {**out, **vocab}


__all__ = ["HEADLINE", "HistoryFigures", "TrainSummary"]
