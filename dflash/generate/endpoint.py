"""Asynchronous HTTP to OpenAI-compatible servers: the servers backend sends every request of a run over one
aiohttp session on one event loop, so thousands of requests in flight cost sockets and small coroutine frames,
not a thread each (a thread each took 2.11 GB of RSS at 8,192 in flight, this 0.92 GB:
docs/results/generation-at-scale.md).

    run_async(coro)                          runs `coro` on a fresh event loop (uvloop when installed)
    new_session(g)                           the aiohttp session: no connection cap of its own (the client caps
                                             requests per server), generate.request_timeout_s per request
    Endpoint(session, url, g, model, vocab)  one server: complete(req) -> Completion (validated, or ServerError),
                                             healthy() (GET /health), identify() (the model check -> version)

aiohttp 3.14.5 (requirements/cpu.txt; vLLM's own dependency, so the GPU image has it too).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine
from typing import Any

import aiohttp

from dflash.core.params import GenerateParams
from dflash.generate.servers import (
    HEALTH_TIMEOUT_S,
    Completion,
    ServerError,
    check_model_card,
    http_failure,
    parse_reply,
    request_body,
    root_url,
)
from dflash.generate.turns import Request

CONNECT_TIMEOUT_S = 10.0  # a TCP connect that takes longer: the node is unreachable (not a slow generation)
_JSON = {"Content-Type": "application/json"}


def run_async(coro: Coroutine) -> Any:
    """Run `coro` to completion on a new event loop: uvloop's when it is installed (vLLM depends on it), which
    halves the loop's own CPU per request; the stdlib loop otherwise."""
    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)


def new_session(g: GenerateParams) -> aiohttp.ClientSession:
    """One session for the whole run. limit=0: the connector does not queue requests itself (the client keeps at
    most generate.max_num_seqs in flight per server); keep-alive connections are reused across requests."""
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
    timeout = aiohttp.ClientTimeout(total=g.request_timeout_s, sock_connect=min(CONNECT_TIMEOUT_S, g.request_timeout_s))
    return aiohttp.ClientSession(connector=connector, timeout=timeout)


class Endpoint:
    """One server's calls over the shared session (`url`: the base URL, http://node7:8000/v1)."""

    def __init__(self, session: aiohttp.ClientSession, url: str, g: GenerateParams, model: str, vocab_size: int):
        self.session, self.url, self.g, self.model, self.vocab_size = session, url.rstrip("/"), g, model, vocab_size
        self.max_model_len = g.max_model_len  # the server's own once identify() read its /models card

    async def complete(self, req: Request, max_tokens: int | None = None) -> Completion:
        """POST /completions for `req`; the reply validated (dflash.generate.servers.parse_reply). ServerError on
        any failure: `unreachable` when no connection could be made, `retry_after` on a 429 / 503 backoff."""
        budget = max_tokens or self.g.sampling.max_tokens
        data = json.dumps(request_body(req, self.g, self.model, max_tokens)).encode()
        try:
            async with self.session.post(self.url + "/completions", data=data, headers=_JSON) as resp:
                body = await resp.read()
                status, ctype = resp.status, resp.headers.get("Content-Type", "")
                retry_after = resp.headers.get("Retry-After")
        except aiohttp.ConnectionTimeoutError:
            raise ServerError(self.url, f"no connection within {CONNECT_TIMEOUT_S:g} s", unreachable=True) from None
        except TimeoutError:
            raise ServerError(
                self.url, f"no reply within {self.g.request_timeout_s:g} s (generate.request_timeout_s)"
            ) from None
        except aiohttp.ClientConnectorError as exc:
            raise ServerError(self.url, f"cannot connect ({exc.os_error.strerror or exc})", unreachable=True) from None
        except (aiohttp.ClientError, OSError) as exc:  # reset, disconnected mid-reply, malformed HTTP
            raise ServerError(self.url, f"connection failed: {type(exc).__name__}: {exc}") from None
        if status != 200:
            raise http_failure(self.url, status, body, retry_after)
        return parse_reply(self.url, body, ctype, req.ids, budget, self.vocab_size, max_model_len=self.max_model_len)

    async def _get(self, path: str, timeout: float) -> tuple[int, bytes]:
        async with self.session.get(path, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            return resp.status, await resp.read()

    async def healthy(self) -> bool:
        """GET /health beside /v1 answers 200."""
        try:
            status, _ = await self._get(root_url(self.url) + "/health", HEALTH_TIMEOUT_S)
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False
        return status == 200

    async def identify(self) -> str:
        """The engine version at /version ("" when unsaid) of a server whose /models lists the expected model with
        generate.max_model_len (else UserError: a setup mistake); ServerError when /models does not answer. Keeps
        the card's max_model_len (generate.max_model_len where it has none) for the replies' "length" check."""
        try:
            status, body = await self._get(self.url + "/models", HEALTH_TIMEOUT_S * 6)
            cards = json.loads(body) if status == 200 else None
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            raise ServerError(self.url, f"/models did not answer ({type(exc).__name__}: {exc})") from None
        if cards is None:
            raise ServerError(self.url, f"/models answered HTTP {status}")
        self.max_model_len = check_model_card(self.url, cards, self.model, self.g) or self.g.max_model_len
        try:
            status, body = await self._get(root_url(self.url) + "/version", HEALTH_TIMEOUT_S)
            version = json.loads(body).get("version", "") if status == 200 else ""
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError, AttributeError):
            version = ""
        return str(version)
