"""Tokenize: training samples (token ids + an assistant-only loss mask) in Arrow shards, with a held-out
eval split and the loss-mask gate.

Inputs (`tokenize.source`):
- `generated` (the demo): the current generate run (`dflash.core.contracts.current_run_dir(generate.out)`,
  its `unit-*.arrow` shards). A sample is exactly what the serving engine saw: the stored `prompt_ids`
  followed by the sampled `completion_ids`, verbatim (text is never re-tokenized). Rows whose status is
  not `completed` are counted as dropped (`not_completed`).
- `recorded` (datasets that already hold real responses; no generation): the audit's
  `conversations.arrow`, rendered with the target's chat template (`dflash.core.chat.load_fast_chat`, no
  transformers). For each assistant turn without tool calls, the conversation up to that turn is
  rendered with `add_generation_prompt=True` (the prompt) and with the turn (the full text); the prompt
  must be a prefix of the full text, as text and as token ids, or the stage fails naming file, row,
  conversation and message (a template that renders history differently once a turn is added would
  silently shift the mask). The template's separator after the end-of-turn token (found by rendering a
  probe turn: `<|im_end|>` then a newline for Qwen) is cut off: the engine stops at `<|im_end|>`.
  transformers' `return_assistant_tokens_mask` is never used (all zeros on Qwen templates).

Multi-turn policy: one sample per assistant turn, each with its own prompt rendered by the template.
The template decides how history looks, and Qwen templates drop the reasoning of earlier turns, so
turn k is trained exactly as the engine serves turn k (earlier answers without their <think> blocks),
never as one long sequence whose earlier turns keep reasoning the engine would not see. In generated
mode the generate stage already rendered each turn's prompt this way; recorded mode renders each turn's
prompt the same way (`tokenize.recorded_turns: last` keeps only the final assistant turn). Assistant turns with tool calls
are history, never samples (generate keeps them as recorded too); `turn_index` k is the k-th assistant
turn without tool calls, the numbering generate uses.

Loss mask: 0 on every prompt token, 1 on every completion token including the end-of-turn token, so
each mask is one contiguous run of ones at the end of the sample ("two adjacent supervised tokens" is
then "at least two supervised tokens").

Filters (each a param, each counted by reason; the first that applies wins, in this order):
not_completed, truncated (finish_reason length), missing_think_end (thinking mode, no </think>),
overlong (longer than max_length, when `overlong: drop`; with `truncate` the sample is cut to max_length
and the later filters see the cut one), few_loss_tokens (< min_loss_tokens), no_anchor_pair.
kept + dropped == input in the metrics.

Held-out split: by conversation id (every turn of a conversation lands in the same split), from a
seeded hash of the id (`base.seed`): the `eval_count` conversations with the smallest hash among those
that can yield a sample (a completed turn / an assistant turn), or, when eval_count is 0, those whose hash
falls below `eval_fraction`. Eval samples are never written to train/.

Speed and memory: a work chunk is up to `chunk_rows` input rows; `num_workers` processes tokenize
chunks (dflash/tokenize/samples.py: rendering + batched Rust tokenization in recorded mode, numpy gathers in
generated mode) while the main process writes shards in input order; at most 2 chunks per worker are in
flight and a worker keeps one decompressed input batch, so memory is bounded whatever the input size.
Output is the same for any number of workers. `benchmarks/tokenize_rate.py` measures the rate.

Outputs under `tokenize.out`: `train/shard-*.arrow`, `eval/shard-*.arrow` (zstd Arrow IPC,
`rows_per_shard` samples each, SAMPLE_SCHEMA in dflash/core/contracts.py), `manifest.json`, `token_counts.json`
(the training split's loss-token counts and the tokenizer's added tokens: what a pruned draft vocabulary is built
from, dflash/drafter/vocab.py; its coverage at COVERAGE_SIZES tokens goes into the metrics); metrics
`${base.reports_dir}/tokenize.json` (headline, HEADLINE) + `tokenize_details.json` (everything)
and the loss-mask-sum histogram `${base.reports_dir}/tokenize_loss_mask_sums.csv` (a DVC plot). The
gates (`tokenize.gates`) use dflash/core/gates.py, like the audit's; the stage fails after writing everything.

    python -m stages.tokenize --params params.yaml
    python -m stages.tokenize -S tokenize.source=recorded -S tokenize.out=artifacts/tokenize-recorded
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from dflash.core.chat import template_kwargs
from dflash.core.errors import UserError
from dflash.core.gates import check_gates, evaluate_gates, failed_gates, loss_mask_spike
from dflash.core.io import atomic_write, staged_folder, write_arrow, write_json
from dflash.core.metrics import write_metrics
from dflash.core.params import Params, TokenizeParams
from dflash.core.target_config import load_target_arch, target_signature, tokenizer_folder
from dflash.drafter.vocab import (
    COUNTS_FILE,
    COVERAGE_SIZES,
    TokenCounts,
    added_token_ids,
    count_loss_tokens,
    coverage_table,
)
from dflash.tokenize.samples import (
    MAX_EXAMPLES,
    REASONS,
    SCHEMA,
    ChunkResult,
    Spec,
    results,
    split_key,
)
from dflash.tokenize.sources import input_files, survey

log = logging.getLogger(__name__)

GATE_FIXES = {
    "loss_mask_sum_mode_frac": "most samples supervise the same number of tokens: the responses are placeholders "
    "or templated (the 27B regeneration case: 87% at 6 tokens). Regenerate them with the generate stage and tokenize "
    "with tokenize.source: generated",
    "dropped_frac": "see dropped_by_reason in tokenize_details.json: raise generate.sampling.max_tokens when most were "
    "truncated, or relax the tokenize filters",
}
HEADLINE = (  # reports/tokenize.json, the DVC metrics; the plan reads train_samples / train_tokens / train_loss_tokens
    "num_samples",
    "num_dropped",
    "train_samples",
    "eval_samples",
    "total_tokens",
    "loss_tokens",
    "train_tokens",
    "train_loss_tokens",
    "train_loss_distinct_tokens",
    "loss_token_frac",
    "loss_mask_sum_mode",
    "loss_mask_sum_mode_frac",
    "gate_failed",
    "target_signature",
)
HISTOGRAM_FILE = "tokenize_loss_mask_sums.csv"


def validate(p: TokenizeParams) -> None:
    checks = [
        ("max_length", p.max_length > 0, "must be > 0"),
        ("min_loss_tokens", p.min_loss_tokens >= 0, "must be >= 0"),
        ("eval_fraction", 0.0 <= p.eval_fraction < 1.0, "must be in [0, 1)"),
        ("eval_count", p.eval_count >= 0, "must be >= 0"),
        ("rows_per_shard", p.rows_per_shard > 0, "must be > 0"),
        ("chunk_rows", p.chunk_rows > 0, "must be > 0"),
        ("num_workers", p.num_workers >= 1, "must be >= 1"),
    ]
    for key, ok, what in checks:
        if not ok:
            raise UserError(f"tokenize.{key}: {what} (got {getattr(p, key)!r})")
    check_gates(p.gates, "tokenize.gates")


class ShardWriter:
    """Appends sample tables and writes `shard-NNNNN.arrow` files of `rows_per_shard` rows (the last may be
    shorter; an empty split still gets one empty shard, so readers always find the schema)."""

    def __init__(self, folder: Path, rows_per_shard: int):
        self.folder, self.rows_per_shard = folder, rows_per_shard
        self.pending: list[pa.Table] = []
        self.num_pending = 0
        self.num_shards = 0
        folder.mkdir(parents=True, exist_ok=True)

    def add(self, table: pa.Table) -> None:
        if table.num_rows:
            self.pending.append(table)
            self.num_pending += table.num_rows
        while self.num_pending >= self.rows_per_shard:
            self._write(self.rows_per_shard)

    def _write(self, n: int) -> None:
        table = pa.concat_tables(self.pending) if self.pending else SCHEMA.empty_table()
        write_arrow(self.folder / f"shard-{self.num_shards:05d}.arrow", table.slice(0, n))
        rest = table.slice(n)
        self.pending = [rest] if rest.num_rows else []
        self.num_pending = rest.num_rows
        self.num_shards += 1

    def close(self) -> int:
        if self.num_pending or not self.num_shards:
            self._write(self.num_pending)
        return self.num_shards


@dataclass
class Totals:
    """Sums over chunk results (bounded: counts and a histogram over loss-mask sums <= max_length)."""

    rows: int = 0
    reasons: np.ndarray = field(default_factory=lambda: np.zeros(len(REASONS) + 1, dtype=np.int64))
    samples: Counter = field(default_factory=Counter)
    conversations: Counter = field(default_factory=Counter)
    last_id: dict[str, str] = field(default_factory=dict)
    tokens: Counter = field(default_factory=Counter)
    histogram: Counter = field(default_factory=Counter)
    cut: int = 0
    info: Counter = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)
    loss_counts: Counter = field(default_factory=Counter)  # training split: token id -> loss tokens (draft vocab)

    def add(self, r: ChunkResult) -> None:
        self.rows += r.rows
        train = r.splits["train"]
        if train.num_rows:
            flat = {c: train.column(c).combine_chunks().flatten().to_numpy() for c in ("input_ids", "loss_mask")}
            self.loss_counts.update(count_loss_tokens(flat["input_ids"], flat["loss_mask"]))
        self.reasons += r.reason_counts
        for name, (distinct, first, last) in r.conversations.items():
            self.samples[name] += r.splits[name].num_rows
            # a conversation's rows are contiguous in the input: only one can straddle a chunk boundary
            self.conversations[name] += distinct - (bool(first) and first == self.last_id.get(name))
            if last:
                self.last_id[name] = last
        self.tokens.update(r.tokens)
        self.histogram.update(r.histogram)
        self.cut += r.cut
        self.info.update(r.info)
        for reason, texts in r.examples.items():
            bucket = self.examples.setdefault(reason, [])
            bucket += texts[: MAX_EXAMPLES - len(bucket)]


def _progress(total: int):
    from tqdm import tqdm

    interactive = sys.stderr.isatty()
    return tqdm(total=total, desc="tokenize", unit="row", mininterval=0.5 if interactive else 10.0, dynamic_ncols=True)


def run(params: Params) -> dict[str, Any]:
    """The tokenize stage: write the shards, manifest, metrics and histogram; return the metrics.
    Gates are evaluated into the metrics; the caller decides to fail (`gate_failure_message`)."""
    start = time.perf_counter()
    p, base = params.tokenize, params.base
    validate(p)
    files, provenance = input_files(params)
    tokenizer_dir = None
    if p.source == "recorded":
        tokenizer_dir = str(tokenizer_folder("target", base.target_dir, key="tokenize.source=recorded: tokenizer"))
    spec = Spec(
        p,
        base.enable_thinking,
        base.seed,
        template_kwargs(base.enable_thinking, base.chat_template_kwargs),
        tokenizer_dir,
        None,
    )
    chunks, num_rows, eval_ids = survey(files, spec)
    spec = dataclasses.replace(spec, eval_ids=eval_ids)
    log.info("tokenize (%s): %d input rows in %d chunks from %s", p.source, num_rows, len(chunks), provenance["input"])

    out = Path(p.out)
    with staged_folder(out) as staging:  # the new output appears whole; a failed run leaves the old one as it was
        writers = {name: ShardWriter(staging / name, p.rows_per_shard) for name in ("train", "eval")}
        totals = Totals()
        bar = _progress(num_rows)
        for result in results(chunks, spec, p.num_workers):
            totals.add(result)
            for name, writer in writers.items():
                writer.add(result.splits[name])
            bar.update(result.rows)
        bar.close()
        shards = {name: writer.close() for name, writer in writers.items()}

        metrics = summarize(totals, p, spec)
        if metrics["num_samples"] == 0:
            why = ", ".join(f"{k}: {v}" for k, v in metrics["dropped_by_reason"].items() if v) or "no input rows"
            examples = [e for texts in metrics["dropped_examples"].values() for e in texts[:1]]
            raise UserError(
                f"tokenize ({p.source}, {provenance['input']}): 0 samples from {metrics['num_input']} candidates "
                f"({why}){'; e.g. ' + examples[0] if examples else ''}. Nothing was written; {out} is unchanged."
            )
        metrics.update(
            {**provenance, "tokenizer": tokenizer_dir, "num_input_rows": num_rows, "out": str(out)},
            target_signature=target_signature(Path(base.target_dir) / "config.json"),
            num_train_shards=shards["train"],
            num_eval_shards=shards["eval"],
        )
        manifest = {
            k: metrics[k]
            for k in ("source", "input", "tokenizer", "num_samples", "train_samples", "eval_samples", "total_tokens")
        }
        manifest.update(
            run_hash=provenance.get("run_hash", ""),
            max_length=p.max_length,
            num_train_shards=shards["train"],
            num_eval_shards=shards["eval"],
            schema=[f"{f.name}: {f.type}" for f in SCHEMA],
        )
        write_json(staging / "manifest.json", manifest)
        metrics.update(draft_vocab_metrics(totals, base.target_dir, staging))

    metrics["elapsed_s"] = round(time.perf_counter() - start, 3)
    metrics["tokens_per_s"] = round(metrics["total_tokens"] / max(metrics["elapsed_s"], 1e-9), 1)
    reports = Path(base.reports_dir)
    write_metrics(reports, "tokenize", metrics, HEADLINE)
    lines = ["loss_mask_tokens,samples"] + [f"{k},{v}" for k, v in sorted(totals.histogram.items())]
    atomic_write(reports / HISTOGRAM_FILE, "\n".join(lines) + "\n")
    return metrics


def draft_vocab_metrics(t: Totals, target_dir: str, staging: Path) -> dict[str, Any]:
    """Write the training split's loss-token counts (dflash/drafter/vocab.py COUNTS_FILE, what train builds a
    pruned draft vocabulary from) and return the coverage of the vocabularies of COVERAGE_SIZES tokens."""
    counts = TokenCounts(dict(t.loss_counts), tuple(added_token_ids(tokenizer_folder("auto", target_dir))))
    write_json(staging / COUNTS_FILE, counts.to_json())
    config = Path(target_dir) / "config.json"  # absent: a tokenizer-only target folder (the ids seen bound it)
    seen = [*counts.counts, *counts.always_in]
    vocab_size = load_target_arch(config).vocab_size if config.exists() else 1 + max(seen, default=0)
    table = coverage_table(counts, [s for s in COVERAGE_SIZES if s < vocab_size], vocab_size)
    return {
        "train_loss_distinct_tokens": len(counts.counts),
        "draft_vocab_coverage": table,  # {size: share of the training loss tokens inside a vocabulary of that size}
    }


def summarize(t: Totals, p: TokenizeParams, spec: Spec) -> dict[str, Any]:
    """The full metrics: counts, token totals, the loss-mask spike and the gates."""
    num_input = int(t.reasons.sum())
    kept = int(t.reasons[0])
    dropped = {name: int(t.reasons[i + 1]) for i, name in enumerate(REASONS)}
    assert kept + sum(dropped.values()) == num_input, "tokenize accounting"
    sums = np.repeat(np.fromiter(t.histogram.keys(), dtype=np.int64), np.fromiter(t.histogram.values(), dtype=np.int64))
    mode, mode_frac = loss_mask_spike(sums)
    total = t.tokens["train"] + t.tokens["eval"]
    loss = t.tokens["train_loss"] + t.tokens["eval_loss"]
    metrics: dict[str, Any] = {
        "num_input": num_input,
        "num_samples": kept,
        "num_dropped": num_input - kept,
        "kept_plus_dropped_equals_input": kept + sum(dropped.values()) == num_input,
        "dropped_by_reason": dropped,
        "dropped_examples": t.examples,  # reason -> the first rows dropped for it (recorded: file, row, what is wrong)
        "dropped_frac": round((num_input - kept) / num_input, 6) if num_input else 0.0,
        "truncated_to_max_length": t.cut,
        "train_samples": t.samples["train"],
        "eval_samples": t.samples["eval"],
        "train_conversations": t.conversations["train"],
        "eval_conversations": t.conversations["eval"],
        "total_tokens": total,
        "loss_tokens": loss,
        "loss_token_frac": round(loss / total, 6) if total else 0.0,
        "train_tokens": t.tokens["train"],
        "train_loss_tokens": t.tokens["train_loss"],
        "mean_tokens": round(total / kept, 2) if kept else 0.0,
        "mean_loss_tokens": round(loss / kept, 2) if kept else 0.0,
        "loss_mask_sum_mode": mode,
        "loss_mask_sum_mode_frac": round(mode_frac, 6),
        "split": {"eval_count": p.eval_count, "eval_fraction": p.eval_fraction, "seed": spec.seed},
        **{k: int(v) for k, v in t.info.items()},
    }
    metrics["gates"] = evaluate_gates(metrics, p.gates, GATE_FIXES)
    metrics["failed_gates"] = failed_gates(metrics["gates"])
    metrics["gate_failed"] = bool(metrics["failed_gates"])
    return metrics


__all__ = [
    "GATE_FIXES",
    "HISTOGRAM_FILE",
    "HEADLINE",
    "REASONS",
    "SCHEMA",
    "run",
    "split_key",
]
