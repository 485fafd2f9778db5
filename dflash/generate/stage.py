"""Generate: regenerate every assistant turn with the target itself through real vLLM.

Inputs: `${audit.out}/conversations.arrow` (normalized conversations, written by the audit stage) and
the target (`${base.target_dir}/target.json`). Outputs: `${generate.out}/run-<hash>/unit-*.arrow`
(one Arrow shard per work unit), `${generate.out}/current.json` (which run is current), metrics
`reports/generate.json` (headline) + `reports/generate_details.json`; in pilot mode `${generate.pilot_out}/...`
and `reports/pilot.json` + `reports/pilot_details.json`.

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
- Data parallel, two backends. `engines`: `num_engines` worker processes, each owning one vLLM engine
  pinned to its devices (CUDA_VISIBLE_DEVICES; `tensor_parallel_size` devices each). The main process is
  the dispatcher (dflash/generate/engines_backend.py): it hands each worker whole work units (chunks of
  `unit_size` conversations) over the worker's own inbox, a few at a time so that its engine's batch stays
  full across unit boundaries; each worker streams requests through its engine (`LLMEngine.add_request` /
  `step`), so a multi-turn conversation's next turn is submitted the moment its previous turn finishes.
  `servers`: one asynchronous client process sends every turn to OpenAI-compatible servers (listed in
  `server_urls`, or `num_engines` local ones), at most `max_num_seqs` in flight per server
  (dflash/generate/servers_backend.py).
- Resumable, nothing lost or duplicated: a unit's shard is written atomically (temp file + rename)
  only when all its conversations are done; the run folder name hashes everything that changes
  outputs (model + weights hash, tokenizer/template, template kwargs, sampling, max_model_len, dtype,
  quantization), so stale shards never mix in; a restart skips units whose shard exists. Requests
  carry a seed derived from the sample id, so a resumed run reproduces the same outputs.
- Failures are one turn wide. Servers backend: every reply is validated before it is stored (token ids
  inside the target's vocabulary, at most max_tokens, a known finish reason); a server whose requests keep
  failing is quarantined and its requests move to the others; a request that fails on `request_retries` + 1
  tries (on different servers when there are) is a failed turn. Engines backend: an engine death loses no
  finished row, and a unit whose engine dies twice is searched for the request that kills it, which becomes
  the failed turn. A failed turn is a row with status `failed` (reason in `skip_reason`); its conversation's
  later turns are skipped (`earlier_turn_failed`) and the rest of its unit is committed. A rerun re-opens the
  shards that hold failed turns and asks for exactly those turns (and the turns they had skipped). Prompts
  longer than the context and empty prompts are recorded as skipped, never a crash. `completed + skipped +
  failed == prompts` in reports/generate.json (failed turns counted by reason); the stage fails at the end if
  anything failed, saying what, and `current.json` names the run only when nothing did.

Data contract: one row per regenerated turn, GENERATED_SCHEMA in dflash/core/contracts.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.core.chat import template_kwargs
from dflash.core.concurrency import resolve_max_num_seqs
from dflash.core.contracts import CONVERSATIONS_FILE, CURRENT_RUN_FILE
from dflash.core.errors import UserError
from dflash.core.io import config_hash, file_sha256, list_shards, read_arrow, write_json
from dflash.core.loader import as_dict
from dflash.core.metrics import write_metrics
from dflash.core.params import Params
from dflash.core.target_config import check_cpu_hybrid, load_target_arch, resolve, target_signature
from dflash.core.validate import check_generate
from dflash.generate.contract import DispatchResult, Unit, WorkerConfig, count_prompts
from dflash.generate.engines_backend import run_engines
from dflash.generate.pilot import PILOT_HEADLINE, percentile, pilot_report
from dflash.generate.servers_backend import run_servers, server_kwargs
from dflash.generate.sweep import run_sweep
from dflash.generate.turns import FAILED, resumable

log = logging.getLogger(__name__)

HEADLINE = (  # reports/generate.json, the DVC metrics (everything else: reports/generate_details.json)
    "num_prompts",
    "num_completed",
    "num_skipped",
    "num_failed",
    "failed_by_reason",
    "output_tokens",
    "output_tokens_per_s",
    "mean_output_tokens",
    "p90_output_tokens",
    "finish_length_frac",
    "missing_think_end_frac",
    "target_signature",
)

# ------------------------------------------------------------------------------- conversations


def load_conversations(path: str | Path) -> list[dict]:
    """Rows of the audit's conversations.arrow as dicts with parsed `messages` and `tools`."""
    if not Path(path).exists():
        raise UserError(f"{path}: missing; run the audit stage first (dvc repro audit)")
    table = read_arrow(path)
    for col in ("conversation_id", "messages", "tools"):
        if col not in table.column_names:
            raise UserError(f"{path}: column {col!r} missing (is this the audit stage's conversations.arrow?)")
    out = []
    seen: dict[str, int] = {}
    for row, (cid, msgs, tools) in enumerate(
        zip(
            table["conversation_id"].to_pylist(), table["messages"].to_pylist(), table["tools"].to_pylist(), strict=True
        )
    ):
        if cid in seen:
            raise UserError(
                f"{path}: conversation_id {cid} appears at rows {seen[cid]} and {row}; ids must be unique "
                "(the audit stage drops duplicates: re-run it rather than editing its output)"
            )
        seen[cid] = row
        out.append(
            {"conversation_id": cid, "messages": json.loads(msgs), "tools": json.loads(tools) if tools else None}
        )
    return out


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


