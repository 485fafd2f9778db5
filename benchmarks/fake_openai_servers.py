"""Fake OpenAI-compatible completion servers on 127.0.0.1, for the servers backend's tests and the client
benchmark: instant canned replies, or one of the ways a sick cluster node misbehaves.

Each server answers GET /health, /version, /v1/models and POST /v1/completions (token ids in, `token_ids` out,
the prompt echoed as `prompt_token_ids` like vLLM with return_token_ids). `mode` says how completions go:

    ok            the canned completion (cut to the request's max_tokens), finish_reason stop / length
    vocab         one token id equal to vocab_size + 7 (a server of another tokenizer, a proxy's corruption)
    negative      one token id of -3
    string        token ids as JSON strings ("151645")
    html          HTTP 200 with a text/html error page (a proxy in front of a dead node)
    no_token_ids  choices[0] without token_ids (a server that ignores return_token_ids)
    no_choices    a reply whose choices list is empty
    two_choices   two choices for a request of one (n = 1): an other completion first, then the canned one
    early_length  the canned completion less its last token, finish_reason "length" with max_tokens and the
                  context far off (a server that cuts answers short)
    throttle      HTTP 429 with Retry-After: 1 (a gateway's rate limit)
    hang          accepts the request and never answers
    error         HTTP 500
    reset         closes the connection without a reply (TCP reset)
    sick          like error, and /health answers 503

`script`: the modes of the next requests, in order (then `mode` again). `fail_if(prompt_ids)` -> True makes that
one request fail at once with HTTP 500 whatever the mode (a poison request). `hold()` -> False holds every
completion answer (polled) until it returns True, or until HOLD_MAX_S after the first answer held: a test orders
events by what happened, not by the clock, so it passes on a loaded machine as on an idle one.
A server runs on its own event loop in a daemon thread (`FakeServer`), or several in the foreground of one
process for the client benchmark (the address of each is printed, one per line, then it serves until killed):

    python benchmarks/fake_openai_servers.py --servers 8 --completion-tokens 1500 [--vocab-size 151936]

Only the stdlib (asyncio with uvloop when it is installed, as the client uses): a server costs the benchmark's
client little CPU on the same cores. HTTP/1.1 with keep-alive, no pipelining, no chunked bodies. Imported by
tests/unit/generate/test_faults.py and tests/unit/generate/test_client.py; run by benchmarks/generate_client.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import threading
import time
from collections.abc import Callable

MODES = (
    "ok",
    "vocab",
    "negative",
    "string",
    "html",
    "no_token_ids",
    "no_choices",
    "two_choices",
    "early_length",
    "throttle",
    "hang",
    "error",
    "reset",
    "sick",
)
HTML_PAGE = b"<html><head><title>502 Bad Gateway</title></head><body><h1>502 Bad Gateway</h1></body></html>"
HOLD_MAX_S = 60.0  # held answers go out this long after the first was held (the test then fails on its checks)
_REASONS = {200: "OK", 404: "Not Found", 429: "Too Many Requests", 500: "Internal Server Error", 503: "Unavailable"}


def canned_completion(tokens: int, vocab_size: int, seed: int = 0) -> list[int]:
    """`tokens` random valid token ids below min(vocab_size, 150000) (ordinary tokens: Qwen's special tokens
    start at 151643): the benchmark's 1,500-token reply."""
    rng = random.Random(seed)
    top = min(vocab_size, 150_000)
    return [rng.randrange(0, top) for _ in range(tokens)]


