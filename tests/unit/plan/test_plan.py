"""Plan stage: the 27B regeneration case's arithmetic, counts checked against transformers, verdicts that flip, clear errors."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from dflash.core import cli, target_config
from dflash.core.errors import ParamsError, UserError
from dflash.drafter import geometry
from dflash.plan import estimate as plan
from dflash.plan import generation as plan_generation
from dflash.plan import inputs as plan_inputs
from dflash.plan import report as plan_report
from dflash.plan import sizing, training_costs
from stages import plan as plan_stage
from tests.helpers import plan_params, repo_params

OVERLAY = "params/gpu-qwen3.6-27b.yaml"
OVERLAY_TARGET_CONFIG = "params/targets/qwen3.6-27b.config.json"
QWEN36 = "params/targets/qwen3.6-27b.config.json"


def _run_stage(argv: list[str], capsys) -> tuple[int, str, str]:
    code = 0
    try:
        cli.run(plan_stage.main, "plan", argv, with_args=True)
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def _hardware_file(tmp_path: Path, **changes) -> str:
    """A copy of params/hardware.yaml with the rtx-pro-6000 profile changed (one file per change set)."""
    from dflash.core.loader import read_yaml
    from dflash.core.yamlio import dump_yaml_text

    data = read_yaml("params/hardware.yaml")
    data["profiles"]["rtx-pro-6000"].update(changes)
    path = tmp_path / ("hardware-" + "-".join(f"{k}{v}" for k, v in changes.items()) + ".yaml")
    path.write_text(dump_yaml_text(data))
    return str(path)


# ---------------------------------------------------------------------------------------------
# The 27B regeneration case's own arithmetic, from its inputs
# ---------------------------------------------------------------------------------------------


def test_seed_batch1_decode_bound():
    # 54 GB of BF16 weights at 1.35 TB/s -> ~25 tok/s at batch 1
    assert plan_generation.batch1_tokens_per_s(54e9, 1.35e12) == pytest.approx(25.0, abs=0.05)


def test_seed_generation_wall_time():
    # 1.37 B output tokens at 3000 tok/s -> ~457K s (5.3 days)
    seconds = plan_generation.wall_seconds(1.37e9, 3000)
    assert seconds == pytest.approx(457e3, rel=0.002)
    assert 5.2 < seconds / 86400 < 5.4


def test_seed_headroom_and_the_real_config(tmp_path):
    assert plan_generation.headroom_bytes(96e9, 54e9) == pytest.approx(42e9)
    # the shipped Qwen3.6-27B config gives the case's 54 GB and 42 GB on the 96 GB card
    result = plan.make_plan(plan_params(tmp_path / "reports"))
    assert result["generation"]["weights_gb"] == pytest.approx(54.0, abs=0.3)
    assert result["generation"]["memory"]["headroom_gb_full_card"] == pytest.approx(42.0, abs=0.3)


def test_seed_drafter_parameter_count(tmp_path):
    """The overlay's DFlash2 is the z-lab DFlash body (~1.73 B, 3.46 GB bf16) plus its convs and selector."""
    body = plan.make_plan(plan_params(tmp_path / "reports", "drafter.kind=dflash"))["drafter"]["params"]["total"]
    assert body == pytest.approx(1.73e9, rel=0.003)
    result = plan.make_plan(plan_params(tmp_path / "reports"))
    assert result["drafter"]["params"]["total"] > body


# ---------------------------------------------------------------------------------------------
# Counts against an independent computation (transformers modules on the meta device)
# ---------------------------------------------------------------------------------------------


def _meta_counts(model) -> dict[str, int]:
    counts = {"vision": 0, "embed": 0, "lm_head": 0, "decoder": 0}
    for name, p in model.named_parameters():
        key = next(
            (k for k, tag in (("vision", "visual"), ("embed", "embed_tokens"), ("lm_head", "lm_head")) if tag in name),
            "decoder",
        )
        counts[key] += p.numel()
    return counts


