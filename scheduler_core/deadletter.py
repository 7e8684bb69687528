"""The dead-letter set: requests given up on, kept for inspection, retry or purge.

A request is dead-lettered when it was delivered `max_attempts` times without completing
(each time its consumer crashed or hung), or when its stored entry is unreadable. Its
producer receives a `RequestFailed` (error type `DeadLettered` or `MalformedRequest`);
the request itself (meta and envelope) stays in `{bg:q}:jobs`, listed in `{bg:q}:dead`
(id -> time) with the reason in `{bg:q}:dead:reason`, until it is retried or purged.

The `batchgate dead-letter` commands (batchgate/deadletter_cli.py) drive these functions.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import orjson
import redis

from scheduler_core.errors import InvalidRequest
from scheduler_core.keys import QueueKeys
from scheduler_core.scripts import Scripts, dead_letter_keys
from scheduler_core.shards import physical_queues
from scheduler_core.wire import split_job

MAX_IDS_PER_CALL = 1000  # the script's bound on work per call
PREVIEW_CHARS = 200


@dataclass(frozen=True)
class DeadLetter:
    id: str
    dead_at_s: float  # Redis time, seconds since the epoch
    error_type: str
    message: str
    attempts: int | None  # deliveries made: times it reached a model (None: no readable meta)
    priority: int | None
    payload_preview: str | None  # the stored request envelope, truncated (None: missing)
    # A request whose retries ran out (docs/failure-modes.md, "Retries"): each failed run,
    # {"attempt", "type", "message"}, oldest first; None for other dead letters.
    runs: list[dict[str, Any]] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _reason(raw: bytes | None) -> tuple[str, str, list[dict[str, Any]] | None]:
    if raw is None:
        return "unknown", "", None
    try:
        error = orjson.loads(raw).get("error") or {}
        runs = error.get("attempts")
        return (str(error.get("type", "unknown")), str(error.get("message", "")),
                runs if isinstance(runs, list) else None)
    except (orjson.JSONDecodeError, AttributeError):
        return "unknown", _text(raw)[:PREVIEW_CHARS], None


def list_dead(client: redis.Redis, queue: str, limit: int = 50,
              offset: int = 0) -> tuple[int, list[DeadLetter]]:
    """(total dead-lettered, the `limit` oldest from `offset`)."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 10_000:
        raise InvalidRequest("limit", f"{limit!r} is outside [1, 10000]")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise InvalidRequest("offset", f"{offset!r} must be an integer >= 0")
    names = physical_queues(client, queue)
    # Oldest first across shards: each shard's first offset+limit, merged by time.
    total, entries = 0, []
    for name in names:
        keys = QueueKeys(name)
        total += client.zcard(keys.dead)
        entries += [(score, member, keys) for member, score in
                    client.zrange(keys.dead, 0, offset + limit - 1, withscores=True)]
    entries.sort(key=lambda e: e[0])
    return total, [_describe(client, keys, member, score)
                   for score, member, keys in entries[offset:offset + limit]]


def _describe(client: redis.Redis, keys: QueueKeys, member: bytes, score: float) -> DeadLetter:
    pipe = client.pipeline(transaction=False)
    pipe.hget(keys.dead_reason, member)
    pipe.hget(keys.jobs, member)
    reason, job = pipe.execute()
    attempts = priority = None
    meta, envelope = split_job(job) if job is not None else (None, None)
    if meta is not None:
        priority, attempts = meta.priority, meta.attempts
    error_type, message, runs = _reason(reason)
    if attempts and error_type == "DeadLettered":
        # Its dead-lettering counted one more attempt, but delivered nothing: the
        # count here is the one its "gave up after N deliveries" names.
        attempts -= 1
    preview = None if envelope is None else _text(envelope)[:PREVIEW_CHARS]
    return DeadLetter(_text(member), score / 1e6, error_type, message, attempts, priority,
                      preview, runs)


def _act(client: redis.Redis, queue: str, action: str, ids: list[str] | None) -> tuple[int, int]:
    """Retry or purge `ids`, or with ids=None every request dead-lettered now; returns
    (done, skipped). On a sharded queue each shard acts on the ids it holds."""
    done = skipped = 0
    for name in physical_queues(client, queue):
        one_done, one_skipped = _act_one(client, QueueKeys(name), action, ids)
        done, skipped = done + one_done, skipped + one_skipped
    if ids is not None:  # an id is skipped by every shard but its own
        skipped = len(ids) - done
    return done, skipped


def _act_one(client: redis.Redis, keys: QueueKeys, action: str,
             ids: list[str] | None) -> tuple[int, int]:
    """_act on one physical queue. Each call of the script handles at most
    MAX_IDS_PER_CALL ids."""
    if ids is None:
        ids = []
        while True:  # a snapshot, read in pages
            page = client.zrange(keys.dead, len(ids), len(ids) + MAX_IDS_PER_CALL - 1)
            ids += [_text(x) for x in page]
            if len(page) < MAX_IDS_PER_CALL:
                break
    scripts = Scripts(client)
    done = skipped = 0
    for start in range(0, len(ids), MAX_IDS_PER_CALL):
        chunk = ids[start:start + MAX_IDS_PER_CALL]
        reply = scripts.dead_letter(keys=dead_letter_keys(keys, chunk),
                                    args=[action, len(chunk), *chunk])
        if int(reply[0]) < 0:
            raise InvalidRequest(_text(reply[1]), "rejected by the dead_letter script")
        done, skipped = done + int(reply[0]), skipped + int(reply[1])
    return done, skipped


def retry(client: redis.Redis, queue: str, ids: list[str] | None = None) -> tuple[int, int]:
    """Enqueue dead letters again (all if ids is None); returns (retried, skipped)."""
    return _act(client, queue, "retry", ids)


def purge(client: redis.Redis, queue: str, ids: list[str] | None = None) -> tuple[int, int]:
    """Delete dead letters for good (all if ids is None); returns (purged, skipped)."""
    return _act(client, queue, "purge", ids)
