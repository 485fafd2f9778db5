"""Generate worker: one process, one vLLM engine. Receives work units from the dispatcher, streams every
turn of every conversation through the engine (`LLMEngine.add_request` / `step`, so the batch never
drains between units and a conversation's next turn goes in the moment its previous turn finishes),
and commits each unit's shard atomically once all its conversations are done. Policies: dflash/generate/
stage.py; the row contract: GENERATED_SCHEMA in dflash/core/contracts.py; messages: dflash/generate/contract.py.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import queue
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pyarrow as pa

from dflash.core.contracts import GENERATED_SCHEMA
from dflash.core.io import write_arrow
from dflash.core.processes import place_engine_core, shutdown_engine
from dflash.generate.contract import (
    CRASH_ENV,
    Exited,
    Progress,
    Ready,
    Unit,
    UnitDone,
    UnitStarted,
    WorkerConfig,
    generation_targets,
    request_seed,
    split_reasoning,
)
from dflash.generate.engines import engine_kwargs


@dataclass
class _ConvState:
    conv: dict
    targets: list[int]
    k: int = 0  # next target
    history: list[dict] = field(default_factory=list)
    pending: tuple | None = None  # (prompt ids, prompt messages JSON, request seed) of the request in flight


def worker_main(engine_index: int, cfg: WorkerConfig, inbox: mp.Queue, outbox: Connection) -> None:
    """One engine: receive units from `inbox`, stream their turns through vLLM, commit shards."""
    try:
        _worker_loop(engine_index, cfg, inbox, outbox)
    except BaseException as exc:
        import traceback

        print(f"generate worker {engine_index} stopped: {exc!r}", file=sys.stderr, flush=True)
        traceback.print_exc()
        sys.stderr.flush()
        # Exit now: multiprocessing's exit hook would otherwise wait forever for vLLM's engine-core
        # children; kill them first so nothing is left running.
        import psutil

        for child in psutil.Process().children(recursive=True):
            child.kill()
        os._exit(1)


def _worker_loop(engine_index: int, cfg: WorkerConfig, inbox: mp.Queue, outbox: Connection) -> None:
    devices = cfg.devices
    if devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = devices
    place_engine_core(cfg.gparams.engine_core_process)
    logging.basicConfig(level=logging.WARNING)
    from vllm import LLM, SamplingParams
    from vllm import __version__ as vllm_version
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    from dflash.core.chat import render_ids
    from dflash.core.hf import load_tokenizer

    g = cfg.gparams
    t0 = time.time()
    tokenizer = load_tokenizer(cfg.model, cfg.trust_remote_code, cfg.revision)
    llm = LLM(**engine_kwargs(g, cfg.model, cfg.revision, cfg.seed, cfg.trust_remote_code))
    engine = llm.llm_engine
    outbox.send(Ready(engine_index, time.time() - t0))
    think_end = tokenizer.convert_tokens_to_ids("</think>")
    think_end = think_end if isinstance(think_end, int) and think_end != tokenizer.unk_token_id else None
    s = g.sampling
    tkw = cfg.template_kwargs
    crash_unit = os.environ.get(CRASH_ENV)

    units: dict[int, dict] = {}  # unit index -> {"unit", "rows", "pending"}
    requests: dict[str, tuple[int, _ConvState]] = {}
    no_more = False

    def row(state: _ConvState, turn: int, **kw: Any) -> dict:
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
            "model": cfg.model_name,
            "revision": cfg.revision,
            "run_hash": cfg.run_hash,
            "engine_version": vllm_version,
            "request_seed": 0,
        }
        base.update(kw)
        return base

    def record(uidx: int, r: dict) -> None:
        units[uidx]["rows"].append(r)
        outbox.send(Progress(engine_index, 1, r["num_completion_tokens"]))

    def advance(uidx: int, state: _ConvState, skip_rest: str = "") -> None:
        """Submit the conversation's next turn, or record skips; decrement pending when it is done."""
        while state.k < len(state.targets):
            turn = state.k
            target = state.targets[turn]
            if skip_rest:
                record(uidx, row(state, turn, status="skipped", skip_reason=skip_rest))
                state.k += 1
                continue
            msgs = state.conv["messages"]
            start = state.targets[turn - 1] + 1 if turn > 0 else 0
            state.history.extend(msgs[start:target])
            prompt_msgs = list(state.history)
            last_user = [m for m in prompt_msgs if m["role"] in ("user", "tool")][-1:]
            if not last_user or not str(last_user[0].get("content") or "").strip():
                record(uidx, row(state, turn, status="skipped", skip_reason="empty_prompt"))
                skip_rest = "earlier_turn_skipped"
                state.k += 1
                continue
            ids = render_ids(tokenizer, prompt_msgs, True, tkw, tools=state.conv["tools"])
            if len(ids) >= g.max_model_len:
                record(
                    uidx, row(state, turn, status="skipped", skip_reason="prompt_too_long", num_prompt_tokens=len(ids))
                )
                skip_rest = "earlier_turn_skipped"
                state.k += 1
                continue
            sid = f"{state.conv['conversation_id']}:{turn}"
            seed = request_seed(s.seed, sid)
            sp = SamplingParams(
                temperature=s.temperature,
                top_p=s.top_p,
                top_k=s.top_k,
                max_tokens=s.max_tokens,
                seed=seed,
                stop=list(s.stop) or None,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
            requests[sid] = (uidx, state)
            state.pending = (ids, json.dumps(prompt_msgs, ensure_ascii=False), seed)
            engine.add_request(sid, TokensPrompt(prompt_token_ids=ids), sp)
            return
        units[uidx]["pending"] -= 1

    def start_unit(unit: Unit) -> None:
        if crash_unit is not None and int(crash_unit) == unit.index:
            os._exit(17)  # simulated engine crash (tests only)
        units[unit.index] = {"unit": unit, "rows": [], "pending": len(unit.conversations)}
        outbox.send(UnitStarted(engine_index, unit.index))
        for conv in unit.conversations:
            advance(unit.index, _ConvState(conv, generation_targets(conv["messages"])))

    def commit_finished() -> None:
        for uidx in [i for i, u in units.items() if u["pending"] == 0]:
            u = units.pop(uidx)
            order = {c["conversation_id"]: i for i, c in enumerate(u["unit"].conversations)}
            rows = sorted(u["rows"], key=lambda r: (order[r["conversation_id"]], r["turn_index"]))
            table = pa.Table.from_pylist(rows, schema=GENERATED_SCHEMA)
            write_arrow(Path(cfg.run_dir) / u["unit"].name, table)
            done = [r for r in rows if r["status"] == "completed"]
            outbox.send(UnitDone(engine_index, uidx, len(rows), sum(r["num_completion_tokens"] for r in done)))

    while True:
        # Take new units while the engine has room (keeps the batch full across unit boundaries).
        while not no_more and (not requests or engine.get_num_unfinished_requests() < 2 * g.max_num_seqs):
            try:
                item = inbox.get(block=not requests and not units)
            except queue.Empty:
                break
            if item is None:
                no_more = True
                break
            start_unit(item)
            commit_finished()  # units whose every prompt was skipped
        if not requests:
            commit_finished()
            if no_more and not units:
                break
            continue
        for out in engine.step():
            if not out.finished:
                continue
            uidx, state = requests.pop(out.request_id)
            comp = out.outputs[0]
            ids, prompt_json, seed = state.pending
            completion = list(comp.token_ids)
            reasoning, answer, has_end = split_reasoning(tokenizer, completion, think_end)
            turn = state.k
            record(
                uidx,
                row(
                    state,
                    turn,
                    prompt_ids=ids,
                    completion_ids=completion,
                    text=comp.text,
                    reasoning=reasoning,
                    answer=answer,
                    finish_reason=str(comp.finish_reason),
                    has_think_end=has_end,
                    num_prompt_tokens=len(ids),
                    num_completion_tokens=len(completion),
                    messages=prompt_json,
                    request_seed=seed,
                ),
            )
            state.history.append({"role": "assistant", "content": answer, "reasoning_content": reasoning})
            state.k += 1
            advance(uidx, state, skip_rest="earlier_turn_truncated" if comp.finish_reason == "length" else "")
        commit_finished()
    outbox.send(Exited(engine_index))
    shutdown_engine(engine, outbox, 0)
