"""Decoding speed measured side by side: engine configurations kept alive in their own worker processes and run
in interleaved rounds (A B C A B C ...) on the same prompts, so that the machine's load of the moment weighs on
every configuration alike and a speedup is a ratio of runs measured next to each other.

Shared by the eval stage (its `speedup`: the trained drafter's engine against plain decoding, dflash/eval/stage.py)
and benchmarks/spec_speedup.py (plain, the trained drafter, n-gram and a second drafter, at several
concurrencies).

One worker per configuration (`SpeedEngine`): it starts vLLM once, warms it up, then answers run requests over a
pipe, so only one engine computes at a time while the others wait. A run submits the prompts with at most
`concurrency` requests in flight and steps the engine until all finish. Around each run it reads, from wall-clock
hooks on vLLM's model runner (installed through `LLM.collective_rpc`, so they work with the engine core in or out
of the worker): the time in the target's forward passes (`_model_forward`: prefill and, with speculation, the
verification of the drafted tokens), in drafting (`propose_draft_token_ids`: the drafter's forward and its
logits, or the n-gram lookup) and, inside drafting, in the drafter's `compute_logits` (its lm_head over the draft
vocabulary). The rest of an engine step (scheduling, sampling and rejection, input preparation, output handling)
is the step's wall time minus those. On a CPU the hooks' times are the computation's (no asynchronous kernels).

Aggregation (`summarize`): per configuration the min and median over rounds of output tokens/s and of ms per
output token; the speedup of a configuration is the median over rounds of its rate / the baseline's rate in the
same round (min and max beside it).

vLLM is imported inside the worker processes only.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from dflash.core.errors import UserError
from dflash.core.processes import kill_tree, place_engine_core, shutdown_engine
from dflash.eval.engines import WARMUP_TOKENS, request_sampling

TIMERS = ("target_forward_s", "drafting_s", "draft_logits_s")


# ------------------------------------------------------------------------------------------ the order


def interleaved_order(names: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, configuration) in the order they run: every configuration once per round, in the given order."""
    if rounds < 1:
        raise UserError(f"speed rounds: need at least 1, got {rounds}")
    if not names or len(set(names)) != len(names):
        raise UserError(f"speed configurations: need distinct names, got {names}")
    return [(r, name) for r in range(rounds) for name in names]


# ------------------------------------------------------------------------------------------ results


@dataclass(frozen=True)
class StepTimes:
    """Seconds a run spent, from the model runner's hooks and the step loop's clock."""

    steps: int  # engine steps
    step_s: float  # wall time of all engine steps
    target_forward_s: float  # the target's forward passes (prefill, decode / verification)
    drafting_s: float  # propose_draft_token_ids: the drafter (or n-gram lookup), its logits included
    draft_logits_s: float  # of drafting: the drafter's compute_logits (its lm_head)

    @property
    def rest_s(self) -> float:
        return max(0.0, self.step_s - self.target_forward_s - self.drafting_s)


@dataclass(frozen=True)
class RunResult:
    """One timed run of one configuration in one round."""

    name: str
    round: int
    concurrency: int
    output_tokens: int
    wall_s: float
    times: StepTimes
    tokens: list[list[int]] = field(repr=False)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def ms_per_token(self) -> float:
        return 1e3 * self.wall_s / self.output_tokens if self.output_tokens else float("inf")


@dataclass(frozen=True)
class Spread:
    min: float
    median: float
    max: float


def spread(values: list[float]) -> Spread:
    if not values:
        raise ValueError("spread of no values")
    return Spread(min=min(values), median=statistics.median(values), max=max(values))


