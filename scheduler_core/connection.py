"""Redis connections with the timeouts and retry policy batchgate relies on.

One URL names any deployment (every command's --redis-url and the Python API):

    redis://[user:pass@]host:port/db              one server (rediss:// over TLS, unix://)
    redis+cluster://[user:pass@]host:port[,host:port...]/       Redis Cluster
    redis+sentinel://[user:pass@]host:port[,host:port...]/service[/db]   Sentinel
    rediss+cluster://..., rediss+sentinel://...   the same over TLS

The cluster and sentinel forms build redis-py's RedisCluster and Sentinel clients (sync
and asyncio): they find the topology and follow failovers; batchgate keeps none of its
own. Credentials in the URL are the data nodes'; sentinels are asked without them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.asyncio.sentinel
import redis.cluster
import redis.sentinel
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


# A failover takes the cluster's node timeout plus an election (or Sentinel's
# down-after-milliseconds plus its vote): a few seconds of retries ride it out.
TOPOLOGY_RETRIES = 12
_TOPOLOGY_ERRORS = [redis.ConnectionError, redis.TimeoutError,
                    redis.exceptions.ClusterDownError, redis.exceptions.TryAgainError,
                    redis.exceptions.ReadOnlyError]


@dataclass(frozen=True)
class Topology:
    """A parsed redis+cluster:// or redis+sentinel:// URL."""

    kind: str  # "cluster" | "sentinel"
    nodes: tuple[tuple[str, int], ...]
    tls: bool
    service: str = ""
    db: int = 0
    username: str | None = None
    password: str | None = None

    def display(self) -> str:
        """The URL without credentials, for messages."""
        scheme = ("rediss+" if self.tls else "redis+") + self.kind
        hosts = ",".join(f"{h}:{p}" for h, p in self.nodes)
        path = f"/{self.service}" + (f"/{self.db}" if self.db else "") \
            if self.kind == "sentinel" else "/"
        return f"{scheme}://{hosts}{path}"


def parse_topology(url: str) -> Topology | None:
    """The cluster or sentinel a URL names; None for a plain redis://, rediss:// or
    unix:// URL. Raises InvalidRequest (field redis_url) for a malformed one."""
    scheme, sep, _ = url.partition("://")
    if scheme not in ("redis+cluster", "rediss+cluster", "redis+sentinel", "rediss+sentinel"):
        return None
    parts = urlsplit(url)
    netloc = parts.netloc
    username = password = None
    if "@" in netloc:
        userinfo, netloc = netloc.rsplit("@", 1)
        user, _, pwd = userinfo.partition(":")
        username, password = unquote(user) or None, unquote(pwd) or None
    kind = scheme.split("+")[1]
    nodes = []
    for item in netloc.split(","):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidRequest("redis_url", f"{kind} node {item!r} is not host:port "
                                 f"(in {scheme}://host:port[,host:port...]/...)")
        nodes.append((host.strip("[]"), int(port)))
    path = [p for p in parts.path.split("/") if p]
    service, db = "", 0
    if kind == "cluster":
        if path and path != ["0"]:
            raise InvalidRequest("redis_url", "a cluster has only database 0: use "
                                 f"{scheme}://host:port[,host:port...]/")
    else:
        if not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
            raise InvalidRequest("redis_url", "a sentinel URL names its service: "
                                 f"{scheme}://host:port[,host:port...]/service_name[/db]")
        service, db = unquote(path[0]), int(path[1]) if len(path) == 2 else 0
    return Topology(kind, tuple(nodes), scheme.startswith("rediss"), service, db,
                    username, password)


def _topology_options(topo: Topology) -> dict[str, Any]:
    options: dict[str, Any] = {**_options("redis://"), "ssl": topo.tls}
    if topo.username:
        options["username"] = topo.username
    if topo.password:
        options["password"] = topo.password
    return options


def _connect_topology(topo: Topology, url: str, max_connections: int, asyncio: bool) -> Any:
    """redis-py's cluster or sentinel client for `topo`, sync or asyncio."""
    if asyncio:
        from redis.asyncio.retry import Retry as AsyncRetry
        retry: Any = AsyncRetry(ExponentialWithJitterBackoff(cap=1.0, base=0.05),
                                TOPOLOGY_RETRIES)
    else:
        retry = Retry(ExponentialWithJitterBackoff(cap=1.0, base=0.05), TOPOLOGY_RETRIES)
    options = _topology_options(topo)
    if topo.kind == "cluster":
        if asyncio:
            nodes = [redis.asyncio.cluster.ClusterNode(h, p) for h, p in topo.nodes]
            client: Any = redis.asyncio.cluster.RedisCluster(
                startup_nodes=nodes, retry=retry, max_connections=max(max_connections, 32),
                **options)
        else:
            nodes = [redis.cluster.ClusterNode(h, p) for h, p in topo.nodes]
            client = redis.cluster.RedisCluster(
                startup_nodes=nodes, retry=retry, max_connections=max(max_connections, 32),
                connection_pool_class=redis.BlockingConnectionPool,
                **options)
    else:
        sentinel_options = {k: v for k, v in options.items()
                            if k not in ("username", "password")}
        module = redis.asyncio.sentinel if asyncio else redis.sentinel
        sentinel = module.Sentinel(list(topo.nodes), sentinel_kwargs=sentinel_options,
                                   **options)
        client = sentinel.master_for(
            topo.service, db=topo.db, retry=retry, retry_on_error=_TOPOLOGY_ERRORS,
            max_connections=_pool_size(max_connections) + 2)
    client.batchgate_topology = topo
    client.batchgate_url = url
    return client