def test_target_counts_match_transformers():
    torch = pytest.importorskip("torch")
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    raw = json.loads(Path(QWEN36).read_text())
    with torch.device("meta"):
        model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(**raw))
    ref = _meta_counts(model)
    ours = sizing.target_params(target_config.parse_target_config(raw, QWEN36))
    assert ours["decoder"] == ref["decoder"]
    assert ours["embed_tokens"] == ref["embed"]
    assert ours["lm_head"] == ref["lm_head"]
    assert ours["vision_skipped"] == pytest.approx(ref["vision"], rel=0.02)  # approximate on purpose
    # text + MTP + vision = the 27.78 B behind the checkpoint's 55.56 GB of bf16 safetensors
    assert ours["text_total"] + ours["mtp_skipped"] + ours["vision_skipped"] == pytest.approx(27.78e9, rel=0.002)


@pytest.mark.parametrize("architecture", ["qwen3", "qwen3_next"])
def test_tiny_target_counts_match_transformers(architecture):
    """Both tiny targets; the hybrid one's last layer is a 4-expert MoE (+ shared expert), which the counts must
    price: every expert loaded, only the top-k run per token."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from dflash.target.build import tiny_config

    p = repo_params([f"target.tiny.architecture={architecture}"])
    cfg = tiny_config(p.target)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    ref = _meta_counts(model)
    t = target_config.parse_target_config(cfg.to_dict(), "tiny")
    ours = sizing.target_params(t)
    assert (ours["decoder"], ours["embed_tokens"], ours["lm_head"]) == (ref["decoder"], ref["embed"], ref["lm_head"])
    if architecture == "qwen3":
        assert t.moe_layers == () and ours["decoder_linear_active"] == ours["decoder_linear"]
        return
    assert t.moe_layers == (t.num_layers - 1,)
    moe = model.model.layers[-1].mlp
    experts = sum(x.numel() for x in moe.experts.parameters())
    active = experts // t.num_experts * t.num_experts_per_tok  # what one token runs of them
    assert ours["decoder_linear"] - ours["decoder_linear_active"] == experts - active > 0


def test_drafter_count_matches_qwen3_layers(tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    p = plan_params(
        tmp_path / "reports", "drafter.kind=dflash"
    )  # the DFlash body; the successors' heads: tests/unit/drafter
    d = p.drafter
    cfg = Qwen3Config(
        hidden_size=5120,
        intermediate_size=d.intermediate_size,
        num_attention_heads=d.num_attention_heads,
        num_key_value_heads=d.num_key_value_heads,
        head_dim=d.head_dim,
        num_hidden_layers=d.num_hidden_layers,
    )
    with torch.device("meta"):
        layer = sum(x.numel() for x in Qwen3DecoderLayer(cfg, 0).parameters())
    expected = d.num_hidden_layers * layer + len(d.target_layer_ids) * 5120 * 5120 + 2 * 5120  # + fc, hidden_norm, norm
    target = target_config.parse_target_config(json.loads(Path(QWEN36).read_text()), QWEN36)
    assert geometry.parameter_counts(geometry.build_drafter_config(d, target))["total"] == expected


# ---------------------------------------------------------------------------------------------
# Behaviour of the models
# ---------------------------------------------------------------------------------------------


def test_hybrid_cache_grows_with_attention_layers_only():
    raw = json.loads(Path(QWEN36).read_text())
    t = target_config.parse_target_config(raw, QWEN36)
    assert (t.n_linear, t.n_attention) == (48, 16)
    kv = sizing.kv_bytes_per_token(t, "bf16")
    assert kv * 2000 == pytest.approx(2 * kv * 1000)  # KV grows linearly with length
    assert sizing.linear_state_bytes(t, "bf16") > 0  # GDN state: constant per sequence
    assert sizing.linear_state_bytes(t, "fp32") > sizing.linear_state_bytes(t, "bf16")
    assert sizing.kv_bytes_per_token(t, "fp8") == kv / 2
    dense = target_config.parse_target_config({**raw["text_config"], "layer_types": ["full_attention"] * 64}, "dense")
    assert sizing.linear_state_bytes(dense, "bf16") == 0
    assert sizing.kv_bytes_per_token(dense, "bf16") == 4 * kv  # 64 attention layers instead of 16


def test_fp8_shrinks_matmul_weights_only():
    t = target_config.parse_target_config(json.loads(Path(QWEN36).read_text()), QWEN36)
    bf16, fp8 = sizing.target_weight_bytes(t, "bf16"), sizing.target_weight_bytes(t, "fp8")
    p = sizing.target_params(t)
    assert bf16["loaded"] - fp8["loaded"] == p["decoder_linear"]  # one byte saved per matmul weight
    assert bf16["loaded"] - bf16["read_per_step"] == 2 * p["embed_tokens"]  # decode gathers embedding rows only


def test_decode_roofline_rises_with_batch_until_compute_binds(tmp_path):
    p = plan_params(tmp_path / "reports")
    t = target_config.parse_target_config(json.loads(Path(QWEN36).read_text()), QWEN36)
    hw = plan_inputs.select_gpu(plan_inputs.load_hardware("params/hardware.yaml"), "rtx-pro-6000", "hw")
    read = sizing.target_weight_bytes(t, "bf16")["read_per_step"]
    gs = plan.generation_settings(p, plan_inputs.resolve_paths(p.plan, p.base))
    steps = [
        plan_generation.decode_step(t, hw, gs, weight_read_bytes=read, batch=b, context=2000, tp=1) for b in (1, 8, 64)
    ]
    assert steps[0].tokens_per_s < steps[1].tokens_per_s < steps[2].tokens_per_s
    assert steps[0].bound == "bandwidth"
    fast_memory = replace(hw, bandwidth_tbps=1e4)
    assert (
        plan_generation.decode_step(t, fast_memory, gs, weight_read_bytes=read, batch=64, context=2000, tp=1).bound
        == "compute"
    )


def test_training_memory_verdict_flips(tmp_path):
    result = plan.make_plan(plan_params(tmp_path / "reports", "plan.train_assumptions.layout=data_parallel"))
    lay = result["training"]["headline"]
    assert lay["fits"]
    need = lay["per_gpu"]["gpu"]["need_gb"]
    small = _hardware_file(tmp_path, memory_gb=need - 0.5)
    big = _hardware_file(tmp_path, memory_gb=need + 0.5)
    base = ["plan.train_assumptions.layout=data_parallel"]
    assert not plan.make_plan(plan_params(tmp_path / "reports", *base, f"plan.hardware_file={small}"))["training"][
        "headline"
    ]["fits"]
    assert plan.make_plan(plan_params(tmp_path / "reports", *base, f"plan.hardware_file={big}"))["training"][
        "headline"
    ]["fits"]
    # growing the batch grows activations until the same card no longer fits
    verdicts = [
        plan.make_plan(plan_params(tmp_path / "reports", *base, f"train.batch_size={b}"))["training"]["headline"][
            "fits"
        ]
        for b in (1, 2, 4)
    ]
    assert verdicts[0] and not verdicts[-1]
    # sharding the optimizer over 4 ranks is what makes data parallel fit where one GPU does not
    single = result["training"]["layouts"]["single"]
    assert single["per_gpu"]["gpu"]["need_gb"] > need


def test_target_loss_targets_cost_the_target_head_and_its_full_depth(tmp_path):
    """train.loss_target: the target runs every layer and its lm_head on the drafted slots; the logits chunk and
    the final hidden states grow the drafter GPU's memory (KL most)."""
    runs = {
        # DFlash: the successors' heads read the target's distribution whatever the loss target
        lt: plan.make_plan(plan_params(tmp_path / "reports", "drafter.kind=dflash", f"train.loss_target={lt}"))[
            "training"
        ]
        for lt in training_costs.LOGITS_BYTES
    }
    f = {lt: r["flops_per_sequence"] for lt, r in runs.items()}
    cfg = json.loads(Path(QWEN36).read_text())["text_config"]
    slots = f["tokens"]["anchors"] * (f["tokens"]["block_tokens"] / f["tokens"]["anchors"] - 1)
    assert f["tokens"]["target_lm_head"] == 0
    for lt in ("target_argmax", "target_kl"):
        assert f[lt]["target_lm_head"] == pytest.approx(2 * cfg["vocab_size"] * cfg["hidden_size"] * slots)
        assert f[lt]["target_forward"] > f["tokens"]["target_forward"]  # the layers after the deepest feature layer
    need = {lt: r["layouts"]["single"]["per_gpu"]["gpu"]["need_gb"] for lt, r in runs.items()}
    assert need["tokens"] < need["target_argmax"] < need["target_kl"]


