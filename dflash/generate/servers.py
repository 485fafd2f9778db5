"""OpenAI-compatible inference servers for the `servers` backend: start local vLLM servers, check that a
server serves the expected model, and send one completion request (token ids in, token ids out).

    local_servers(g, model, ...)     context manager: `g.num_engines` vLLM api_server processes on 127.0.0.1
                                     (free ports, one per device group), healthy on entry, killed on exit
                                     (also on an error or Ctrl-C; on Linux a SIGKILL of the stage sends them
                                     SIGTERM: no orphaned server); yields their base URLs
    check_servers(urls, model, g)    GET {url}/models lists `model` (and max_model_len >= generate.max_model_len
                                     where exposed), else a UserError naming the URL and both values
    complete(url, req, g, model)     POST {url}/completions; a ServerError says whether the server is down
    healthy(url)                     GET <url without /v1>/health answers 200

A base URL is what OpenAI clients take (http://node7:8000/v1); /health and /version live beside /v1. Only the
listed URLs and 127.0.0.1 are ever contacted. The stdlib HTTP client only: no new dependency.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dflash.core.errors import UserError
from dflash.core.params import GenerateParams, kv_cache_bytes
from dflash.core.processes import kill_tree, local_only_vllm
from dflash.generate.engines import device_groups
from dflash.generate.turns import Request

log = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 5.0  # one /health probe
START_TIMEOUT_S = 1800.0  # a local server's start (weights load, graph capture)


class ServerError(Exception):
    """A failed request. `down`: the server refused the connection (nothing listens: it is gone)."""

    def __init__(self, url: str, reason: str, down: bool = False):
        super().__init__(f"{url}: {reason}")
        self.url, self.reason, self.down = url, reason, down


def root_url(url: str) -> str:
    """The server root of a base URL: http://h:8000/v1 -> http://h:8000 (where /health and /version are)."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _get_json(url: str, timeout: float) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (http(s) only: validate.py)
        return json.loads(resp.read().decode("utf-8"))


def healthy(url: str, timeout: float = HEALTH_TIMEOUT_S) -> bool:
    try:
        with urllib.request.urlopen(root_url(url) + "/health", timeout=timeout) as resp:  # noqa: S310
            return resp.status == 200
    except (OSError, http.client.HTTPException):
        return False


def server_version(url: str) -> str:
    """The engine version a server reports at /version ("" when it does not say)."""
    try:
        return str(_get_json(root_url(url) + "/version", HEALTH_TIMEOUT_S).get("version", ""))
    except (OSError, http.client.HTTPException, ValueError, AttributeError):
        return ""


def check_servers(urls: list[str], model: str, g: GenerateParams) -> dict[str, str]:
    """Every server lists `model` at /models and holds generate.max_model_len where it says its own;
    {url: engine version}. A UserError names the URL and both values on a mismatch."""
    versions = {}
    for url in urls:
        try:
            cards = _get_json(url.rstrip("/") + "/models", HEALTH_TIMEOUT_S * 6).get("data", [])
        except (OSError, http.client.HTTPException, ValueError, AttributeError) as exc:
            raise UserError(f"generate.server_urls: {url}/models did not answer ({exc}); is the server up?") from None
        ids = [c.get("id") for c in cards if isinstance(c, dict)]
        card = next((c for c in cards if isinstance(c, dict) and c.get("id") == model), None)
        if card is None:
            raise UserError(
                f"generate.server_urls: {url} serves {ids}, not the expected model {model!r} "
                "(start it with --served-model-name, or set generate.server_model)"
            )
        mml = card.get("max_model_len")
        if isinstance(mml, int) and mml < g.max_model_len:
            raise UserError(
                f"generate.server_urls: {url} serves {model!r} with max_model_len {mml}, below "
                f"generate.max_model_len {g.max_model_len} (start it with --max-model-len {g.max_model_len})"
            )
        versions[url] = server_version(url)
    return versions


def request_body(req: Request, g: GenerateParams, model: str) -> dict:
    """The completions request of one turn: the engines backend's sampling, every field explicit (a server
    would otherwise fill unset ones from the model's generation_config)."""
    s = g.sampling
    body = {
        "model": model,
        "prompt": req.ids,
        "max_tokens": s.max_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "seed": req.seed,
        "return_token_ids": True,
        "stream": False,
    }
    if s.stop:
        body["stop"] = list(s.stop)
    return body


