"""Queue administration shared by the CLI, the gateway and the consumer: policy,
statistics, and where a request is."""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, replace
from typing import Any

import redis
import redis.asyncio

from scheduler_core.auto_delay import STATS_AT_US, STATS_DELAY_US
from scheduler_core.connection import (
    refresh_topology_async,
    slot_owner_async,
)
from scheduler_core.errors import InvalidPolicy, PolicyConflict
from scheduler_core.keys import QueueKeys
from scheduler_core.load import rate_from
from scheduler_core.policy import LIMITS, Policy, Priority
from scheduler_core.reading import CONSUMER_ALIVE_S, quantile, read_queue
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


@dataclass
class QueueStats:
    queue: str
    policy: dict[str, Any] | None
    depth: dict[str, int]
    in_flight_requests: int
    in_flight_batches: int
    oldest_wait_ms: float | None
    consumers_alive: int
    processed: int
    failed: int
    requeued: int
    cancelled: int
    expired: int
    dead_letters: int
    batches: int
    mean_batch_size: float | None
    queue_wait_ms: dict[str, float | None]
    end_to_end_ms: dict[str, float | None]
    model_ms: dict[str, float | None]  # per batch
    delayed: int = 0  # waiting past their deadline (on_timeout = delay), run when idle
    past_deadline: int = 0  # waiting past their deadline, about to be expired
    # requests/s enqueued over the last 10 complete seconds (enqueue.lua's counts)
    arrival_rate_rps: float = 0.0
    # the max_queue_delay_ms pop_batch applies: the stored one, or under
    # max_queue_delay_ms=auto the one a consumer derived within CONSUMER_ALIVE_S (None
    # when no consumer did)
    max_queue_delay_ms_in_use: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _percentiles(samples_us: list[int]) -> dict[str, float | None]:
    """p50 and p99 (ms) of sorted samples (µs): nearest rank over the capped window of
    recent samples."""
    if not samples_us:
        return {"p50": None, "p99": None, "samples": 0}
    return {"p50": quantile(samples_us, 0.50) / 1000, "p99": quantile(samples_us, 0.99) / 1000,
            "samples": len(samples_us)}


def queue_stats(client: redis.Redis, queue: str) -> QueueStats:
    """The queue's statistics; a sharded queue's (policy field `shards` > 1) summed over
    its shards: counts added, oldest wait the oldest, percentiles over all samples."""
    r = read_queue(client, queue)
    counters = r.counters
    batches = counters.get("batches", 0)
    stored = Policy.from_redis(r.policy) if r.policy else None
    return QueueStats(
        queue=queue,
        policy=stored.to_dict() if stored else None,
        depth={p.name.lower(): n for p, n in zip(Priority, r.depth, strict=True)},
        in_flight_requests=r.owned,
        in_flight_batches=r.batches_in_flight,
        oldest_wait_ms=(r.now_us - min(r.oldest_us)) / 1000 if r.oldest_us else None,
        consumers_alive=r.consumers_alive,
        processed=counters.get("processed", 0),
        failed=counters.get("failed", 0),
        requeued=counters.get("requeued", 0),
        cancelled=counters.get("cancelled", 0),
        expired=counters.get("expired", 0),
        dead_letters=r.dead,
        batches=batches,
        mean_batch_size=counters.get("batched_requests", 0) / batches if batches else None,
        queue_wait_ms=_percentiles(r.waits),
        end_to_end_ms=_percentiles(r.e2e),
        model_ms=_percentiles(r.model),
        delayed=r.delayed,
        past_deadline=r.past_deadline,
        arrival_rate_rps=rate_from(r.arrivals, r.now_us // 1_000_000),
        max_queue_delay_ms_in_use=_delay_in_use(stored, counters,
                                                r.now_us - CONSUMER_ALIVE_S * 1_000_000),
    )


def _delay_in_use(policy: Policy | None, counters: dict[str, int],
                  alive_after: float) -> float | None:
    if policy is None:
        return None
    if not policy.auto_delay:
        return policy.max_queue_delay_ms
    if counters.get(STATS_AT_US, 0) < alive_after:
        return None
    return counters.get(STATS_DELAY_US, 0) / 1000


# -- an autoscaling signal -------------------------------------------------------------
def slo_of(raw_policy: dict[Any, Any]) -> float | None:
    """The policy hash's `slo_p99_ms` field, if it holds a positive number."""
    for key, value in raw_policy.items():
        if (key.decode() if isinstance(key, bytes) else key) == "slo_p99_ms":
            try:
                slo = float(value)
            except ValueError:
                return None
            return slo if 0 < slo <= 86_400_000 else None
    return None


def scaling_signal(client: redis.Redis, queue: str,
                   slo_p99_ms: float | None = None) -> dict[str, Any]:
    """What `recommended_consumers` rests on, and its value: the measured arrival rate
    (scheduler_core.load), the target (`slo_p99_ms` given, else the policy's field), the
    stored cost model, and the planner's consumer count for the queue's current policy
    (scheduler_core.planner.recommended_consumers). None where an input is missing: no
    policy, no target, or no cost model yet."""
    from scheduler_core.cost_model import read_cost_model
    from scheduler_core.load import DEFAULT_WINDOW_S, arrival_rate
    from scheduler_core.planner import Costs, Target, recommended_consumers
    from scheduler_core.simulation import ModelTime

    keys = QueueKeys(queue)
    raw = client.hgetall(keys.policy)
    slo = slo_p99_ms if slo_p99_ms is not None else slo_of(raw)
    shards = [QueueKeys(name) for name in physical_queues(client, queue)]
    rate = sum(arrival_rate(client, shard) for shard in shards)  # a sharded queue's: all
    model = read_cost_model(client, keys)
    out: dict[str, Any] = {"arrival_rate_rps": rate, "arrival_window_s": DEFAULT_WINDOW_S,
                           "slo_p99_ms": slo,
                           "cost_model": model.to_dict() if model is not None else None,
                           "recommended_consumers": None}
    if raw and slo is not None and model is not None:
        pipe = client.pipeline(transaction=False)
        for shard in shards:
            for key in shard.pending_all:
                pipe.zcard(key)
            pipe.hlen(shard.owner)
        waiting = sum(pipe.execute())
        try:
            policy = Policy.from_redis(raw)
        except (ValueError, InvalidPolicy):
            return out  # a policy this version cannot simulate
        if policy.auto_delay:  # simulate the delay the consumers derived last
            used_us = int(client.hget(keys.stats, STATS_DELAY_US) or 0)
            policy = replace(policy, delay_mode="fixed",
                             max_queue_delay_ms=min(round(used_us / 1000),
                                                    LIMITS["max_queue_delay_ms"][1]))
        costs = Costs(ModelTime(model.base_ms, model.per_item_ms))
        out["recommended_consumers"] = recommended_consumers(rate, policy, Target(slo), costs,
                                                             waiting)
    return out


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
    for key in [*keys.pending_all, keys.delayed]:  # delayed: past its deadline, queued
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
