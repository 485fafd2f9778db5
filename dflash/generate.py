"""Generate: regenerate every assistant turn with the target itself through real vLLM.

Inputs: `${audit.out}/conversations.arrow` (normalized conversations, written by the audit stage) and
the target (`${base.target_dir}/target.json`). Outputs: `${generate.out}/run-<hash>/unit-*.arrow`
(one Arrow shard per work unit), `${generate.out}/current.json` (which run is current), metrics
`reports/generate.json`; in pilot mode `${generate.pilot_out}/...` and `reports/pilot.json`.

Command: python -m stages.generate --params params.yaml        (full run; resumable)
         python -m stages.generate --pilot                      (pilot of generate.pilot_samples prompts)

Policies
- Prompts are rendered with the target's own tokenizer + chat template (thinking mode and template
  kwargs from `base`) and passed to vLLM as token ids, so the exact prompt ids are known; the sampled
  completion ids are stored verbatim (tokenize never re-derives them from text).
- Which turns are regenerated: every assistant message WITHOUT tool calls, in order, each against
  the model's own earlier regenerated turns (the recorded answers are the placeholders we replace);
  a conversation that ends with a user (or tool) message also gets a final turn. Assistant messages
  WITH tool calls are kept exactly as recorded, together with the recorded tool results, because a
  regenerated call would not match the recorded result; they are history, never training samples.
  After a truncated turn (finish_reason "length") the later turns of that conversation are skipped
  (their history would contain a cut-off answer).
- Data parallel: `num_engines` worker processes, each owning one vLLM engine pinned to its devices
  (CUDA_VISIBLE_DEVICES; `tensor_parallel_size` devices each). The main process is the dispatcher: a
  shared queue of work units (chunks of `unit_size` conversations) from which it keeps every worker
  fed; each worker streams requests through its engine (`LLMEngine.add_request` / `step`), so the
  batch never drains between units and a multi-turn conversation's next turn is submitted the moment
  its previous turn finishes.
- Resumable, nothing lost or duplicated: a unit's shard is written atomically (temp file + rename)
  only when all its conversations are done; the run folder name hashes everything that changes
  outputs (model + weights hash, tokenizer/template, template kwargs, sampling, max_model_len, dtype,
  quantization), so stale shards never mix in; a restart skips units whose shard exists. Requests
  carry a seed derived from the sample id, so a resumed run reproduces the same outputs.
- Failures: a worker that dies (engine crash) is restarted; its in-flight units are retried alone
  (so a bad unit cannot take innocent ones down with it) up to `max_unit_retries`, then recorded as
  failed. Prompts longer than the context and empty prompts are recorded as skipped, never a crash.
  `completed + skipped + failed == prompts` in reports/generate.json; the stage fails at the end if
  anything failed, saying what.

Data contract: unit shard rows (one per regenerated turn)
  sample_id str "<conversation_id>:<turn>"   conversation_id str   turn_index int32
  status str completed|skipped               skip_reason str ("" when completed)
  prompt_ids list<int32>  (the exact rendered prompt)
  completion_ids list<int32>  (sampled ids verbatim, incl. the end-of-turn token when it stopped)
  text str  reasoning str  answer str (split at </think>)  finish_reason str  has_think_end bool
  num_prompt_tokens int32  num_completion_tokens int32  messages str (JSON: prompt messages of this turn)
  tools str (JSON or "")  model str  revision str  run_hash str  engine_version str  request_seed int64
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import multiprocessing as mp
import os
import queue
import random
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from dflash.chat import template_kwargs
from dflash.config import GenerateParams, Params, as_dict
from dflash.io import config_hash, file_sha256, list_shards, read_arrow, read_json, write_arrow, write_json

log = logging.getLogger(__name__)

CRASH_ENV = "DFLASH_GENERATE_CRASH_UNIT"  # fault injection for tests: "<unit index>" -> worker dies on it

SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("conversation_id", pa.string()),
        ("turn_index", pa.int32()),
        ("status", pa.string()),
        ("skip_reason", pa.string()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("completion_ids", pa.list_(pa.int32())),
        ("text", pa.string()),
        ("reasoning", pa.string()),
        ("answer", pa.string()),
        ("finish_reason", pa.string()),
        ("has_think_end", pa.bool_()),
        ("num_prompt_tokens", pa.int32()),
        ("num_completion_tokens", pa.int32()),
        ("messages", pa.string()),
        ("tools", pa.string()),
        ("model", pa.string()),
        ("revision", pa.string()),
        ("run_hash", pa.string()),
        ("engine_version", pa.string()),
        ("request_seed", pa.int64()),
    ]
)


# ------------------------------------------------------------------------------- conversations


def load_conversations(path: str | Path) -> list[dict]:
    """Rows of the audit's conversations.arrow as dicts with parsed `messages` and `tools`."""
    table = read_arrow(path)
    for col in ("conversation_id", "messages", "tools"):
        if col not in table.column_names:
            raise ValueError(f"{path}: column {col!r} missing (is this the audit stage's conversations.arrow?)")
    out = []
    seen: dict[str, int] = {}
    for row, (cid, msgs, tools) in enumerate(
        zip(
            table["conversation_id"].to_pylist(), table["messages"].to_pylist(), table["tools"].to_pylist(), strict=True
        )
    ):
        if cid in seen:
            raise ValueError(
                f"{path}: conversation_id {cid} appears at rows {seen[cid]} and {row}; ids must be unique "
                "(the audit stage drops duplicates: re-run it rather than editing its output)"
            )
        seen[cid] = row
        out.append(
            {"conversation_id": cid, "messages": json.loads(msgs), "tools": json.loads(tools) if tools else None}
        )
    return out


