"""Queue administration on the protocol's side, shared by the CLI, the gateway and the
consumer: a queue's policy (store, read, ensure) and where a request is. Statistics are
the tooling's (scheduler_core/ops/stats.py)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio

from scheduler_core.connection import (
    refresh_topology_async,
    slot_owner_async,
)
from scheduler_core.errors import InvalidPolicy, PolicyConflict
from scheduler_core.keys import QueueKeys
from scheduler_core.policy import Policy
from scheduler_core.registry import register_queue
from scheduler_core.scripts import Scripts, configure_keys
from scheduler_core.shards import (
    physical_queues,
    shard_count,
    shard_count_async,
    shard_names,
    split_shard,
)
from scheduler_core.wire import CANCELLED, DEADLINE, Result, decode_result


def _pairs(flat: list[Any]) -> dict[str, str]:
    text = [x.decode() if isinstance(x, bytes) else str(x) for x in flat]
    return dict(zip(text[::2], text[1::2], strict=True))


def store_policy(client: redis.Redis, queue: str, policy: Policy, replace: bool) -> Policy:
    """Write `policy` (always, or only if the queue has none); return the stored one. On
    a logical queue, every shard's policy is then set to the stored one (a shard's
    pop_batch reads its own). Fewer shards than before: each shard to drop is retired
    first (enqueue refuses it from then on, so that a producer still placing on it
    re-reads the count); if one still holds requests (waiting, running or
    dead-lettered), those retired are restored and InvalidPolicy names `shards`, nothing
    else written."""
    if split_shard(queue)[1] == 0:
        if replace:
            _retire_dropped_shards(client, queue, policy.shards)
        stored = _configure(client, queue, policy, replace)
        for name in shard_names(queue, stored.shards)[1:]:
            _configure(client, name, stored, replace=True)  # also un-retires a re-added one
        return stored
    return _configure(client, queue, policy, replace)


def change_policy(client: redis.Redis, queue: str,
                  changes: dict[str, Any]) -> tuple[Policy | None, Policy]:
    """The one way a user changes a stored policy (`policy set`, `plan --apply`, the
    dashboard): `changes` applied to the stored policy by Policy.changed, stored, and the
    queue registered. Returns (the policy before, the policy stored)."""
    current = read_policy(client, queue)
    stored = store_policy(client, queue, (current or Policy()).changed(**changes),
                          replace=True)
    with contextlib.suppress(redis.ResponseError):  # an ACL limited to the queue's keys
        register_queue(client, queue)
    return current, stored


def _retire_dropped_shards(client: redis.Redis, queue: str, shards: int) -> None:
    retired: list[QueueKeys] = []
    for name in shard_names(queue, shard_count(client, queue))[shards:]:
        keys = QueueKeys(name)
        reply = Scripts(client).configure(keys=configure_keys(keys), args=["retire"])
        if int(reply[0]) < 0:
            for done in retired:
                Scripts(client).configure(keys=configure_keys(done), args=["restore"])
            raise InvalidPolicy("shards", f"{shards}: shard {name!r} still holds requests "
                                          "(waiting, running or dead-lettered); drain it, "
                                          "or keep the shard count")
        retired.append(keys)


def _configure(client: redis.Redis, queue: str, policy: Policy, replace: bool) -> Policy:
    keys = QueueKeys(queue)
    args: list[Any] = ["replace" if replace else "ensure"]
    for field, value in policy.to_redis().items():
        args += [field, value]
    reply = Scripts(client).configure(keys=configure_keys(keys), args=args)
    if int(reply[0]) < 0:
        field = reply[1].decode() if isinstance(reply[1], bytes) else str(reply[1])
        raise InvalidPolicy(field, "rejected by configure.lua")
    return Policy.from_redis(_pairs(reply[1:]))


def read_policy(client: redis.Redis, queue: str) -> Policy | None:
    raw = client.hgetall(QueueKeys(queue).policy)
    return Policy.from_redis(raw) if raw else None


def ensure_policy(client: redis.Redis, queue: str, requested: dict[str, Any]) -> Policy:
    """The queue's policy, created from `requested` if it has none.

    `requested` holds only the values a user gave explicitly (None = not given). If the
    queue already has a policy and any given value differs, PolicyConflict says which.
    """
    given = {k: v for k, v in requested.items() if v is not None}
    wanted = Policy.build(**given)
    stored = store_policy(client, queue, wanted, replace=False)
    diff = stored.differences(given)
    if diff:
        detail = ", ".join(f"{k}={have} (asked {want})" for k, (have, want) in diff.items())
        raise PolicyConflict(
            f"queue {queue!r} already runs with {detail}. Every consumer of a queue applies "
            "the same rules: start without these flags to adopt the stored policy, or change "
            f"it for all with `batchgate policy set --queue {queue} ...`"
        )
    return stored


# -- where a request is ----------------------------------------------------------------
def status_of(result: Result) -> str:
    """done, expired (deadline passed before it ran), cancelled, or failed."""
    if result.ok:
        return "done"
    return {DEADLINE: "expired", CANCELLED: "cancelled"}.get(result.error_type, "failed")


@dataclass(frozen=True)
class Found:
    """A request the queue knows: `status` is queued, running, or that of `result`."""

    id: str
    status: str
    result: Result | None = None


def queue_lookup(pipe: Any, keys: QueueKeys, request_id: str) -> None:
    """Add to `pipe` (sync or asyncio, MULTI) the reads `read_lookup` needs: one
    transaction, so a request moving between states is seen in one of them."""
    pipe.get(keys.result(request_id))
    pipe.hexists(keys.owner, request_id)
    # delayed: past its deadline; retry: waiting out a retry's backoff; both queued
    for key in [*keys.pending_all, keys.delayed, keys.retry]:
        pipe.zscore(key, request_id)
    pipe.hget(keys.dead_reason, request_id)


def read_lookup(request_id: str, replies: list[Any]) -> Found | None:
    """The request's state from `queue_lookup`'s replies; None if the queue does not know
    it (never submitted, or its result expired after result_ttl_s)."""
    raw, running, *pending, dead = replies
    if raw is None and dead is not None:
        raw = dead  # dead-lettered, and its stored result has expired
    if raw is not None:
        result = decode_result(raw)
        return Found(request_id, status_of(result), result)
    if running:
        return Found(request_id, "running")
    if any(score is not None for score in pending):
        return Found(request_id, "queued")
    return None


def unknown_requests(client: redis.Redis, keys: QueueKeys, request_ids: list[str]) -> list[str]:
    """The ids Redis no longer knows: not in jobs (waiting, in flight, dead-lettered) and
    without a stored result. Lost with Redis' data, or their result expired. One MULTI."""
    pipe = client.pipeline(transaction=True)
    for request_id in request_ids:
        pipe.hexists(keys.jobs, request_id)
        pipe.exists(keys.result(request_id))
    replies = pipe.execute()
    return [rid for rid, job, result in zip(request_ids, replies[::2], replies[1::2],
                                            strict=True) if not job and not result]


