"""The tiny target's cache (dflash.target.cache): a build of a recipe in the cache saves the same model as the build
that wrote the entry; the key follows everything the weights depend on and nothing else; an entry that is not the
recipe's model is refused, and a load whose weights differ from the writer's says so."""

from __future__ import annotations

import json

import pytest

from dflash.target import build, cache
from tests.helpers import repo_params
from tests.helpers.models import NARROW_TARGET

RECIPE = ("target.tiny.steps=2", "target.tiny.corpus_size=20", *NARROW_TARGET)


def _params(folder, *more):
    return repo_params([*RECIPE, f"target.tiny.cache={folder}", *more])


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A narrow 2-step recipe pre-trained once with write_cache, and its entry."""
    folder = tmp_path_factory.mktemp("cache")
    p = _params(folder)
    metrics = build.build_tiny(p.target, p.base, tmp_path_factory.mktemp("w") / "target", write_cache=True)
    return folder, metrics


def test_a_recipe_in_the_cache_is_loaded_and_saves_the_writers_model(written, tmp_path):
    folder, wrote = written
    assert wrote["pretrained_by"] == "this build" and wrote["cache_entry"].startswith(str(folder))
    p = _params(folder)
    got = build.build_tiny(p.target, p.base, tmp_path / "target")
    assert got["pretrained_by"] == f"cache {wrote['cache_entry']}"
    assert got["weights_sha256"] == wrote["weights_sha256"]  # byte for byte the model the writer saved
    assert "weights_match_cache" not in got
    for key in ("final_loss", "first_loss", "pretrain_steps", "seen_vocab", "corpus_tokens"):
        assert got[key] == wrote[key], key  # the writer's pre-training figures, not a rerun's


def test_a_recipe_not_in_the_cache_is_pre_trained_here(written, tmp_path):
    folder, wrote = written
    p = _params(folder, "target.tiny.lr=1.0e-3")
    got = build.build_tiny(p.target, p.base, tmp_path / "target")
    assert got["pretrained_by"] == "this build" and got["weights_sha256"] != wrote["weights_sha256"]
    assert len(list(folder.iterdir())) == 1  # only write_cache writes entries


def test_the_key_follows_the_weights_and_not_the_margin_report():
    docs = [[1, 2, 3], [4, 5]]
    code = (build.pretrain,)

    def key(*more, d=docs, c=code):
        p = repo_params([*RECIPE, *more])
        return cache.recipe_key(cache.recipe(p.target, p.base.seed, d, c))

    base = key()
    assert key("target.tiny.margin_prompts=3", "target.tiny.margin_max_tokens=5", "target.tiny.cache=elsewhere") == base
    assert key("target.tiny.gates.near_tie_frac.max=0.5") == base
    changed = [
        key("target.tiny.steps=3"),
        key("target.tiny.lr=1.0e-3"),
        key("target.tiny.hidden_size=128"),
        key("base.seed=1"),
        key(d=[[1, 2, 3], [4, 6]]),  # another corpus
        key(c=(build.pretrain, build.tiny_config)),  # other code
    ]
    assert len({base, *changed}) == len(changed) + 1


def test_an_entry_of_another_model_is_refused(written, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    folder, wrote = written
    entry = folder / wrote["cache_entry"].rsplit("/", 1)[1]
    with safe_open(str(entry), "pt") as fh:
        meta, tensors = dict(fh.metadata()), {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118
    other = tmp_path / "other"
    other.mkdir()
    dropped = sorted(k for k in tensors if k.startswith("body."))[0]
    save_file({k: v for k, v in tensors.items() if k != dropped}, str(other / entry.name), metadata=meta)
    p = _params(other)
    with pytest.raises(ValueError, match=f"lacks .*{dropped}"):
        build.build_tiny(p.target, p.base, tmp_path / "target")


def test_a_load_whose_weights_differ_from_the_writers_says_so(written, tmp_path, caplog):
    from safetensors import safe_open
    from safetensors.torch import save_file

    folder, wrote = written
    entry = folder / wrote["cache_entry"].rsplit("/", 1)[1]
    with safe_open(str(entry), "pt") as fh:
        meta, tensors = dict(fh.metadata()), {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118
    other = tmp_path / "other"
    other.mkdir()
    save_file(tensors, str(other / entry.name), metadata={**meta, "model_sha256": "0" * 64})  # another CPU's init
    p = _params(other)
    with caplog.at_level("WARNING"):
        got = build.build_tiny(p.target, p.base, tmp_path / "target")
    assert got["weights_match_cache"] is False and got["weights_sha256"] == wrote["weights_sha256"]
    assert "differ from the ones its build saved" in caplog.text
    assert json.loads(meta["recipe"])["seed"] == p.base.seed