def generation_targets(messages: list[dict]) -> list[int]:
    """Indices in `messages` where a regenerated assistant turn goes (see the module docstring).

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


def split_reasoning(tokenizer: Any, completion_ids: list[int], think_end_id: int | None) -> tuple[str, str, bool]:
    """(reasoning, answer, has_think_end) split at the </think> token of the sampled ids."""
    if think_end_id is not None and think_end_id in completion_ids:
        cut = completion_ids.index(think_end_id)
        reasoning = tokenizer.decode(completion_ids[:cut], skip_special_tokens=True)
        reasoning = reasoning.replace("<think>", "").strip("\n")
        answer = tokenizer.decode(completion_ids[cut + 1 :], skip_special_tokens=True).strip("\n")
        return reasoning, answer, True
    return "", tokenizer.decode(completion_ids, skip_special_tokens=True).strip("\n"), False


# ------------------------------------------------------------------------------- run identity


def run_identity(params: Params, target_info: dict, target_dir: str | Path) -> dict:
    """Everything that changes generated outputs (hashed into the run folder name)."""
    g = params.generate
    tdir = Path(target_dir)
    weights = sorted(tdir.glob("*.safetensors"))
    return {
        "model": target_info["model"] if target_info.get("source") != "tiny" else "tiny",
        "revision": target_info.get("revision", ""),
        "weights_sha": [file_sha256(w)[:16] for w in weights],
        "tokenizer_sha": [
            file_sha256(tdir / f)[:16] for f in ("tokenizer.json", "tokenizer_config.json") if (tdir / f).exists()
        ],
        "template_kwargs": template_kwargs(params.base.enable_thinking, params.base.chat_template_kwargs),
        "sampling": as_dict(g.sampling),
        "max_model_len": g.max_model_len,
        "dtype": g.dtype,
        "quantization": g.quantization,
    }


@dataclass
class Unit:
    index: int
    conversations: list[dict]
    name: str  # file name: keyed by the member ids, so a changed input never reuses a stale unit
    attempts: int = 0


def make_units(conversations: list[dict], unit_size: int) -> list[Unit]:
    units = []
    for k in range(0, len(conversations), unit_size):
        members = conversations[k : k + unit_size]
        key = hashlib.sha256("\n".join(c["conversation_id"] for c in members).encode()).hexdigest()[:10]
        idx = k // unit_size
        units.append(Unit(idx, members, f"unit-{idx:05d}-{key}.arrow"))
    return units


# ------------------------------------------------------------------------------- worker


@dataclass
class _ConvState:
    conv: dict
    targets: list[int]
    k: int = 0  # next target
    history: list[dict] = field(default_factory=list)
    pending: tuple | None = None  # (prompt ids, prompt messages JSON, request seed) of the request in flight


def _engine_kwargs(g: GenerateParams, model: str, revision: str, seed: int, trust_remote_code: bool) -> dict:
    kw = {
        "model": model,
        "tokenizer": model,
        "revision": revision or None,
        "dtype": g.dtype,
        "quantization": g.quantization or None,
        "tensor_parallel_size": g.tensor_parallel_size,
        "max_model_len": g.max_model_len,
        "max_num_seqs": g.max_num_seqs,
        "max_num_batched_tokens": g.max_num_batched_tokens,
        "gpu_memory_utilization": g.gpu_memory_utilization,
        "enable_prefix_caching": g.enable_prefix_caching,
        "enforce_eager": g.enforce_eager,
        "seed": seed,
        "trust_remote_code": trust_remote_code,
        "disable_log_stats": True,
    }
    return kw


def _worker_main(engine_index: int, cfg: dict, inbox: mp.Queue, outbox: mp.Queue) -> None:
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


def _worker_loop(engine_index: int, cfg: dict, inbox: mp.Queue, outbox: mp.Queue) -> None:
    devices = cfg["devices"]
    if devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = devices
    logging.basicConfig(level=logging.WARNING)
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm import __version__ as vllm_version
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    from dflash.chat import render_ids

    g: GenerateParams = cfg["gparams"]
    t0 = time.time()
    tokenizer = AutoTokenizer.from_pretrained(
        cfg["model"], trust_remote_code=cfg["trust_remote_code"], revision=cfg["revision"] or None
    )
    llm = LLM(**_engine_kwargs(g, cfg["model"], cfg["revision"], cfg["seed"], cfg["trust_remote_code"]))
    engine = llm.llm_engine
    outbox.put(("ready", engine_index, time.time() - t0))
    think_end = tokenizer.convert_tokens_to_ids("</think>")
    think_end = think_end if isinstance(think_end, int) and think_end != tokenizer.unk_token_id else None
    s = g.sampling
    tkw = cfg["template_kwargs"]
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
            "model": cfg["model_name"],
            "revision": cfg["revision"],
            "run_hash": cfg["run_hash"],
            "engine_version": vllm_version,
            "request_seed": 0,
        }
        base.update(kw)
        return base

    def record(uidx: int, r: dict) -> None:
        units[uidx]["rows"].append(r)
        outbox.put(("progress", engine_index, 1, r["num_completion_tokens"]))

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
        outbox.put(("started", engine_index, unit.index))
        for conv in unit.conversations:
            advance(unit.index, _ConvState(conv, generation_targets(conv["messages"])))

    def commit_finished() -> None:
        for uidx in [i for i, u in units.items() if u["pending"] == 0]:
            u = units.pop(uidx)
            order = {c["conversation_id"]: i for i, c in enumerate(u["unit"].conversations)}
            rows = sorted(u["rows"], key=lambda r: (order[r["conversation_id"]], r["turn_index"]))
            table = pa.Table.from_pylist(rows, schema=SCHEMA)
            write_arrow(Path(cfg["run_dir"]) / u["unit"].name, table)
            done = [r for r in rows if r["status"] == "completed"]
            outbox.put(
                (
                    "unit_done",
                    engine_index,
                    uidx,
                    {"prompts": len(rows), "output_tokens": sum(r["num_completion_tokens"] for r in done)},
                )
            )

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
    outbox.put(("exit", engine_index, None))
    _shutdown(engine, outbox, 0)


def _shutdown(engine: Any, outbox: mp.Queue, code: int) -> None:
    """Stop the engine and its processes, flush our messages, and exit without multiprocessing's exit
    hook (which would wait forever on vLLM's engine-core children)."""
    import psutil

    with contextlib.suppress(Exception):  # already dead: the kill below cleans up
        engine.engine_core.shutdown()
    for child in psutil.Process().children(recursive=True):
        child.kill()
    outbox.close()
    outbox.join_thread()
    os._exit(code)


# ------------------------------------------------------------------------------- dispatcher


def _kill_tree(pid: int) -> None:
    """Kill a worker and every process it started (vLLM engine cores), so nothing is left running."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(procs, timeout=10)


def _device_groups(num_engines: int, tp: int) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES for each engine (None on CPU machines: nothing to pin)."""
    try:
        import torch

        n = torch.cuda.device_count()
    except Exception:
        n = 0
    if n == 0:
        return [None] * num_engines
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",")] if visible else [str(i) for i in range(n)]
    if len(ids) < num_engines * tp:
        raise ValueError(
            f"generate.num_engines={num_engines} x generate.tensor_parallel_size={tp} needs "
            f"{num_engines * tp} GPUs, {len(ids)} visible"
        )
    return [",".join(ids[i * tp : (i + 1) * tp]) for i in range(num_engines)]


