"""Samples: the per-chunk work of the tokenize stage, run in worker processes (see dflash/tokenize/stage.py for
the policies: sources, multi-turn, filters, split).

A chunk is up to `tokenize.chunk_rows` rows of one input file. `process_chunk` reads them (only the
columns it needs; the decompressed record batch is kept for the next chunk of the same batch), turns
them into candidates (generated: stored prompt and completion ids; recorded: the chat template's
prompt render and the ids the assistant turn adds up to its end-of-turn token), applies the filters,
assembles `input_ids` / `loss_mask` with numpy gathers (no per-token Python) and splits the samples
into train / eval by conversation. `results` runs chunks over `num_workers` spawned processes and
yields their results in input order. No torch and no transformers here (`dflash.core.chat.load_fast_chat`).

Not runnable on its own: `python -m stages.tokenize` runs it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc

from dflash.core.contracts import SAMPLE_SCHEMA as SCHEMA
from dflash.core.errors import UserError
from dflash.core.params import TokenizeParams

REASONS = (
    "not_completed",  # generated: the generate row was skipped (prompt too long, empty, earlier turn cut)
    "truncated",  # generated: finish_reason length (the completion hit the token budget)
    "missing_think_end",  # generated, thinking mode: no </think> in the completion
    "overlong",  # longer than max_length (overlong: drop)
    "few_loss_tokens",  # fewer than min_loss_tokens supervised tokens
    "no_anchor_pair",  # no two adjacent supervised tokens (DFlash needs an anchor and its next token)
    "template_error",  # recorded: the chat template refused the conversation up to this turn
    "unstable_render",  # recorded: the prompt render is not a prefix of the turn's render (text or token ids), or the
    # turn does not end with the template's end-of-turn tokens: its loss mask would be misplaced
)
(NOT_COMPLETED, TRUNCATED, MISSING_THINK_END, OVERLONG, FEW_LOSS_TOKENS, NO_ANCHOR_PAIR, TEMPLATE_ERROR, UNSTABLE) = (
    range(1, 9)
)  # 0 = kept
MAX_EXAMPLES = 5  # dropped-row examples kept per reason (file, row, conversation, what is wrong)
GENERATED_COLUMNS = (
    "sample_id",
    "conversation_id",
    "turn_index",
    "status",
    "prompt_ids",
    "completion_ids",
    "finish_reason",
    "has_think_end",
)
RECORDED_COLUMNS = ("conversation_id", "messages", "tools")


@dataclass(frozen=True)
class Spec:
    """Everything a worker needs (pickled once per worker)."""

    params: TokenizeParams
    thinking: bool  # base.enable_thinking
    seed: int  # base.seed (the split hash)
    template_kwargs: dict[str, Any]
    tokenizer_dir: str | None  # recorded source only
    eval_ids: frozenset[str] | None  # eval_count > 0: the held-out conversations; None: eval_fraction


@dataclass(frozen=True)
class Chunk:
    path: str
    batch: int  # record batch index in the file
    first_row: int  # row number in the file of the batch's first row
    start: int  # rows [start, stop) of the batch
    stop: int


@dataclass
class Candidates:
    """Possible samples of one chunk, before the generic filters."""

    sample_id: pa.Array
    conversation_id: pa.Array
    turn_index: pa.Array
    prompt: pa.ListArray  # list<int32>
    completion: pa.ListArray  # list<int32>
    reason: np.ndarray  # (n,) int8: 0 or the code of a source-specific drop reason
    info: dict[str, int] = field(default_factory=dict)  # extra counts (recorded: tool-call turns...)
    examples: dict[str, list[str]] = field(default_factory=dict)  # reason -> "FILE: row N (conversation C): what"


@dataclass
class ChunkResult:
    rows: int  # input rows read
    reason_counts: np.ndarray  # (len(REASONS) + 1,) int64; [0] = kept
    splits: dict[str, pa.Table]  # "train" / "eval" -> samples in SCHEMA
    conversations: dict[str, tuple[int, str, str]]  # split -> (distinct ids, first id, last id)
    histogram: dict[int, int]  # loss-mask sum -> kept samples
    tokens: dict[str, int]  # split -> tokens; "<split>_loss" -> supervised tokens
    cut: int  # kept samples cut to max_length
    info: dict[str, int]
    examples: dict[str, list[str]] = field(default_factory=dict)  # reason -> first dropped rows, with details


_STATE: dict[str, Any] = {}  # per process: spec, chat template, turn end, last decompressed batch


def init_worker(spec: Spec) -> None:
    if _STATE.get("pool"):
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker; the pool is the parallelism
    _STATE.update(spec=spec, batch_key=None, batch=None)
    if spec.tokenizer_dir is not None and _STATE.get("chat_dir") != (spec.tokenizer_dir, str(spec.template_kwargs)):
        from dflash.core.chat import load_fast_chat

        chat = load_fast_chat(spec.tokenizer_dir)
        _STATE.update(chat=chat, end=turn_end(chat, spec.template_kwargs))
        _STATE["chat_dir"] = (spec.tokenizer_dir, str(spec.template_kwargs))


def _init_pool_worker(spec: Spec) -> None:
    _STATE["pool"] = True
    init_worker(spec)


def split_key(seed: int, conversation_id: str) -> float:
    """Uniform [0, 1) key of a conversation for the held-out split (seeded)."""
    digest = hashlib.sha256(f"{seed}:{conversation_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def turn_end(chat: Any, kwargs: dict[str, Any]) -> tuple[int | None, tuple[int, ...]]:
    """(end-of-turn token id or None, ids the template writes after it). Found by rendering a probe turn:
    for Qwen `<|im_end|>` then "\\n"; the engine stops at the former, the latter belongs to the next prompt."""
    probe = "dflash tokenize probe"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": probe}]
    text = chat.render(messages, False, kwargs)
    if probe not in text:
        raise UserError(f"{chat.folder}: the chat template does not render assistant content; cannot find turn ends")
    ids = chat.encode_batch([text[text.rindex(probe) + len(probe) :]])[0]
    return (ids[0] if ids else None), tuple(ids[1:])


def _read(chunk: Chunk, columns: tuple[str, ...]) -> pa.RecordBatch:
    """Rows of a chunk. The decompressed batch is kept, since the next chunks usually come from it."""
    key = (chunk.path, chunk.batch)
    if _STATE.get("batch_key") != key:
        with pa.memory_map(chunk.path, "r") as source:
            schema = ipc.open_file(source).schema
            fields = [schema.get_field_index(c) for c in columns]
            options = ipc.IpcReadOptions(included_fields=fields)
            _STATE.update(batch_key=key, batch=ipc.open_file(source, options=options).get_batch(chunk.batch))
    return _STATE["batch"].slice(chunk.start, chunk.stop - chunk.start)


def generated_candidates(b: pa.RecordBatch, spec: Spec) -> Candidates:
    """Generate rows -> candidates: prompt_ids + completion_ids as stored, drop reasons of the source."""
    p = spec.params
    n = b.num_rows
    reason = np.zeros(n, dtype=np.int8)
    completed = pc.fill_null(pc.equal(b["status"], "completed"), False).to_numpy(zero_copy_only=False)
    reason[~completed] = NOT_COMPLETED
    if p.drop_truncated:
        cut = pc.fill_null(pc.equal(b["finish_reason"], "length"), False).to_numpy(zero_copy_only=False)
        reason[(reason == 0) & cut] = TRUNCATED
    if p.drop_missing_think_end and spec.thinking:
        no_end = ~pc.fill_null(b["has_think_end"], False).to_numpy(zero_copy_only=False)
        reason[(reason == 0) & no_end] = MISSING_THINK_END
    return Candidates(
        b["sample_id"], b["conversation_id"], b["turn_index"], b["prompt_ids"], b["completion_ids"], reason
    )


def _unstable(where: str, cid: str, i: int, prefix: str, full: str) -> str:
    k = next((j for j, (a, b) in enumerate(zip(prefix, full, strict=False)) if a != b), min(len(prefix), len(full)))
    return (
        f"{where} (conversation {cid}), assistant message {i}: the chat template renders the conversation "
        f"differently once this turn is added, so the prompt (add_generation_prompt=True) is not a prefix of "
        f"the full render; first difference at character {k}: prompt {prefix[k : k + 40]!r} vs full "
        f"{full[k : k + 40]!r}. The loss mask would be misplaced; fix the data or the template "
        "(or use tokenize.source: generated)."
    )


def recorded_candidates(b: pa.RecordBatch, chunk: Chunk, spec: Spec) -> Candidates:
    """Conversations -> one candidate per assistant turn without tool calls (or the last one): the
    prompt render's ids, then the ids the turn adds up to its end-of-turn token. A turn the template
    refuses or renders unstably is a dropped candidate (template_error / unstable_render) naming its row."""
    chat = _STATE["chat"]
    end_id, tail = _STATE["end"]
    kwargs = spec.template_kwargs
    sids, cids, turns, prefixes, fulls, where, codes = [], [], [], [], [], [], []
    info = {"tool_call_turns": 0, "conversations_without_turns": 0}
    examples: dict[str, list[str]] = {}

    def drop(code: int, text: str) -> None:
        codes[-1] = code
        bucket = examples.setdefault(REASONS[code - 1], [])
        if len(bucket) < MAX_EXAMPLES:
            bucket.append(text)

    rows = zip(b["conversation_id"].to_pylist(), b["messages"].to_pylist(), b["tools"].to_pylist(), strict=True)
    for r, (cid, messages_json, tools_json) in enumerate(rows):
        row = f"{chunk.path}: row {chunk.first_row + chunk.start + r}"
        messages = json.loads(messages_json)
        tools = json.loads(tools_json) if tools_json else None
        targets = [i for i, m in enumerate(messages) if m.get("role") == "assistant" and not m.get("tool_calls")]
        info["tool_call_turns"] += sum(m.get("role") == "assistant" and bool(m.get("tool_calls")) for m in messages)
        info["conversations_without_turns"] += not targets
        picked = list(enumerate(targets))
        for k, i in picked[-1:] if spec.params.recorded_turns == "last" else picked:
            sids.append(f"{cid}:{k}")
            cids.append(cid)
            turns.append(k)
            where.append((row, cid, i))
            codes.append(0)
            prefix = full = ""
            try:
                prefix = chat.render(messages[:i], True, kwargs, tools)
                full = chat.render(messages[: i + 1], False, kwargs, tools)
            except Exception as exc:  # jinja raise_exception / undefined: the template refuses this shape
                prefix = full = ""
                drop(TEMPLATE_ERROR, f"{row} (conversation {cid}), assistant message {i}: chat template error: {exc}")
            else:
                if not full.startswith(prefix):
                    drop(UNSTABLE, _unstable(row, cid, i, prefix, full))
                    prefix = full = ""
            prefixes.append(prefix)
            fulls.append(full)
    # ids only: encode_batch_fast (tokenizers >= 0.20) skips the character offsets we never use
    encode = getattr(chat.tokenizer, "encode_batch_fast", chat.tokenizer.encode_batch)
    encoded = [e.ids for e in encode(prefixes + fulls, add_special_tokens=False)]
    prompts, completions = encoded[: len(prefixes)], []
    for j, (row, cid, i) in enumerate(where):
        p_ids, f_ids = prompts[j], encoded[len(prefixes) + j]
        completion: list[int] = []
        if codes[j] == 0:
            stop = len(f_ids) - len(tail)
            if f_ids[: len(p_ids)] != p_ids:
                codes[j] = UNSTABLE
                why = "the prompt's token ids are not a prefix of the full render's (a token crosses the boundary)"
            elif (
                tuple(f_ids[stop:]) != tail or stop <= len(p_ids) or (end_id is not None and f_ids[stop - 1] != end_id)
            ):
                codes[j] = UNSTABLE
                why = f"the rendered turn does not end with the template's end-of-turn tokens {[end_id, *tail]}"
            else:
                completion = f_ids[len(p_ids) : stop]
            if codes[j]:
                bucket = examples.setdefault(REASONS[UNSTABLE - 1], [])
                if len(bucket) < MAX_EXAMPLES:
                    bucket.append(f"{row} (conversation {cid}), assistant message {i}: {why}")
        if codes[j]:
            prompts[j] = []
        completions.append(completion)
    return Candidates(
        pa.array(sids, pa.string()),
        pa.array(cids, pa.string()),
        pa.array(turns, pa.int32()),
        pa.array(prompts, pa.list_(pa.int32())),
        pa.array(completions, pa.list_(pa.int32())),
        np.array(codes, dtype=np.int8),
        info,
        examples,
    )


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, s + l) over (starts, lengths), without a Python loop."""
    total = int(lengths.sum())
    ends = np.cumsum(lengths)
    return np.repeat(starts - (ends - lengths), lengths) + np.arange(total)


