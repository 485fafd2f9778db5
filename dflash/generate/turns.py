"""The per-conversation turn logic and the unit commit, shared by both backends: the engines worker
(dflash/generate/worker.py, vLLM in-process) and the servers client (dflash/generate/servers_backend.py, HTTP).

A `TurnBook` holds the units a backend is working on. `start_unit` renders each conversation's first
regenerated turn into a `Request` (prompt token ids + per-request seed) or records a skip; `complete`
records a finished request as a GENERATED_SCHEMA row and returns the conversation's next turn (rendered
against the model's own earlier answers) the moment it is known; `fail` records a turn that could not be
generated (status `failed`, the reason in `skip_reason`; the conversation's later turns are skipped as
`earlier_turn_failed`); `commit_finished` writes the shard of every unit whose conversations are all done
(atomically: dflash.core.io.write_arrow), failed turns included, so the rest of a unit is never lost to one
request. A unit can start from rows already made (`Unit.done_rows`: a shard re-opened to retry its failed
turns, or what an engine finished before it died): those turns are replayed into the conversation's history,
not asked again. The policies are dflash/generate/stage.py's; the backends only move requests.
"""

from __future__ import annotations

import itertools
import json
import os
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from dflash.core.contracts import GENERATED_SCHEMA
from dflash.core.io import write_arrow
from dflash.generate.contract import (
    CRASH_ENV,
    FastDecode,
    Unit,
    WorkerConfig,
    generation_targets,
    request_seed,
    split_reasoning,
)

FAILED = "failed"  # GENERATED_SCHEMA status of a turn that could not be generated
AFTER_FAILED = "earlier_turn_failed"  # skip_reason of the later turns of its conversation


@dataclass
class Request:
    """One turn to generate: `ids` is the rendered prompt, `seed` its per-request seed."""

    sid: str  # sample id "<conversation_id>:<turn>", also the request id
    unit: int
    ids: array  # array("i"): 4 bytes an id while thousands of requests wait (a list costs ~36)
    seed: int
    charges: list[tuple[str, str]] = field(default_factory=list)  # servers backend: (url, error) of failed tries


def resumable(rows: list[dict]) -> list[dict]:
    """The rows of a committed shard a rerun keeps: all but its failed turns and the turns skipped after them
    (those are asked again)."""
    return [r for r in rows if r["status"] != FAILED and r["skip_reason"] != AFTER_FAILED]


assert array("i").itemsize == 4, "token id columns are built from C ints as int32"
_ID_LISTS = pa.list_(pa.int32())


