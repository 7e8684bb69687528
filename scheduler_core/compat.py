"""What batchgate needs from its environment: the Redis server's version, the host's cores.

batchgate needs Redis 7.0 or newer: producers drain their inboxes with BLMPOP and the
scripts rely on 7.0 semantics. An older server would fail later with an unknown-command
error in a background thread, so every entry point checks once, when it connects (consumer
start, a producer's first submit, gateway start, the CLI commands), and fails with a
message that says what is wrong. The result is cached per client object.
"""

from __future__ import annotations

import os
import re
import weakref
from typing import Any

import redis
import redis.asyncio

from scheduler_core.connection import connect, is_cluster, topology_of
from scheduler_core.errors import BatchgateError

MIN_REDIS_VERSION = (7, 0)
_VERSION = re.compile(rb"^redis_version:(\d+)\.(\d+)(?:\.(\d+))?", re.MULTILINE)
# Clients already checked (weakly held: a closed, collected client drops out).
_checked: weakref.WeakSet[Any] = weakref.WeakSet()


class RedisVersionError(BatchgateError):
    """The Redis server is older than MIN_REDIS_VERSION."""


def parse_redis_version(info: bytes | str | dict[str, Any]) -> tuple[int, ...] | None:
    """The server version from `INFO server` (raw text, or redis-py's parsed dict); None
    when the reply carries none (a proxy that hides it)."""
    if isinstance(info, dict):
        raw = info.get("redis_version")
        info = f"redis_version:{raw}" if raw is not None else ""
    text = info.encode() if isinstance(info, str) else info
    match = _VERSION.search(text)
    if match is None:
        return None
    return tuple(int(part) for part in match.groups() if part is not None)


def describe_server(client: redis.Redis | redis.asyncio.Redis) -> str:
    """The client's server as a URL without credentials, for messages."""
    topo = topology_of(client)
    if topo is not None:
        return topo.display()
    pool = client.connection_pool
    kwargs = pool.connection_kwargs
    if kwargs.get("path"):
        return f"unix://{kwargs['path']}"
    scheme = "rediss" if "SSL" in pool.connection_class.__name__ else "redis"
    return f"{scheme}://{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}/" \
           f"{kwargs.get('db', 0)}"


def check_redis_version(version: tuple[int, ...] | None, where: str) -> None:
    """Raise RedisVersionError if `version` is known and older than the minimum."""
    if version is not None and version[:2] < MIN_REDIS_VERSION:
        need = ".".join(map(str, MIN_REDIS_VERSION))
        raise RedisVersionError(f"batchgate needs Redis >= {need}; {where} runs "
                                f"{'.'.join(map(str, version))}")


def _info_server(reply: Any, client: Any) -> None:
    """Check INFO's reply; on a cluster, one reply per node (every node must do)."""
    per_node = reply.items() if is_cluster(client) and isinstance(reply, dict) \
        and all(isinstance(v, dict) for v in reply.values()) else [(None, reply)]
    for node, info in per_node:
        version = parse_redis_version(info)
        if version is not None and version[:2] < MIN_REDIS_VERSION:
            where = describe_server(client) + (f" (node {node})" if node else "")
            check_redis_version(version, where)
    _checked.add(client)


def _info_args(client: Any) -> dict[str, Any]:
    return {"target_nodes": "all"} if is_cluster(client) else {}


def require_redis_version(client: redis.Redis) -> None:
    """Fail with RedisVersionError if the server is older than Redis 7.0 (once per
    client; connection errors propagate). A server that refuses INFO (an ACL without
    it) is given the benefit of the doubt."""
    if client in _checked:
        return
    try:
        reply = client.info("server", **_info_args(client))
    except redis.ResponseError:
        _checked.add(client)
        return
    _info_server(reply, client)


def connect_checked(url: str) -> redis.Redis:
    """`connection.connect(url)`, checked to be a server batchgate can use."""
    client = connect(url)
    require_redis_version(client)
    return client


async def require_redis_version_async(client: redis.asyncio.Redis) -> None:
    """`require_redis_version` for an asyncio client."""
    if client in _checked:
        return
    try:
        reply = await client.info("server", **_info_args(client))
    except redis.ResponseError:
        _checked.add(client)
        return
    _info_server(reply, client)


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, e.g. a container's cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
