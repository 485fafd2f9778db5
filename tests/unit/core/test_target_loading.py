"""Loading a target fails, when a user can fix it, with one line naming the param and the fix:
a config that needs custom code while base.trust_remote_code is false (refused before any of it runs), a hub
id neither in the local hub cache nor reachable, a revision the model does not have, an unknown model id.

No network: the hub cache is a temporary HF_HOME laid out as huggingface_hub lays it (models--OWNER--NAME,
refs/main -> snapshots/COMMIT/config.json), HF_HUB_OFFLINE=1 stands for "no network", and the hub's own
answers for a missing revision / repository come from a local HTTP server (HF_ENDPOINT on 127.0.0.1) that
replies as the hub does (404 with its X-Error-Code header). huggingface_hub reads these settings when it is
imported, so each group runs in a subprocess. The custom code the configs point at would write a marker
file if it ever ran: no test runs it.
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from dflash.core.errors import UserError
from dflash.core.hf import load_config, load_target_model
from dflash.target.build import write_reference
from tests.helpers import REPO, repo_params
from tests.helpers.train import free_port

COMMIT = "89abcdef0123456789abcdef0123456789abcdef"


def custom_folder(folder: Path, marker: Path) -> Path:
    """A model folder whose config needs custom code; that code writes `marker` when it runs."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": "my_custom",
        "architectures": ["MyCustomForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_my.MyConfig", "AutoModelForCausalLM": "modeling_my.MyModel"},
        "hidden_size": 8,
    }
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("configuration_my.py", "modeling_my.py"):
        (folder / name).write_text(f"open({str(marker)!r}, 'w').write('custom code ran')\n")
    return folder


def hub_model_cache(home: Path, model: str, config: dict) -> None:
    """HF_HOME's hub cache holding `model` at COMMIT (refs/main) with only its config.json."""
    repo = home / "hub" / f"models--{model.replace('/', '--')}"
    (repo / "snapshots" / COMMIT).mkdir(parents=True)
    (repo / "snapshots" / COMMIT / "config.json").write_text(json.dumps(config))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)


def _target_params(tmp_path: Path, source: str, revision: str = ""):
    return repo_params(
        [f"target.source={source}", f"target.revision={revision}" if revision else "target.revision=''"],
    ).target


def test_custom_code_is_refused_naming_base_trust_remote_code(tmp_path):
    marker = tmp_path / "ran.txt"
    folder = custom_folder(tmp_path / "custom", marker)
    with pytest.raises(UserError, match=r"needs custom code .*base\.trust_remote_code=true; nothing was run"):
        write_reference(_target_params(tmp_path, str(folder)), tmp_path / "target", trust_remote_code=False)
    assert not (tmp_path / "target").exists()  # nothing recorded
    with pytest.raises(UserError, match=r"base\.trust_remote_code=true"):
        load_config(folder, None, trust_remote_code=False)
    # A target folder recorded earlier (say with the flag on), loaded now with it off: refused too.
    target = tmp_path / "recorded"
    target.mkdir()
    (target / "config.json").write_text((folder / "config.json").read_text())
    (target / "target.json").write_text(json.dumps({"source": str(folder), "model": str(folder), "revision": ""}))
    with pytest.raises(UserError, match=r"base\.trust_remote_code=true") as err:
        load_target_model(target, None, "cpu", trust_remote_code=False)
    assert "\n" not in str(err.value)
    assert not marker.exists()


# The errors met past our own check, straight from transformers: run in subprocesses (module docstring).
PROBE = """
import json, sys
sys.path.insert(0, sys.argv[1])
from dflash.core.errors import UserError
from dflash.core.hf import load_config
out = []
for model, revision in json.loads(sys.argv[2]):
    try:
        load_config(model, revision, trust_remote_code=False)
        out.append("loaded")
    except UserError as exc:
        out.append(str(exc))
print(json.dumps(out))
"""


def _probe(env: dict, cases: list[tuple[str, str]]) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, str(REPO), json.dumps(cases)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _env(home: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_") and k != "TRANSFORMERS_OFFLINE"}
    return {**env, "HF_HOME": str(home), **extra}


def test_offline_hub_ids_name_the_param_and_the_fix(tmp_path):
    home = tmp_path / "hf"
    hub_model_cache(home, "someorg/plain", {"model_type": "qwen3", "hidden_size": 8})
    hub_model_cache(home, "someorg/custom", {"model_type": "my_custom", "auto_map": {"AutoConfig": "x.Y"}})
    got = _probe(
        _env(home, HF_HUB_OFFLINE="1"),
        [("someorg/plain", ""), ("someorg/absent", ""), ("someorg/plain", "v2"), ("someorg/custom", "")],
    )
    assert got[0] == "loaded"
    assert got[1].startswith(
        f"target.source=someorg/absent: not in the local hub cache ({home / 'hub'}) and the hub cannot be reached "
        "(HF_HUB_OFFLINE is set); run once with network"
    ), got[1]
    assert got[2].startswith(
        f"target.revision='v2': not in the local hub cache of someorg/plain (it holds main, {COMMIT})"
    ), got[2]
    assert got[3].startswith(
        "target.source=someorg/custom: it needs custom code, which runs only with base.trust_remote_code=true"
    )


class _Hub(http.server.BaseHTTPRequestHandler):
    """Answers as the hub does for an unknown repository or revision (404 + X-Error-Code)."""

    def _reply(self) -> None:
        code = "RepoNotFound" if "/someorg/absent/" in self.path else "RevisionNotFound"
        self.send_response(404)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", f"{code} (test hub)")
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD = do_POST = _reply

    def log_message(self, *args) -> None:  # quiet
        pass


def test_hub_answers_for_a_missing_revision_or_repository_name_the_param(tmp_path):
    port = free_port()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), _Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = _env(tmp_path / "hf", HF_ENDPOINT=f"http://127.0.0.1:{port}")
        got = _probe(env, [("someorg/model", "nope"), ("someorg/absent", "")])
    finally:
        server.shutdown()
    assert got[0].startswith(
        "target.revision='nope': someorg/model has no such revision on the hub; set target.revision"
    ), got[0]
    assert got[1].startswith(
        "target.source=someorg/absent: not a local folder, and not a model on the hub that you can access"
    ), got[1]


def test_the_target_stage_prints_one_line(tmp_path):
    marker = tmp_path / "ran.txt"
    folder = custom_folder(tmp_path / "custom", marker)
    cmd = [sys.executable, "-m", "stages.target", "--params", "params.yaml", "-S", f"target.source={folder}"]
    cmd += ["-S", f"base.target_dir={tmp_path / 'target'}", "-S", f"base.reports_dir={tmp_path / 'reports'}"]
    proc = subprocess.run(
        cmd, cwd=REPO, env=_env(tmp_path / "hf", HF_HUB_OFFLINE="1"), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (last,) = [line for line in proc.stderr.strip().splitlines() if line.startswith("error:")]
    assert (
        f"target.source={folder}: its config.json needs custom code" in last and "base.trust_remote_code=true" in last
    )
    assert not marker.exists()
