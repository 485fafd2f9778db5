"""Generate worker: one process, one vLLM engine. Receives work units from the dispatcher, streams every
turn of every conversation through the engine (`LLMEngine.add_request` / `step`, so the batch never
drains between units and a conversation's next turn goes in the moment its previous turn finishes),
and commits each unit's shard atomically once all its conversations are done. Policies: dflash/generate/
stage.py; the row contract: GENERATED_SCHEMA in dflash/core/contracts.py; messages: dflash/generate/contract.py.
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
from dflash.generate.contract import Exited, Progress, Ready, UnitDone, UnitStarted, WorkerConfig
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
        cfg,
        tokenizer,
        vllm_version,
        on_row=lambda r: outbox.send(Progress(engine_index, 1, r["num_completion_tokens"])),
    )
    no_more = False

    def submit(req: Request | None) -> None:
        if req is None:
            return
        sp = SamplingParams(
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            max_tokens=s.max_tokens,
            seed=req.seed,
            stop=list(s.stop) or None,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        engine.add_request(req.sid, TokensPrompt(prompt_token_ids=req.ids), sp)

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
            for req in book.start_unit(item):
                submit(req)
            commit_finished()  # units whose every prompt was skipped
        if not book.requests:
            commit_finished()
            if no_more and not book.units:
                break
            continue
        for out in engine.step():
            if not out.finished:
                continue
            comp = out.outputs[0]
            submit(book.complete(out.request_id, list(comp.token_ids), comp.text, str(comp.finish_reason)))
        commit_finished()
    outbox.send(Exited(engine_index))
    shutdown_engine(engine, outbox, 0)
