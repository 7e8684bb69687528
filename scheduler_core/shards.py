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

from scheduler_core.errors import InvalidRequest

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
