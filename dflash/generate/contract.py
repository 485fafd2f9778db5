"""What the generate stage, its two backends and the engines backend's workers agree on: work units, the worker's
config, the messages a worker sends back, the turn policy every side applies (which turns are regenerated,
per-request seeds, the reasoning / answer split), and the result either backend returns (DispatchResult with each
engine's or server's EngineStats). Imported by both backends, the worker and the stage; imports none of them.

Messages travel over one one-way pipe per worker (dflash/generate/engines_backend.py says why): a worker sends
Ready once its engine is up, UnitStarted / Submitted / RowDone / UnitDone while it works, Exited before a clean
exit. Submitted and RowDone let the dispatcher keep what a dying engine finished and know which requests were in
it when it died (the search for a poison request).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from dflash.core.params import GenerateParams

CRASH_ENV = "DFLASH_GENERATE_CRASH_UNIT"  # fault injection for tests: "<unit index>" -> worker dies on it
# Fault injection for tests: "<text>" -> the engine worker dies (exit 17) in the engine step that runs a prompt
# whose rendering contains the text: a poison prompt that kills the engine every time it is scheduled.
POISON_ENV = "DFLASH_GENERATE_POISON_TEXT"


@dataclass
class Unit:
    """A chunk of `generate.unit_size` conversations: the commit and resume unit (one shard)."""

    index: int
    conversations: list[dict]  # {"conversation_id", "messages", "tools"}
    name: str  # file name: keyed by the member ids, so a changed input never reuses a stale unit
    attempts: int = 0  # engine deaths so far (a retried unit runs alone)
    done_rows: list[dict] = field(default_factory=list)  # rows made already: replayed, not asked again
    failed_turns: dict[str, dict] = field(default_factory=dict)  # sid -> {"reason", "error"}: recorded, not asked
    suspects: list[str] = field(default_factory=list)  # engines: sids that may kill the engine, run last, half a time


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker process needs (pickled into it at spawn)."""

    gparams: GenerateParams
    model: str  # path or hub id the engine loads
    model_name: str  # what the shard rows record as `model`
    revision: str
    seed: int  # engine seed (base.seed)
    trust_remote_code: bool
    template_kwargs: dict[str, Any]  # chat template kwargs (thinking mode, base.chat_template_kwargs)
    run_dir: str  # where unit shards are committed
    run_hash: str
    vocab_size: int  # the target's config.json vocab_size: a server's token ids must lie in [0, vocab_size)
    devices: str | None = None  # CUDA_VISIBLE_DEVICES of this worker's engine (None on CPU)


@dataclass(frozen=True)
class Ready:
    engine: int
    start_s: float  # engine start-up time


@dataclass(frozen=True)
class UnitStarted:
    engine: int
    unit: int


@dataclass(frozen=True)
class Submitted:
    engine: int
    unit: int
    sids: list[str]  # requests just added to the engine


@dataclass(frozen=True)
class RowDone:
    engine: int
    unit: int
    row: dict  # a GENERATED_SCHEMA row just recorded (completed, skipped or failed)


@dataclass(frozen=True)
class UnitDone:
    engine: int
    unit: int
    prompts: int
    output_tokens: int


@dataclass(frozen=True)
class Exited:
    engine: int


WorkerMessage = Ready | UnitStarted | Submitted | RowDone | UnitDone | Exited


def generation_targets(messages: list[dict]) -> list[int]:
    """Indices in `messages` where a regenerated assistant turn goes (policy: dflash/generate/stage.py).

    An index equal to len(messages) means "append a final turn". History before index i is
    messages[:i] with earlier targets replaced by their regenerated answers.
    """
    targets = [i for i, m in enumerate(messages) if m["role"] == "assistant" and not m.get("tool_calls")]
    if messages and messages[-1]["role"] in ("user", "tool"):
        targets.append(len(messages))
    return targets


def count_prompts(conversations: list[dict]) -> int:
    return sum(len(generation_targets(c["messages"])) for c in conversations)


def request_seed(seed: int, sample_id: str) -> int:
    """Per-request seed derived from the sample id: a resumed run samples the same outputs."""
    return int(hashlib.sha256(f"{seed}:{sample_id}".encode()).hexdigest()[:15], 16)


class FastDecode:
    """`tokenizer.decode(ids, skip_special_tokens=...)` with the same result and a third of the cost on a 1,500-token
    reply: the Rust tokenizer's own decode, without transformers' walk over every id to normalise the argument,
    when the tokenizer does no clean-up after it (clean_up_tokenization_spaces off, as Qwen's); else the
    tokenizer's decode itself."""

    def __init__(self, tokenizer: Any):
        backend = getattr(tokenizer, "backend_tokenizer", None)
        cleans = getattr(tokenizer, "clean_up_tokenization_spaces", True)
        self.tokenizer, self.backend = tokenizer, backend if backend is not None and not cleans else None

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        if self.backend is not None:
            return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def split_reasoning(tokenizer: Any, completion_ids: list[int], think_end_id: int | None) -> tuple[str, str, bool]:
    """(reasoning, answer, has_think_end) split at the </think> token of the sampled ids."""
    if think_end_id is not None and think_end_id in completion_ids:
        cut = completion_ids.index(think_end_id)
        reasoning = tokenizer.decode(completion_ids[:cut], skip_special_tokens=True)
        reasoning = reasoning.replace("<think>", "").strip("\n")
        answer = tokenizer.decode(completion_ids[cut + 1 :], skip_special_tokens=True).strip("\n")
        return reasoning, answer, True
    return "", tokenizer.decode(completion_ids, skip_special_tokens=True).strip("\n"), False


@dataclass
class EngineStats:
    """One engine's (engines backend) or one server's (servers backend) share of the run."""

    prompts: int = 0
    output_tokens: int = 0
    ready_at: float | None = None  # wall clock when its engine was up
    last_done: float | None = None  # wall clock of its last committed unit


@dataclass
class DispatchResult:
    """What a backend run returns to the stage (both backends)."""

    failed_units: list[dict]  # {"unit", "name", "attempts", "exit_code", "error"} of units given up on whole
    engine_start_s: list[float]
    per_engine: dict[int, EngineStats]
    tokens_this_session: int  # output tokens generated by this run (resumed units excluded)
    gen_wall_s: float  # first engine ready -> last unit committed (engine start-up and shutdown excluded)
    wall_s: float
    failed_turns: list[dict] = field(default_factory=list)  # {"sample_id", "reason", "error"} of this run
