"""dflash.core.overlay writes a params overlay into params.yaml (what `make repro-gpu` does before `dvc repro`),
and the shipped GPU overlay describes the real job consistently."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dflash.core.errors import ParamsError
from dflash.core.loader import load_params, read_yaml
from dflash.core.overlay import apply_overlay, apply_overlay_text, main
from dflash.core.yamlio import load_yaml_text
from tests.helpers import repo_params

OVERLAY = "params/gpu-qwen3.6-27b.yaml"


def _comments(text: str) -> list[str]:
    return [m.group(1).strip() for m in re.finditer(r"#(.*)$", text, re.MULTILINE)]


@pytest.fixture()
def params_copy(repo_root, tmp_path) -> Path:
    path = tmp_path / "params.yaml"
    path.write_text((repo_root / "params.yaml").read_text())
    return path


def test_written_params_equal_the_overlay_merge_and_keep_every_comment(repo_root, params_copy):
    before = params_copy.read_text()
    changes = apply_overlay(params_copy, repo_root / OVERLAY)
    after = params_copy.read_text()
    assert changes and after != before
    # what dvc repro will read == what `--overlay` gives the stages
    assert load_params(params_copy) == repo_params(overlays=[repo_root / OVERLAY])
    assert _comments(after) == _comments(before)  # every comment kept, in order
    # only the changed values' lines differ
    changed_keys = {c.split(":")[0].rsplit(".", 1)[-1] for c in changes}
    for old, new in zip(before.splitlines(), after.splitlines(), strict=True):
        if old != new:
            assert old.split(":")[0].strip() in changed_keys, (old, new)


def test_applying_twice_changes_nothing(repo_root, params_copy):
    apply_overlay(params_copy, repo_root / OVERLAY)
    once = params_copy.read_text()
    assert apply_overlay(params_copy, repo_root / OVERLAY) == []
    assert params_copy.read_text() == once


def _typed(value):
    if isinstance(value, dict):
        return {repr(_typed(k)): _typed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_typed(v) for v in value]
    return (type(value).__name__, value)


def test_after_writing_the_shipped_overlay_dvc_and_the_stages_read_the_same(repo_root, params_copy):
    from dvc.utils.serialize import load_yaml

    apply_overlay(params_copy, repo_root / OVERLAY)
    assert _typed(read_yaml(params_copy)) == _typed(load_yaml(str(params_copy)))


def test_values_read_back_identically_by_dvc_and_the_stages(repo_root, tmp_path):
    # Strings that YAML 1.1 or 1.2 would turn into bool / float / int / date if unquoted, and small floats.
    from dvc.utils.serialize import load_yaml

    text = (repo_root / "params.yaml").read_text()
    overlay = {
        "target": {"source": "yes", "revision": "1e3"},
        "audit": {"input": "2024-01-01", "out": "010", "tokenizer": "0x1f"},
        "generate": {"quantization": "off", "sampling": {"stop": ["no", "12:30", "</s>", "~"], "top_p": 1e-06}},
        "drafter": {"rope_theta": 1e20, "rms_norm_eps": 1e-05},
        "base": {"chat_template_kwargs": {"preserve_thinking": True, "mode": "on"}},
    }
    new_text, _ = apply_overlay_text(text, overlay)
    raw = load_yaml_text(new_text, "params.yaml")
    written = tmp_path / "params.yaml"
    written.write_text(new_text)
    assert _typed(raw) == _typed(load_yaml(str(written)))  # DVC reads what we read
    assert raw["audit"] == {**raw["audit"], "input": "2024-01-01", "out": "010", "tokenizer": "0x1f"}
    assert raw["target"] == {**raw["target"], "source": "yes", "revision": "1e3"}
    assert raw["generate"]["quantization"] == "off"
    assert raw["generate"]["sampling"]["stop"] == ["no", "12:30", "</s>", "~"]
    assert raw["generate"]["sampling"]["top_p"] == 1e-06 and isinstance(raw["generate"]["sampling"]["top_p"], float)
    assert raw["drafter"]["rope_theta"] == 1e20 and raw["drafter"]["rms_norm_eps"] == 1e-05
    assert raw["base"]["chat_template_kwargs"] == {"preserve_thinking": True, "mode": "on"}


def test_unknown_key_is_an_error_and_the_file_is_untouched(params_copy, tmp_path):
    overlay = tmp_path / "bad.yaml"
    overlay.write_text("generate:\n  num_enignes: 4\n")
    before = params_copy.read_text()
    with pytest.raises(ParamsError, match="generate.num_enignes"):
        apply_overlay(params_copy, overlay)
    assert params_copy.read_text() == before
    assert main([str(overlay), "--params", str(params_copy)]) == 2


def test_check_mode_reports_without_writing(repo_root, params_copy, capsys):
    before = params_copy.read_text()
    assert main([str(repo_root / OVERLAY), "--params", str(params_copy), "--check"]) == 0
    assert "generate.num_engines: 1 -> 4" in capsys.readouterr().out
    assert params_copy.read_text() == before


def test_gpu_overlay_describes_one_bf16_engine_per_gpu_in_thinking_mode(repo_root):
    p = repo_params(overlays=[repo_root / OVERLAY])
    g = p.generate
    assert p.target.source == "Qwen/Qwen3.6-27B" and re.fullmatch(r"[0-9a-f]{40}", p.target.revision)
    assert p.base.enable_thinking
    assert g.tensor_parallel_size == 1 and g.num_engines * g.tensor_parallel_size == p.plan.num_gpus == 4
    assert g.dtype == "bfloat16" and g.quantization == ""
    assert g.max_num_seqs == "auto" and g.pilot_sweep  # the pilot sweep's knee
    assert not g.enforce_eager and 0.85 <= g.gpu_memory_utilization <= 0.95
    # the plan estimates the run that generate will do: it reads these engine settings from `generate`
    from dflash.plan.estimate import generation_settings
    from dflash.plan.inputs import resolve_paths

    gs = generation_settings(p, resolve_paths(p.plan, p.base))
    # before a sweep of this target: its largest level (a pilot.json of the tiny demo does not count)
    assert (gs.max_model_len, gs.max_num_seqs, gs.tensor_parallel_size) == (g.max_model_len, max(g.pilot_sweep), 1)
    from dflash.plan.estimate import make_plan

    memory = make_plan(p)["generation"]["memory"]
    assert max(g.pilot_sweep) <= memory["max_seqs_in_cache"]  # the sweep stays inside the KV/state pool
    assert g.sampling.max_tokens < g.max_model_len  # room for the prompt
    assert g.sampling.temperature > 0  # Qwen's thinking-mode sampling, not greedy (see the overlay's comment)
    assert p.drafter.mask_token_id == 248070 and p.drafter.block_size == 16


def test_a_bad_value_is_reported_as_the_overlay_files_and_params_yaml_is_untouched(params_copy, tmp_path):
    overlay = tmp_path / "gpu.yaml"
    overlay.write_text("generate:\n  num_engines: four\n")
    before = params_copy.read_text()
    with pytest.raises(ParamsError, match=rf"^{overlay}: generate\.num_engines: expected int, got str 'four'$"):
        apply_overlay(params_copy, overlay)
    assert params_copy.read_text() == before
    (tmp_path / "dir.yaml").mkdir()
    assert main([str(tmp_path / "dir.yaml"), "--params", str(params_copy)]) == 2  # a folder: an error, no traceback
    assert main([str(overlay), "--params", str(tmp_path)]) == 2