def complete(url: str, req: Request, g: GenerateParams, model: str) -> dict:
    """One completion: {"token_ids", "text", "finish_reason"}; ServerError on any failure."""
    data = json.dumps(request_body(req, g, model)).encode("utf-8")
    http_req = urllib.request.Request(
        url.rstrip("/") + "/completions", data=data, headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(http_req, timeout=g.request_timeout_s) as resp:  # noqa: S310
            out = json.loads(resp.read().decode("utf-8"))
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:300].decode("utf-8", "replace")
        raise ServerError(url, f"HTTP {exc.code}: {detail}") from None
    except urllib.error.URLError as exc:
        refused = isinstance(exc.reason, ConnectionRefusedError)
        raise ServerError(url, f"{exc.reason!r}", down=refused) from None
    except ConnectionRefusedError as exc:
        raise ServerError(url, repr(exc), down=True) from None
    except (OSError, http.client.HTTPException, ValueError) as exc:  # timeout, reset, bad reply
        raise ServerError(url, repr(exc)) from None
    try:
        choice = out["choices"][0]
        ids = choice["token_ids"]
    except (KeyError, IndexError, TypeError):
        raise ServerError(url, f"reply without choices[0].token_ids (an old vLLM?): {str(out)[:200]}") from None
    if not isinstance(ids, list):
        raise ServerError(url, "choices[0].token_ids is not a list (the server ignores return_token_ids)")
    return {"token_ids": ids, "text": choice.get("text") or "", "finish_reason": str(choice.get("finish_reason"))}


# ------------------------------------------------------------------------------------------ local servers


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(g: GenerateParams, model: str, served_name: str, port: int, **kw: Any) -> list[str]:
    """`python -m vllm.entrypoints.openai.api_server` with the engine settings of `generate` (the engines
    backend's engine_kwargs, as flags); `kw`: revision, seed, trust_remote_code, max_num_seqs."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--tokenizer", model]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", served_name]
    cmd += ["--dtype", g.dtype, "--max-model-len", str(g.max_model_len)]
    cmd += ["--max-num-seqs", str(kw.get("max_num_seqs") or g.max_num_seqs)]
    cmd += ["--max-num-batched-tokens", str(g.max_num_batched_tokens)]
    cmd += ["--gpu-memory-utilization", str(g.gpu_memory_utilization)]
    kv_bytes = kv_cache_bytes(g.kv_cache_memory_gb)
    if kv_bytes:
        cmd += ["--kv-cache-memory-bytes", str(kv_bytes)]
    cmd += ["--tensor-parallel-size", str(g.tensor_parallel_size), "--seed", str(kw.get("seed", 0))]
    cmd += ["--enable-prefix-caching" if g.enable_prefix_caching else "--no-enable-prefix-caching"]
    if g.enforce_eager:
        cmd += ["--enforce-eager"]
    if g.quantization:
        cmd += ["--quantization", g.quantization]
    if kw.get("revision"):
        cmd += ["--revision", kw["revision"]]
    if kw.get("trust_remote_code"):
        cmd += ["--trust-remote-code"]
    return cmd


def _die_with_parent() -> None:
    """In a local server's child before exec (Linux): SIGTERM when the stage that started it dies, even by
    SIGKILL (prctl PR_SET_PDEATHSIG), so the server shuts its engine down instead of running on orphaned.
    Elsewhere a no-op (the exit / error path still kills the tree)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG


def _tail(path: Path, n: int = 3000) -> str:
    with contextlib.suppress(OSError):
        return path.read_text(encoding="utf-8", errors="replace")[-n:]
    return ""


@contextlib.contextmanager
def local_servers(
    g: GenerateParams, model: str, served_name: str, count: int | None = None, **kw: Any
) -> Iterator[list[dict]]:
    """Start `count` (default g.num_engines) local servers, one per device group; yield
    [{"url", "proc", "log", "start_s"}] once all are healthy; kill every process tree on exit."""
    count = count or g.num_engines
    devices = device_groups(count, g.tensor_parallel_size)
    logdir = Path(tempfile.mkdtemp(prefix="dflash-servers-"))
    servers: list[dict] = []
    try:
        for i in range(count):
            port = free_port()
            env = dict(os.environ)
            local_only_vllm(env)
            if devices[i] is not None:
                env["CUDA_VISIBLE_DEVICES"] = devices[i]
            logf = logdir / f"server-{i}.log"
            with open(logf, "wb") as out:
                proc = subprocess.Popen(
                    server_command(g, model, served_name, port, **kw),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=env,
                    preexec_fn=_die_with_parent,  # noqa: PLW1509 (only prctl, no locks or threads touched)
                )
            servers.append({"url": f"http://127.0.0.1:{port}/v1", "proc": proc, "log": logf, "t0": time.time()})
            log.info("local server %d: %s (log %s)", i, servers[-1]["url"], logf)
        waiting = list(servers)
        deadline = time.time() + START_TIMEOUT_S
        while waiting:
            for s in list(waiting):
                if s["proc"].poll() is not None:
                    raise UserError(
                        f"local vLLM server {s['url']} exited with code {s['proc'].returncode} while starting; "
                        f"its log ({s['log']}) ends:\n{_tail(s['log'])}"
                    )
                if healthy(s["url"], timeout=2.0):
                    s["start_s"] = round(time.time() - s["t0"], 2)
                    waiting.remove(s)
            if time.time() > deadline:
                raise UserError(
                    f"local vLLM servers {[s['url'] for s in waiting]} not healthy after {START_TIMEOUT_S} s"
                )
            if waiting:
                time.sleep(1.0)
        yield servers
    finally:
        for s in servers:
            kill_tree(s["proc"].pid)
            with contextlib.suppress(Exception):
                s["proc"].wait(timeout=10)