def _progress_bars(total: int, num_engines: int, initial: int):
    from tqdm import tqdm

    interactive = sys.stderr.isatty()
    kw = {"mininterval": 0.5 if interactive else 10.0, "dynamic_ncols": True}
    bar = tqdm(total=total, initial=initial, desc="generate (all)", unit="prompt", position=0, **kw)
    engines = [
        tqdm(total=None, desc=f"  engine {i}", unit="prompt", position=i + 1, leave=False, **kw)
        for i in range(num_engines)
    ]
    return bar, engines


def dispatch(units: list[Unit], cfg: dict, g: GenerateParams, total_prompts: int, done_prompts: int) -> dict:
    """Run `units` over `g.num_engines` workers; return timing, per-engine and failure stats."""
    ctx = mp.get_context("spawn")
    outbox = ctx.Queue()
    pending = list(units)  # front = next; suspects (retries) go to the front and run alone
    workers: dict[int, dict] = {}
    failed: list[dict] = []
    stats = {
        "engine_start_s": [],
        "per_engine": {
            i: {"prompts": 0, "output_tokens": 0, "ready_at": None, "last_done": None} for i in range(g.num_engines)
        },
    }
    devices = _device_groups(g.num_engines, g.tensor_parallel_size)
    bar, engine_bars = _progress_bars(total_prompts, g.num_engines, done_prompts)
    t_start = time.time()
    tokens = 0
    first_ready = None
    start_failures = 0

    def spawn(i: int) -> None:
        inbox = ctx.Queue()
        # Not daemonic: vLLM starts its own engine-core processes, which daemonic processes may not.
        proc = ctx.Process(target=_worker_main, args=(i, {**cfg, "devices": devices[i]}, inbox, outbox))
        proc.start()
        workers[i] = {"proc": proc, "inbox": inbox, "held": {}, "ready": False, "alone": False, "closed": False}

    def feed(i: int) -> None:
        w = workers[i]
        if not w["ready"] or w["closed"]:
            return
        while pending and len(w["held"]) < 2 and not w["alone"]:
            unit = pending[0]
            if unit.attempts > 0 and w["held"]:
                break  # a suspect unit runs alone
            pending.pop(0)
            w["held"][unit.index] = unit
            w["alone"] = unit.attempts > 0
            w["inbox"].put(unit)
        if not pending and not w["held"]:
            w["inbox"].put(None)
            w["closed"] = True

    for i in range(g.num_engines):
        spawn(i)
    try:
        while workers:
            try:
                msg = outbox.get(timeout=1.0)
            except queue.Empty:
                msg = None
            if msg is not None:
                kind, i = msg[0], msg[1]
                if kind == "ready":
                    workers[i]["ready"] = True
                    stats["engine_start_s"].append(round(msg[2], 2))
                    stats["per_engine"][i]["ready_at"] = time.time()
                    first_ready = first_ready or time.time()
                elif kind == "progress":
                    bar.update(msg[2])
                    engine_bars[i].update(msg[2])
                    tokens += msg[3]
                    stats["per_engine"][i]["prompts"] += msg[2]
                    stats["per_engine"][i]["output_tokens"] += msg[3]
                    elapsed = max(1e-9, time.time() - (first_ready or t_start))
                    bar.set_postfix_str(f"{tokens / elapsed:.0f} tok/s", refresh=False)
                elif kind == "unit_done":
                    unit = workers[i]["held"].pop(msg[2])
                    workers[i]["alone"] = False
                    stats["per_engine"][i]["last_done"] = time.time()
                    if unit.attempts > 0:
                        log.info("unit %d succeeded on retry %d", unit.index, unit.attempts)
                elif kind == "exit":
                    workers[i]["proc"].join(timeout=60)
                    del workers[i]
                    continue
            # Dead workers: retry their units alone, or give up on them.
            for i, w in list(workers.items()):
                if w["proc"].is_alive() or w["proc"].exitcode == 0:
                    continue
                code = w["proc"].exitcode
                held = list(w["held"].values())
                log.warning("engine %d died (exit code %s) holding units %s", i, code, [u.index for u in held])
                _kill_tree(w["proc"].pid)
                del workers[i]
                if not w["ready"]:
                    start_failures += 1
                    if start_failures > g.max_unit_retries:
                        raise RuntimeError(
                            f"vLLM engine failed to start {start_failures} times (last exit code {code}); "
                            "see the engine log above (model path, memory: generate.gpu_memory_utilization)"
                        )
                for unit in held:
                    unit.attempts += 1
                    if unit.attempts > g.max_unit_retries:
                        failed.append(
                            {"unit": unit.index, "name": unit.name, "attempts": unit.attempts, "exit_code": code}
                        )
                    else:
                        pending.insert(0, unit)
                if pending:
                    spawn(i)
            for i in list(workers):
                feed(i)
            if not workers and pending:  # every worker gone with work left (cannot happen unless spawn failed)
                raise RuntimeError("all generate workers exited with work pending")
    finally:
        for w in workers.values():
            _kill_tree(w["proc"].pid)
        bar.close()
        for b in engine_bars:
            b.close()
    stats["failed_units"] = failed
    stats["tokens_this_session"] = tokens
    stats["gen_wall_s"] = time.time() - (first_ready or t_start)
    stats["wall_s"] = time.time() - t_start
    return stats