def make_units(conversations: list[dict], unit_size: int) -> list[Unit]:
    units = []
    for k in range(0, len(conversations), unit_size):
        members = conversations[k : k + unit_size]
        key = hashlib.sha256("\n".join(c["conversation_id"] for c in members).encode()).hexdigest()[:10]
        idx = k // unit_size
        units.append(Unit(idx, members, f"unit-{idx:05d}-{key}.arrow"))
    return units


# ------------------------------------------------------------------------------- worker


def target_vocab_size(params: Params, pilot: bool) -> int:
    """The target's config.json vocab_size: a server's token ids must lie below it (the servers backend's reply
    validation, the pilot's sweep). A target without a config.json cannot be served that way: a UserError."""
    path = Path(params.base.target_dir) / "config.json"
    if not path.exists():
        if params.generate.backend == "servers" or (pilot and params.generate.pilot_sweep):
            raise UserError(
                f"{path}: missing; generate.backend: servers checks every token id a server sends against the "
                "target's vocab_size (re-run the target stage where the model's config.json can be read)"
            )
        return 0  # the engines backend loads the model itself: its ids come from it
    return load_target_arch(path).vocab_size


def _worker_cfg(params: Params, run_dir: Path, run_hash: str, info: dict, pilot: bool = False) -> WorkerConfig:
    return WorkerConfig(
        gparams=params.generate,
        model=info["model"],
        model_name=info["model"] if info.get("source") != "tiny" else f"tiny:{info['model']}",
        revision=info.get("revision", ""),
        seed=params.base.seed,
        trust_remote_code=params.base.trust_remote_code,
        template_kwargs=template_kwargs(params.base.enable_thinking, params.base.chat_template_kwargs),
        run_dir=str(run_dir),
        run_hash=run_hash,
        vocab_size=target_vocab_size(params, pilot),
    )


def _tokenizer(cfg: WorkerConfig):
    from dflash.core.hf import load_tokenizer

    return load_tokenizer(cfg.model, cfg.trust_remote_code, cfg.revision)


def shard_rows(shard: Path) -> list[dict]:
    return read_arrow(shard).to_pylist()


def failed_in(shard: Path) -> int:
    """Failed turns in a committed shard (its status column only)."""
    return sum(1 for v in read_arrow(shard).column("status").to_pylist() if v == FAILED)


def summarize(run_dir: Path, units: list[Unit], failed: list[dict]) -> dict:
    """Counts over the committed shards of this run (reused + new); `failed`: units given up on whole."""
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
    skipped: dict[str, int] = {}
    failed_by_reason: dict[str, int] = {}
    for r in rows:
        if r["status"] == "skipped":
            skipped[r["skip_reason"]] = skipped.get(r["skip_reason"], 0) + 1
        elif r["status"] == FAILED:
            failed_by_reason[r["skip_reason"]] = failed_by_reason.get(r["skip_reason"], 0) + 1
    unit_prompts = sum(count_prompts(u.conversations) for u in units if u.name in failed_names)
    if unit_prompts:
        failed_by_reason["unit_failed"] = unit_prompts
    return {
        "num_completed": len(completed),
        "num_skipped": sum(skipped.values()),
        "num_failed": sum(failed_by_reason.values()),
        "skipped_by_reason": skipped,
        "failed_by_reason": failed_by_reason,
        "output_tokens": sum(out_lens),
        "prompt_tokens": sum(r["num_prompt_tokens"] for r in completed),
        "finish_length_frac": round(sum(r["finish_reason"] == "length" for r in completed) / max(1, len(completed)), 4),
        "missing_think_end_frac": round(sum(not r["has_think_end"] for r in completed) / max(1, len(completed)), 4),
        "mean_output_tokens": round(sum(out_lens) / max(1, len(out_lens)), 2),
        "p50_output_tokens": percentile(out_lens, 0.5),
        "p90_output_tokens": percentile(out_lens, 0.9),
        "p99_output_tokens": percentile(out_lens, 0.99),
        "output_lengths": out_lens,
    }


