"""Sharded queues: one logical queue spread over S physical queues (docs/scaling.md).

Shard 0 is the logical queue itself, so a queue with `shards` = 1 keeps exactly the
single-queue layout. Shard i > 0 is the queue `<queue>#<i>`: its own hash tag
`{bg:<queue>#<i>}`, hence its own cluster slot. '#' is not allowed in a queue name a user
gives (keys.QUEUE_NAME), so a shard never collides with a user's queue. Every shard is a
complete queue (policy, pending levels, jobs, dead letters ...) that the unchanged Lua
scripts run on; the logical queue's policy holds the shard count (policy field `shards`)
and every shard's policy mirrors it.
"""

from __future__ import annotations

import re

import redis
import redis.asyncio

from scheduler_core.errors import InvalidRequest
from scheduler_core.keys import QueueKeys
from scheduler_core.policy import LIMITS

SEPARATOR = "#"
SHARD_SUFFIX = re.compile(r"#([1-9][0-9]{0,2})")  # shard 1..999 (policy caps at LIMITS)
PLACEMENTS = ("round_robin", "least_depth")


def shard_name(queue: str, index: int) -> str:
    """The physical queue of shard `index` (0 = the logical queue itself)."""
    return queue if index == 0 else f"{queue}{SEPARATOR}{index}"


def shard_names(queue: str, shards: int) -> list[str]:
    return [shard_name(queue, i) for i in range(shards)]


def split_shard(name: str) -> tuple[str, int]:
    """(logical queue, shard index) of a physical queue name."""
    base, sep, tail = name.rpartition(SEPARATOR)
    if sep and SHARD_SUFFIX.fullmatch(SEPARATOR + tail):
        return base, int(tail)
    return name, 0


def logical_queue(name: str) -> str:
    return split_shard(name)[0]


def check_placement(placement: object) -> str:
    if placement not in PLACEMENTS:
        raise InvalidRequest("placement", f"{placement!r}: use {' or '.join(PLACEMENTS)}")
    assert isinstance(placement, str)
    return placement


def shard_count(client: redis.Redis, queue: str) -> int:
    """The logical queue's shard count (policy field `shards`; 1 when unset or unknown)."""
    return _count(client.hget(QueueKeys(queue).policy, "shards"))


def physical_queues(client: redis.Redis, queue: str) -> list[str]:
    """The physical queues of `queue`: its shards; a shard's name is just itself."""
    if split_shard(queue)[1]:
        return [queue]
    return shard_names(queue, shard_count(client, queue))


async def shard_count_async(client: redis.asyncio.Redis, queue: str) -> int:
    return _count(await client.hget(QueueKeys(queue).policy, "shards"))


def _count(raw: bytes | str | None) -> int:
    try:
        value = int(raw) if raw is not None else 1
    except ValueError:
        return 1
    low, high = LIMITS["shards"]
    return value if low <= value <= high else 1
