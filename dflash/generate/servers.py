"""OpenAI-compatible inference servers for the `servers` backend: start local vLLM servers, check that a
server serves the expected model, the completion request of a turn, and the validation of its reply.

    local_servers(g, model, ...)     context manager: `g.num_engines` vLLM api_server processes on 127.0.0.1
                                     (free ports, one per device group), healthy on entry, killed on exit
                                     (also on an error or Ctrl-C; on Linux a SIGKILL of the stage sends them
                                     SIGTERM: no orphaned server); yields their base URLs
    check_servers(urls, model, g)    GET {url}/models lists `model` (and max_model_len >= generate.max_model_len
                                     where exposed), else a UserError naming the URL and both values
    request_body(req, g, model)      the POST {url}/completions body of one turn (token ids in, token ids out)
    parse_reply(url, body, ...)      a 200 answer validated before anything of it is stored (exactly one choice,
                                     ids inside the target's vocabulary, <= max_tokens, a known finish reason,
                                     "length" only where the request ran out of max_tokens or of the server's
                                     context, the prompt echo), else a ServerError quoting what the server sent
    healthy(url)                     GET <url without /v1>/health answers 200 (blocking)

A base URL is what OpenAI clients take (http://node7:8000/v1); /health and /version live beside /v1. Only the
listed URLs and 127.0.0.1 are ever contacted. Requests themselves go out asynchronously (dflash/generate/endpoint.py);
the blocking calls here use the stdlib (a server's start-up, the model check).
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
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
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
    """A request a server did not serve: `reason` says what it sent (or did not), in one line.

    `unreachable`: no connection could be made (nothing listens, no route: the server is gone, taken out of
    rotation at once, the request not charged). `retry_after`: the server asked to be left alone for that many seconds (HTTP 429, or 503 with
    Retry-After): backed off, not a failure. Anything else is a failure of the request on that server."""

    def __init__(self, url: str, reason: str, unreachable: bool = False, retry_after: float | None = None):
        super().__init__(f"{url}: {reason}")
        self.url, self.reason, self.unreachable, self.retry_after = url, reason, unreachable, retry_after


@dataclass(frozen=True)
class Completion:
    """A validated reply: ids in [0, vocab_size), at most max_tokens of them, a known finish reason."""

    token_ids: list[int]
    text: str
    finish_reason: str  # stop | length


FINISH_REASONS = ("stop", "length")

try:  # orjson (vLLM's dependency, in the lock) parses a 1,500-id reply 4x faster than the stdlib
    from orjson import loads as _loads
except ImportError:  # pragma: no cover - the stdlib's answer is the same
    _loads = json.loads
MAX_RETRY_AFTER_S = 300.0  # a Retry-After beyond this is capped (a gateway's hour-long value would stall the run)


def root_url(url: str) -> str:
    """The server root of a base URL: http://h:8000/v1 -> http://h:8000 (where /health and /version are)."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _get_json(url: str, timeout: float) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (http(s) only: validate.py)
        return json.loads(resp.read().decode("utf-8"))


def healthy(url: str, timeout: float = HEALTH_TIMEOUT_S) -> bool:
    """GET /health answers 200 (blocking: a local server's start-up; the client's is dflash.generate.endpoint)."""
    try:
        with urllib.request.urlopen(root_url(url) + "/health", timeout=timeout) as resp:  # noqa: S310
            return resp.status == 200
    except (OSError, http.client.HTTPException):
        return False


def check_model_card(url: str, cards: Any, model: str, g: GenerateParams) -> int | None:
    """The /models listing of `url` serves `model` with at least generate.max_model_len, else a UserError naming
    the URL and both values (a server of another model or context is a setup mistake, not a sick node). Returns
    the card's `max_model_len` (vLLM reports it; None where the server does not say): the context a "length"
    finish may fill (parse_reply)."""
    cards = cards.get("data", []) if isinstance(cards, dict) else []
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
    return mml if isinstance(mml, int) and not isinstance(mml, bool) else None


def server_version(url: str) -> str:
    """The engine version a server reports at /version ("" when it does not say)."""
    try:
        return str(_get_json(root_url(url) + "/version", HEALTH_TIMEOUT_S).get("version", ""))
    except (OSError, http.client.HTTPException, ValueError, AttributeError):
        return ""


def check_servers(urls: list[str], model: str, g: GenerateParams) -> dict[str, str]:
    """Every server lists `model` at /models and holds generate.max_model_len where it says its own;
    {url: engine version}. A UserError names the URL and both values on a mismatch, or a server that does not
    answer (blocking: the pilot sweep's one server; the generate client checks its pool itself)."""
    versions = {}
    for url in urls:
        try:
            cards = _get_json(url.rstrip("/") + "/models", HEALTH_TIMEOUT_S * 6)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise UserError(f"generate.server_urls: {url}/models did not answer ({exc}); is the server up?") from None
        check_model_card(url, cards, model, g)
        versions[url] = server_version(url)
    return versions


