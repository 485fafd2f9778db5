"""The generate run's units: the run folder named by the hash of everything that changes the outputs, the units of
conversations (the commit and resume unit, one shard each), what is left of them (a rerun skips committed units and
re-opens the shards that hold failed turns), and the counts over the committed shards.

Inputs: the params (`generate`, `base`), the target's identity (target.json) and the conversations. Outputs:
`${generate.out}/run-<hash>/identity.json` (the pilot's under `${generate.pilot_out}`), stale shards removed, and the
units for a backend (dflash/generate/stage.py runs them).
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

from dflash.core.chat import template_kwargs
from dflash.core.io import config_hash, file_sha256, list_shards, read_arrow, write_json
from dflash.core.loader import as_dict
from dflash.core.params import Params
from dflash.generate.contract import Unit, count_prompts
from dflash.generate.pilot import percentile
from dflash.generate.turns import FAILED, resumable

log = logging.getLogger(__name__)


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