@dataclass(frozen=True)
class SpeedSummary:
    """One configuration over every round at one concurrency."""

    name: str
    concurrency: int
    rounds: int
    tokens_per_s: Spread
    ms_per_token: Spread
    speedup: Spread | None  # rate / the baseline's rate in the same round (None for the baseline, or none given)
    output_tokens: int  # of one round (the first)
    breakdown_ms_per_step: dict[str, float]  # target_forward / drafting / draft_logits / rest / step, mean per step
    tokens_per_step: float  # output tokens per engine step (mean over rounds)

    def to_json(self) -> dict:
        return asdict(self)


def summarize(results: list[RunResult], baseline: str | None = None) -> dict[str, SpeedSummary]:
    """Per configuration (at one concurrency): the spread of rates over rounds, the paired speedup against
    `baseline` and the mean step-time breakdown. Every configuration must have run in the baseline's rounds."""
    concurrencies = {r.concurrency for r in results}
    if len(concurrencies) > 1:
        raise ValueError(f"summarize one concurrency at a time, got {sorted(concurrencies)}")
    by_name: dict[str, list[RunResult]] = {}
    for r in results:
        by_name.setdefault(r.name, []).append(r)
    base = {r.round: r for r in by_name.get(baseline, [])} if baseline else {}
    if baseline and not base:
        raise ValueError(f"baseline {baseline!r} has no runs")
    out = {}
    for name, runs in by_name.items():
        ratios = None
        if baseline and name != baseline:
            missing = [r.round for r in runs if r.round not in base]
            if missing:
                raise ValueError(f"{name}: rounds {missing} have no {baseline} run to pair with")
            ratios = spread([r.tokens_per_s / base[r.round].tokens_per_s for r in runs])
        steps = sum(r.times.steps for r in runs) or 1
        breakdown = {
            "target_forward": sum(r.times.target_forward_s for r in runs),
            "drafting": sum(r.times.drafting_s for r in runs),
            "draft_logits": sum(r.times.draft_logits_s for r in runs),
            "rest": sum(r.times.rest_s for r in runs),
            "step": sum(r.times.step_s for r in runs),
        }
        out[name] = SpeedSummary(
            name=name,
            concurrency=runs[0].concurrency,
            rounds=len(runs),
            tokens_per_s=spread([r.tokens_per_s for r in runs]),
            ms_per_token=spread([r.ms_per_token for r in runs]),
            speedup=ratios,
            output_tokens=runs[0].output_tokens,
            breakdown_ms_per_step={k: 1e3 * v / steps for k, v in breakdown.items()},
            tokens_per_step=sum(r.output_tokens for r in runs) / steps,
        )
    return out


# ------------------------------------------------------------------------------------------ inside the worker


def _timed(fn: Callable, timers: dict, key: str) -> Callable:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            timers[key] += time.perf_counter() - t0

    return wrapper


def install_timers(worker: Any) -> bool:
    """collective_rpc callable (runs in vLLM's worker): wrap the model runner's target forward, its drafting and
    the drafter's compute_logits with wall-clock accumulators. True when the drafting hooks found a drafter."""
    runner = worker.model_runner
    timers = dict.fromkeys(TIMERS, 0.0)
    runner._dflash_speed_timers = timers
    runner._model_forward = _timed(runner._model_forward, timers, "target_forward_s")
    runner.propose_draft_token_ids = _timed(runner.propose_draft_token_ids, timers, "drafting_s")
    model = getattr(getattr(runner, "drafter", None), "model", None)
    if model is not None and hasattr(model, "compute_logits"):
        model.compute_logits = _timed(model.compute_logits, timers, "draft_logits_s")
        return True
    return False


def read_timers(worker: Any) -> dict:
    """collective_rpc callable: the accumulated seconds so far."""
    return dict(worker.model_runner._dflash_speed_timers)


