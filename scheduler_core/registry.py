"""The registry of queues: `batchgate:queues`, a sorted set of queue name -> last seen
(ms since the epoch), so that the dashboard, `batchgate top` and the exporter find every
queue without KEYS or SCAN.

Who registers a queue (a plain ZADD GT, outside any queue's hash tag, so it works on a
Redis Cluster too):
- a consumer, at start and then every REGISTER_EVERY_S from its lease thread;
- a producer, once, after its first accepted submit;
- `batchgate policy set`.

A queue is dropped from the registry by `known_queues` when it has not been seen for
STALE_S and none of its lasting keys (policy, pending, jobs, stats, consumers, dead) is
left, i.e. when someone deleted it. A stale entry whose keys are still there is marked
seen again instead, so the check runs at most once per STALE_S per queue.
"""

from __future__ import annotations

import time
from typing import Any

import redis
import redis.asyncio

from scheduler_core.keys import QUEUE_NAME, QueueKeys, validate_queue_name
from scheduler_core.shards import logical_queue

QUEUES_KEY = "batchgate:queues"
REGISTER_EVERY_S = 30.0  # a consumer's re-registration period
STALE_S = 3600.0  # unseen this long and without keys: gone


def _now_ms() -> int:
    return int(time.time() * 1000)


def register_queue(client: redis.Redis, queue: str) -> None:
    """Record `queue` as seen now (GT: a host whose clock lags never moves it back). A
    shard's physical queue records its logical queue."""
    client.zadd(QUEUES_KEY, {validate_queue_name(logical_queue(queue)): _now_ms()}, gt=True)


async def register_queue_async(client: redis.asyncio.Redis, queue: str) -> None:
    """`register_queue` for an asyncio client."""
    await client.zadd(QUEUES_KEY, {validate_queue_name(logical_queue(queue)): _now_ms()},
                      gt=True)


def forget_queues(client: redis.Redis, queues: list[str]) -> None:
    """Remove `queues` from the registry (after deleting their keys); a consumer or
    producer still using one registers it again."""
    if queues:
        client.zrem(QUEUES_KEY, *queues)


def _lasting_keys(queue: str) -> list[str]:
    keys = QueueKeys(queue)
    return [keys.policy, *keys.pending_all, keys.jobs, keys.stats, keys.consumers, keys.dead]


def known_queues(client: redis.Redis, prune: bool = True) -> list[str]:
    """Every registered queue, sorted by name. With `prune`, entries unseen for STALE_S
    whose queue has no keys left are removed first (see the module docstring)."""
    entries: list[tuple[Any, float]] = client.zrange(QUEUES_KEY, 0, -1, withscores=True)
    names = {(m.decode() if isinstance(m, bytes) else str(m)): score for m, score in entries}
    names = {n: s for n, s in names.items() if QUEUE_NAME.fullmatch(n)}  # none by hand
    cutoff = _now_ms() - STALE_S * 1000
    stale = [name for name, seen in names.items() if seen < cutoff]
    if prune and stale:
        alive, gone = [], []
        for name in stale:
            exists = client.exists(*_lasting_keys(name))  # one slot: the queue's tag
            (alive if exists else gone).append(name)
        if alive:
            client.zadd(QUEUES_KEY, dict.fromkeys(alive, _now_ms()), gt=True)
        if gone:
            # Remove by score, not by name: a producer or consumer that registered one of
            # these meanwhile moved it past the cutoff, and it stays.
            client.zremrangebyscore(QUEUES_KEY, "-inf", f"({cutoff}")
            for name in gone:
                names.pop(name, None)
    return sorted(names)
