"""The kind registry (dflash/drafter/kinds.py): every spec's references resolve, its facts agree with the params
schema and with what its module builds, and the torch-free half stays torch-free."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing

import pytest

from dflash.core.params import DrafterParams, TrainParams
from dflash.drafter.build import build_drafter
from dflash.drafter.export import body_keys
from dflash.drafter.geometry import build_drafter_config
from dflash.drafter.kinds import KINDS, resolve, spec_for
from tests.helpers import REPO
from tests.helpers.models import kind_drafter_params, small_qwen3_config


def test_the_registry_is_the_params_schemas_list_of_kinds():
    (kind_type,) = [f.type for f in dataclasses.fields(DrafterParams) if f.name == "kind"]
    assert typing.get_args(eval(kind_type, vars(sys.modules[DrafterParams.__module__]))) == tuple(KINDS)
    assert all(spec.name == name for name, spec in KINDS.items())


def test_draft_vocabulary_flags_say_which_kinds_train_and_serve_a_pruned_vocabulary():
    assert {name: spec.draft_vocab for name, spec in KINDS.items()} == {
        "dflash": True,
        "dspark": False,  # vLLM has a path; our DSpark loss has no draft-space Markov W2 yet
        "dflash2": False,
        "lilicorr": False,
    }


def test_a_kinds_loss_weights_are_the_train_section_core_validate_reads():
    """core/validate.py cannot import the registry; it finds a kind's loss weights as train.<kind>_loss."""
    fields = {f.name for f in dataclasses.fields(TrainParams)}
    for name, spec in KINDS.items():
        assert spec.loss_params == (f"{name}_loss" if f"{name}_loss" in fields else None)
        assert callable(resolve(spec.loss)) and callable(resolve(spec.decode_step))


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_spec_builds_its_class_and_names_every_tensor_it_holds(kind):
    spec = spec_for(kind)
    cfg = build_drafter_config(kind_drafter_params(kind, num_hidden_layers=2, block_size=8), small_qwen3_config(4))
    model = build_drafter(cfg, device="meta")
    assert type(model) is resolve(spec.drafter_class)
    assert sorted(model.state_dict()) == sorted(body_keys(cfg))
    assert cfg.query_slots == spec.query_slots(8) and spec.query_slots(8) in (7, 8)


def test_an_unknown_kind_is_named():
    with pytest.raises(KeyError, match="'eagle3': expected one of dflash, dspark, dflash2, lilicorr"):
        spec_for("eagle3")


def test_the_registry_and_the_geometry_import_no_torch():
    code = (
        "import sys, dflash.drafter.geometry, dflash.drafter.kinds, dflash.drafter.flops; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