def _run(llm: Any, prompts: list[list[int]], sampling: list[Any], concurrency: int, prefix: str) -> dict:
    """Keep at most `concurrency` requests in flight until every prompt finished; count steps and their time."""
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    tokens: list[list[int]] = [[] for _ in prompts]
    pending = list(range(len(prompts)))[::-1]
    in_flight, steps, step_s = 0, 0, 0.0
    while pending or engine.has_unfinished_requests():
        while pending and in_flight < concurrency:
            i = pending.pop()
            engine.add_request(f"{prefix}{i}", TokensPrompt(prompt_token_ids=prompts[i]), sampling[i])
            in_flight += 1
        t0 = time.perf_counter()
        outs = engine.step()
        step_s += time.perf_counter() - t0
        steps += 1
        for out in outs:
            tokens[int(out.request_id.removeprefix(prefix))] += list(out.outputs[0].token_ids)
            if out.finished:
                in_flight -= 1
    return {"tokens": tokens, "steps": steps, "step_s": step_s}


def _serve(cfg: dict, conn: Any) -> None:
    """Worker process: one engine, warmed up, answering ("run", request) until ("stop", None)."""
    logging.basicConfig(level=logging.WARNING)
    place_engine_core(cfg["engine_core_process"])
    llm, code = None, 0
    try:
        from vllm import LLM

        llm = LLM(**cfg["engine_kwargs"])
        llm.collective_rpc(install_timers)
        _run(llm, [cfg["warmup_prompt"]], [request_sampling(cfg, WARMUP_TOKENS, 0)], 1, "warmup-")
        conn.send(("ready", None))
        count = 0
        while True:
            kind, req = conn.recv()
            if kind == "stop":
                break
            count += 1
            before = llm.collective_rpc(read_timers)[0]
            seeds = [request_sampling(cfg, cfg["max_tokens"], cfg["seed"] + i) for i in range(len(req["prompts"]))]
            t0 = time.perf_counter()
            run = _run(llm, req["prompts"], seeds, req["concurrency"], f"r{count}-")
            wall = time.perf_counter() - t0
            after = llm.collective_rpc(read_timers)[0]
            conn.send(("done", {**run, "wall_s": wall, **{k: after[k] - before[k] for k in TIMERS}}))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        code = 1
    shutdown_engine(llm.llm_engine if llm is not None else None, conn, code)


# ------------------------------------------------------------------------------------------ the parent's side


class SpeedEngine:
    """One configuration's worker: `start()` (waits until its engine is warm), `run(...)`, `close()`.
    `cfg`: engine_kwargs (dflash.eval.engines.engine_kwargs), temperature, stop_ids, max_tokens, seed,
    engine_core_process and warmup_prompt (token ids)."""

    def __init__(self, name: str, cfg: dict, timeout_s: float):
        self.name, self.cfg, self.timeout_s = name, cfg, timeout_s
        self.proc: Any = None
        self.conn: Any = None
        self.start_s: float | None = None

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        # Not daemonic: vLLM starts its own engine-core processes, which daemonic processes may not.
        self.proc = ctx.Process(target=_serve, args=(self.cfg, child), name=f"speed-{self.name}")
        t0 = time.perf_counter()
        self.proc.start()
        self._answer("ready")
        self.start_s = time.perf_counter() - t0

    def _answer(self, want: str) -> Any:
        deadline = time.time() + self.timeout_s
        while not self.conn.poll(1.0):
            if not self.proc.is_alive():
                raise RuntimeError(f"speed engine {self.name!r} died (exit code {self.proc.exitcode}); see its log")
            if time.time() > deadline:
                raise UserError(f"speed engine {self.name!r}: no answer within {self.timeout_s:g} s")
        kind, payload = self.conn.recv()
        if kind == "error":
            raise RuntimeError(f"speed engine {self.name!r} failed:\n{payload}")
        if kind != want:
            raise RuntimeError(f"speed engine {self.name!r}: expected {want!r}, got {kind!r}")
        return payload

    def run(self, prompts: list[list[int]], concurrency: int, round_index: int) -> RunResult:
        self.conn.send(("run", {"prompts": prompts, "concurrency": concurrency}))
        r = self._answer("done")
        times = StepTimes(
            steps=r["steps"],
            step_s=r["step_s"],
            target_forward_s=r["target_forward_s"],
            drafting_s=r["drafting_s"],
            draft_logits_s=r["draft_logits_s"],
        )
        return RunResult(
            name=self.name,
            round=round_index,
            concurrency=concurrency,
            output_tokens=sum(len(t) for t in r["tokens"]),
            wall_s=r["wall_s"],
            times=times,
            tokens=r["tokens"],
        )

    def close(self) -> None:
        if self.proc is None:
            return
        try:
            if self.proc.is_alive():
                self.conn.send(("stop", None))
                self.proc.join(timeout=60)
        finally:
            kill_tree(self.proc.pid)
            self.proc = None