# ------------------------------------------------------------------------------- stage


def _worker_cfg(params: Params, run_dir: Path, run_hash: str, info: dict) -> dict:
    return {
        "gparams": params.generate,
        "model": info["model"],
        "model_name": info["model"] if info.get("source") != "tiny" else f"tiny:{info['model']}",
        "revision": info.get("revision", ""),
        "seed": params.base.seed,
        "trust_remote_code": params.base.trust_remote_code,
        "template_kwargs": template_kwargs(params.base.enable_thinking, params.base.chat_template_kwargs),
        "run_dir": str(run_dir),
        "run_hash": run_hash,
    }


def _percentile(values: list[int], q: float) -> float:
    if not values:
        return 0.0
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def summarize(run_dir: Path, units: list[Unit], failed: list[dict]) -> dict:
    """Counts over the committed shards of this run (reused + new)."""
    wanted = {u.name for u in units}
    failed_names = {f["name"] for f in failed}
    rows = []
    for shard in list_shards(run_dir, "unit-*.arrow"):
        if shard.name in wanted:
            rows.extend(
                read_arrow(shard)
                .select(
                    [
                        "status",
                        "skip_reason",
                        "finish_reason",
                        "num_completion_tokens",
                        "num_prompt_tokens",
                        "has_think_end",
                    ]
                )
                .to_pylist()
            )
    completed = [r for r in rows if r["status"] == "completed"]
    out_lens = [r["num_completion_tokens"] for r in completed]
    reasons: dict[str, int] = {}
    for r in rows:
        if r["status"] == "skipped":
            reasons[r["skip_reason"]] = reasons.get(r["skip_reason"], 0) + 1
    n_failed = sum(count_prompts(u.conversations) for u in units if u.name in failed_names)
    return {
        "num_completed": len(completed),
        "num_skipped": len(rows) - len(completed),
        "num_failed": n_failed,
        "skipped_by_reason": reasons,
        "output_tokens": sum(out_lens),
        "prompt_tokens": sum(r["num_prompt_tokens"] for r in completed),
        "finish_length_frac": round(sum(r["finish_reason"] == "length" for r in completed) / max(1, len(completed)), 4),
        "missing_think_end_frac": round(sum(not r["has_think_end"] for r in completed) / max(1, len(completed)), 4),
        "mean_output_tokens": round(sum(out_lens) / max(1, len(out_lens)), 2),
        "p50_output_tokens": _percentile(out_lens, 0.5),
        "p90_output_tokens": _percentile(out_lens, 0.9),
        "p99_output_tokens": _percentile(out_lens, 0.99),
        "output_lengths": out_lens,
    }