def served_model(params: Params, info: dict) -> str:
    """The model id the servers backend expects at /v1/models: generate.server_model, or "" -> target.json's
    `model` (a hub id as `vllm serve <hub id>` lists it; the tiny target: its folder). Local servers are
    started with this --served-model-name."""
    return params.generate.server_model or info["model"]


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:  # a box without torch serves nothing on a GPU either
        return False


@dataclass
class RunFolder:
    """This run's folder: named by the hash of everything that changes its outputs (run_identity)."""

    path: Path  # ${generate.out}/run-<hash> (the pilot's: ${generate.pilot_out}/run-<hash>)
    run_hash: str
    out_root: Path  # generate.out or generate.pilot_out


@dataclass
class UnitWork:
    """The run's units and what is left of them: the units without a shard, and those re-opened for their failed
    turns (their committed rows replayed)."""

    units: list[Unit]
    todo: list[Unit]
    reopened: int
    total_prompts: int
    done_prompts: int  # prompts already committed (rows replayed into re-opened units included)


def resolved_params(params: Params, pilot: bool) -> Params:
    """The params checked and `generate.max_num_seqs: auto` resolved (the pilot's chosen concurrency)."""
    check_generate(params, pilot)  # dflash/core/validate.py: the engine sizes the plan refuses too
    pilot_json = Path(params.base.reports_dir) / "pilot.json"
    signature = target_signature(Path(params.base.target_dir) / "config.json")
    params = dataclasses.replace(params, generate=resolve_max_num_seqs(params.generate, pilot_json, pilot, signature))
    g = params.generate
    hybrid = check_cpu_hybrid(params.base.target_dir, "generate", g.dtype, g.enable_prefix_caching, not _has_cuda())
    if hybrid:
        log.info("generate: %s", hybrid)
    return params


def run_conversations(params: Params, pilot: bool) -> list[dict]:
    """The audit's conversations; the pilot's seeded sample of generate.pilot_samples of them."""
    conversations = load_conversations(Path(params.audit.out) / CONVERSATIONS_FILE)
    if pilot:
        rng = random.Random(params.base.seed)
        conversations = rng.sample(conversations, min(params.generate.pilot_samples, len(conversations)))
    return conversations


def open_run_folder(params: Params, info: dict, pilot: bool) -> RunFolder:
    """The run folder, created (a pilot's from scratch: it measures speed), half-written shards of a killed run
    removed, its identity.json written."""
    g = params.generate
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
    return RunFolder(path=run_dir, run_hash=run_hash, out_root=out_root)


def units_to_do(conversations: list[dict], folder: RunFolder, unit_size: int, pilot: bool) -> UnitWork:
    """The units, stale shards removed (same hash, other input), and the units left to run (module docstring:
    resumable; a rerun re-opens the shards that hold failed turns)."""
    units = make_units(conversations, unit_size)
    wanted = {u.name for u in units}
    for stale in list_shards(folder.path, "unit-*.arrow"):
        if stale.name not in wanted:
            stale.unlink()  # same run hash but different input: not part of this run
    todo, reopened = [], 0
    for u in units:
        shard = folder.path / u.name
        if not shard.exists():
            todo.append(u)
        elif not pilot and failed_in(shard):  # a rerun asks again for exactly its failed turns
            u.done_rows = resumable(shard_rows(shard))
            todo.append(u)
            reopened += 1
    total = count_prompts(conversations)
    done_prompts = total - count_prompts([c for u in todo for c in u.conversations])
    done_prompts += sum(len(u.done_rows) for u in todo)
    log.info(
        "generate: %d conversations, %d prompts, %d units (%d already done, %d re-opened for their failed turns) -> %s",
        len(conversations),
        total,
        len(units),
        len(units) - len(todo),
        reopened,
        folder.path,
    )
    return UnitWork(units=units, todo=todo, reopened=reopened, total_prompts=total, done_prompts=done_prompts)


