"""Redis connections with the timeouts and retry policy batchgate relies on."""

from __future__ import annotations

import logging
import time
from typing import Any

import redis
import redis.asyncio
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
SOCKET_TIMEOUT_S = 10.0  # longer than any blocking call batchgate makes (<= 2 s)
CONNECT_TIMEOUT_S = 5.0

log = logging.getLogger("batchgate")


def _options(url: str) -> dict[str, Any]:
    options: dict[str, Any] = {
        "socket_timeout": SOCKET_TIMEOUT_S,
        "socket_connect_timeout": CONNECT_TIMEOUT_S,
        "health_check_interval": 30,
    }
    if not url.startswith("unix:"):  # a unix socket connection takes no keepalive
        options["socket_keepalive"] = True
    return options


def connect(url: str = DEFAULT_REDIS_URL) -> redis.Redis:
    """A sync client. Commands are retried on connection errors with jittered backoff;
    every script batchgate runs is safe to resend (see the scripts' headers)."""
    return redis.Redis.from_url(
        url,
        retry=Retry(ExponentialWithJitterBackoff(cap=1.0, base=0.05), 3),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        **_options(url),
    )


def connect_async(url: str = DEFAULT_REDIS_URL) -> redis.asyncio.Redis:
    from redis.asyncio.retry import Retry as AsyncRetry

    return redis.asyncio.Redis.from_url(
        url,
        retry=AsyncRetry(ExponentialWithJitterBackoff(cap=1.0, base=0.05), 3),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        **_options(url),
    )


class Backoff:
    """Reconnect pacing for long-running loops: exponential up to `cap` seconds, and the
    outage logged once when it starts and once when it ends, not on every attempt."""

    def __init__(self, what: str, base: float = 0.05, cap: float = 2.0):
        self.what, self.base, self.cap = what, base, cap
        self.failures = 0
        self.since = 0.0

    def failed(self, exc: BaseException) -> float:
        if self.failures == 0:
            self.since = time.monotonic()
            log.warning("%s: Redis unavailable (%s); retrying with backoff", self.what, exc)
        self.failures += 1
        return min(self.cap, self.base * 2 ** min(self.failures, 16))

    def sleep_after(self, exc: BaseException) -> None:
        time.sleep(self.failed(exc))

    def succeeded(self) -> None:
        if self.failures:
            log.warning("%s: Redis is back after %.1fs (%d failed attempts)", self.what,
                        time.monotonic() - self.since, self.failures)
        self.failures = 0
