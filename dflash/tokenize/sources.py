"""What the tokenize stage reads: the current generate run's unit shards (`tokenize.source: generated`) or the
audit's conversations (`recorded`), and a survey of them that plans the work chunks and picks the held-out
conversations while reading only the id columns.
"""

from __future__ import annotations

import heapq
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc

from dflash.core.contracts import CONVERSATIONS_FILE, current_run_dir
from dflash.core.errors import UserError
from dflash.core.io import list_shards
from dflash.core.params import Params
from dflash.tokenize.samples import GENERATED_COLUMNS, RECORDED_COLUMNS, Chunk, Spec, split_key


def input_files(params: Params) -> tuple[list[Path], dict[str, Any]]:
    """Input files and their provenance for the manifest."""
    if params.tokenize.source == "generated":
        run_dir = current_run_dir(params.generate.out)
        files = list_shards(run_dir, "unit-*.arrow")
        if not files:
            raise UserError(f"{run_dir}: no unit-*.arrow shards (an unfinished generate run?)")
        return files, {"source": "generated", "input": str(run_dir), "run_hash": run_dir.name.removeprefix("run-")}
    path = Path(params.audit.out) / CONVERSATIONS_FILE
    if not path.exists():
        raise UserError(f"{path}: missing; run the audit stage first (dvc repro audit)")
    return [path], {"source": "recorded", "input": str(path)}


def survey(files: list[Path], spec: Spec) -> tuple[list[Chunk], int, frozenset[str] | None]:
    """Work chunks, input rows and, when eval_count > 0, the held-out conversations (the eval_count
    eligible ids with the smallest split key), reading only the id columns."""
    p = spec.params
    need = GENERATED_COLUMNS if p.source == "generated" else RECORDED_COLUMNS
    chunks: list[Chunk] = []
    rows = 0
    heap: list[tuple[float, str]] = []  # (-key, id): heap[0] holds the largest key kept so far
    in_heap: set[str] = set()
    for path in files:
        with pa.memory_map(str(path), "r") as source:
            schema = ipc.open_file(source).schema
            missing = [c for c in need if c not in schema.names]
            if missing:
                raise UserError(f"{path}: column(s) {missing} missing (expected the {p.source} source's shards)")
            # eligible for eval: conversations that can yield a sample (a completed turn / an assistant turn)
            gate = "status" if p.source == "generated" else "num_assistant_turns"
            has_gate = gate in schema.names
            id_cols = ["conversation_id"] + ([gate] if has_gate else [])
            options = ipc.IpcReadOptions(included_fields=[schema.get_field_index(c) for c in id_cols])
            reader = ipc.open_file(source, options=options)
            file_rows = 0
            for bi in range(reader.num_record_batches):
                batch = reader.get_batch(bi)
                n = batch.num_rows
                chunks += [
                    Chunk(str(path), bi, file_rows, s, min(n, s + p.chunk_rows)) for s in range(0, n, p.chunk_rows)
                ]
                file_rows += n
                if p.eval_count == 0:
                    continue
                ids = batch["conversation_id"]
                if has_gate:
                    ok = pc.equal(batch[gate], "completed") if p.source == "generated" else pc.greater(batch[gate], 0)
                    ids = ids.filter(pc.fill_null(ok, False))
                for cid in set(ids.to_pylist()) - in_heap:
                    item = (-split_key(spec.seed, cid), cid)
                    if len(heap) < p.eval_count:
                        heapq.heappush(heap, item)
                        in_heap.add(cid)
                    elif item > heap[0]:  # a smaller key than the largest kept
                        in_heap.discard(heapq.heapreplace(heap, item)[1])
                        in_heap.add(cid)
            rows += file_rows
    return chunks, rows, (frozenset(in_heap) if p.eval_count > 0 else None)
