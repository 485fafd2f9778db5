"""The plan's pre-pilot generation model against published measured runs (params/published/runs.yaml).

For each run: its setup (a params overlay), the figure it measured and the model's figure for the same setup,
without any pilot, audit or tokenize file (what the plan would have said before measuring anything), the error
(model / measured - 1), and the model's per-engine rate at every concurrency level, so that the model's sensitivity
to what a source did not record (the RTX PRO 6000 run's concurrency) is on the page. Then the decode step the
model prices at the run's batch: weights, KV cache and Gated DeltaNet state bytes, and the time each takes at the
profile's bandwidth x efficiency, beside the step time the measured figure implies.

    python benchmarks/published_runs.py [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dflash.core.loader import load_params  # noqa: E402
from dflash.plan import sizing  # noqa: E402
from dflash.plan.generation import GenerationEstimate, generation_estimate  # noqa: E402
from dflash.plan.inputs import dataset_inputs, load_target, planned_hardware, resolve_paths  # noqa: E402
from dflash.plan.published import PublishedRuns, check_runs  # noqa: E402
from dflash.plan.settings import GenerationSettings, generation_settings  # noqa: E402

LEVELS = (8, 16, 32, 64, 96, 128, 256)


def breakdown(overlay: str, measured: str, value: float) -> dict:
    """The model's decode step at the run's batch, and the per-engine rate at every concurrency level."""
    params = load_params(REPO / "params.yaml", overlays=[REPO / overlay])
    plan = params.plan
    paths = resolve_paths(plan, params.base)
    t, hw = load_target(paths.target_config), planned_hardware(plan)
    gs = generation_settings(params, paths)
    data = dataset_inputs(plan, paths, signature=t.signature, measured=False)

    def estimate(settings: GenerationSettings) -> GenerationEstimate:
        return generation_estimate(
            t, hw, settings, weight_dtype=plan.weight_dtype, num_gpus=plan.num_gpus, data=data, price=0.0
        )

    est = estimate(gs)
    cap, step = est.memory, est.step
    ctx = cap.resident_context_tokens
    kv = sizing.kv_bytes_per_token(t, gs.kv_cache_dtype, ctx) * ctx * step.batch
    state = 2 * sizing.linear_state_bytes(t, gs.ssm_state_dtype) * step.batch
    peak_bw = hw.bandwidth_tbps * 1e12
    per_engine = (
        value / gs.tensor_parallel_size
        if measured == "tokens_per_s_per_gpu"
        else est.output_tokens / (value * 3600) / est.engines
    )
    curve = {}
    for level in LEVELS:
        e = estimate(dataclasses.replace(gs, max_num_seqs=level))
        curve[level] = e.model_tokens_per_s / e.engines if e.engines else None
    return {
        "batch": step.batch,
        "resident_context": ctx,
        "weights_gb": est.weights_read_per_step_gb,
        "kv_gb": kv / 1e9,
        "state_gb": state / 1e9,
        "state_dtype": gs.ssm_state_dtype,
        "memory_ms": step.memory_ms,
        "compute_ms": step.compute_ms,
        "model_step_ms": step.step_ms,
        "measured_step_ms": step.batch / per_engine * 1e3,
        "model_per_engine": step.tokens_per_s,
        "measured_per_engine": per_engine,
        "rate_by_level": curve,
        # the bytes the model says a step moves, over the step time the measurement implies, as a share of peak:
        # the end-to-end efficiency the run reached (the model assumes bandwidth_efficiency for the kernels alone)
        "implied_bandwidth_share": (est.weights_read_per_step_gb * 1e9 + kv + state)
        / (step.batch / per_engine)
        / peak_bw,
        "assumed_bandwidth_efficiency": gs.bandwidth_efficiency,
        "seqs_in_cache": cap.max_seqs_in_cache,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    out = []
    for c in check_runs(PublishedRuns(REPO / "params.yaml", REPO / "params/published/runs.yaml")):
        b = breakdown(c.overlay, c.measured, c.value)
        out.append({**dataclasses.asdict(c), "breakdown": b})
        print(f"\n== {c.key}: {c.what}")
        print(
            f"measured {c.value:,.4g} {c.unit}; model {c.model:,.4g}; error {c.error:+.1%} "
            f"({'optimistic' if c.optimistic else 'pessimistic'})"
        )
        print(
            f"decode step at batch {b['batch']} (resident context {b['resident_context']:.0f} tokens, "
            f"{b['seqs_in_cache']} sequences fit): weights {b['weights_gb']:.1f} GB + KV {b['kv_gb']:.1f} GB + GDN "
            f"state read and written {b['state_gb']:.1f} GB ({b['state_dtype']}) -> {b['memory_ms']:.1f} ms memory, "
            f"{b['compute_ms']:.1f} ms compute; model {b['model_step_ms']:.1f} ms vs {b['measured_step_ms']:.1f} ms "
            f"implied by the measurement ({b['model_per_engine']:,.0f} vs {b['measured_per_engine']:,.0f} tok/s per engine)"
        )
        print(
            "model tok/s per engine by max_num_seqs: "
            + ", ".join(f"{k}: {v:,.0f}" for k, v in b["rate_by_level"].items() if v)
        )
        print(
            f"bandwidth: the measurement implies {b['implied_bandwidth_share']:.2f} of peak end to end; the model "
            f"assumes {b['assumed_bandwidth_efficiency']} for the decode kernels and nothing between them"
        )
        print(f"source: {c.source}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