def topology_of(client: Any) -> Topology | None:
    """The cluster or sentinel a client of `connect` talks to; None for one server."""
    return getattr(client, "batchgate_topology", None)


def is_cluster(client: Any) -> bool:
    return isinstance(client, (redis.cluster.RedisCluster, redis.asyncio.cluster.RedisCluster))


# redis-py retries a connection's handshake and its health-check PING with the
# connection's Retry, the same one every command is retried with: a command attempt that
# reconnects to a hung server (accepting, never answering) then waits its socket timeout
# once per handshake attempt, nesting the retries. batchgate's connections send both once
# and leave retrying to the command, so a hung Redis fails a call after its command
# attempts (1 + COMMAND_RETRIES), each one socket timeout. Only the TCP connect is
# retried on its own (a refusal fails at once: cheap), as every reconnect does, to ride
# out a restart.
COMMAND_RETRIES = 3


class _SyncOnce:
    def connect(self) -> None:
        self.connect_check_health(check_health=True,  # type: ignore[attr-defined]
                                  retry_socket_connect=True)

    def check_health(self) -> None:
        if self.health_check_interval \
                and time.monotonic() > self.next_health_check:  # type: ignore[attr-defined]
            self._send_ping()  # type: ignore[attr-defined]


class _AsyncOnce:
    async def connect(self) -> None:
        await self.connect_check_health(check_health=True,  # type: ignore[attr-defined]
                                        retry_socket_connect=True)

    async def check_health(self) -> None:
        import asyncio
        if self.health_check_interval and asyncio.get_running_loop().time() \
                > self.next_health_check:  # type: ignore[attr-defined]
            await self._send_ping()  # type: ignore[attr-defined]


_ONCE: dict[type, type] = {}


def _connect_once(pool: Any) -> Any:
    """`pool` making connections that send their handshake and health-check PING once."""
    base = pool.connection_class
    if base not in _ONCE:
        mixin = _AsyncOnce if isinstance(pool, redis.asyncio.ConnectionPool) else _SyncOnce
        _ONCE[base] = type(base.__name__, (mixin, base), {})
    pool.connection_class = _ONCE[base]
    return pool


def connect(url: str = DEFAULT_REDIS_URL,
            max_connections: int = DEFAULT_MAX_CONNECTIONS) -> redis.Redis:
    """A sync client on a pool of at most `max_connections`; a thread finding all in use
    waits for one. Commands are retried on connection errors with jittered backoff;
    every script batchgate runs is safe to resend (see the scripts' headers). A
    redis+cluster:// or redis+sentinel:// URL gives redis-py's cluster or sentinel
    client, retrying through failovers (ClusterDown, MOVED, READONLY, lost connections)."""
    topo = parse_topology(url)
    if topo is not None:
        return _connect_topology(topo, url, _pool_size(max_connections), asyncio=False)
    pool = _connect_once(redis.BlockingConnectionPool.from_url(
        url, max_connections=_pool_size(max_connections), timeout=None,
        retry=Retry(ExponentialWithJitterBackoff(cap=1.0, base=0.05), COMMAND_RETRIES),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        **_options(url),
    ))
    return redis.Redis.from_pool(pool)


def connect_async(url: str = DEFAULT_REDIS_URL,
                  max_connections: int = DEFAULT_MAX_CONNECTIONS) -> redis.asyncio.Redis:
    """As `connect`, for asyncio: a task finding all connections in use awaits one."""
    from redis.asyncio.retry import Retry as AsyncRetry

    topo = parse_topology(url)
    if topo is not None:
        return _connect_topology(topo, url, _pool_size(max_connections), asyncio=True)
    pool = _connect_once(redis.asyncio.BlockingConnectionPool.from_url(
        url, max_connections=_pool_size(max_connections), timeout=None,
        retry=AsyncRetry(ExponentialWithJitterBackoff(cap=1.0, base=0.05), COMMAND_RETRIES),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        **_options(url),
    ))
    return redis.asyncio.Redis.from_pool(pool)


def dedicated(client: Any) -> Any:
    """A client with `client`'s settings on one connection of its own, for a loop that
    blocks in Redis (BLMPOP): it never waits behind, nor holds up, the pool's users.
    Anything without a connection pool (a stand-in in tests) is returned as it is. A
    cluster or sentinel client gets a fresh client of its own from the same URL."""
    url = getattr(client, "batchgate_url", None)
    if url is not None:
        asyncio_client = isinstance(client, (redis.asyncio.Redis,
                                             redis.asyncio.cluster.RedisCluster))
        return (connect_async if asyncio_client else connect)(url, 1)
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