def test_generation_verdict_flips_when_weights_do_not_fit(tmp_path):
    ok = plan.make_plan(plan_params(tmp_path / "reports"))["generation"]
    assert ok["memory"]["fits"] and ok["memory"]["batch"] > 0
    small = _hardware_file(tmp_path, memory_gb=60)  # 60 x 0.9 - 3 GB reserve < 53.8 GB of weights
    gen = plan.make_plan(plan_params(tmp_path / "reports", f"plan.hardware_file={small}"))["generation"]
    assert not gen["memory"]["fits"] and gen["memory"]["batch"] == 0
    assert gen["model_tokens_per_s"] == 0 and gen["wall_hours"]["mid"] is None
    built = plan.build_plan(plan_params(tmp_path / "reports", f"plan.hardware_file={small}"))
    result = built.to_json()
    json.dumps(result, allow_nan=False)  # metrics stay valid JSON (no Infinity)
    assert "DO NOT FIT" in plan_report.render_markdown(built)
    fp8 = plan.make_plan(plan_params(tmp_path / "reports", f"plan.hardware_file={small}", "plan.weight_dtype=fp8"))[
        "generation"
    ]
    assert fp8["memory"]["fits"] and fp8["model_tokens_per_s"] > 0


# ---------------------------------------------------------------------------------------------
# Inputs: measurements replace params; missing inputs name the param
# ---------------------------------------------------------------------------------------------


