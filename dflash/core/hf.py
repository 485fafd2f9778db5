"""The target through transformers: its tokenizer, its config when no config.json was written, its weights.

Only the stages that run the target in-process (train, eval) or render with transformers' tokenizer
(generate) call these; everything here imports transformers (and so torch) lazily, inside the function.
`trust_remote_code` is passed through from `base.trust_remote_code` (off unless a param turns it on).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from dflash.core.target_config import CONFIG_JSON, read_config, resolve

log = logging.getLogger(__name__)


def load_tokenizer(model: str | Path, trust_remote_code: bool = False, revision: str | None = None) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model), trust_remote_code=trust_remote_code, revision=revision or None)


def target_tokenizer(target_dir: str | Path, trust_remote_code: bool) -> Any:
    """The target's tokenizer, or None when its folder has no tokenizer files (checks that need it are skipped)."""
    info = resolve(target_dir)
    folder = Path(info["model"])
    if folder.is_dir() and not any((folder / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    try:
        return load_tokenizer(info["model"], trust_remote_code, info.get("revision"))
    except (OSError, ValueError) as exc:  # transformers' own errors for a folder it cannot read
        log.info("no tokenizer for %s (%s)", info["model"], exc)
        return None


def target_config_dict(target_dir: str | Path, trust_remote_code: bool) -> dict:
    """The target's config without loading weights: `${base.target_dir}/config.json` when present (the target
    stage writes it for tiny and real targets), else transformers' AutoConfig on the resolved reference."""
    path = Path(target_dir) / CONFIG_JSON
    if path.exists():
        return read_config(path)
    from transformers import AutoConfig

    info = resolve(target_dir)
    config = AutoConfig.from_pretrained(
        info["model"], revision=info.get("revision") or None, trust_remote_code=trust_remote_code
    )
    return config.to_dict()


def load_target_model(target_dir: str | Path, dtype: Any, device: Any, trust_remote_code: bool) -> Any:
    """The target's causal LM (transformers), in eval mode, frozen, on `device`."""
    from transformers import AutoModelForCausalLM

    info = resolve(target_dir)
    model = AutoModelForCausalLM.from_pretrained(
        info["model"], revision=info.get("revision") or None, dtype=dtype, trust_remote_code=trust_remote_code
    )
    model.to(device).eval().requires_grad_(False)
    return model
