"""Audit raw conversations before any GPU time: catch placeholder responses, broken rows, shape errors,
duplicates and over-long prompts in seconds, and write the normalized prompts generation completes.

Inputs: `audit.input` (file, folder or glob of ShareGPT json/jsonl, OpenAI `messages` jsonl, parquet;
see dflash/audit/readers.py), optionally the target's tokenizer. Outputs under `audit.out`:
- `conversations.arrow`: one row per KEPT conversation (CONVERSATIONS_SCHEMA in dflash/core/contracts.py).
- `rejected.jsonl`: one object per rejected input row: source_file, source_row, reasons, detail,
  conversation_id (when the row could be read) and an excerpt. kept + rejected == input rows.
- `audit_details.json` (every count and example), `report.md` (findings and what to do), `plots/*.csv`
  (DVC plots). The stage writes the headline numbers (HEADLINE) to `${base.reports_dir}/audit.json`.

    python -m stages.audit --params params.yaml -S audit.input=FILE -S audit.out=DIR
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc

from dflash.audit.checks import audit_chunk
from dflash.audit.hub import HubSpec, check_hub_params, is_hub, load_split
from dflash.audit.readers import iter_chunks, prefetch, resolve_inputs
from dflash.audit.report import write_outputs
from dflash.audit.state import AuditState
from dflash.core.chat import load_fast_chat, template_kwargs
from dflash.core.contracts import CONVERSATIONS_FILE, CONVERSATIONS_SCHEMA
from dflash.core.errors import UserError
from dflash.core.gates import check_gates, evaluate_gates, failed_gates
from dflash.core.io import staged_folder
from dflash.core.params import AuditParams, BaseParams
from dflash.core.target_config import target_signature, tokenizer_folder
from dflash.core.validate import SHARE, at_least, check

log = logging.getLogger(__name__)

HEADLINE = (  # reports/audit.json, the DVC metrics; the plan reads num_conversations and mean_prompt_tokens
    "num_rows",
    "num_kept",
    "num_rejected",
    "num_malformed",
    "num_conversations",
    "placeholder_response_frac",
    "response_length_spike_frac",
    "repeated_response_frac",
    "duplicate_prompt_frac",
    "mean_prompt_tokens",
    "gate_failed",
    "target_signature",
)

GATE_FIXES = {
    "placeholder_response_frac": "regenerate every response with the generate stage (it completes `prompt_messages` "
    "with the target); once that is the plan, set this gate's action to report",
    "response_length_spike_frac": "most responses have the same length: they are templated or placeholders; regenerate "
    "them with the generate stage (see the most common responses in report.md)",
    "repeated_response_frac": "a few response texts repeat across many conversations; regenerate them with the "
    "generate stage or drop those rows",
    "malformed_frac": "fix or drop the rows listed in rejected.jsonl (each names file and line and what is wrong)",
    "duplicate_prompt_frac": "deduplicate the source data (duplicates are already left out of conversations.arrow); "
    "raise the gate if repeats are intended",
    "rejected_frac": "read the reasons in rejected.jsonl and report.md, and fix the source data",
}


RESPONSE_GATES = ("placeholder_response_frac", "response_length_spike_frac", "repeated_response_frac")


def auto_actions(tokenize_source: str) -> dict[str, tuple[str, str]]:
    """What `action: auto` means for the response gates, given `tokenize.source` (see GateParams)."""
    if tokenize_source == "recorded":
        why = "auto: fail, because tokenize.source is recorded: these responses would be trained on as written"
        return {name: ("fail", why) for name in RESPONSE_GATES}
    why = "auto: report, because tokenize.source is generated: the generate stage replaces every response"
    return {name: ("report", why) for name in RESPONSE_GATES}


AUDIT_RULES = {
    "max_prompt_tokens": at_least(1),
    "short_response_chars": at_least(0),
    "repeated_response_min_share": SHARE,
    "chunk_bytes": at_least(1),  # 0 read nothing and passed every gate
    "examples": at_least(0),
}


def validate(p: AuditParams) -> None:
    """ParamsError naming the key for an audit size or gate that cannot work."""
    check(p, "audit", AUDIT_RULES)
    check_hub_params(p)
    check_gates(p.gates, "audit.gates")


def run_audit(p: AuditParams, base: BaseParams, tokenize_source: str = "generated") -> dict:
    """Audit `p.input`, write every output under `p.out`, return the metrics (also in audit_details.json).
    Gates are evaluated into the metrics (`action: auto` resolved from `tokenize_source`, the stage passes
    `tokenize.source`); the caller decides to fail (`failed_gates`)."""
    start = time.perf_counter()
    validate(p)
    out = Path(p.out)
    folder = tokenizer_folder(p.tokenizer, base.target_dir)
    if folder is None and p.tokenizer == "auto":
        log.warning("audit.tokenizer=auto: no tokenizer under %s; auditing without token counts", base.target_dir)
    chat = load_fast_chat(folder) if folder is not None else None
    kwargs = template_kwargs(base.enable_thinking, base.chat_template_kwargs)
    state = AuditState(p)
    options = ipc.IpcWriteOptions(compression="zstd")
    hub = HubSpec.from_params(p) if is_hub(p.input) else None
    names = [hub.label] if hub else [str(f) for f in resolve_inputs(p.input)]
    with staged_folder(out) as staging:  # replaces `out` whole at the end; untouched if anything fails
        with (
            pa.OSFile(str(staging / CONVERSATIONS_FILE), "wb") as sink,
            ipc.new_file(sink, CONVERSATIONS_SCHEMA, options=options) as writer,
            open(staging / "rejected.jsonl", "w", encoding="utf-8") as rejected,
        ):
            state.rejected_file = rejected
            for chunk in prefetch(iter_chunks(p.input, p.chunk_bytes, hub)):
                state.files.add(chunk.file)
                kept = audit_chunk(chunk, state, chat, kwargs)
                if kept.num_rows:
                    writer.write_table(kept)
        if state.num_rows == 0:
            listed = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            raise UserError(
                f"audit.input={p.input!r}: no rows in {listed} (empty, or only blank lines / a 0-row table); "
                f"nothing to audit. {out} was left as it was."
            )
        metrics = state.metrics(tokenizer=str(folder) if folder else None)
        # The pipeline's target (its tokenizer counted the prompt tokens): a plan of another target ignores this file.
        prompt_tokens = metrics["prompt_tokens"] or {}
        metrics["mean_prompt_tokens"] = prompt_tokens.get(
            "mean"
        )  # None without a tokenizer (the plan then uses params)
        metrics["target_signature"] = target_signature(Path(base.target_dir) / "config.json")
        metrics["responses_from"] = tokenize_source
        if hub:  # what was read, exactly: the cache folder of the pinned commit
            split = load_split(hub)
            metrics["hub"] = {
                "dataset": hub.dataset,
                "split": hub.split,
                "revision": split.revision,
                "cache": split.cache,
            }
        # each gate compares the metric of its name
        metrics["gates"] = evaluate_gates(metrics, p.gates, GATE_FIXES, auto_actions(tokenize_source))
        metrics["failed_gates"] = failed_gates(metrics["gates"])
        metrics["gate_failed"] = bool(metrics["failed_gates"])
        metrics["elapsed_s"] = round(time.perf_counter() - start, 3)
        metrics["rows_per_s"] = round(metrics["num_rows"] / max(metrics["elapsed_s"], 1e-9), 1)
        write_outputs(staging, metrics, state)
    return metrics