def test_measurements_replace_params_and_pilot_calibrates(tmp_path):
    reports = tmp_path / "reports"
    reports.mkdir()
    (reports / "audit.json").write_text(json.dumps({"num_conversations": 1000, "mean_prompt_tokens": 100.0}))
    (reports / "tokenize.json").write_text(
        json.dumps({"num_samples": 900, "total_tokens": 1_800_000, "loss_tokens": 1_500_000})
    )
    pilot = {"output_tokens_per_s": 400.0, "mean_output_tokens": 300.0, "p90_output_tokens": 900, "num_engines": 1}
    (reports / "pilot.json").write_text(json.dumps({**pilot, "estimated_total_hours": 0.2}))
    result = plan.make_plan(plan_params(tmp_path / "reports"))
    ds, gen = result["dataset"], result["generation"]
    assert (ds["num_prompts"], ds["mean_prompt_tokens"], ds["mean_output_tokens"]) == (1000, 100, 300)
    assert (ds["train_samples"], ds["seq_tokens"], ds["loss_tokens"]) == (900, 2000, pytest.approx(1666.67, abs=0.01))
    assert "audit.json" in result["inputs"]["sources"]["num_prompts"]
    pl = gen["pilot"]
    assert pl["measured_over_model"] == pytest.approx(400.0 / (gen["model_tokens_per_s"] / gen["engines"]))
    assert gen["wall_hours"]["mid"] == pytest.approx(1000 * 300 / (400.0 * gen["engines"]) / 3600)


def test_missing_target_config_names_the_param(tmp_path, capsys):
    code, _, err = _run_stage(
        ["-S", f"base.target_dir={tmp_path / 'nothing'}", "-S", f"base.reports_dir={tmp_path}"], capsys
    )
    assert code == 1 and "plan.target_config" in err


