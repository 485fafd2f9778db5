"""Plan stage, `plan.deadline_hours`: the smallest cluster that meets a deadline (dflash/plan/deadline.py).

Pins the maths: a hand-computed ring all-reduce, the candidate sizes, the deadline met at the chosen size and
not at the next smaller one, more GPUs never slower unless communication dominates (and then the plan says so),
the same memory verdict as the layout table, no deadline key at 0, and the refused values.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from dflash.core import cli
from dflash.core.errors import ParamsError, UserError
from dflash.plan import deadline as plan_deadline
from dflash.plan import estimate as plan
from dflash.plan import report as plan_report
from stages import plan as plan_stage
from tests.helpers import plan_params

OVERLAY = "params/gpu-qwen3.6-27b.yaml"


def _deadline(tmp_path: Path, *overrides: str) -> dict:
    return plan.make_plan(plan_params(tmp_path / "reports", *overrides))["deadline"]


# ---------------------------------------------------------------------------------------------
# The arithmetic
# ---------------------------------------------------------------------------------------------


def test_ring_allreduce_by_hand():
    # 1.73 B fp32 gradients = 6.92 GB over 4 ranks at 50 GB/s: 2 x 3/4 x 6.92 / 50 = 0.2076 s
    assert plan_deadline.ring_allreduce_seconds(6.92e9, 4, 50.0) == pytest.approx(0.2076)
    assert plan_deadline.ring_allreduce_seconds(6.92e9, 2, 64.0) == pytest.approx(6.92 / 64)  # 2 x 1/2 = 1
    assert plan_deadline.ring_allreduce_seconds(6.92e9, 1, 50.0) == 0.0  # one replica: nothing to reduce


def test_cluster_sizes_fill_one_node_then_whole_nodes():
    assert plan_deadline.cluster_sizes(4, 16) == [1, 2, 3, 4, 8, 12, 16]
    assert plan_deadline.cluster_sizes(8)[-1] == 1024 and plan_deadline.cluster_sizes(8)[8] == 16


def test_the_plans_allreduce_is_the_hand_formula(tmp_path):
    result = plan.make_plan(plan_params(tmp_path / "reports", "plan.deadline_hours=72"))
    d, c = result["deadline"], result["deadline"]["chosen"]
    grad_bytes = result["drafter"]["params"]["total"] * 4  # fp32 gradients
    assert d["grad_gb_per_step"] == pytest.approx(grad_bytes / 1e9)
    # the split layout: half the GPUs hold the drafter; ranks span nodes, so the slower link (50 < 64 GB/s) sets it
    assert c["layout"] == "split" and c["ranks"] == d["gpus"] // 2 and c["link_gbps"] == 50.0
    n = c["ranks"]
    assert c["allreduce_s"] == pytest.approx(2 * (n - 1) / n * grad_bytes / 50e9)
    one_node = next(r for r in d["curve"] if r["gpus"] == 4)
    assert one_node["link_gbps"] == 64.0  # PCIe inside the node (the profile's interconnect_gbps)
    assert one_node["allreduce_s"] == pytest.approx(grad_bytes / 64e9)  # 2 ranks: 2 x 1/2 x bytes
    # the exposed part: what the overlapped backward does not hide, added to the drafter's step
    hidden = 0.5 * 2 / 3 * result["training"]["drafter_seconds_per_sequence"]
    assert c["exposed_s"] == pytest.approx(max(0.0, c["allreduce_s"] - hidden))
    assert c["train_hours"] == pytest.approx(c["compute_hours"] * c["step_s"] / c["compute_step_s"])


# ---------------------------------------------------------------------------------------------
# The 27B case in 72 hours
# ---------------------------------------------------------------------------------------------


def test_27b_in_three_days_needs_many_nodes(tmp_path, capsys):
    code = 0
    try:
        argv = ["--overlay", OVERLAY, "-S", "plan.deadline_hours=72", "-S", f"base.reports_dir={tmp_path}"]
        cli.run(plan_stage.main, "plan", argv + ["-S", "plan.audit_json=", "-S", "plan.tokenize_json="], with_args=True)
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr().out
    assert code == 0
    d = json.loads((tmp_path / "plan.json").read_text())["deadline"]
    assert {"hours", "gpus", "nodes", "gpus_per_node", "layout", "train_hours", "generation_hours"} <= set(d)
    assert d["met"] and d["hours"] == 72 and d["gpus_per_node"] == 4  # the overlay's node: 4 x RTX PRO 6000
    assert d["gpus"] > 4 * 4 and d["gpus"] % 4 == 0 and d["nodes"] == d["gpus"] // 4
    assert d["generation_hours"] + d["train_hours"] == pytest.approx(d["total_hours"]) and d["total_hours"] <= 72
    assert d["train_fits"] and not d["communication_dominates"]
    assert "## Deadline: 72.0 h" in out and f"**{d['gpus']} x NVIDIA RTX PRO 6000" in out
    assert f"| {d['gpus']} | {d['nodes']} |" in out  # the hours-vs-GPUs table holds the chosen size


def test_met_at_the_chosen_size_and_not_one_size_smaller(tmp_path):
    d = _deadline(tmp_path, "plan.deadline_hours=72")
    prev = d["previous"]
    assert prev["gpus"] == d["gpus"] - d["gpus_per_node"]  # the next smaller candidate: one node fewer
    assert prev["total_hours"] > 72 >= d["total_hours"]
    # a deadline equal to the chosen size's hours is met there exactly; a hair less needs the next size
    exact = _deadline(tmp_path, f"plan.deadline_hours={d['total_hours']!r}")
    assert exact["gpus"] == d["gpus"] and exact["met"]
    tighter = _deadline(tmp_path, f"plan.deadline_hours={d['total_hours'] * (1 - 1e-9)!r}")
    assert tighter["gpus"] == d["gpus"] + 4
    # a deadline the 4-GPU node already meets chooses it (sizes inside one node come first)
    node = next(r for r in d["curve"] if r["gpus"] == 4)
    assert _deadline(tmp_path, f"plan.deadline_hours={node['total_hours'] + 1}")["gpus"] == 4


def test_hours_equal_the_plans_own_generation_and_layout_estimates(tmp_path):
    result = plan.make_plan(plan_params(tmp_path / "reports", "plan.deadline_hours=72", "plan.gpu_counts=[4, 8, 64]"))
    curve = {r["gpus"]: r for r in result["deadline"]["curve"]}
    for row in result["scaling"]:  # the time-vs-GPUs table: same generation model, same layout scaling
        assert curve[row["gpus"]]["generation_hours"] == pytest.approx(row["generation_hours"])
        assert curve[row["gpus"]]["compute_hours"] == pytest.approx(row["train_hours"])
        assert curve[row["gpus"]]["layout"] == row["train_layout"]
    # data-parallel engines: 16 times the GPUs, a sixteenth of the generation time
    assert curve[64]["generation_hours"] == pytest.approx(curve[4]["generation_hours"] / 16)


def test_same_memory_verdict_as_the_layout_table(tmp_path):
    d = _deadline(tmp_path, "plan.deadline_hours=72")
    g = d["gpus"]
    same = plan.make_plan(
        plan_params(tmp_path / "reports", f"plan.num_gpus={g}", f"plan.train_assumptions.split_target_gpus={g // 2}")
    )
    head = same["training"]["headline"]
    assert d["chosen"]["need_gb"] == {role: c["need_gb"] for role, c in head["per_gpu"].items()}
    assert d["chosen"]["margin_gb"] == pytest.approx(head["margin_gb"]) and d["chosen"]["fits"] == head["fits"]


# ---------------------------------------------------------------------------------------------
# More GPUs, never slower unless communication dominates, which the plan says
# ---------------------------------------------------------------------------------------------


def test_more_gpus_never_slower_at_the_shipped_bandwidths(tmp_path):
    chosen = {}
    for overlap in ("0.5", "0.0"):
        d = _deadline(tmp_path, "plan.deadline_hours=72", f"plan.allreduce_overlap={overlap}")
        assert d["communication_dominates"] == []  # checked over every candidate size, not only the table's
        hours = [r["total_hours"] for r in d["curve"] if r["total_hours"] is not None]
        assert hours == sorted(hours, reverse=True) and len(set(hours)) == len(hours)
        chosen[overlap] = d["gpus"]
    # no overlap: the whole all-reduce adds to each step, so more GPUs are needed
    assert chosen["0.0"] > chosen["0.5"]


def test_slow_internode_link_dominates_and_the_plan_says_so(tmp_path):
    built = plan.build_plan(plan_params(tmp_path / "reports", "plan.deadline_hours=72", "plan.internode_gbps=0.5"))
    result = built.to_json()
    d = result["deadline"]
    slower = d["communication_dominates"]
    assert slower and (slower[0]["from_gpus"], slower[0]["to_gpus"]) == (4, 8)  # leaving the node: PCIe -> 0.5 GB/s
    assert slower[0]["to_train_hours"] > slower[0]["from_train_hours"] and slower[0]["link_gbps"] == 0.5
    assert result["summary"]["deadline"]["communication_dominates"] is True
    md = plan_report.render_markdown(built)
    assert "Communication dominates from 4 to 8 GPUs" in md
    # unchanged compute: the slowdown is the all-reduce alone
    fast = _deadline(tmp_path, "plan.deadline_hours=72")
    c8 = {r["gpus"]: r for r in fast["curve"]}[8]
    s8 = {r["gpus"]: r for r in d["curve"]}[8]
    assert s8["compute_hours"] == pytest.approx(c8["compute_hours"]) and s8["train_hours"] > c8["train_hours"]


def test_slower_steps_flags_every_rise():
    rows = [
        {"gpus": 1, "total_hours": None, "train_hours": 9.0, "allreduce_s": 0.0, "link_gbps": 64},  # does not fit
        {"gpus": 2, "total_hours": 5.0, "train_hours": 4.0, "allreduce_s": 0.1, "link_gbps": 64},
        {"gpus": 4, "total_hours": 3.0, "train_hours": 2.0, "allreduce_s": 0.1, "link_gbps": 64},
        {"gpus": 8, "total_hours": 4.0, "train_hours": 3.0, "allreduce_s": 9.0, "link_gbps": 1},
    ]
    rows = [SimpleNamespace(**r) for r in rows]  # the attributes slower_steps reads of a SizeRow
    assert [(s.from_gpus, s.to_gpus) for s in plan_deadline.slower_steps(rows)] == [(4, 8)]


def test_unreachable_deadline_says_so_with_the_best_hours(tmp_path):
    built = plan.build_plan(plan_params(tmp_path / "reports", "plan.deadline_hours=1"))
    result = built.to_json()
    d = result["deadline"]
    assert not d["met"] and d["gpus"] == plan_deadline.MAX_GPUS
    assert d["total_hours"] == d["best_hours"] > 1
    assert result["summary"]["deadline"]["met"] is False
    assert "**NOT MET** by any cluster of up to 1024 GPUs" in plan_report.render_markdown(built)


# ---------------------------------------------------------------------------------------------
# Off, and refused values
# ---------------------------------------------------------------------------------------------


def test_deadline_zero_means_no_deadline_key(tmp_path):
    built = plan.build_plan(plan_params(tmp_path / "reports"))
    result = built.to_json()
    assert "deadline" not in result["summary"] and result["deadline"] is None
    assert "## Deadline" not in plan_report.render_markdown(built)
    assert not any(a.startswith("Deadline:") for a in result["assumptions"])
    on = plan.make_plan(plan_params(tmp_path / "reports", "plan.deadline_hours=72"))
    assert any(a.startswith("Deadline:") for a in on["assumptions"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("plan.deadline_hours=-1", "plan.deadline_hours: must be >= 0, got -1.0"),
        ("plan.gpus_per_node=0", "plan.gpus_per_node: must be >= 1, got 0"),
        ("plan.internode_gbps=0", "plan.internode_gbps: must be > 0, got 0.0"),
        ("plan.allreduce_overlap=1.5", "plan.allreduce_overlap: must be in [0, 1], got 1.5"),
    ],
)
def test_bad_deadline_params_are_refused(tmp_path, capsys, override, message):
    with pytest.raises(ParamsError, match=re.escape(message)):
        plan.make_plan(plan_params(tmp_path / "reports", override))
    code = 0
    try:
        argv = ["--overlay", OVERLAY, "-S", f"base.reports_dir={tmp_path}", "-S", override]
        cli.run(plan_stage.main, "plan", argv, with_args=True)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "plan.json").exists()


def test_an_engine_wider_than_a_node_is_refused(tmp_path):
    with pytest.raises(UserError, match=r"plan.gpus_per_node: 4 GPUs cannot hold one engine of generate"):
        plan.make_plan(
            plan_params(
                tmp_path / "reports", "plan.deadline_hours=72", "plan.num_gpus=8", "generate.tensor_parallel_size=8"
            )
        )
