"""The registry of queues: which queues this Redis serves, without KEYS.

A zset `batchgate:queues`, queue name -> when it was last seen (ms since the epoch),
kept up by consumers, producers and `policy set`; read by the exporter, the dashboard and
`batchgate top`.
"""

from __future__ import annotations

import time

import redis

REGISTRY_KEY = "batchgate:queues"


def register_queue(client: redis.Redis, queue: str) -> None:
    """Record `queue` as seen now."""
    client.zadd(REGISTRY_KEY, {queue: int(time.time() * 1000)})


def known_queues(client: redis.Redis) -> list[str]:
    """Every registered queue name."""
    return [name.decode() if isinstance(name, bytes) else name
            for name in client.zrange(REGISTRY_KEY, 0, -1)]