class Outage:
    """One process's view of a Redis outage, shared by the loops that meet it (a
    consumer's main loop and its completions being retried): logged once when the first
    of them fails and once when the last of them is through (each line names what that
    loop was doing)."""

    def __init__(self, what: str):
        self.what = what
        self._lock = threading.Lock()
        self._failing = 0  # loops failing now
        self._attempts = 0
        self._since = 0.0

    def began(self, exc: BaseException, where: str) -> None:
        with self._lock:
            self._failing += 1
            if self._failing == 1:
                self._since, self._attempts = time.monotonic(), 0
                log.warning("%s%s: Redis unavailable (%s); retrying with backoff", self.what,
                            where, exc)

    def attempted(self) -> None:
        with self._lock:
            self._attempts += 1

    def ended(self, where: str) -> None:
        with self._lock:
            self._failing -= 1
            if self._failing == 0:
                log.warning("%s%s: Redis is back after %.1fs (%d failed attempts)", self.what,
                            where, time.monotonic() - self._since, self._attempts)


class Backoff:
    """Reconnect pacing for long-running loops: exponential up to `cap` seconds, and the
    outage logged once when it starts and once when it ends, not on every attempt; with
    `outage`, once for all the loops that share it."""

    def __init__(self, what: str = "", base: float = 0.05, cap: float = 2.0,
                 outage: Outage | None = None, where: str = ""):
        self.base, self.cap = base, cap
        self.outage = outage or Outage(what)
        self.where = where  # what this loop was doing, in the first loop's log line
        self.failures = 0

    def failed(self, exc: BaseException) -> float:
        if self.failures == 0:
            self.outage.began(exc, self.where)
        self.outage.attempted()
        self.failures += 1
        return min(self.cap, self.base * 2 ** min(self.failures, 16))

    def sleep_after(self, exc: BaseException) -> None:
        time.sleep(self.failed(exc))

    def succeeded(self) -> None:
        if self.failures:
            self.outage.ended(self.where)
        self.failures = 0


# Errors after which a pipeline bound to one cluster node must find the slot's owner
# again (a failover moved it) before a resend.
_MOVED = (redis.exceptions.MovedError, redis.exceptions.AskError,
          redis.exceptions.ClusterDownError, redis.exceptions.TryAgainError,
          redis.ConnectionError, redis.TimeoutError, redis.exceptions.ReadOnlyError)


def _node_clients(client: Any) -> dict[str, Any]:
    nodes = getattr(client, "batchgate_nodes", None)
    if nodes is None:
        nodes = client.batchgate_nodes = {}
    return nodes


def slot_owner(client: Any, key: str) -> Any:
    """The client to send a script and its WAIT on one connection: `client` itself for one
    server or Sentinel; on a cluster, a plain client of the primary serving `key`'s slot
    (the cluster client would route WAIT, which has no key, to some other node)."""
    if not isinstance(client, redis.cluster.RedisCluster):
        return client
    node = client.get_node_from_key(key)
    nodes = _node_clients(client)
    if node.name not in nodes:
        topo = topology_of(client)
        options = _topology_options(topo) if topo else {}
        nodes[node.name] = redis.Redis(host=node.host, port=node.port, **options)
    return nodes[node.name]


async def slot_owner_async(client: Any, key: str) -> Any:
    """`slot_owner` for asyncio clients."""
    if not isinstance(client, redis.asyncio.cluster.RedisCluster):
        return client
    await client.initialize()
    node = client.get_node_from_key(key)
    nodes = _node_clients(client)
    if node.name not in nodes:
        topo = topology_of(client)
        options = _topology_options(topo) if topo else {}
        nodes[node.name] = redis.asyncio.Redis(host=node.host, port=node.port, **options)
    return nodes[node.name]


def close_node_clients(client: Any) -> None:
    """Close the per-node clients `slot_owner` made for `client` (a cluster's)."""
    for node in getattr(client, "batchgate_nodes", {}).values():
        node.close()


async def aclose_node_clients(client: Any) -> None:
    for node in getattr(client, "batchgate_nodes", {}).values():
        await node.aclose()


def refresh_topology(client: Any, exc: BaseException) -> None:
    """After `exc` on a connection bound to one cluster node: ask the cluster again who
    serves which slot (redis-py's own NodesManager), so the resend goes to the new owner."""
    if isinstance(client, redis.cluster.RedisCluster) and isinstance(exc, _MOVED):
        # still failing over: the caller's backoff tries again
        with contextlib.suppress(redis.RedisError):
            client.nodes_manager.initialize()


async def refresh_topology_async(client: Any, exc: BaseException) -> None:
    if isinstance(client, redis.asyncio.cluster.RedisCluster) and isinstance(exc, _MOVED):
        with contextlib.suppress(redis.RedisError):
            await client.nodes_manager.initialize()