class _Server:
    """One fake server's state and behaviour (shared by its connections, all on one event loop)."""

    def __init__(self, completion: list[int], text: str, model: str, max_model_len: int, vocab_size: int):
        self.completion, self.text = completion, text
        self.model, self.max_model_len, self.vocab_size = model, max_model_len, vocab_size
        self.mode = "ok"
        self.script: list[str] = []  # modes of the next requests, in order
        self.delay_s = 0.0
        self.hold: Callable[[], bool] | None = None  # completions wait until it returns True
        self.hold_ends: float | None = None  # monotonic time when holding stops whatever hold() says
        self.fail_if: Callable[[list[int]], bool] | None = None
        self.received = 0  # completion requests received
        self.answered: list[list[int]] = []  # prompts given a valid reply, in order
        self.keep_prompts = True  # False: count answers only (the benchmark: no memory kept per request)
        self.answered_count = 0
        self.port = 0
        self.waiting: set[asyncio.Task] = set()  # delayed or hanging answers
        self._models = json.dumps({"object": "list", "data": [{"id": model, "max_model_len": max_model_len}]})
        # A full-length reply is the same bytes around the echoed prompt: build them once.
        self._tail = json.dumps(
            {"text": text, "token_ids": completion, "finish_reason": "stop" if completion else "length"}
        )[1:]

    def get(self, path: str) -> tuple[int, str, bytes, dict]:
        if path == "/health":
            return 503 if self.mode == "sick" else 200, "application/json", b"{}", {}
        if path == "/version":
            return 200, "application/json", b'{"version": "fake-1"}', {}
        if path == "/v1/models":
            return 200, "application/json", self._models.encode(), {}
        return 404, "application/json", b"{}", {}

    def reply(self, body: bytes) -> tuple[str, tuple[int, str, bytes, dict] | None]:
        """(the mode it was answered in, the answer to POST /v1/completions; None: close the connection)."""
        self.received += 1
        req = json.loads(body)
        prompt, max_tokens = req.get("prompt") or [], int(req.get("max_tokens") or 16)
        if self.fail_if is not None and self.fail_if(prompt):
            return "error", (500, "application/json", b'{"error": "poison request"}', {})
        mode = self.script.pop(0) if self.script else self.mode
        return mode, self._answer(mode, prompt, max_tokens)

    def _answer(self, mode: str, prompt: list[int], max_tokens: int) -> tuple[int, str, bytes, dict] | None:
        if mode in ("error", "sick"):
            return 500, "application/json", b'{"error": "internal error"}', {}
        if mode == "reset":
            return None
        if mode == "throttle":
            return 429, "application/json", b'{"error": "rate limited"}', {"Retry-After": "1"}
        if mode == "html":
            return 200, "text/html", HTML_PAGE, {}
        head = '{"id":"cmpl-fake","object":"text_completion","model":"' + self.model + '","choices":['
        if mode == "no_choices":
            return 200, "application/json", (head + "]}").encode(), {}
        echo = '{"index":0,"prompt_token_ids":' + json.dumps(prompt) + ","
        if mode == "ok" and max_tokens >= len(self.completion):
            body_out = head + echo + self._tail + "]}"
        else:
            ids: list = self.completion[:max_tokens]
            if mode == "vocab":
                ids = [*ids[:-1], self.vocab_size + 7]
            elif mode == "negative":
                ids = [*ids[:-1], -3]
            elif mode == "string":
                ids = [str(i) for i in ids]
            choice = {"text": self.text, "finish_reason": "stop" if len(ids) == len(self.completion) else "length"}
            if mode == "early_length":
                ids, choice["finish_reason"] = ids[:-1], "length"
            if mode != "no_token_ids":
                choice["token_ids"] = ids
            body_out = head + echo + json.dumps(choice)[1:] + "]}"
            if mode == "two_choices":  # another valid completion first: only "exactly one choice" can tell
                other = {**choice, "token_ids": [(t + 1) % min(self.vocab_size, 150_000) for t in ids]}
                body_out = head + echo + json.dumps(other)[1:] + "," + body_out[len(head) :]
        if mode == "ok":
            self.answered_count += 1
            if self.keep_prompts:
                self.answered.append(prompt)
        return 200, "application/json", body_out.encode(), {}


