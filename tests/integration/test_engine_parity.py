"""Engine-code parity: the reference's DFlash2, DSpark and LiLiCorr drafting against vLLM 0.32's own speculator code.

vLLM's DFlash2Speculator / DSparkSpeculator / LiLiCorrSpeculator methods (their Triton kernels under Triton's
interpreter, their torch parts as they are) draft over vLLM's model classes loaded from our exports;
dflash/eval/reference.py drafts over our modules; both decode the same prompts (tests/engine_parity/harness.py says
what is shared and what is vLLM's). For a random and a trained drafter of each kind, at temperature 0 and 1 with the
same seeds: the same drafted tokens in every verification cycle, the same accepted lengths, the same committed
tokens, the same draft logits; at temperature 0 the accepted lengths also by vLLM's own rejection_sample
(tests/engine_parity/verify.py). Each comparison is also made against the reference with one drafted token changed
(cycle 1, slot 1), which must fail.

Triton 3.9 lives in build/triton (installed from PyPI by the fixture when missing; in the venv it breaks
`import transformers`), on the path of the harness's subprocess only. One subprocess for all the kinds (vLLM's import
and the target once).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.engine_parity.triton_env import ensure_triton, subprocess_env
from tests.helpers import REPO

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

KINDS = ("dflash2", "dspark", "lilicorr")
DRAFTERS = ("random", "trained")
TEMPERATURES = (0.0, 1.0)


@pytest.fixture(scope="module")
def triton_ready():
    why = ensure_triton(REPO)
    if why is not None:
        pytest.skip(why)


@pytest.fixture(scope="module")
def reports(triton_ready, tmp_path_factory):
    """The harness's report for every kind (tests/engine_parity/harness.py's JSON)."""
    out = tmp_path_factory.mktemp("parity") / "report.json"
    cmd = [sys.executable, "-m", "tests.engine_parity.harness", "--kind", *KINDS, "--out", str(out)]
    done = subprocess.run(cmd, cwd=REPO, env=subprocess_env(REPO), capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(params=KINDS)
def parity(request, reports):
    """One kind's report: its runs."""
    return reports["kinds"][request.param]


def _run(report: dict, drafter: str, temperature: float) -> dict:
    (run,) = [r for r in report["runs"] if r["drafter"] == drafter and r["temperature"] == temperature]
    return run


def mismatches(reference: list[dict], engine: list[dict]) -> list[str]:
    """Every difference between two runs' decodes: (prompt, cycle) drafted tokens, accepted lengths per cycle and
    per position, committed tokens."""
    found = []
    for p, (a, b) in enumerate(zip(reference, engine, strict=True)):
        if len(a["cycles"]) != len(b["cycles"]):
            found.append(f"prompt {p}: {len(a['cycles'])} cycles vs {len(b['cycles'])}")
        for c, (x, y) in enumerate(zip(a["cycles"], b["cycles"], strict=False)):
            if x != y:
                found.append(f"prompt {p} cycle {c}: drafted {x} vs {y}")
        if a["accepted"] != b["accepted"]:
            found.append(f"prompt {p}: accepted per cycle {a['accepted']} vs {b['accepted']}")
        if a["accepted_per_pos"] != b["accepted_per_pos"]:
            found.append(f"prompt {p}: accepted per position {a['accepted_per_pos']} vs {b['accepted_per_pos']}")
        if a["tokens"] != b["tokens"]:
            found.append(f"prompt {p}: committed tokens differ")
    return found


def test_the_interpreter_needs_the_mask_fix_and_runs_vllms_kernels_with_it(reports):
    # the harness ran vLLM's kernels (the parity runs below exist) only through the fix; without it, the bug
    assert "mask has unsupported dtype" in reports["interpreter_mask_bug"]
    assert sorted(reports["kinds"]) == sorted(KINDS)


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_reference_drafts_what_vllms_speculator_drafts(parity, drafter, temperature):
    run = _run(parity, drafter, temperature)
    assert mismatches(run["reference"], run["engine"]) == []
    assert sum(len(d["cycles"]) for d in run["engine"]) >= 12  # enough cycles to compare
    if temperature > 0:  # the draft distributions rejection sampling reads are the same, not only the drafts
        assert run["max_draft_logit_diff"] is not None and run["max_draft_logit_diff"] < 1e-4
    else:
        assert run["max_draft_logit_diff"] is None  # greedy: vLLM keeps no draft logits
        # the kind's head changes vLLM's greedy drafts (walk / Markov bias): a reference that ignored it would fail
        assert run["not_argmax"] >= 3
        # vLLM's own greedy rejection sampling of the engine run's blocks accepts what the reference accepted
        for ours, engine in zip(run["reference"], run["engine"], strict=True):
            assert engine["vllm_accepted"] == ours["accepted"]


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_one_changed_reference_token_fails_the_comparison(parity, drafter, temperature):
    run = _run(parity, drafter, temperature)
    found = mismatches(run["mutated"], run["engine"])
    assert any(line.startswith("prompt 0 cycle 1: drafted") for line in found), found


def test_the_trained_drafter_is_accepted_so_accepted_lengths_are_compared(parity):
    # a drafter the target never accepts would compare accepted lengths of zero only
    run = _run(parity, "trained", 0.0)
    assert sum(sum(d["accepted_per_pos"]) for d in run["engine"]) >= 5
    assert any(d["accepted_per_pos"][1] > 0 for d in run["engine"])  # beyond the first slot
