"""Generate's engines backend against a prompt that kills its engine every time it is scheduled (real vLLM, the
tiny target): the unit is searched for that request, which becomes one failed turn; every other prompt of the unit
is generated with exactly the ids an unpoisoned run gives (temperature 0), and a rerun asks for exactly that turn.

The poison is the worker's test hook (contract.POISON_ENV): the worker process exits in the engine step that would
run a prompt holding the text, as a crash of the engine on that prompt would take it down.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from dflash.core.io import list_shards, read_arrow, read_json
from dflash.generate import contract
from tests.helpers import REPO
from tests.helpers.generate import generate_cmd
from tests.helpers.inputs import write_conversations

# 2 in flight: the poison search halves 2 suspects to 1 (each halving is an engine death and a restart)
OVERRIDES = (
    "generate.unit_size=4",
    "generate.max_num_seqs=2",
    "generate.unit_retries=1",
    "generate.engine_start_retries=1",
)
POISON = "Recite the forbidden verse."


def _rows(ws: Path) -> dict[str, dict]:
    run_dir = Path(read_json(ws / "reports" / "generate_details.json")["run_dir"])
    return {r["sample_id"]: r for s in list_shards(run_dir, "unit-*.arrow") for r in read_arrow(s).to_pylist()}


def _run(ws: Path, target: Path, poison: bool) -> subprocess.CompletedProcess:
    env = {**os.environ, contract.POISON_ENV: POISON} if poison else None
    return subprocess.run(generate_cmd(ws, target, *OVERRIDES), cwd=REPO, capture_output=True, text=True, env=env)


@pytest.mark.slow
@pytest.mark.vllm
def test_a_prompt_that_kills_the_engine_is_one_failed_turn(tmp_path, tiny_target, sample_conversations):
    convs = [list(c) for c in sample_conversations[:8]]
    bad = 5  # two regenerated turns, in unit 1 (conversations 4-7)
    assert len(contract.generation_targets(convs[bad])) == 2
    first_user = next(i for i, m in enumerate(convs[bad]) if m["role"] == "user")
    convs[bad][first_user] = {"role": "user", "content": f"{POISON} {convs[bad][first_user]['content']}"}
    spaces = {}
    for name in ("reference", "poisoned"):
        ws = tmp_path / name
        write_conversations(ws / "audit" / "conversations.arrow", convs)
        spaces[name] = ws
    ref = _run(spaces["reference"], tiny_target, poison=False)
    assert ref.returncode == 0, ref.stderr[-3000:]
    expected = _rows(spaces["reference"])

    ws = spaces["poisoned"]
    out = _run(ws, tiny_target, poison=True)
    assert out.returncode == 1, out.stderr[-3000:]
    # The stage's own last word (vLLM's dying processes may print their warnings after it).
    (last,) = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert "1 turn(s) failed (1 engine_died" in last, last
    rows = _rows(ws)
    assert set(rows) == set(expected), "every prompt has its row"
    failed = [sid for sid, r in rows.items() if r["status"] == "failed"]
    cid = rows[failed[0]]["conversation_id"]
    assert failed == [f"{cid}:0"] and rows[failed[0]]["skip_reason"] == "engine_died"
    assert (rows[f"{cid}:1"]["status"], rows[f"{cid}:1"]["skip_reason"]) == ("skipped", "earlier_turn_failed")
    for sid, r in rows.items():
        if r["conversation_id"] != cid:  # every other prompt, its own unit's included: generated, and as before
            assert r["status"] == expected[sid]["status"] and r["completion_ids"] == expected[sid]["completion_ids"], (
                sid
            )
    m = read_json(ws / "reports" / "generate_details.json")
    assert m["failed_by_reason"] == {"engine_died": 1} and m["units_failed"] == []
    assert [t["sample_id"] for t in m["failed_turns"]] == failed
    assert not (ws / "generate" / "current.json").exists()

    # The rerun without the poison asks for the failed turn (and the one it skipped) and nothing else.
    again = _run(ws, tiny_target, poison=False)
    assert again.returncode == 0, again.stderr[-3000:]
    m = read_json(ws / "reports" / "generate_details.json")
    assert m["units_reopened"] == 1 and m["units_reused"] == 1 and m["num_failed"] == 0
    final = _rows(ws)
    assert final[f"{cid}:0"]["status"] == "completed"
    for sid, r in expected.items():  # the kept rows and the two asked again: as the unpoisoned run made them
        assert (final[sid]["status"], final[sid]["completion_ids"]) == (r["status"], r["completion_ids"]), sid
