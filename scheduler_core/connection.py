"""Redis connections with the timeouts and retry policy batchgate relies on."""

from __future__ import annotations

import logging
import time
from typing import Any

import redis
import redis.asyncio
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

from scheduler_core.errors import InvalidRequest

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
SOCKET_TIMEOUT_S = 10.0  # longer than any blocking call batchgate makes (<= 2 s)
CONNECT_TIMEOUT_S = 5.0
# Connections one client opens at most. Callers beyond it wait for a free connection
# (no timeout) instead of failing: a burst of concurrent calls queues in the client, where
# batchgate's producers coalesce it, rather than opening a connection per call.
DEFAULT_MAX_CONNECTIONS = 8

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


def connect(url: str = DEFAULT_REDIS_URL,
            max_connections: int = DEFAULT_MAX_CONNECTIONS) -> redis.Redis:
    """A sync client on a pool of at most `max_connections`; a thread finding all in use
    waits for one. Commands are retried on connection errors with jittered backoff;
    every script batchgate runs is safe to resend (see the scripts' headers)."""
    pool = redis.BlockingConnectionPool.from_url(
        url, max_connections=_pool_size(max_connections), timeout=None,
        retry=Retry(ExponentialWithJitterBackoff(cap=1.0, base=0.05), 3),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        **_options(url),
    )
    return redis.Redis.from_pool(pool)


def connect_async(url: str = DEFAULT_REDIS_URL,
                  max_connections: int = DEFAULT_MAX_CONNECTIONS) -> redis.asyncio.Redis:
    """As `connect`, for asyncio: a task finding all connections in use awaits one."""
    from redis.asyncio.retry import Retry as AsyncRetry

    pool = redis.asyncio.BlockingConnectionPool.from_url(
        url, max_connections=_pool_size(max_connections), timeout=None,
        retry=AsyncRetry(ExponentialWithJitterBackoff(cap=1.0, base=0.05), 3),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        **_options(url),
    )
    return redis.asyncio.Redis.from_pool(pool)


def dedicated(client: Any) -> Any:
    """A client with `client`'s settings on one connection of its own, for a loop that
    blocks in Redis (BLMPOP): it never waits behind, nor holds up, the pool's users.
    Anything without a connection pool (a stand-in in tests) is returned as it is."""
    pool = getattr(client, "connection_pool", None)
    kwargs = getattr(pool, "connection_kwargs", None)
    if kwargs is None:
        return client
    asyncio_client = isinstance(client, redis.asyncio.Redis)
    own = (redis.asyncio.BlockingConnectionPool if asyncio_client
           else redis.BlockingConnectionPool)(
        connection_class=pool.connection_class, max_connections=1, timeout=None, **kwargs)
    return type(client).from_pool(own)


def _pool_size(max_connections: Any) -> int:
    if isinstance(max_connections, bool) or not isinstance(max_connections, int) \
            or not 1 <= max_connections <= 10_000:
        raise InvalidRequest("max_connections", f"{max_connections!r} is outside [1, 10000]")
    return max_connections


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