def measure(
    engines: dict[str, SpeedEngine],
    prompts: list[list[int]],
    rounds: int,
    concurrency: int,
    on_run: Callable[[RunResult], None] = lambda r: None,
) -> list[RunResult]:
    """Every started engine once per round, in interleaved order, on the same prompts at one concurrency."""
    results = []
    for r, name in interleaved_order(list(engines), rounds):
        result = engines[name].run(prompts, concurrency, r)
        on_run(result)
        results.append(result)
    return results


@dataclass(frozen=True)
class SpeedSetup:
    """What every configuration of one measurement shares (the eval's sampling settings and stop ids)."""

    temperature: float
    stop_ids: list[int]
    max_tokens: int
    seed: int
    engine_core_process: bool
    timeout_s: float


def run_interleaved(
    engine_kwargs: dict[str, dict],
    setup: SpeedSetup,
    prompts: list[list[int]],
    rounds: int,
    concurrencies: list[int],
    on_run: Callable[[RunResult], None] = lambda r: None,
) -> tuple[list[RunResult], dict[str, float]]:
    """Start one worker per configuration (`engine_kwargs`: name -> vLLM LLM kwargs), run `rounds` interleaved
    rounds at each concurrency in turn, stop every worker. Returns the runs and each engine's start seconds."""
    engines = {
        name: SpeedEngine(
            name,
            {
                "engine_kwargs": kw,
                "temperature": setup.temperature,
                "stop_ids": setup.stop_ids,
                "max_tokens": setup.max_tokens,
                "seed": setup.seed,
                "engine_core_process": setup.engine_core_process,
                "warmup_prompt": prompts[0],
            },
            setup.timeout_s,
        )
        for name, kw in engine_kwargs.items()
    }
    results: list[RunResult] = []
    try:
        for engine in engines.values():
            engine.start()
        for c in concurrencies:
            results += measure(engines, prompts, rounds, c, on_run)
    finally:
        for engine in engines.values():
            engine.close()
    return results, {name: e.start_s or 0.0 for name, e in engines.items()}


def eval_speedup(
    e: Any, engine_kwargs: dict[str, dict], prompts: list[list[int]], stop_ids: list[int], seed: int
) -> dict[str, dict]:
    """The eval stage's speedup (eval.speed_rounds rounds of plain decoding and the trained drafter, interleaved, on
    the first eval.speed_prompts held-out prompts at eval.max_num_seqs): per configuration its summary as JSON, the
    drafter's `speedup` the paired median."""
    setup = SpeedSetup(
        temperature=e.temperature,
        stop_ids=stop_ids,
        max_tokens=e.max_tokens,
        seed=seed,
        engine_core_process=e.engine_core_process,
        timeout_s=e.engine_timeout_s,
    )
    chosen = prompts[: e.speed_prompts] if e.speed_prompts else prompts
    results, starts = run_interleaved(engine_kwargs, setup, chosen, e.speed_rounds, [e.max_num_seqs])
    summaries = summarize(results, baseline="none")
    return {
        name: {**s.to_json(), "num_prompts": len(chosen), "engine_start_s": starts[name]}
        for name, s in summaries.items()
    }
