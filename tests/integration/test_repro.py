"""Reproducibility of the real DVC pipeline, end to end on a tiny run:

- S3 round trip through DVC's own S3 remote (a moto server on 127.0.0.1): `make remote` + `make push`
  (dvc push --run-cache), `git clone` into a fresh folder, `make remote` + `make pull` there, then
  `dvc status --json` is `{}` and every output is byte-identical to the original;
- partial reruns: a changed param reruns only the stages that read it and what depends on them
  (`dvc status` names only those, `dvc repro` skips the rest and leaves their dvc.lock entries alone).
  Checked on real runs, never with `dvc repro --dry` (it errors on fresh checkouts and exits 0 anyway).

One module fixture copies this repo's tracked files into a throw-away git repo, writes a TINY params.yaml
(16 conversations, an untrained small target, 16-token completions) and runs `dvc repro` once (~2 min on
2 cores). Each test then works in its own `git clone` of it, so the tests do not depend on their order.

Extending: when a stage lands, give it tiny settings in TINY; the rerun cases in PARTIAL_RERUNS are data
(the param to change, the stages `dvc status` must name, the stages `dvc repro` must run: every other stage
of dvc.yaml must be skipped).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from dflash.core.metrics import MAX_SHOWN, shown_values
from tests.helpers import REPO
from tests.helpers.dvc import changed_stages, dvc_env, write_params
from tests.helpers.inputs import distinct_sample_rows
from tests.helpers.models import NARROW_TARGET

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


# Overrides of params.yaml for the tiny run (section.key=value, as in `dvc exp run -S`).
TINY = [
    "target.tiny.steps=0",  # untrained weights: built in seconds
    "target.tiny.margin_prompts=0",  # no margin report: an untrained target's decisions are near-ties (its gate)
    *NARROW_TARGET,  # a ~90 MB target to push and pull
    "audit.input=data/tiny.jsonl",  # written by the fixture: 16 conversations of data/sample
    "generate.pilot_samples=4",
    "generate.unit_size=8",
    "generate.max_model_len=512",
    "generate.sampling.max_tokens=16",
    # An untrained target rambles until the budget: keep its truncated, same-length completions (the spike
    # gate would rightly fail 100% of samples at 16 tokens, so it only reports here).
    "tokenize.drop_truncated=false",
    "tokenize.drop_missing_think_end=false",
    "tokenize.eval_count=3",
    "tokenize.gates.loss_mask_sum_mode_frac.action=report",
    "drafter.block_size=4",
    "train.epochs=1",
    "train.num_anchors=4",
    "eval.engines=[dflash]",  # one engine start; the baselines are covered by tests/integration/test_eval_stage.py
    "eval.num_prompts=3",
    "eval.max_tokens=16",
    "eval.max_model_len=512",
]
NUM_CONVERSATIONS = 16

# name: (override, stages `dvc status` names, stages `dvc repro` runs). A training knob reruns training and
# what reads its drafter (eval) or its metrics (the plan's calibration), never generation nor the training pilot
# (the learning rate shapes no step time); a sampling param reruns generation and everything after it (the plan
# reads the pilot, tokenize, train pilot and stage metrics), never audit or the target. The report stage reads
# every stage's outputs, so it reruns after any of them.
PARTIAL_RERUNS = {
    "train_param": ("train.lr=1.0e-3", {"train"}, {"train", "eval", "plan", "report"}),
    "sampling_param": (
        "generate.sampling.max_tokens=12",
        {"pilot", "generate"},
        {"pilot", "generate", "plan", "tokenize", "train_pilot", "train", "eval", "report"},
    ),
}

DUMMY_AWS = {  # the moto server accepts any keys; distinctive values so that a leak is detectable
    # (joined at run time: the values must not appear literally in this tracked file, which the leak check greps)
    "AWS_ACCESS_KEY_ID": "-".join(["dflash", "test", "key", "id"]),
    "AWS_SECRET_ACCESS_KEY": "-".join(["dflash", "test", "secret", "value"]),
    "AWS_DEFAULT_REGION": "us-east-1",
}


def run(cmd: list[str], cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, cwd=cwd, env=dvc_env(), capture_output=True, text=True)
    if check and result.returncode != 0:
        pytest.fail(
            f"{' '.join(cmd)} failed ({result.returncode}) in {cwd}:\n{(result.stdout + result.stderr)[-4000:]}"
        )
    return result


def git_commit(repo: Path, message: str) -> None:
    run(["git", "add", "-A"], repo)
    run(["git", "-c", "commit.gpgsign=false", "commit", "-q", "-m", message], repo)


def dvc_status(repo: Path) -> dict:
    """What `dvc status` says has changed (always-changed stages, which it always names, left out)."""
    return changed_stages(json.loads(run(["dvc", "status", "--json"], repo).stdout.strip() or "{}"))


def lock_stages(repo: Path) -> dict:
    return yaml.safe_load((repo / "dvc.lock").read_text())["stages"]


def out_hashes(repo: Path) -> dict[str, str]:
    """sha256 of every file of every output recorded in dvc.lock (directories file by file)."""
    hashes = {}
    for name, stage in lock_stages(repo).items():
        for out in stage.get("outs", []):
            path = repo / out["path"]
            files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
            assert files, f"stage {name}: output {out['path']} is missing or empty"
            for f in files:
                hashes[str(f.relative_to(repo))] = hashlib.sha256(f.read_bytes()).hexdigest()
    return hashes


def write_tiny_input(repo: Path) -> None:
    """The first NUM_CONVERSATIONS well-formed conversations of the bundled sample with distinct first prompts."""
    rows = distinct_sample_rows(NUM_CONVERSATIONS)
    assert len(rows) >= NUM_CONVERSATIONS, "data/sample has too few usable conversations"
    (repo / "data/tiny.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture(scope="module")
def tiny_repo(tmp_path_factory) -> Path:
    """A git repo holding this project's tracked files, TINY params, and one committed full `dvc repro`."""
    repo = tmp_path_factory.mktemp("repro") / "repo"
    tracked = run(["git", "ls-files", "-z"], REPO).stdout.split("\0")
    for rel in filter(None, tracked):
        src = REPO / rel
        if src.is_file():  # tracked but deleted in this checkout: skip
            (repo / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, repo / rel)
    write_params(repo, TINY)
    write_tiny_input(repo)
    run(["git", "init", "-q"], repo)
    git_commit(repo, "tiny params")
    run(["dvc", "repro"], repo)
    git_commit(repo, "tiny run: dvc.lock + reports")
    assert dvc_status(repo) == {}
    return repo


