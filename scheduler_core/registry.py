"""Which queues exist, for the dashboard, `batchgate top` and the exporter: each queue
marks itself seen in a key under its own hash tag, `{bg:<queue>}:seen` (ms since the
epoch), and readers find the marks with SCAN. No key is shared between queues: a
credential confined to its queues' keys (`~{bg:<queue>}:*`, docs/guarantees.md) marks its
own queues and can neither add, hide nor remove anyone else's.

Who marks a queue (a plain SET under the queue's tag; works on a Redis Cluster):
- a consumer, at start and then every REGISTER_EVERY_S from its lease thread;
- a producer, once, after its first accepted submit;
- `batchgate policy set` and the dashboard's policy change.
A shard's physical queue marks itself; readers list its logical queue.

Finding them: one SCAN pass over the keyspace (SCAN_COUNT keys per call, so Redis never
blocks long), at most once per `QueueFinder.rescan_s` and no more than a tenth of the
time. A mark unseen for STALE_S whose
queue has none of its lasting keys (policy, pending, jobs, stats, consumers, dead) left is
deleted by the reader that finds it; one whose keys are there is marked seen again, so the
check runs at most once per STALE_S per queue.

Showing them: a reader shows at most `max_queues` (`busiest`): the queues with the most
requests waiting or running first, then those with the most consumers, then the most
recently seen; queues named explicitly (`--queue`) are always shown.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio

from scheduler_core.keys import QueueKeys
from scheduler_core.shards import logical_queue

SEEN_SUFFIX = "seen"
SEEN_MATCH = "{bg:*}:" + SEEN_SUFFIX  # SCAN's pattern; '{' and '}' are literal in globs
REGISTER_EVERY_S = 30.0  # a consumer's re-registration period
STALE_S = 3600.0  # unseen this long and without keys: gone
SCAN_COUNT = 1000  # keys SCAN looks at per call
RESCAN_S = 5.0  # QueueFinder: at most one SCAN pass this often,
SCAN_SHARE = 10  # and no sooner than this many times the last pass took after it ended
DEFAULT_MAX_QUEUES = 100  # readers show at most this many discovered queues


def _now_ms() -> int:
    return int(time.time() * 1000)


def register_queue(client: redis.Redis, queue: str) -> None:
    """Mark `queue` (a shard's physical queue too) as seen now."""
    client.set(QueueKeys(queue).seen, _now_ms())


async def register_queue_async(client: redis.asyncio.Redis, queue: str) -> None:
    """`register_queue` for an asyncio client."""
    await client.set(QueueKeys(queue).seen, _now_ms())


def queue_of(key: Any) -> str | None:
    """The physical queue whose mark `key` is, or None for any other key (one that merely
    ends like a mark, under some queue's tag: its 'name' holds a brace)."""
    name = key.decode(errors="replace") if isinstance(key, bytes) else str(key)
    head, tail = "{bg:", "}:" + SEEN_SUFFIX
    if not (name.startswith(head) and name.endswith(tail)):
        return None
    queue = name[len(head):-len(tail)]
    try:
        QueueKeys(queue)  # a queue's name, or a shard's
    except ValueError:
        return None
    return queue


def _lasting_keys(queue: str) -> list[str]:
    keys = QueueKeys(queue)
    return [keys.policy, *keys.pending_all, keys.jobs, keys.stats, keys.consumers, keys.dead]


def _scan(client: Any) -> list[str]:
    """Every marked physical queue: one SCAN pass (every primary's, on a cluster)."""
    found = []
    for key in client.scan_iter(match=SEEN_MATCH, count=SCAN_COUNT, _type="string"):
        queue = queue_of(key)
        if queue is not None:
            found.append(queue)
    return found


def _prune(client: Any, queues: list[str]) -> list[str]:
    """`queues` less those gone: unseen for STALE_S and without lasting keys (their marks
    are deleted); the others of the stale ones are marked seen again."""
    if not queues:
        return queues
    pipe = client.pipeline(transaction=False)
    for queue in queues:
        pipe.get(QueueKeys(queue).seen)
    seen = pipe.execute(raise_on_error=False)
    cutoff = _now_ms() - STALE_S * 1000
    gone = set()
    for queue, value in zip(queues, seen, strict=True):
        if isinstance(value, Exception) or _int(value) >= cutoff:
            continue
        if not client.exists(*_lasting_keys(queue)):  # one slot: the queue's tag
            gone.add(queue)
        # A reader without SET/DEL on the marks (NOPERM) only skips the pruning.
        with contextlib.suppress(redis.exceptions.NoPermissionError):
            if queue in gone:
                _forget_if_unseen_since(client, queue, value)
            else:
                register_queue(client, queue)
    return [q for q in queues if q not in gone]


def _forget_if_unseen_since(client: Any, queue: str, value: Any) -> None:
    """Delete the mark unless someone marked the queue since it read `value` (a user that
    marks it in the instant between the two calls has lasting keys, or marks it again:
    a consumer within REGISTER_EVERY_S)."""
    key = QueueKeys(queue).seen
    if client.get(key) == value:
        client.delete(key)


def known_queues(client: redis.Redis, prune: bool = True) -> list[str]:
    """Every marked queue (logical names), sorted by name. With `prune`, queues gone (see
    the module docstring) are dropped first."""
    physical = _scan(client)
    if prune:
        physical = _prune(client, physical)
    return sorted({logical_queue(q) for q in physical})


@dataclass(frozen=True)
class Activity:
    """What `busiest` ranks a queue by: requests waiting or running, live consumers
    (heartbeat entries), and its mark."""

    queue: str
    work: int
    consumers: int
    seen_ms: int

    def rank(self) -> tuple[int, int, int, str]:
        return (-self.work, -self.consumers, -self.seen_ms, self.queue)


def activity(client: Any, queues: list[str]) -> list[Activity]:
    """Each queue's Activity (its shard 0: the logical queue), in one pipeline."""
    pipe = client.pipeline(transaction=False)
    for queue in queues:
        keys = QueueKeys(queue)
        for key in keys.pending_all:
            pipe.zcard(key)
        pipe.hlen(keys.owner)
        pipe.zcard(keys.consumers)
        pipe.get(keys.seen)
    # A key of the wrong type (a queue's own users may write anything under its tag)
    # counts as 0 for that queue alone.
    replies = [r if isinstance(r, int) else _int(r) for r in
               pipe.execute(raise_on_error=False)]
    return [Activity(queue, sum(replies[i * 6:i * 6 + 4]), replies[i * 6 + 4],
                     replies[i * 6 + 5]) for i, queue in enumerate(queues)]


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def busiest(client: Any, found: list[str], max_queues: int,
            listed: tuple[str, ...] = ()) -> tuple[list[str], int]:
    """The queues to show, sorted by name, and how many found ones were left out: every
    `listed` queue, then the most active of `found` (Activity.rank) up to `max_queues`
    in all. Reads nothing when everything fits."""
    shown = list(dict.fromkeys(listed))
    rest = [q for q in dict.fromkeys(found) if q not in shown]
    room = max(0, max_queues - len(shown))
    if len(rest) > room:
        ranked = sorted(activity(client, rest), key=Activity.rank)
        kept = [a.queue for a in ranked[:room]]
    else:
        kept = rest
    return sorted(shown + kept), len(rest) - len(kept)


def shown_queues(client: Any, only: list[str] | None = None,
                 max_queues: int = DEFAULT_MAX_QUEUES,
                 finder: QueueFinder | None = None) -> tuple[list[str], int]:
    """The queues a reader shows, and how many found ones it leaves out: `only` (all of
    them, found or not), else the `max_queues` most active of those found
    (registry.busiest)."""
    if only:
        return sorted(set(only)), 0
    found = (finder or QueueFinder(client)).queues()
    return busiest(client, found, max_queues)


class QueueFinder:
    """`known_queues`, re-read at most every `rescan_s`, and at most a tenth of the time
    (SCAN_SHARE): a reader that refreshes often scans a large keyspace rarely."""

    def __init__(self, client: Any, rescan_s: float = RESCAN_S):
        self.client, self.rescan_s = client, rescan_s
        self._next = float("-inf")
        self._queues: list[str] = []

    def queues(self) -> list[str]:
        started = time.monotonic()
        if started >= self._next:
            self._queues = known_queues(self.client)
            ended = time.monotonic()
            self._next = ended + max(self.rescan_s - (ended - started),
                                     SCAN_SHARE * (ended - started))
        return self._queues