def run(params: Params, pilot: bool = False) -> dict:
    """The generate stage (or its pilot). Returns the metrics written to reports/."""
    from dflash.target import resolve

    g = params.generate
    info = resolve(params.base.target_dir)
    source = Path(params.audit.out) / "conversations.arrow"
    conversations = load_conversations(source)
    if pilot:
        if g.pilot_samples <= 0:
            raise ValueError("generate.pilot_samples: must be > 0 for a pilot run")
        rng = random.Random(params.base.seed)
        conversations = rng.sample(conversations, min(g.pilot_samples, len(conversations)))
    identity = run_identity(params, info, params.base.target_dir)
    run_hash = config_hash(identity)
    out_root = Path(g.pilot_out if pilot else g.out)
    run_dir = out_root / f"run-{run_hash}"
    if pilot and run_dir.exists():
        shutil.rmtree(run_dir)  # a pilot measures speed: always from scratch
    run_dir.mkdir(parents=True, exist_ok=True)
    for tmp in run_dir.glob(".*.tmp"):
        tmp.unlink()  # half-written shards of a killed run
    write_json(run_dir / "identity.json", identity)

    units = make_units(conversations, g.unit_size)
    wanted = {u.name for u in units}
    for stale in list_shards(run_dir, "unit-*.arrow"):
        if stale.name not in wanted:
            stale.unlink()  # same run hash but different input: not part of this run
    todo = [u for u in units if not (run_dir / u.name).exists()]
    total = count_prompts(conversations)
    done_prompts = total - count_prompts([c for u in todo for c in u.conversations])
    log.info(
        "generate: %d conversations, %d prompts, %d units (%d already done) -> %s",
        len(conversations),
        total,
        len(units),
        len(units) - len(todo),
        run_dir,
    )
    stats: dict[str, Any] = {
        "failed_units": [],
        "engine_start_s": [],
        "gen_wall_s": 0.0,
        "wall_s": 0.0,
        "tokens_this_session": 0,
        "per_engine": {},
    }
    if todo:
        stats = dispatch(todo, _worker_cfg(params, run_dir, run_hash, info), g, total, done_prompts)
    summary = summarize(run_dir, units, stats["failed_units"])
    lengths = summary.pop("output_lengths")
    metrics: dict[str, Any] = {
        "num_prompts": total,
        **summary,
        "output_tokens_per_s": round(stats["tokens_this_session"] / stats["gen_wall_s"], 2)
        if stats["gen_wall_s"]
        else None,
        "num_conversations": len(conversations),
        "num_units": len(units),
        "units_reused": len(units) - len(todo),
        "units_failed": stats["failed_units"],
        "num_engines": g.num_engines,
        "engine_start_s": stats["engine_start_s"],
        "generation_wall_s": round(stats["gen_wall_s"], 2),
        "stage_wall_s": round(stats["wall_s"], 2),
        "run_dir": str(run_dir),
        "run_hash": run_hash,
    }
    accounted = metrics["num_completed"] + metrics["num_skipped"] + metrics["num_failed"]
    assert accounted == total, f"generate accounting: {accounted} != {total} prompts"
    if pilot:
        metrics = pilot_report(
            metrics,
            stats,
            lengths,
            num_input_prompts=count_prompts(load_conversations(source)),
            g=g,
            seed=params.base.seed,
        )
        write_json(Path(params.base.reports_dir) / "pilot.json", metrics)
    else:
        write_json(Path(params.base.reports_dir) / "generate.json", metrics)
        if not stats["failed_units"]:
            write_json(
                out_root / "current.json", {"run_dir": run_dir.name, "run_hash": run_hash, "num_units": len(units)}
            )
    return metrics