def clone(src: Path, dest: Path, share_cache: bool) -> Path:
    run(["git", "clone", "-q", str(src), str(dest)], dest.parent)
    if share_cache:  # outputs come from the source's cache (no recomputation, no remote)
        run(["dvc", "cache", "dir", "--local", str(src / ".dvc/cache")], dest)
        run(["dvc", "checkout"], dest)
    return dest


# ------------------------------------------------------------------------------------ S3 round trip


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory):
    """A moto S3 server on 127.0.0.1 (random port). Dummy credentials live only in the environment
    (never in a file); AWS config files point nowhere so that a developer's real ones are never read."""
    from moto.server import ThreadedMotoServer

    nowhere = tmp_path_factory.mktemp("aws") / "absent"
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        with pytest.MonkeyPatch.context() as mp:
            for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
                mp.delenv(key, raising=False)
            for key, value in DUMMY_AWS.items():
                mp.setenv(key, value)
            mp.setenv("AWS_CONFIG_FILE", str(nowhere))
            mp.setenv("AWS_SHARED_CREDENTIALS_FILE", str(nowhere))
            yield f"http://{host}:{port}"
    finally:
        server.stop()


def test_s3_round_trip_restores_identical_outputs(tiny_repo, s3_endpoint, tmp_path):
    import boto3

    bucket = "dflash-repro"
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    s3.create_bucket(Bucket=bucket)
    remote = ["make", "-s", "remote", f"BUCKET={bucket}/cache", f"ENDPOINT={s3_endpoint}"]

    logs = run(remote, tiny_repo).stdout
    logs += run(["make", "-s", "push"], tiny_repo).stdout
    keys = [
        o["Key"]
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket)
        for o in page.get("Contents", [])
    ]
    assert any(k.startswith("cache/files/md5/") for k in keys), keys[:10]
    assert any(k.startswith("cache/runs/") for k in keys), "the run cache was not pushed"

    fresh = clone(tiny_repo, tmp_path / "fresh", share_cache=False)
    assert not (fresh / ".dvc/config.local").exists()  # remote settings are per machine, never in git
    assert not (fresh / "artifacts").exists()
    logs += run(remote, fresh).stdout
    logs += run(["make", "-s", "pull"], fresh).stdout
    assert dvc_status(fresh) == {}
    assert out_hashes(fresh) == out_hashes(tiny_repo)

    # Credentials stayed in the environment: not in any config file, tracked file or log.
    for repo in (tiny_repo, fresh):
        assert run(["git", "status", "--porcelain"], repo).stdout == "", "make remote/push/pull changed tracked files"
        config = (repo / ".dvc/config.local").read_text()
        assert f"url = s3://{bucket}/cache" in config and f"endpointurl = {s3_endpoint}" in config
        for secret in (DUMMY_AWS["AWS_ACCESS_KEY_ID"], DUMMY_AWS["AWS_SECRET_ACCESS_KEY"]):
            assert secret not in config + (repo / ".dvc/config").read_text() + logs
            assert run(["git", "grep", "-q", secret], repo, check=False).returncode == 1


