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
import json
import logging
import random
from pathlib import Path
from typing import Any

from dflash.core.chat import template_kwargs
from dflash.core.concurrency import resolve_max_num_seqs
from dflash.core.contracts import CONVERSATIONS_FILE, CURRENT_RUN_FILE
from dflash.core.errors import UserError
from dflash.core.io import read_arrow, write_json
from dflash.core.metrics import write_metrics
from dflash.core.params import Params
from dflash.core.target_config import check_cpu_hybrid, load_target_arch, resolve, target_signature
from dflash.core.validate import check_generate
from dflash.generate.contract import DispatchResult, WorkerConfig, count_prompts
from dflash.generate.engines_backend import run_engines
from dflash.generate.pilot import PILOT_HEADLINE, pilot_report
from dflash.generate.servers_backend import run_servers, server_kwargs
from dflash.generate.sweep import run_sweep
from dflash.generate.units import RunFolder, UnitWork, open_run_folder, summarize, units_to_do

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
