"""The target through transformers: its tokenizer, its config when no config.json was written, its weights.

Only the stages that run the target in-process (train, eval) or render with transformers' tokenizer
(generate), and the target stage reading a hub model's config, call these; everything here imports
transformers (and so torch) lazily, inside the function. `trust_remote_code` is passed through from
`base.trust_remote_code` (off unless a param turns it on). What a user can fix is a one-line UserError naming
the param and the fix (`target_errors`): a config that needs custom code while base.trust_remote_code is
false (refused before any of it runs), a hub id that is neither in the local hub cache nor reachable, a
revision the model does not have, a model id that does not exist or is not accessible.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dflash.core.errors import UserError
from dflash.core.target_config import CONFIG_JSON, check_remote_code, read_config, resolve

log = logging.getLogger(__name__)


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """exc and what it was raised from (transformers wraps huggingface_hub's errors in an OSError)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _cached_revisions(model: str) -> list[str]:
    """The refs (branches / tags) and commits of `model` in the local hub cache, [] when it holds none."""
    from huggingface_hub import constants

    folder = Path(constants.HF_HUB_CACHE) / f"models--{model.replace('/', '--')}"
    refs = sorted(p.name for p in (folder / "refs").glob("*") if p.is_file())
    return refs + sorted(p.name for p in (folder / "snapshots").glob("*") if p.is_dir())


def target_error(exc: BaseException, model: str, revision: str | None) -> UserError | None:
    """The UserError for a load failure a user can fix (see the module docstring), or None for anything else."""
    names = {type(c).__name__ for c in _causes(exc)} | {b.__name__ for c in _causes(exc) for b in type(c).__mro__}
    text = " ".join(str(exc).split())
    rev = revision or "main"
    if isinstance(exc, ValueError) and "trust_remote_code" in text:
        return UserError(
            f"target.source={model}: it needs custom code, which runs only with base.trust_remote_code=true; nothing "
            "was run. Set base.trust_remote_code=true if you trust that code, or use a model transformers supports "
            f"without it ({text[:200]})"
        )
    if "RevisionNotFoundError" in names:
        return UserError(
            f"target.revision={rev!r}: {model} has no such revision on the hub; set target.revision to one of its "
            "commits, branches or tags (the model page's commit history lists them)"
        )
    if "RepositoryNotFoundError" in names:  # GatedRepoError is one too
        return UserError(
            f"target.source={model}: not a local folder, and not a model on the hub that you can access; set "
            "target.source to a folder holding config.json or to a hub id, and log in (`hf auth login` or HF_TOKEN) "
            "for a private or gated model"
        )
    if names & {
        "LocalEntryNotFoundError",
        "OfflineModeIsEnabled",
        "ConnectError",
        "ConnectionError",
        "TimeoutException",
    }:
        from huggingface_hub import constants

        cached = _cached_revisions(model)
        offline = " (HF_HUB_OFFLINE is set)" if constants.HF_HUB_OFFLINE else ""
        if cached:
            return UserError(
                f"target.revision={rev!r}: not in the local hub cache of {model} (it holds {', '.join(cached[:6])}), "
                f"and the hub cannot be reached{offline}; set target.revision to a cached one, or run once with "
                "network to download it"
            )
        return UserError(
            f"target.source={model}: not in the local hub cache ({constants.HF_HUB_CACHE}) and the hub cannot be "
            f"reached{offline}; run once with network (or `hf download {model} --revision {rev}` on a machine that "
            "has one, then copy the cache), or set target.source to a local folder holding the model"
        )
    return None


@contextmanager
def target_errors(model: str | Path, revision: str | None = None) -> Iterator[None]:
    """Re-raise what transformers / huggingface_hub raise for a target a user can fix as one-line UserErrors."""
    try:
        yield
    except (OSError, ValueError) as exc:
        error = target_error(exc, str(model), revision)
        if error is None:
            raise
        raise error from None


def _check_local_config(model: str | Path, trust_remote_code: bool) -> None:
    """A local folder's config.json that needs custom code is refused before transformers reads it."""
    config = Path(model) / CONFIG_JSON
    if config.is_file():
        check_remote_code(read_config(config), str(model), trust_remote_code)


def load_tokenizer(model: str | Path, trust_remote_code: bool = False, revision: str | None = None) -> Any:
    from transformers import AutoTokenizer

    with target_errors(model, revision):
        return AutoTokenizer.from_pretrained(str(model), trust_remote_code=trust_remote_code, revision=revision or None)


def target_tokenizer(target_dir: str | Path, trust_remote_code: bool) -> Any:
    """The target's tokenizer, or None when its folder has no tokenizer files (checks that need it are skipped)."""
    info = resolve(target_dir)
    folder = Path(info["model"])
    if folder.is_dir() and not any((folder / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    try:
        return load_tokenizer(info["model"], trust_remote_code, info.get("revision"))
    except UserError:
        raise
    except (OSError, ValueError) as exc:  # transformers' own errors for a folder it cannot read
        log.info("no tokenizer for %s (%s)", info["model"], exc)
        return None


def load_config(model: str | Path, revision: str | None, trust_remote_code: bool) -> dict:
    """transformers' AutoConfig of a folder or hub id, as a dict; errors a user can fix as UserErrors."""
    from transformers import AutoConfig

    _check_local_config(model, trust_remote_code)
    with target_errors(model, revision):
        config = AutoConfig.from_pretrained(str(model), revision=revision or None, trust_remote_code=trust_remote_code)
    return config.to_dict()


def target_config_dict(target_dir: str | Path, trust_remote_code: bool) -> dict:
    """The target's config without loading weights: `${base.target_dir}/config.json` when present (the target
    stage writes it for tiny and real targets), else transformers' AutoConfig on the resolved reference."""
    path = Path(target_dir) / CONFIG_JSON
    if path.exists():
        return read_config(path)
    info = resolve(target_dir)
    return load_config(info["model"], info.get("revision"), trust_remote_code)


def load_target_model(target_dir: str | Path, dtype: Any, device: Any, trust_remote_code: bool) -> Any:
    """The target's causal LM (transformers), in eval mode, frozen, on `device`."""
    from transformers import AutoModelForCausalLM

    info = resolve(target_dir)
    config = Path(target_dir) / CONFIG_JSON
    if config.is_file():  # the target stage's copy: refuse custom code before transformers sees it
        check_remote_code(read_config(config), info["model"], trust_remote_code)
    _check_local_config(info["model"], trust_remote_code)
    with target_errors(info["model"], info.get("revision")):
        model = AutoModelForCausalLM.from_pretrained(
            info["model"], revision=info.get("revision") or None, dtype=dtype, trust_remote_code=trust_remote_code
        )
    model.to(device).eval().requires_grad_(False)
    return model