def _response(status: int, ctype: str, body: bytes, headers: dict, close: bool) -> bytes:
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}", f"Content-Type: {ctype}"]
    lines += [f"Content-Length: {len(body)}", f"Connection: {'close' if close else 'keep-alive'}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class _Connection(asyncio.Protocol):
    """One client connection: parse a request, answer it (after `delay_s`, or never: hang), repeat."""

    def __init__(self, server: _Server):
        self.server = server
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.busy = False  # a request is being answered (no pipelining: later bytes wait in buf)

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.busy:
            self._next()

    def _next(self) -> None:
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self.buf[:end].decode("latin-1").split("\r\n")
        fields = {}
        for line in head[1:]:
            k, _, v = line.partition(":")
            fields[k.strip().lower()] = v.strip()
        length = int(fields.get("content-length", "0"))
        if len(self.buf) < end + 4 + length:
            return
        body, self.buf = self.buf[end + 4 : end + 4 + length], self.buf[end + 4 + length :]
        method, path = head[0].split(" ")[:2]
        close = fields.get("connection", "").lower() == "close" or head[0].endswith("HTTP/1.0")
        srv = self.server
        mode, answer = ("", srv.get(path)) if method == "GET" else srv.reply(body)
        if answer is None:  # reset: abort the connection, which the client reads as a reset
            self.transport.abort()
            return
        if method == "POST" and (mode == "hang" or srv.delay_s or srv.hold is not None):
            self.busy = True
            task = asyncio.get_running_loop().create_task(self._later(answer, close, hang=mode == "hang"))
            srv.waiting.add(task)  # held, or the loop could garbage-collect a hanging answer mid-wait
            task.add_done_callback(srv.waiting.discard)
            return
        self._send(answer, close)

    async def _later(self, answer, close: bool, hang: bool) -> None:
        if hang:
            await asyncio.Event().wait()  # until the server stops (the task is cancelled with the loop)
        await asyncio.sleep(self.server.delay_s)
        srv = self.server
        if srv.hold is not None and srv.hold_ends is None:
            srv.hold_ends = time.monotonic() + HOLD_MAX_S
        while srv.hold is not None and not srv.hold() and time.monotonic() < srv.hold_ends:
            await asyncio.sleep(0.01)
        self.busy = False
        self._send(answer, close)

    def _send(self, answer, close: bool) -> None:
        if self.transport.is_closing():
            return
        self.transport.write(_response(*answer, close=close))
        if close:
            self.transport.close()
        elif self.buf:
            self._next()


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


class FakeServer:
    """A fake server on 127.0.0.1 served from a daemon thread: `url` (…/v1), `mode`, `script`, `delay_s`, `hold`,
    `fail_if`,
    `answered` (prompts given a valid reply), `received`; `stop()` (or leaving a `with` block) closes it: later
    connections are refused."""

    def __init__(
        self,
        completion: list[int],
        text: str = "x",
        model: str = "m",
        max_model_len: int = 1024,
        vocab_size: int = 151936,
        mode: str = "ok",
    ):
        if mode not in MODES:
            raise ValueError(f"unknown fake server mode {mode!r} (one of {MODES})")
        self._srv = _Server(completion, text, model, max_model_len, vocab_size)
        self._srv.mode = mode
        self._loop = _new_loop()
        started = threading.Event()

        def serve() -> None:
            asyncio.set_event_loop(self._loop)
            self._listener = self._loop.run_until_complete(
                self._loop.create_server(lambda: _Connection(self._srv), "127.0.0.1", 0, backlog=4096)
            )
            self._srv.port = self._listener.sockets[0].getsockname()[1]
            started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, daemon=True, name="fake-server")
        self._thread.start()
        started.wait(10)
        self.url = f"http://127.0.0.1:{self._srv.port}/v1"

    def __getattr__(self, name: str):  # mode, delay_s, fail_if, answered, received live on the shared state
        return getattr(self.__dict__["_srv"], name)

    def __setattr__(self, name: str, value) -> None:
        if name in ("mode", "script", "delay_s", "hold", "fail_if", "keep_prompts"):
            if name == "mode" and value not in MODES or name == "script" and not set(value) <= set(MODES):
                raise ValueError(f"unknown fake server mode in {value!r}")
            setattr(self._srv, name, value)
        else:
            super().__setattr__(name, value)

    def __enter__(self) -> FakeServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        async def close() -> None:
            self._listener.close()
            pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in pending:  # hanging answers
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            self._loop.stop()

        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(close(), self._loop)
            self._thread.join(10)


async def _serve_many(count: int, completion: list[int], text: str, model: str, vocab_size: int) -> None:
    loop = asyncio.get_running_loop()
    for _ in range(count):
        srv = _Server(completion, text, model, 1 << 20, vocab_size)
        srv.keep_prompts = False
        listener = await loop.create_server(lambda s=srv: _Connection(s), "127.0.0.1", 0, backlog=8192)
        print(f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}/v1", flush=True)
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", type=int, default=4)
    parser.add_argument("--completion-tokens", type=int, default=1500)
    parser.add_argument("--vocab-size", type=int, default=151936)
    parser.add_argument("--model", default="m")
    args = parser.parse_args()
    completion = canned_completion(args.completion_tokens, args.vocab_size)
    text = "word " * args.completion_tokens  # about what 1,500 tokens decode to
    loop = _new_loop()
    asyncio.set_event_loop(loop)
    loop.run_until_complete(_serve_many(args.servers, completion, text, args.model, args.vocab_size))


if __name__ == "__main__":
    main()