def run_backend(work: UnitWork, cfg: WorkerConfig, params: Params, info: dict) -> DispatchResult:
    """The units left, through the backend generate.backend names (nothing left: an empty result)."""
    g = params.generate
    if not work.todo:  # every unit was committed by an earlier run: nothing to dispatch
        return DispatchResult(
            failed_units=[], engine_start_s=[], per_engine={}, tokens_this_session=0, gen_wall_s=0.0, wall_s=0.0
        )
    if g.backend == "servers":
        model = served_model(params, info)
        return run_servers(work.todo, cfg, g, total_prompts=work.total_prompts, done=work.done_prompts, model=model)
    return run_engines(work.todo, cfg, g, total_prompts=work.total_prompts, done=work.done_prompts)


def run_metrics(
    params: Params, folder: RunFolder, work: UnitWork, stats: DispatchResult, summary: dict, conversations: list[dict]
) -> dict:
    """The stage's metrics: the committed shards' `summary` (summarize) and the run's figures; every prompt
    accounted for (completed + skipped + failed)."""
    g = params.generate
    metrics: dict[str, Any] = {
        "target_signature": target_signature(Path(params.base.target_dir) / "config.json"),
        "num_prompts": work.total_prompts,
        **summary,
        "output_tokens_per_s": round(stats.tokens_this_session / stats.gen_wall_s, 2) if stats.gen_wall_s else None,
        "num_conversations": len(conversations),
        "num_units": len(work.units),
        "units_reused": len(work.units) - len(work.todo),
        "units_reopened": work.reopened,
        "units_failed": stats.failed_units,
        "failed_turns": stats.failed_turns,
        "num_engines": len(g.server_urls) if g.backend == "servers" and g.server_urls else g.num_engines,
        "engine_start_s": stats.engine_start_s,
        "generation_wall_s": round(stats.gen_wall_s, 2),
        "stage_wall_s": round(stats.wall_s, 2),
        "run_dir": str(folder.path),
        "run_hash": folder.run_hash,
    }
    accounted = metrics["num_completed"] + metrics["num_skipped"] + metrics["num_failed"]
    assert accounted == work.total_prompts, f"generate accounting: {accounted} != {work.total_prompts} prompts"
    metrics["backend"] = g.backend
    metrics["max_num_seqs"] = g.max_num_seqs
    return metrics


def write_pilot(
    params: Params,
    metrics: dict,
    stats: DispatchResult,
    lengths: list[int],
    conversations: list[dict],
    cfg: WorkerConfig,
    info: dict,
) -> dict:
    """The pilot's report (its rate and lengths extrapolated to the whole input) and its concurrency sweep over the
    pilot's `conversations`."""
    g = params.generate
    metrics = pilot_report(
        metrics,
        stats,
        lengths,
        num_input_prompts=count_prompts(load_conversations(Path(params.audit.out) / CONVERSATIONS_FILE)),
        g=g,
        seed=params.base.seed,
    )
    sweep = {"sweep": [], "chosen_max_num_seqs": None}
    if g.pilot_sweep:
        sweep = run_sweep(g, cfg, _tokenizer(cfg), conversations, served_model(params, info), **server_kwargs(cfg))
    metrics.update(sweep)
    write_json(Path(params.base.reports_dir) / "pilot_sweep.json", sweep["sweep"])  # the dvc plots data
    write_metrics(params.base.reports_dir, "pilot", metrics, PILOT_HEADLINE)
    return metrics


def write_generate(params: Params, metrics: dict, folder: RunFolder, work: UnitWork) -> None:
    """generate.json / generate_details.json, and current.json naming this run when nothing failed."""
    write_metrics(params.base.reports_dir, "generate", metrics, HEADLINE)
    if not metrics["num_failed"]:
        current = {"run_dir": folder.path.name, "run_hash": folder.run_hash, "num_units": len(work.units)}
        write_json(folder.out_root / CURRENT_RUN_FILE, current)


def run(params: Params, pilot: bool = False) -> dict:
    """The generate stage (or its pilot). Returns the metrics written to reports/."""
    params = resolved_params(params, pilot)
    info = resolve(params.base.target_dir)
    conversations = run_conversations(params, pilot)
    folder = open_run_folder(params, info, pilot)
    work = units_to_do(conversations, folder, params.generate.unit_size, pilot)
    cfg = _worker_cfg(params, folder.path, folder.run_hash, info, pilot)
    stats = run_backend(work, cfg, params, info)
    summary = summarize(folder.path, work.units, stats.failed_units)
    lengths = summary.pop("output_lengths")
    metrics = run_metrics(params, folder, work, stats, summary, conversations)
    if pilot:
        return write_pilot(params, metrics, stats, lengths, conversations, cfg, info)
    write_generate(params, metrics, folder, work)
    return metrics
