"""Pre-trained tiny targets kept in the repository, one file per recipe: the same target on every CPU.

Why a cache and not a rebuild: the tiny target's pre-training is chaotic. Two builds of the same recipe on one
Intel Xeon, under two of MKL's code paths (`MKL_ENABLE_INSTRUCTIONS` AVX512 vs AVX2: the sums of one matmul differ
in their last bits), trained weights that differ in 3,342,580 of the 3,342,592 trained elements, by up to 1.1e-2
in float32; in float64 they still differed in every element, by up to 1.5e-3 (docs/results/reproducibility.md).
AdamW turns last-bit gradient differences into whole updates, and 200+ steps grow them. A target built on
another CPU type is therefore another model: its greedy outputs, the generated data and tau follow. So the
build of a recipe is done once (`python -m dflash.target.build`) and its trained tensors are committed; the
target stage loads them when the recipe matches and pre-trains only recipes the cache does not hold.

Key: the sha256 of the recipe, everything the trained weights depend on: the `target.tiny` values that shape the
model or its pre-training (not the margin report's or the gate's), `base.seed`, the sha256 of the pre-training
corpus's token ids (dflash.target.synthetic + the tokenizer + the chat template), and the source text of the
functions that build and pre-train it (an edit to them is a new recipe).

File: `<target.tiny.cache>/<key>.safetensors`: every parameter of the body (all but the embedding and the
lm_head), the seen token ids and their embedding and lm_head rows (the other lm_head rows are zero by
construction, the other embedding rows the seeded initialisation), with metadata: the recipe, the pre-training
metrics of the build that wrote it, the sha256 of the model.safetensors it saved (a load compares its own), and
where and when it was built. ~13 MB per recipe (3.34 M float32 values).

The entry of params.yaml's recipe is written by `python -m dflash.target.build --params params.yaml`.

May import: torch, safetensors (lazily), dflash.core, dflash.target.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import platform
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from dflash.core.params import TargetParams

log = logging.getLogger(__name__)

NOT_RECIPE = ("margin_prompts", "margin_max_tokens", "gates", "cache")  # target.tiny keys the weights do not depend on
KEY_CHARS = 16  # hex characters of the recipe hash in a file name


def recipe(tp: TargetParams, seed: int, docs: Sequence[Sequence[int]], code: Sequence[Callable]) -> dict[str, Any]:
    """Everything the trained weights depend on (module docstring), as a JSON-able dict."""
    corpus = hashlib.sha256()
    for doc in docs:
        corpus.update(json.dumps(list(doc)).encode())
    return {
        "tiny": {k: v for k, v in asdict(tp.tiny).items() if k not in NOT_RECIPE},
        "seed": seed,
        "corpus_sha256": corpus.hexdigest(),
        "code_sha256": hashlib.sha256("".join(inspect.getsource(f) for f in code).encode()).hexdigest(),
    }


def recipe_key(rec: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(rec, sort_keys=True).encode()).hexdigest()[:KEY_CHARS]


def entry_path(folder: str | Path, rec: dict[str, Any]) -> Path:
    return Path(folder) / f"{recipe_key(rec)}.safetensors"


def _body(model: Any) -> dict[str, Any]:
    """The body's parameters by name (everything but the embedding and the lm_head)."""
    return {f"body.{n}": p for n, p in model.model.named_parameters() if not n.startswith("embed_tokens")}


def trained_tensors(model: Any, seen: list[int]) -> dict[str, Any]:
    """What pre-training changed in `model` (pre-trained on the tokens `seen`): the entry's tensors."""
    import torch

    ids = torch.tensor(seen, dtype=torch.long)
    tensors = {n: p.detach().clone().contiguous() for n, p in _body(model).items()}
    tensors["seen_ids"] = ids
    tensors["embed_seen"] = model.model.embed_tokens.weight.detach()[ids].contiguous()
    tensors["lm_head_seen"] = model.lm_head.weight.detach()[ids].contiguous()
    return tensors


def save_entry(tensors: dict[str, Any], rec: dict[str, Any], metrics: dict[str, Any], model_sha256: str, path: Path):
    """Write `tensors` (trained_tensors) as the cache entry `path`, with the build's metrics and the sha256 of
    the model.safetensors it saved."""
    from safetensors.torch import save_file

    from dflash.core.io import atomic_write

    meta = {
        "recipe": json.dumps(rec, sort_keys=True),
        "metrics": json.dumps(metrics, sort_keys=True),
        "model_sha256": model_sha256,
        "built_on": f"{platform.machine()} {_cpu_name()}",
        "built_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:  # written whole, then moved into place
        part = Path(tmp) / path.name
        save_file(tensors, str(part), metadata=meta)
        atomic_write(path, part.read_bytes())
    log.info("wrote the tiny target cache entry %s (%.1f MB)", path, path.stat().st_size / 1e6)


def load_entry(model: Any, path: Path) -> dict[str, Any]:
    """Put the entry's trained tensors into `model` (built from the same recipe, initialised with its seed);
    return the metadata: `metrics` (of the build that wrote it), `model_sha256`, `built_on`, `built_at`."""
    import torch
    from safetensors import safe_open

    with safe_open(str(path), "pt") as fh:
        meta = dict(fh.metadata())
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118 (not a dict)
    body = _body(model)
    missing = sorted(set(body) - set(tensors))
    if missing:
        raise ValueError(f"{path}: the cache entry lacks {missing[:3]}: not this recipe's model")
    with torch.no_grad():
        for name, param in body.items():
            param.copy_(tensors[name])
        ids = tensors["seen_ids"]
        model.model.embed_tokens.weight[ids] = tensors["embed_seen"]
        model.lm_head.weight.zero_()
        model.lm_head.weight[ids] = tensors["lm_head_seen"]
    return {
        "metrics": json.loads(meta["metrics"]),
        "model_sha256": meta["model_sha256"],
        "built_on": meta.get("built_on", ""),
        "built_at": meta.get("built_at", ""),
    }


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