def request_state(client: redis.Redis, queue: str, request_id: str) -> Found | None:
    """Where request `request_id` of `queue` is (see read_lookup); on a sharded queue,
    in whichever shard knows it (one MULTI per shard until one does)."""
    for name in physical_queues(client, queue):
        pipe = client.pipeline(transaction=True)
        queue_lookup(pipe, QueueKeys(name), request_id)
        found = read_lookup(request_id, pipe.execute())
        if found is not None:
            return found
    return None


async def request_state_async(client: redis.asyncio.Redis, queue: str,
                              request_id: str) -> Found | None:
    """`request_state` for an asyncio client. On a cluster the MULTI goes to the primary
    serving the queue's slot (redis-py's asyncio cluster transactions mis-parse ZSCORE)."""
    shards = 1 if split_shard(queue)[1] else await shard_count_async(client, queue)
    for name in shard_names(queue, shards):
        found = await shard_state_async(client, QueueKeys(name), request_id)
        if found is not None:
            return found
    return None


async def shard_state_async(client: redis.asyncio.Redis, keys: QueueKeys,
                            request_id: str) -> Found | None:
    """Where request `request_id` is in the one physical queue `keys` (a shard, or an
    unsharded queue): one MULTI, on a cluster on the primary serving its slot."""
    pipe = (await slot_owner_async(client, keys.jobs)).pipeline(transaction=True)
    queue_lookup(pipe, keys, request_id)
    try:
        return read_lookup(request_id, await pipe.execute())
    except redis.RedisError as exc:
        await refresh_topology_async(client, exc)
        raise

