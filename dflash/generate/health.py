"""A server's health judged from what it does, not only from /health (the servers backend's client).

A server that answers /health with 200 can still time out, send an HTML page, or send ids from another
tokenizer. `ServerHealth` keeps the outcome of a server's recent requests and says when to quarantine it:
- `generate.server_failures_in_a_row` failed requests in a row (timeouts count), or
- a share >= `generate.server_failure_share` failed among its last `generate.server_failure_window` requests, or
- answering only HTTP 429 / 503 backoffs for longer than `generate.request_timeout_s` (a request could not have
  been served within its timeout there either).
A backoff (Retry-After) is not a failure: the server is paused for that long (`paused_until`), and its requests
go to the others meanwhile. Pure bookkeeping: no I/O, the caller passes the clock.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from dflash.core.params import GenerateParams


@dataclass(frozen=True)
class HealthRules:
    failures_in_a_row: int
    failure_share: float
    window: int
    throttle_limit_s: float

    @classmethod
    def of(cls, g: GenerateParams) -> HealthRules:
        return cls(g.server_failures_in_a_row, g.server_failure_share, g.server_failure_window, g.request_timeout_s)


@dataclass
class ServerHealth:
    rules: HealthRules
    outcomes: collections.deque = field(init=False)  # True = failed, the last `rules.window` requests
    in_a_row: int = 0
    throttled_since: float | None = None  # first backoff since its last success
    paused_until: float = 0.0  # no request before this time (Retry-After)

    def __post_init__(self) -> None:
        self.outcomes = collections.deque(maxlen=self.rules.window)

    def success(self) -> None:
        self.outcomes.append(False)
        self.in_a_row, self.throttled_since = 0, None

    def failure(self) -> str:
        """Count a failed request; why the server is to be quarantined now, or ""."""
        self.outcomes.append(True)
        self.in_a_row += 1
        if self.in_a_row >= self.rules.failures_in_a_row:
            return f"{self.in_a_row} failed requests in a row"
        failed = sum(self.outcomes)
        if len(self.outcomes) == self.rules.window and failed >= self.rules.failure_share * self.rules.window:
            return f"{failed} of its last {self.rules.window} requests failed"
        return ""

    def throttle(self, wait_s: float, now: float) -> str:
        """Pause for a Retry-After of `wait_s`; why the server is to be quarantined now (it has done nothing but
        back off for longer than a request may take), or ""."""
        self.paused_until = max(self.paused_until, now + wait_s)
        if self.throttled_since is None:
            self.throttled_since = now
        elif now - self.throttled_since > self.rules.throttle_limit_s:
            return f"only backoffs (HTTP 429 / 503) for {now - self.throttled_since:.0f} s"
        return ""

    def clear(self) -> None:
        """A fresh start (a quarantined server that passed its probe)."""
        self.outcomes.clear()
        self.in_a_row, self.throttled_since, self.paused_until = 0, None, 0.0