def _id_lists(values: list) -> pa.Array:
    """A list<int32> column built from the ids' bytes (lists or array("i")s): pyarrow's conversion of Python int
    lists costs about 0.6 us an id, most of the client's time per 1,500-token row at cluster scale."""
    arrays = [v if isinstance(v, array) else array("i", v) for v in values]
    offsets = array("i", itertools.accumulate(map(len, arrays), initial=0))
    flat = b"".join(a.tobytes() for a in arrays)
    ids = pa.Array.from_buffers(pa.int32(), len(flat) // 4, [None, pa.py_buffer(flat)])
    return pa.ListArray.from_arrays(pa.Array.from_buffers(pa.int32(), len(offsets), [None, pa.py_buffer(offsets)]), ids)


def rows_table(rows: list[dict]) -> pa.Table:
    """GENERATED_SCHEMA rows as a table (the same table pa.Table.from_pylist makes, 20x faster on long replies)."""
    columns = []
    for f in GENERATED_SCHEMA:
        values = [r[f.name] for r in rows]
        columns.append(_id_lists(values) if f.type == _ID_LISTS else pa.array(values, type=f.type))
    return pa.Table.from_arrays(columns, schema=GENERATED_SCHEMA)


@dataclass
class _ConvState:
    conv: dict
    targets: list[int]
    k: int = 0  # next target
    history: list[dict] = field(default_factory=list)
    prompt_json: str = ""  # the prompt messages of the request in flight


def think_end_id(tokenizer: Any) -> int | None:
    tid = tokenizer.convert_tokens_to_ids("</think>")
    return tid if isinstance(tid, int) and tid != tokenizer.unk_token_id else None


class TurnBook:
    """Units in progress: their conversations' turn state, rows so far, and pending conversation counts."""

    def __init__(
        self, cfg: WorkerConfig, tokenizer: Any, engine_version: str, on_row: Callable[[dict], None] | None = None
    ):
        self.cfg, self.tokenizer, self.on_row = cfg, tokenizer, on_row
        self.engine_version = engine_version  # rows record it (a request's own server version wins)
        self.think_end = think_end_id(tokenizer)
        self.decoder = FastDecode(tokenizer)
        self.units: dict[int, dict] = {}  # unit index -> {"unit", "rows", "pending"}
        self.requests: dict[str, tuple[Request, _ConvState]] = {}  # in flight (or queued) by sample id
        self.failed_turns: list[dict] = []  # {"sample_id", "reason", "error"} recorded by this book
        self.crash_unit = os.environ.get(CRASH_ENV)

    def row(self, state: _ConvState, turn: int, engine_version: str = "", **kw: Any) -> dict:
        base = {
            "sample_id": f"{state.conv['conversation_id']}:{turn}",
            "conversation_id": state.conv["conversation_id"],
            "turn_index": turn,
            "status": "completed",
            "skip_reason": "",
            "prompt_ids": [],
            "completion_ids": [],
            "text": "",
            "reasoning": "",
            "answer": "",
            "finish_reason": "",
            "has_think_end": False,
            "num_prompt_tokens": 0,
            "num_completion_tokens": 0,
            "messages": "",
            "tools": json.dumps(state.conv["tools"]) if state.conv["tools"] else "",
            "model": self.cfg.model_name,
            "revision": self.cfg.revision,
            "run_hash": self.cfg.run_hash,
            "engine_version": engine_version or self.engine_version,
            "request_seed": 0,
        }
        base.update(kw)
        return base

    def _record(self, uidx: int, r: dict, new: bool = True) -> None:
        self.units[uidx]["rows"].append(r)
        if new and self.on_row is not None:
            self.on_row(r)

    def _replay(self, uidx: int, state: _ConvState, r: dict) -> None:
        """Take a row made earlier (Unit.done_rows) as turn state.k: its answer joins the history."""
        if r["status"] == "completed":
            msgs, turn = state.conv["messages"], state.k
            start = state.targets[turn - 1] + 1 if turn > 0 else 0
            state.history.extend(msgs[start : state.targets[turn]])
            state.history.append({"role": "assistant", "content": r["answer"], "reasoning_content": r["reasoning"]})
        self._record(uidx, r, new=False)
        state.k += 1

    def _advance(self, uidx: int, state: _ConvState, skip_rest: str = "", version: str = "") -> Request | None:
        """The conversation's next request, or None once it is done (skips recorded, pending decremented)."""
        from dflash.core.chat import render_ids

        g = self.cfg.gparams
        while state.k < len(state.targets):
            turn = state.k
            target = state.targets[turn]
            if skip_rest:
                self._record(uidx, self.row(state, turn, version, status="skipped", skip_reason=skip_rest))
                state.k += 1
                continue
            msgs = state.conv["messages"]
            start = state.targets[turn - 1] + 1 if turn > 0 else 0
            state.history.extend(msgs[start:target])
            prompt_msgs = list(state.history)
            last_user = [m for m in prompt_msgs if m["role"] in ("user", "tool")][-1:]
            if not last_user or not str(last_user[0].get("content") or "").strip():
                self._record(uidx, self.row(state, turn, version, status="skipped", skip_reason="empty_prompt"))
                skip_rest = "earlier_turn_skipped"
                state.k += 1
                continue
            tkw = self.cfg.template_kwargs
            ids = render_ids(self.tokenizer, prompt_msgs, True, tkw, tools=state.conv["tools"])
            if len(ids) >= g.max_model_len:
                r = self.row(state, turn, version, status="skipped", skip_reason="prompt_too_long")
                self._record(uidx, r | {"num_prompt_tokens": len(ids)})
                skip_rest = "earlier_turn_skipped"
                state.k += 1
                continue
            sid = f"{state.conv['conversation_id']}:{turn}"
            known = self.units[uidx]["unit"].failed_turns.get(sid)
            if known is not None:  # found to kill the engine (dflash/generate/engines_backend.py): not asked again
                self._fail_row(uidx, state, known)
                skip_rest = AFTER_FAILED
                state.k += 1
                continue
            req = Request(sid, uidx, array("i", ids), request_seed(g.sampling.seed, sid))
            state.prompt_json = json.dumps(prompt_msgs, ensure_ascii=False)
            self.requests[sid] = (req, state)
            return req
        self.units[uidx]["pending"] -= 1
        return None

    def start_unit(self, unit: Unit) -> list[Request]:
        """Register a unit; its conversations' first requests (conversations with nothing to ask are done)."""
        if self.crash_unit is not None and int(self.crash_unit) == unit.index:
            os._exit(17)  # simulated engine crash (tests only)
        self.units[unit.index] = {"unit": unit, "rows": [], "pending": len(unit.conversations)}
        made: dict[str, list[dict]] = {}
        for r in unit.done_rows:
            made.setdefault(r["conversation_id"], []).append(r)
        reqs = []
        for c in unit.conversations:
            state = _ConvState(c, generation_targets(c["messages"]))
            skip = ""  # what the replayed rows imply for the turns after them
            for r in sorted(made.get(c["conversation_id"], []), key=lambda r: r["turn_index"]):
                if r["turn_index"] != state.k:
                    raise ValueError(f"unit {unit.index}: rows of {c['conversation_id']} skip turn {state.k}")
                self._replay(unit.index, state, r)
                if r["status"] == FAILED:
                    skip = AFTER_FAILED
                elif r["status"] != "completed":
                    skip = r["skip_reason"] if r["skip_reason"].startswith("earlier_turn") else "earlier_turn_skipped"
                elif r["finish_reason"] == "length":
                    skip = "earlier_turn_truncated"
            reqs.append(self._advance(unit.index, state, skip))
        return [r for r in reqs if r is not None]

    def complete(
        self, sid: str, completion: list[int], text: str, finish_reason: str, engine_version: str = ""
    ) -> Request | None:
        """Record a finished request; the same conversation's next request (None when it is done)."""
        req, state = self.requests.pop(sid)
        reasoning, answer, has_end = split_reasoning(self.decoder, completion, self.think_end)
        r = self.row(
            state,
            state.k,
            engine_version,
            prompt_ids=req.ids,
            completion_ids=array("i", completion),  # 4 bytes an id while the row waits for its unit, not ~36
            text=text,
            reasoning=reasoning,
            answer=answer,
            finish_reason=finish_reason,
            has_think_end=has_end,
            num_prompt_tokens=len(req.ids),
            num_completion_tokens=len(completion),
            messages=state.prompt_json,
            request_seed=req.seed,
        )
        self._record(req.unit, r)
        state.history.append({"role": "assistant", "content": answer, "reasoning_content": reasoning})
        state.k += 1
        skip = "earlier_turn_truncated" if finish_reason == "length" else ""
        return self._advance(req.unit, state, skip, engine_version)

    def _fail_row(self, uidx: int, state: _ConvState, failure: dict) -> None:
        sid = f"{state.conv['conversation_id']}:{state.k}"
        self._record(uidx, self.row(state, state.k, status=FAILED, skip_reason=failure["reason"]))
        self.failed_turns.append({"sample_id": sid, **failure})

    def fail(self, sid: str, reason: str, error: str) -> None:
        """Record the request `sid` as a failed turn (`reason`: request_failed | engine_died; `error`: what
        happened, for the report); its conversation's later turns are skipped (AFTER_FAILED)."""
        req, state = self.requests.pop(sid)
        self._fail_row(req.unit, state, {"reason": reason, "error": error})
        state.k += 1
        self._advance(req.unit, state, AFTER_FAILED)

    def commit_finished(self) -> list[tuple[int, int, int]]:
        """Write the shard of every unit whose conversations are all done: [(unit, rows, output tokens)]."""
        done_units = []
        for uidx in [i for i, u in self.units.items() if u["pending"] == 0]:
            u = self.units.pop(uidx)
            order = {c["conversation_id"]: i for i, c in enumerate(u["unit"].conversations)}
            rows = sorted(u["rows"], key=lambda r: (order[r["conversation_id"]], r["turn_index"]))
            write_arrow(Path(self.cfg.run_dir) / u["unit"].name, rows_table(rows))
            tokens = sum(r["num_completion_tokens"] for r in rows if r["status"] == "completed")
            done_units.append((uidx, len(rows), tokens))
        return done_units