def _list_parts(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(offsets into values, values) of a list array; offsets index the unsliced values buffer."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    return np.asarray(arr.offsets, dtype=np.int64), np.asarray(arr.values)


def assemble(cand: Candidates, rows: np.ndarray, n_prompt: np.ndarray, n_loss: np.ndarray) -> pa.Table:
    """Samples `rows` of `cand`: the first n_prompt ids of the prompt, then the first n_loss of the completion."""
    p_off, p_val = _list_parts(cand.prompt)
    c_off, c_val = _list_parts(cand.completion)
    n_tok = n_prompt + n_loss
    off = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(n_tok, out=off[1:])
    assert off[-1] < 2**31, "chunk too large for int32 list offsets"
    ids = np.empty(off[-1], dtype=np.int32)
    mask = np.zeros(off[-1], dtype=np.int8)
    ids[_ranges(off[:-1], n_prompt)] = p_val[_ranges(p_off[rows], n_prompt)]
    dst = _ranges(off[:-1] + n_prompt, n_loss)
    ids[dst] = c_val[_ranges(c_off[rows], n_loss)]
    mask[dst] = 1
    offsets = pa.array(off.astype(np.int32))
    take = pa.array(rows, pa.int64())
    return pa.Table.from_arrays(
        [
            cand.sample_id.take(take),
            cand.conversation_id.take(take),
            cand.turn_index.take(take).cast(pa.int32()),
            pa.ListArray.from_arrays(offsets, pa.array(ids)),
            pa.ListArray.from_arrays(offsets, pa.array(mask)),
            pa.array(n_tok.astype(np.int32)),
            pa.array(n_loss.astype(np.int32)),
            pa.array(n_prompt.astype(np.int32)),
        ],
        schema=SCHEMA,
    )


def finish(cand: Candidates, spec: Spec, rows_read: int) -> ChunkResult:
    """Generic filters, truncation, the samples and the split of one chunk."""
    p = spec.params
    n_prompt = np.diff(_list_parts(cand.prompt)[0])
    n_comp = np.diff(_list_parts(cand.completion)[0])
    reason = cand.reason.copy()
    over = n_prompt + n_comp > p.max_length
    if p.overlong == "drop":
        reason[(reason == 0) & over] = OVERLONG
    n_prompt = np.minimum(n_prompt, p.max_length)
    n_loss = np.minimum(n_comp, p.max_length - n_prompt)
    reason[(reason == 0) & (n_loss < p.min_loss_tokens)] = FEW_LOSS_TOKENS
    if p.require_anchor_pair:  # the mask is one contiguous run: an adjacent pair exists iff 2+ ones
        reason[(reason == 0) & (n_loss < 2)] = NO_ANCHOR_PAIR
    keep = np.flatnonzero(reason == 0)
    table = assemble(cand, keep, n_prompt[keep], n_loss[keep])
    cids = table["conversation_id"].to_pylist()
    if spec.eval_ids is not None:
        is_eval = np.array([c in spec.eval_ids for c in cids], dtype=bool)
    else:
        is_eval = np.array([split_key(spec.seed, c) < p.eval_fraction for c in cids], dtype=bool)
    splits, conversations, tokens = {}, {}, {}
    for name, sel in (("train", ~is_eval), ("eval", is_eval)):
        part = table.filter(pa.array(sel))
        ids = [c for c, s in zip(cids, sel, strict=True) if s]
        splits[name] = part
        conversations[name] = (len(set(ids)), ids[0] if ids else "", ids[-1] if ids else "")
        tokens[name] = int(n_prompt[keep][sel].sum() + n_loss[keep][sel].sum())
        tokens[f"{name}_loss"] = int(n_loss[keep][sel].sum())
    values, counts = np.unique(n_loss[keep], return_counts=True)
    return ChunkResult(
        rows=rows_read,
        reason_counts=np.bincount(reason, minlength=len(REASONS) + 1).astype(np.int64),
        splits=splits,
        conversations=conversations,
        histogram={int(v): int(c) for v, c in zip(values, counts, strict=True)},
        tokens=tokens,
        cut=int(over[keep].sum()),
        info=cand.info,
        examples=cand.examples,
    )


def process_chunk(chunk: Chunk) -> ChunkResult:
    """One work chunk -> its samples and counts (runs in a worker, or inline)."""
    spec: Spec = _STATE["spec"]
    if spec.params.source == "generated":
        batch = _read(chunk, GENERATED_COLUMNS)
        cand = generated_candidates(batch, spec)
    else:
        batch = _read(chunk, RECORDED_COLUMNS)
        cand = recorded_candidates(batch, chunk, spec)
    return finish(cand, spec, batch.num_rows)


def results(chunks: list[Chunk], spec: Spec, num_workers: int) -> Iterator[ChunkResult]:
    """Chunk results in input order; at most 2 chunks per worker in flight (bounded memory)."""
    if num_workers <= 1 or len(chunks) <= 1:
        _STATE.pop("pool", None)
        init_worker(spec)
        for chunk in chunks:
            yield process_chunk(chunk)
        return
    import multiprocessing as mp

    # spawn: a forked copy of a process that already ran Rust tokenizer threads can deadlock
    ctx = mp.get_context("spawn")
    with ctx.Pool(min(num_workers, len(chunks)), initializer=_init_pool_worker, initargs=(spec,)) as pool:
        pending: deque = deque()
        for chunk in chunks:
            if len(pending) >= 2 * num_workers:
                yield pending.popleft().get()
            pending.append(pool.apply_async(process_chunk, (chunk,)))
        while pending:
            yield pending.popleft().get()