def test_missing_dataset_size_names_the_param(tmp_path, capsys):
    argv = [
        "--overlay",
        OVERLAY,
        "-S",
        f"base.reports_dir={tmp_path}",
        "-S",
        "plan.audit_json=",
        "-S",
        "plan.dataset.num_prompts=0",
    ]
    code, _, err = _run_stage(argv, capsys)
    assert code == 1 and "plan.dataset.num_prompts" in err


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("plan.hardware=tpu-v9", "plan.hardware: no profile 'tpu-v9'"),
        ("plan.dataset.output_tokens_high=10", "plan.dataset.output_tokens_low / output_tokens_high"),
        ("plan.train_assumptions.split_target_gpus=4", "plan.train_assumptions.split_target_gpus"),
        ("drafter.target_layer_ids=[1, 64]", "drafter.target_layer_ids"),
        ("drafter.num_attention_heads=6", "drafter.num_key_value_heads: 6 query heads are not a multiple of 8"),
    ],
)
def test_bad_settings_name_the_param(tmp_path, capsys, override, expected):
    code, _, err = _run_stage(["--overlay", OVERLAY, "-S", f"base.reports_dir={tmp_path}", "-S", override], capsys)
    assert expected in err
    # a params value the schema accepts but the rules refuse exits 2, like every size error (validate.py)
    assert code == (2 if override.startswith(("drafter.", "plan.dataset.", "plan.train_assumptions.")) else 1), err


def test_bad_hardware_profile_names_the_key(tmp_path):
    from dflash.core.loader import read_yaml
    from dflash.core.yamlio import dump_yaml_text

    data = read_yaml("params/hardware.yaml")
    del data["profiles"]["h200"]["bandwidth_tbps"]
    path = tmp_path / "hw.yaml"
    path.write_text(dump_yaml_text(data))
    with pytest.raises(UserError, match=r"profiles\.h200\.bandwidth_tbps: missing key"):
        plan_inputs.load_hardware(path)


def test_every_shipped_profile_cites_a_source():
    profiles = plan_inputs.load_hardware("params/hardware.yaml")
    assert {"rtx-pro-6000", "b200", "h200", "h100-sxm"} <= set(profiles)
    assert all(len(p.source) > 40 for p in profiles.values())


# ---------------------------------------------------------------------------------------------
# End to end: the stage on the tiny demo target, and the shipped overlay
# ---------------------------------------------------------------------------------------------


def test_stage_on_tiny_target(tmp_path, capsys):
    pytest.importorskip("torch")
    from dflash.target.build import build_tiny

    p = repo_params(["target.tiny.steps=0"])
    build_tiny(p.target, p.base, tmp_path / "target")  # untrained: ~5 s
    argv = ["-S", f"base.target_dir={tmp_path / 'target'}", "-S", f"base.reports_dir={tmp_path / 'reports'}"]
    code, out, _ = _run_stage([*argv, "-S", "plan.deadline_hours=1"], capsys)
    assert code == 0 and "Qwen3ForCausalLM" in out
    result = json.loads((tmp_path / "reports" / "plan_details.json").read_text())
    assert json.loads((tmp_path / "reports" / "plan.json").read_text()) == result["summary"]  # the DVC metrics
    assert result["summary"]["deadline"]["met"] and result["summary"]["deadline"]["gpus"] == 1  # the tiny one: 1 GPU
    tp = result["target"]["params"]
    assert result["summary"]["target_weights_gb"] == pytest.approx(tp["text_total"] * 4 / 1e9)  # fp32, as the demo runs
    assert result["summary"]["generation_hours"] > 0 and result["summary"]["train_fits"]
    rows = (tmp_path / "reports" / "plan_train_scaling.csv").read_text().splitlines()
    assert rows[0] == "gpus,hours" and len(rows) == 1 + len(p.plan.gpu_counts)
    assert (tmp_path / "reports" / "plan.md").read_text() == out.rstrip("\n") + "\n"


def test_overlay_prints_a_full_estimate_without_a_download(tmp_path, capsys):
    code, out, _ = _run_stage(["--overlay", OVERLAY, "-S", f"base.reports_dir={tmp_path}"], capsys)
    assert code == 0
    for needle in (
        "Qwen3_5ForConditionalGeneration on 4 x NVIDIA RTX PRO 6000",
        "48 linear-attention",
        "## Generation",
        "## Training",
        "split (headline)",
        "## Time vs GPU count",
        "Source: NVIDIA RTX PRO 6000",
    ):
        assert needle in out
    summary = json.loads((tmp_path / "plan.json").read_text())
    assert summary["train_layout"] == "split" and summary["generation_hours"] > 0


