"""Generate stage: turn policy, resume identity, and real vLLM runs (kill / resume, crash / retry).

The vLLM tests run `python -m stages.generate` as a subprocess against the session's tiny target, so
a SIGKILL hits a real process tree (dispatcher, worker, vLLM engine core) exactly as a crash would.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
from pathlib import Path

import pytest
from conftest import REPO, generate_cmd, write_conversations

from dflash.core.errors import UserError
from dflash.core.io import file_sha256, list_shards, read_arrow, read_json
from dflash.core.loader import load_params
from dflash.core.processes import kill_tree
from dflash.generate import contract
from dflash.generate import stage as gen

U = {"role": "user", "content": "What is 2 + 2?"}
A = {"role": "assistant", "content": "OK."}
S = {"role": "system", "content": "Be brief."}
CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
}
TOOL = {"role": "tool", "tool_call_id": "c1", "content": "{}"}


# ---------------------------------------------------------------------------------------------- policy


@pytest.mark.parametrize(
    "messages,expected",
    [
        ([U], [1]),  # prompt only: one final turn
        ([U, A], [1]),  # the recorded placeholder is replaced
        ([S, U, A, U, A], [2, 4]),  # every assistant turn, in order
        ([U, A, U], [1, 3]),  # ends with a user turn: a final turn is appended
        ([U, CALL, TOOL, A], [3]),  # the tool-call turn is kept as recorded; the answer after it is regenerated
        ([U, CALL, TOOL], [3]),  # ends with a tool result: the model answers it
    ],
)
def test_generation_targets(messages, expected):
    assert contract.generation_targets(messages) == expected


def test_request_seed_is_stable_and_distinct():
    assert contract.request_seed(0, "abc:0") == contract.request_seed(0, "abc:0")
    assert contract.request_seed(0, "abc:0") != contract.request_seed(0, "abc:1")
    assert contract.request_seed(0, "abc:0") != contract.request_seed(1, "abc:0")


def test_unit_names_follow_their_members():
    convs = [{"conversation_id": f"c{i}", "messages": [U], "tools": None} for i in range(10)]
    a = gen.make_units(convs, 4)
    changed = convs[:5] + [{"conversation_id": "new", "messages": [U], "tools": None}] + convs[6:]
    b = gen.make_units(changed, 4)
    assert [u.name for u in a][0] == [u.name for u in b][0]  # untouched unit: reused on resume
    assert a[1].name != b[1].name  # a changed member: never reuses the stale shard
    assert a[2].name == b[2].name


def test_split_reasoning_at_think_end(qwen_tokenizer):
    ids = qwen_tokenizer("<think>\nadd them\n</think>\n\nThe answer is 4.<|im_end|>", add_special_tokens=False)[
        "input_ids"
    ]
    end = qwen_tokenizer.convert_tokens_to_ids("</think>")
    assert contract.split_reasoning(qwen_tokenizer, ids, end) == ("add them", "The answer is 4.", True)
    cut = ids[: ids.index(end)]  # truncated before </think>
    assert contract.split_reasoning(qwen_tokenizer, cut, end)[2] is False


def test_duplicate_conversation_ids_are_refused(tmp_path):
    path = tmp_path / "conversations.arrow"
    write_conversations(path, [[U, A], [S, U], [U, A]])
    with pytest.raises(UserError, match=r"conversations\.arrow: conversation_id \w+ appears at rows 0 and 2"):
        gen.load_conversations(path)


def test_run_identity_changes_with_outputs_not_with_engine_sizing(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"w")
    (tmp_path / "tokenizer.json").write_text("{}")
    info = {"source": "tiny", "model": str(tmp_path)}

    def ident(*overrides):
        return gen.run_identity(load_params(REPO / "params.yaml", list(overrides)), info, tmp_path)

    base = ident()
    assert ident("generate.num_engines=4", "generate.max_num_seqs=8") == base
    assert ident("generate.sampling.temperature=0.7") != base
    assert ident("base.enable_thinking=false") != base
    (tmp_path / "model.safetensors").write_bytes(b"other weights")
    assert ident() != base


# ---------------------------------------------------------------------------------------------- vLLM


def _rows(run_dir: Path) -> list[dict]:
    rows = []
    for shard in list_shards(run_dir, "unit-*.arrow"):
        rows.extend(read_arrow(shard).to_pylist())
    return rows


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, sample_conversations):
    ws = tmp_path_factory.mktemp("generate")
    (ws / "audit").mkdir()
    write_conversations(ws / "audit" / "conversations.arrow", sample_conversations)
    return ws


@pytest.fixture(scope="module")
def reference(workspace, tiny_target):
    """One uninterrupted run: the outputs every interrupted run must reproduce."""
    ws = workspace / "reference"
    ws.mkdir()
    (ws / "audit").symlink_to(workspace / "audit")
    out = subprocess.run(
        generate_cmd(ws, tiny_target, "generate.unit_size=8"), cwd=REPO, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = read_json(ws / "reports" / "generate_details.json")
    return {"metrics": metrics, "rows": _rows(Path(metrics["run_dir"]))}


@pytest.mark.slow
@pytest.mark.vllm
def test_reference_run_accounts_for_every_prompt(reference, sample_conversations):
    m = reference["metrics"]
    assert m["num_prompts"] == contract.count_prompts(
        [{"conversation_id": str(i), "messages": c, "tools": None} for i, c in enumerate(sample_conversations)]
    )
    assert m["num_completed"] + m["num_skipped"] + m["num_failed"] == m["num_prompts"]
    ids = [r["sample_id"] for r in reference["rows"]]
    assert len(ids) == len(set(ids)) == m["num_prompts"]
    done = [r for r in reference["rows"] if r["status"] == "completed"]
    assert done and all(r["prompt_ids"] and r["completion_ids"] for r in done)
    stopped = [r for r in done if r["finish_reason"] == "stop"]
    assert stopped and all(r["completion_ids"][-1] == 151645 for r in stopped)  # <|im_end|> kept verbatim
    # Multi-turn: the second turn's prompt holds the model's own first answer, not the placeholder.
    second = next(r for r in done if r["turn_index"] == 1)
    first = next(r for r in reference["rows"] if r["sample_id"] == f"{second['conversation_id']}:0")
    history = json.loads(second["messages"])
    assert any(m["role"] == "assistant" and m["content"] == first["answer"] for m in history)


@pytest.mark.slow
@pytest.mark.vllm
def test_sigkill_and_resume_loses_and_duplicates_nothing(workspace, tiny_target, reference):
    """SIGKILL the whole process tree at random moments, resume each time, then finish."""
    ws = workspace / "killed"
    ws.mkdir()
    (ws / "audit").symlink_to(workspace / "audit")
    cmd = generate_cmd(ws, tiny_target, "generate.unit_size=8")
    rng = random.Random(1234)
    committed: dict[str, str] = {}  # shard name -> sha256 at the time of a kill
    kills = 0
    for attempt in range(2):  # two kills at random moments (each restart costs an engine start, ~35 s)
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        run_dirs = []
        deadline = time.time() + 240
        before = len(committed)
        # Wait until this attempt commits a new unit, then kill after a random extra delay.
        while time.time() < deadline and proc.poll() is None:
            run_dirs = list((ws / "generate").glob("run-*"))
            if run_dirs and len(list_shards(run_dirs[0], "unit-*.arrow")) > before:
                break
            time.sleep(0.2)
        time.sleep(rng.uniform(0.0, 1.5))
        if proc.poll() is None:
            kill_tree(proc.pid)  # the whole tree: dispatcher, worker, vLLM engine core
            kills += 1
        assert run_dirs, f"attempt {attempt}: no run folder appeared"
        for shard in list_shards(run_dirs[0], "unit-*.arrow"):
            committed.setdefault(shard.name, file_sha256(shard))
    assert kills >= 2, "the run finished before it could be killed: make the workload larger"
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = read_json(ws / "reports" / "generate_details.json")
    run_dir = Path(metrics["run_dir"])
    assert metrics["units_reused"] >= 1
    # Units committed before a kill are byte-identical afterwards.
    for name, sha in committed.items():
        assert file_sha256(run_dir / name) == sha, f"{name} changed after resume"
    assert not list(run_dir.glob(".*.tmp")), "half-written shards left behind"
    rows = _rows(run_dir)
    ids = [r["sample_id"] for r in rows]
    assert len(ids) == len(set(ids)), "a sample id appears twice"
    ref = {r["sample_id"]: r for r in reference["rows"]}
    assert set(ids) == set(ref), "samples lost or invented"
    # Temperature 0: the resumed run reproduces the uninterrupted one. Measured, not hidden: any
    # difference would come from CPU numerics under a different batch composition.
    differ = [r["sample_id"] for r in rows if r["completion_ids"] != ref[r["sample_id"]]["completion_ids"]]
    print(f"kill/resume: {kills} kills, {len(differ)}/{len(rows)} completions differ from the uninterrupted run")
    assert not differ, f"{len(differ)} of {len(rows)} completions differ: {differ[:5]}"


def _engine_processes() -> set[int]:
    """pids of running vLLM engine processes (vLLM names them VLLM::EngineCore, VLLM::Worker...)."""
    import psutil

    found = set()
    for proc in psutil.process_iter(["pid", "name", "cmdline"]):
        text = f"{proc.info['name']} {' '.join(proc.info['cmdline'] or [])}"
        if "VLLM::" in text:
            found.add(proc.info["pid"])
    return found


@pytest.mark.slow
@pytest.mark.vllm
def test_engine_crash_retries_then_fails_only_the_bad_unit(workspace, tiny_target, sample_conversations):
    ws = workspace / "crash"
    (ws / "audit").mkdir(parents=True)
    convs = sample_conversations[:12]
    write_conversations(ws / "audit" / "conversations.arrow", convs)
    # vLLM's own engine-core processes (the GPU setting): a dead worker's engine cores must not be left running
    cmd = generate_cmd(
        ws, tiny_target, "generate.unit_size=4", "generate.max_unit_retries=1", "generate.engine_core_process=true"
    )
    env = {**os.environ, contract.CRASH_ENV: "1"}  # the worker dies whenever it receives unit 1
    before = _engine_processes()
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    assert out.returncode == 1
    left = _engine_processes() - before
    for _ in range(10):  # a killed process is listed until the OS has reaped it: allow a few seconds for that
        if not left:
            break
        time.sleep(0.5)
        left &= _engine_processes()
    assert not left, "engine-core processes left running after the stage exited"
    assert "unit-00001" in out.stderr and "failed after retries" in out.stderr
    m = read_json(ws / "reports" / "generate_details.json")
    bad = gen.make_units(gen.load_conversations(ws / "audit" / "conversations.arrow"), 4)[1]
    assert m["num_failed"] == contract.count_prompts(bad.conversations)
    assert m["num_completed"] + m["num_skipped"] + m["num_failed"] == m["num_prompts"]
    assert [u["unit"] for u in m["units_failed"]] == [1]
    names = {p.name for p in list_shards(Path(m["run_dir"]), "unit-*.arrow")}
    assert names == {
        u.name for u in gen.make_units(gen.load_conversations(ws / "audit" / "conversations.arrow"), 4)
    } - {bad.name}
    assert not (ws / "generate" / "current.json").exists()  # an incomplete run is never marked current
