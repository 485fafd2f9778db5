"""The vLLM server command with the generate stage's engine settings, for servers the stage does not start itself.

slurm/generate-servers.sbatch runs one per task (then announces it in generate.server_registry once /health
answers): the local servers' command (dflash.generate.servers.server_command: dtype, max_model_len,
max_num_seqs, KV cache, the served model name the stage checks, seed, revision) bound to `--host`, the node's
address on a cluster (127.0.0.1, the default, everywhere else).

    python -m stages.generate --server-command 8000 [--server-host "$(hostname)"] [--params params.yaml]
        [--overlay params/gpu-qwen3.6-27b.yaml] [-S key=value ...]

Input: params and `${base.target_dir}/target.json` (+ config.json). Output: the command, shell-quoted, one line
(stages/generate.py prints it; no server is started here).
"""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path

from dflash.core.concurrency import resolve_max_num_seqs
from dflash.core.params import Params
from dflash.core.target_config import resolve, target_signature
from dflash.generate.servers import server_command
from dflash.generate.servers_backend import server_kwargs
from dflash.generate.stage import _worker_cfg, served_model


def server_command_line(params: Params, host: str, port: int) -> str:
    """The local servers' command (the stage's engine settings and served model name) bound to `host`."""
    signature = target_signature(Path(params.base.target_dir) / "config.json")
    pilot_json = Path(params.base.reports_dir) / "pilot.json"
    g = resolve_max_num_seqs(params.generate, pilot_json, False, signature)  # "auto": the pilot's choice
    params = dataclasses.replace(params, generate=g)
    info = resolve(params.base.target_dir)
    cfg = _worker_cfg(params, Path(g.out), "", info)
    cmd = server_command(params.generate, cfg.model, served_model(params, info), port, **server_kwargs(cfg))
    cmd[cmd.index("--host") + 1] = host
    return shlex.join(cmd)