def pilot_report(
    metrics: dict, stats: dict, lengths: list[int], num_input_prompts: int, g: GenerateParams, seed: int
) -> dict:
    """Throughput + output-length distribution of the pilot, extrapolated to the full input."""
    rng = random.Random(seed)
    n = len(lengths)
    means = sorted(sum(rng.choice(lengths) for _ in range(n)) / n for _ in range(1000)) if n else [0.0]
    tok_s = metrics["output_tokens_per_s"] or 0.0
    mean = sum(lengths) / max(1, n)
    total_tokens = mean * num_input_prompts
    per_engine = {}
    for i, e in stats.get("per_engine", {}).items():
        span = (e["last_done"] or 0) - (e["ready_at"] or 0)
        per_engine[str(i)] = {
            "prompts": e["prompts"],
            "output_tokens": e["output_tokens"],
            "output_tokens_per_s": round(e["output_tokens"] / span, 2) if span > 0 else None,
        }
    prompt_tok_s = metrics["prompt_tokens"] / metrics["generation_wall_s"] if metrics["generation_wall_s"] else None

    def hours(tokens: float) -> float | None:
        return round(tokens / tok_s / 3600, 4) if tok_s else None

    return {
        "pilot_prompts": metrics["num_prompts"],
        "num_completed": metrics["num_completed"],
        "num_skipped": metrics["num_skipped"],
        "num_failed": metrics["num_failed"],
        "units_failed": metrics["units_failed"],
        "num_engines": g.num_engines,
        "output_tokens_per_s": tok_s,
        "prompt_tokens_per_s": round(prompt_tok_s, 2) if prompt_tok_s else None,
        "per_engine": per_engine,
        "mean_output_tokens": round(mean, 2),
        "p10_output_tokens": _percentile(lengths, 0.1),
        "p50_output_tokens": metrics["p50_output_tokens"],
        "p90_output_tokens": metrics["p90_output_tokens"],
        "p99_output_tokens": metrics["p99_output_tokens"],
        "finish_length_frac": metrics["finish_length_frac"],
        "missing_think_end_frac": metrics["missing_think_end_frac"],
        "full_run_prompts": num_input_prompts,
        "estimated_total_output_tokens": round(total_tokens),
        "estimated_total_output_tokens_p10_p90": [
            round(means[100] * num_input_prompts),
            round(means[900] * num_input_prompts),
        ],
        "estimated_total_hours": hours(total_tokens),
        "estimated_total_hours_p10_p90": [hours(means[100] * num_input_prompts), hours(means[900] * num_input_prompts)],
        "note": "wall time assumes the full run uses the same engines and hardware as the pilot; "
        "the plan stage rescales it to other hardware",
        "engine_start_s": metrics["engine_start_s"],
        "generation_wall_s": metrics["generation_wall_s"],
        "sampling_max_tokens": g.sampling.max_tokens,
    }


def current_run_dir(out: str | Path) -> Path:
    """The run folder the last successful full generate run committed (read by tokenize)."""
    out = Path(out)
    info = read_json(out / "current.json")
    return out / info["run_dir"]