def test_measurements_of_another_target_are_ignored_and_said_so(tmp_path, capsys):
    """The tiny demo's pilot must never calibrate the 27B plan (and a matching pilot is used)."""
    from dflash.core.target_config import target_signature

    reports = tmp_path / "reports"
    reports.mkdir()
    pilot = {"output_tokens_per_s": 400.0, "mean_output_tokens": 300.0, "target_signature": "Qwen3ForCausalLM/layers=4"}
    (reports / "pilot.json").write_text(json.dumps(pilot))
    built = plan.build_plan(plan_params(tmp_path / "reports"))  # the overlay plans Qwen3.6-27B
    result = built.to_json()
    assert result["inputs"]["pilot_json"] is None
    assert "Qwen3ForCausalLM/layers=4" in next(iter(result["inputs"]["ignored"].values()))
    assert "ignored:" in plan_report.render_markdown(built)
    pilot["target_signature"] = target_signature(OVERLAY_TARGET_CONFIG)
    (reports / "pilot.json").write_text(json.dumps(pilot))
    assert plan.make_plan(plan_params(tmp_path / "reports"))["inputs"]["pilot_json"] is not None


def test_the_demo_audit_does_not_size_the_27b_dataset(tmp_path):
    """An audit of the 368-row sample (run with the tiny target) leaves the overlay's 902K prompts in force."""
    from dflash.core.target_config import target_signature

    reports = tmp_path / "reports"
    reports.mkdir()
    audit = {"num_conversations": 364, "prompt_tokens": {"mean": 33.0}, "target_signature": "Qwen3ForCausalLM/layers=4"}
    (reports / "audit.json").write_text(json.dumps(audit))
    params = plan_params(tmp_path / "reports", f"plan.audit_json={reports / 'audit.json'}")
    result = plan.make_plan(params)
    assert result["dataset"]["num_prompts"] == params.plan.dataset.num_prompts == 902000
    assert str(reports / "audit.json") in result["inputs"]["ignored"]
    audit["target_signature"] = target_signature(OVERLAY_TARGET_CONFIG)  # an audit run with the 27B's tokenizer
    (reports / "audit.json").write_text(json.dumps(audit))
    assert plan.make_plan(params)["dataset"]["num_prompts"] == 364


# ---------------------------------------------------------------------------------------------
# Issue 14 item 10: the plan refuses what train and generate refuse, before any estimate
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "key", "message"),
    [
        # sizes (dflash/core/validate.py): before the fix a plan (negative hours) or a ZeroDivisionError
        ("generate.tensor_parallel_size=0", "generate.tensor_parallel_size", "must be >= 1, got 0"),
        ("train.batch_size=0", "train.batch_size", "must be >= 1, got 0"),
        ("train.grad_accum_steps=0", "train.grad_accum_steps", "must be >= 1, got 0"),
        ("train.max_length=0", "train.max_length", "must be >= 2, got 0"),
        ("generate.unit_size=0", "generate.unit_size", "must be >= 1, got 0"),
        ("generate.unit_size=-3", "generate.unit_size", "must be >= 1, got -3"),
        ("train.epochs=-1", "train.epochs", "must be >= 1, got -1"),  # printed negative hours
        ("train.num_anchors=0", "train.num_anchors", "must be >= 1, got 0"),
        ("generate.max_num_seqs=0", "generate.max_num_seqs", "must be >= 1 or auto, got 0"),
        ("generate.gpu_memory_utilization=1.5", "generate.gpu_memory_utilization", "must be in (0, 1], got 1.5"),
        ("plan.train_assumptions.mfu=-0.35", "plan.train_assumptions.mfu", "must be in (0, 1], got -0.35"),
        ("plan.generation.decode_mfu=0", "plan.generation.decode_mfu", "must be in (0, 1], got 0.0"),
        ("plan.price_per_gpu_hour=-2", "plan.price_per_gpu_hour", "must be >= 0, got -2.0"),
        ("plan.gpu_counts=[1, -4]", "plan.gpu_counts[1]", "must be >= 1, got -4"),
        ("plan.num_gpus=-1", "plan.num_gpus", "must be >= 1, got -1"),
    ],
)
def test_plan_refuses_bad_sizes_before_any_estimate(tmp_path, capsys, override, key, message):
    params = plan_params(tmp_path / "reports", override)
    with pytest.raises(ParamsError, match=re.escape(f"{key}: {message}")):
        plan.make_plan(params)
    code, out, err = _run_stage(["--overlay", OVERLAY, "-S", f"base.reports_dir={tmp_path}", "-S", override], capsys)
    assert code == 2 and f"{key}: {message}" in err and "Traceback" not in err
    assert not (tmp_path / "plan.md").exists() and "# Plan" not in out


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("drafter.mask_token_id=248320", "drafter.mask_token_id: 248320 is outside the 248320 embedding rows"),
        ("drafter.mask_token_id=-1", "drafter.mask_token_id: -1 is outside"),
        ("drafter.target_layer_ids=[1, 16, 63]", "drafter.target_layer_ids: [1, 16, 63] includes the target's last"),
        ("drafter.target_layer_ids=[16, 1, 31]", "drafter.target_layer_ids: [16, 1, 31] is not sorted"),
        ("drafter.target_layer_ids=[1, 16, 16]", "drafter.target_layer_ids: [1, 16, 16] has duplicates"),
        ("drafter.num_key_value_heads=0", "drafter.num_key_value_heads: must be >= 1, got 0"),
    ],
)
def test_plan_refuses_the_drafter_train_refuses(tmp_path, override, message):
    """The drafter geometry (dflash/drafter/geometry.py) is the same validator train runs."""
    with pytest.raises(UserError, match=re.escape(message)):
        plan.make_plan(plan_params(tmp_path / "reports", override))


