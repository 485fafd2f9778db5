"""Generate worker: one process, one vLLM engine. Receives work units from the dispatcher, streams every
turn of every conversation through the engine (`LLMEngine.add_request` / `step`, so the batch never
drains between units and a conversation's next turn goes in the moment its previous turn finishes),
and commits each unit's shard atomically once all its conversations are done. It tells the dispatcher which
requests it puts into the engine (Submitted, before they go in) and every row it finishes (RowDone), so an
engine death loses nothing made and says which requests were in it. A unit's suspects (requests that may kill
the engine, dflash/generate/engines_backend.py) wait until nothing else is in the engine, then go in half at a time.
Policies: dflash/generate/stage.py; the row contract: GENERATED_SCHEMA in dflash/core/contracts.py; messages:
dflash/generate/contract.py.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import sys
import time
from multiprocessing.connection import Connection

from dflash.core.processes import place_engine_core, shutdown_engine
from dflash.generate.contract import (
    POISON_ENV,
    Exited,
    Ready,
    RowDone,
    Submitted,
    Unit,
    UnitDone,
    UnitStarted,
    WorkerConfig,
    generation_targets,
)
from dflash.generate.engines import engine_kwargs
from dflash.generate.turns import Request, TurnBook


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

    from dflash.core.hf import load_tokenizer

    g = cfg.gparams
    t0 = time.time()
    tokenizer = load_tokenizer(cfg.model, cfg.trust_remote_code, cfg.revision)
    llm = LLM(**engine_kwargs(g, cfg.model, cfg.revision, cfg.seed, cfg.trust_remote_code))
    engine = llm.llm_engine
    outbox.send(Ready(engine_index, time.time() - t0))
    s = g.sampling
    book = TurnBook(
        cfg, tokenizer, vllm_version, on_row=lambda r: outbox.send(RowDone(engine_index, unit_of[r["sample_id"]], r))
    )
    unit_of: dict[str, int] = {}  # sample id -> its unit (a row's message names the unit)
    suspects: set[str] = set()  # of the units held now: run last, half at a time
    parked: list[Request] = []  # suspects waiting for the engine to be otherwise empty
    poison = os.environ.get(POISON_ENV)  # tests only: the engine "crashes" on a prompt holding this text
    poisoned = False
    no_more = False

    def note_rows(unit: Unit) -> None:  # every sample id of a unit -> the unit (skipped turns have rows too)
        for c in unit.conversations:
            for k in range(len(generation_targets(c["messages"]))):
                unit_of[f"{c['conversation_id']}:{k}"] = unit.index

    def submit(reqs: list[Request | None]) -> None:
        nonlocal poisoned
        reqs = [r for r in reqs if r is not None]
        parked.extend(r for r in reqs if r.sid in suspects)
        reqs = [r for r in reqs if r.sid not in suspects]
        if not reqs:
            return
        by_unit: dict[int, list[str]] = {}
        for req in reqs:
            by_unit.setdefault(req.unit, []).append(req.sid)
        for uidx, sids in by_unit.items():  # before they go in: a request that kills the engine is named
            outbox.send(Submitted(engine_index, uidx, sids))
        for req in reqs:
            sp = SamplingParams(
                temperature=s.temperature,
                top_p=s.top_p,
                top_k=s.top_k,
                max_tokens=s.max_tokens,
                seed=req.seed,
                stop=list(s.stop) or None,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
            engine.add_request(req.sid, TokensPrompt(prompt_token_ids=list(req.ids)), sp)
            poisoned = poisoned or bool(poison and poison in tokenizer.decode(list(req.ids)))

    def commit_finished() -> None:
        for uidx, prompts, tokens in book.commit_finished():
            outbox.send(UnitDone(engine_index, uidx, prompts, tokens))

    while True:
        # Take new units while the engine has room (keeps the batch full across unit boundaries).
        while not no_more and (not book.requests or engine.get_num_unfinished_requests() < 2 * g.max_num_seqs):
            try:
                item = inbox.get(block=not book.requests and not book.units)
            except queue.Empty:
                break
            if item is None:
                no_more = True
                break
            outbox.send(UnitStarted(engine_index, item.index))
            note_rows(item)
            suspects.update(item.suspects)
            submit(book.start_unit(item))
            commit_finished()  # units whose every prompt was skipped
        if not book.requests:
            commit_finished()
            if no_more and not book.units:
                break
            continue
        if parked and engine.get_num_unfinished_requests() == 0:
            half, parked[:] = parked[: -(-len(parked) // 2)], parked[-(-len(parked) // 2) :]
            suspects.difference_update(r.sid for r in half)
            submit(half)
        if poisoned:
            os._exit(17)  # the simulated engine crash: this step would run the poison prompt
        finished = [out for out in engine.step() if out.finished]
        nxt = []
        for out in finished:
            comp = out.outputs[0]
            nxt.append(book.complete(out.request_id, list(comp.token_ids), comp.text, str(comp.finish_reason)))
        submit(nxt)
        commit_finished()
    outbox.send(Exited(engine_index))
    shutdown_engine(engine, outbox, 0)