# ---------------------------------------------------------------------------------- partial reruns


@pytest.mark.parametrize("case", sorted(PARTIAL_RERUNS))
def test_changed_param_reruns_only_the_stages_that_depend_on_it(tiny_repo, tmp_path, case):
    override, status_expected, rerun_expected = PARTIAL_RERUNS[case]
    repo = clone(tiny_repo, tmp_path / "work", share_cache=True)
    defined = yaml.safe_load((repo / "dvc.yaml").read_text())["stages"]
    stages, always = list(defined), {name for name, stage in defined.items() if stage.get("always_changed")}
    assert status_expected <= rerun_expected <= set(stages)
    assert dvc_status(repo) == {}
    before = lock_stages(repo)

    write_params(repo, [override])
    status = dvc_status(repo)
    assert set(status) == status_expected, status

    output = run(["dvc", "repro"], repo).stdout
    for stage in stages:
        if stage in always:  # runs on every repro; its unchanged output (checked below) is what keeps the rest
            assert f"Running stage '{stage}'" in output, f"{stage} is always_changed:\n{output[-3000:]}"
        elif stage in rerun_expected:
            assert f"Running stage '{stage}'" in output, f"{stage} should have rerun:\n{output[-3000:]}"
        else:
            assert f"Stage '{stage}' didn't change, skipping" in output, f"{stage} should be skipped:\n{output[-3000:]}"
    after = lock_stages(repo)
    for stage in stages:
        if stage in rerun_expected:
            assert stage in after
        else:
            assert after[stage] == before[stage], f"dvc.lock entry of untouched stage {stage} changed"
    for stage in status_expected:
        assert after[stage]["params"] != before[stage]["params"], f"{stage}: the new param value is not recorded"
    assert dvc_status(repo) == {}


def test_pipeline_reports_hold_their_contract_keys(tiny_repo):
    """The tiny run wrote every stage's metrics with the keys downstream tools and the README rely on."""
    reports = tiny_repo / "reports"
    contract = {
        "pilot.json": ["output_tokens_per_s", "mean_output_tokens", "p90_output_tokens", "estimated_total_hours"],
        "generate.json": [
            "num_prompts",
            "num_completed",
            "num_skipped",
            "num_failed",
            "output_tokens",
            "output_tokens_per_s",
            "finish_length_frac",
        ],
        "tokenize.json": ["num_samples", "total_tokens", "loss_tokens", "loss_token_frac", "loss_mask_sum_mode_frac"],
        "eval.json": ["tau", "tau_reference", "acceptance", "speedup", "num_prompts"],
        "eval_details.json": ["acceptance_per_position", "engines", "reference", "goal", "notes"],
    }
    for name, keys in contract.items():
        data = json.loads((reports / name).read_text())
        assert not [k for k in keys if k not in data], f"{name} lacks {[k for k in keys if k not in data]}"
    pilot = json.loads((reports / "pilot.json").read_text())
    assert pilot["pilot_prompts"] == 4 and pilot["estimated_total_hours"] > 0
    notes = json.loads((reports / "pilot_details.json").read_text())["notes"]
    assert any("lower bound" in n for n in notes)  # 4 prompts never fill the engine: said so
    gen = json.loads((reports / "generate.json").read_text())
    assert gen["num_completed"] + gen["num_skipped"] + gen["num_failed"] == gen["num_prompts"]
    # Every DVC metrics file holds headline numbers only; what is left out is in its details file.
    for name, stage in yaml.safe_load((tiny_repo / "dvc.yaml").read_text())["stages"].items():
        for entry in stage.get("metrics", []):
            path = tiny_repo / (next(iter(entry)) if isinstance(entry, dict) else entry).replace(
                "${base.reports_dir}", "reports"
            )
            data = json.loads(path.read_text())
            assert shown_values(data) <= MAX_SHOWN, f"stage {name}: {path.name} shows {shown_values(data)} values"
    dvc_show = run(["dvc", "metrics", "show", "--json"], tiny_repo).stdout
    shown = sum(shown_values(v["data"]) for v in json.loads(dvc_show)[""]["data"].values())
    print(f"dvc metrics show: {shown} values in all")