def _tiny_target_folder(tmp_path: Path, referenced: bool) -> tuple[Path, Path]:
    """(target folder, tokenizer folder) as the target stage writes them: for the tiny target config.json + the
    Qwen3 tokenizer in one folder; for a real local model (`referenced`) config.json + target.json naming the
    model folder, which holds the tokenizer."""
    import shutil

    from dflash.target.build import QWEN3_VOCAB_ROWS, qwen3_tokenizer_dir

    folder = tmp_path / "target"
    folder.mkdir()
    tok = tmp_path / "model" if referenced else folder
    tok.mkdir(exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(qwen3_tokenizer_dir() / name, tok / name)
    if referenced:
        (folder / "target.json").write_text(json.dumps({"source": str(tok), "model": str(tok), "revision": ""}))
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": QWEN3_VOCAB_ROWS,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder, tok


@pytest.mark.parametrize(
    ("mask_token_id", "message"),
    [
        (100, "drafter.mask_token_id: 100 is the tokenizer's text token"),
        (151645, "drafter.mask_token_id: 151645 ('<|im_end|>') is a special token the data uses"),
        (151643, "drafter.mask_token_id: 151643 ('<|endoftext|>') is a special token the data uses"),
    ],
)
@pytest.mark.parametrize("referenced", [False, True], ids=["tiny", "local-model"])
def test_plan_checks_the_mask_token_against_the_targets_tokenizer(tmp_path, referenced, mask_token_id, message):
    """Train refuses a mask token the data can hold (check_mask_token with the target's tokenizer); so does the
    plan, reading the same tokenizer without transformers."""
    target, tok = _tiny_target_folder(tmp_path, referenced)
    overrides = [f"base.target_dir={target}", "drafter.target_layer_ids=[0, 1]"]
    good = plan.make_plan(
        plan_params(tmp_path / "reports", *overrides, overlay=False)
    )  # 151669 = len(tokenizer): unused
    assert good["inputs"]["mask_token_checked_against"] == str(tok / "tokenizer.json")
    with pytest.raises(UserError, match=re.escape(message)):
        plan.make_plan(
            plan_params(tmp_path / "reports", *overrides, f"drafter.mask_token_id={mask_token_id}", overlay=False)
        )


def test_a_shipped_config_says_the_mask_token_was_checked_against_embedding_rows_only(tmp_path):
    result = plan.make_plan(plan_params(tmp_path / "reports"))
    assert result["inputs"]["mask_token_checked_against"].startswith("the target's embedding rows only")