def request_body(req: Request, g: GenerateParams, model: str, max_tokens: int | None = None) -> dict:
    """The completions request of one turn: the engines backend's sampling, every field explicit (a server
    would otherwise fill unset ones from the model's generation_config). `max_tokens`: a probe's budget."""
    s = g.sampling
    body = {
        "model": model,
        "prompt": list(req.ids),
        "max_tokens": max_tokens or s.max_tokens,
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


def snippet(data: bytes | str, n: int = 160) -> str:
    """The start of what a server sent, on one line (error messages quote it)."""
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    text = " ".join(text.split())
    return text[:n] + ("..." if len(text) > n else "")


def retry_after_s(value: str | None) -> float | None:
    """Seconds in a Retry-After header (delta-seconds or an HTTP date), capped; None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            from email.utils import parsedate_to_datetime

            seconds = parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError, IndexError, OverflowError):
            return None
    return min(MAX_RETRY_AFTER_S, max(0.0, seconds))


def http_failure(url: str, status: int, body: bytes, retry_after: str | None) -> ServerError:
    """The ServerError of a non-200 answer: 429 (and 503 with Retry-After) back the server off, the rest fail."""
    wait = retry_after_s(retry_after)
    if status == 429 or (status == 503 and wait is not None):
        wait = 1.0 if wait is None else wait
        return ServerError(url, f"HTTP {status} (Retry-After {wait:g} s): {snippet(body, 80)}", retry_after=wait)
    return ServerError(url, f"HTTP {status}: {snippet(body)}")


def parse_reply(
    url: str,
    body: bytes,
    content_type: str,
    sent: Sequence[int],
    max_tokens: int,
    vocab_size: int,
    max_model_len: int | None = None,
) -> Completion:
    """Validate a 200 answer to the completion of prompt `sent` before anything of it is stored: JSON with
    exactly one choice (the request asks for n = 1), its token_ids every one an int in [0, vocab_size), at most
    max_tokens of them (at least one), a known finish reason, and the prompt_token_ids echo (where the server
    sends one) equal to `sent`. A "length" finish must be one: max_tokens ids, or the prompt and the completion
    filling `max_model_len` (the server's context, from its /models card; None: only max_tokens ids are a
    "length"), else the server cut the answer short and later turns would be skipped for nothing.
    A ServerError says what was wrong, quoting the server."""
    try:
        out = _loads(body)
    except (ValueError, UnicodeDecodeError):
        raise ServerError(url, f"reply is not JSON ({content_type or 'no content type'}): {snippet(body)}") from None
    choices = out.get("choices") if isinstance(out, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ServerError(url, f"reply with no choices: {snippet(json.dumps(out))}")
    if len(choices) != 1:
        raise ServerError(url, f"{len(choices)} choices for a request of one (n = 1): {snippet(json.dumps(out), 120)}")
    choice = choices[0]
    ids = choice.get("token_ids")
    if ids is None:
        raise ServerError(
            url, "reply without choices[0].token_ids (does the server honour return_token_ids? vLLM does)"
        )
    if not isinstance(ids, list) or not ids:
        raise ServerError(url, f"choices[0].token_ids is {snippet(json.dumps(ids), 60)}, not a list of token ids")
    if not set(map(type, ids)) <= {int}:  # bool is an int subclass: type(), not isinstance()
        pos, bad = next((i, t) for i, t in enumerate(ids) if type(t) is not int)
        raise ServerError(url, f"token id {bad!r} at position {pos} is not an integer")
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= vocab_size:
        pos, bad = next((i, t) for i, t in enumerate(ids) if not 0 <= t < vocab_size)
        raise ServerError(
            url,
            f"token id {bad} at position {pos} is outside the vocabulary [0, {vocab_size}) of the target's "
            "config.json (a server of another model or tokenizer?)",
        )
    if len(ids) > max_tokens:
        raise ServerError(url, f"{len(ids)} token ids, more than max_tokens {max_tokens}")
    echo = choice.get("prompt_token_ids")
    if echo is not None and echo != list(sent):
        at = next((i for i, (a, b) in enumerate(zip(sent, echo, strict=False)) if a != b), min(len(sent), len(echo)))
        raise ServerError(
            url,
            f"prompt_token_ids echo differs from the prompt sent ({len(echo)} vs {len(sent)} ids, from position {at})",
        )
    finish = choice.get("finish_reason")
    if finish not in FINISH_REASONS:
        raise ServerError(url, f"finish_reason {finish!r}, expected one of {FINISH_REASONS}")
    if finish == "length" and len(ids) < max_tokens and len(sent) + len(ids) != max_model_len:
        context = f"max_model_len {max_model_len}" if max_model_len else "a max_model_len it does not report"
        raise ServerError(
            url,
            f'finish_reason "length" after {len(ids)} token ids, below max_tokens {max_tokens}, with '
            f"{len(sent)} + {len(ids)} tokens short of the server's {context} (an answer cut short)",
        )
    text = choice.get("text")
    if text is not None and not isinstance(text, str):
        raise ServerError(url, f"choices[0].text is {type(text).__name__}, not a string")
    return Completion(ids, text or "", finish)


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
    g: GenerateParams,
    model: str,
    served_name: str,
    count: int | None = None,
    on_wait: Callable[[], None] | None = None,
    **kw: Any,
) -> Iterator[list[dict]]:
    """Start `count` (default g.num_engines) local servers, one per device group; yield
    [{"url", "proc", "log", "start_s"}] once all are healthy; kill every process tree on exit.
    `on_wait()` is called about once a second while they start (a progress bar's redraw)."""
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
                if on_wait is not None:
                    on_wait()
                time.sleep(1.0)
        yield servers
    finally:
        for s in servers:
            kill_tree(s["proc"].pid)
            with contextlib.suppress(Exception):
                s["proc"].wait(timeout=10)
