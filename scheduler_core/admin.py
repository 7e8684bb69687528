"""Queue administration shared by the CLI, the gateway and the consumer: policy,
statistics, and where a request is."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import redis
import redis.asyncio

from scheduler_core.errors import InvalidPolicy, PolicyConflict
from scheduler_core.keys import QueueKeys
from scheduler_core.policy import Policy, Priority
from scheduler_core.scripts import Scripts, configure_keys
from scheduler_core.wire import CANCELLED, DEADLINE, Result, decode_result

CONSUMER_ALIVE_S = 5.0  # a consumer heartbeats at least every second while running


def _pairs(flat: list[Any]) -> dict[str, str]:
    text = [x.decode() if isinstance(x, bytes) else str(x) for x in flat]
    return dict(zip(text[::2], text[1::2], strict=True))


def store_policy(client: redis.Redis, queue: str, policy: Policy, replace: bool) -> Policy:
    """Write `policy` (always, or only if the queue has none); return the stored one."""
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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _percentiles(samples_us: list[bytes]) -> dict[str, float | None]:
    values = sorted(int(x) for x in samples_us)
    if not values:
        return {"p50": None, "p99": None, "samples": 0}

    def pick(q: float) -> float:
        # nearest-rank percentile over the capped window of recent samples
        return values[min(len(values) - 1, max(0, int(q * len(values) + 0.5) - 1))] / 1000
    return {"p50": pick(0.50), "p99": pick(0.99), "samples": len(values)}


SAMPLES_READ = 10_000  # the lists hold this many, plus up to 500 between trims


def queue_stats(client: redis.Redis, queue: str) -> QueueStats:
    keys = QueueKeys(queue)
    pipe = client.pipeline(transaction=True)
    pipe.time()
    pipe.hgetall(keys.policy)
    for key in keys.pending_all:
        pipe.zcard(key)
    for key in keys.pending_all:
        pipe.zrange(key, 0, 0, withscores=True)
    pipe.hlen(keys.owner)
    pipe.zcard(keys.inflight)
    pipe.zrange(keys.consumers, 0, -1, withscores=True)
    pipe.hgetall(keys.stats)
    pipe.zcard(keys.dead)
    pipe.lrange(keys.wait_samples, 0, SAMPLES_READ - 1)
    pipe.lrange(keys.e2e_samples, 0, SAMPLES_READ - 1)
    pipe.lrange(keys.model_samples, 0, SAMPLES_READ - 1)
    pipe.zcard(keys.delayed)
    (now_s, now_frac), policy, d0, d1, d2, o0, o1, o2, owned, batches_in_flight, consumers, \
        counters, dead, waits, e2e, model, delayed = pipe.execute()
    now_us = now_s * 1_000_000 + now_frac
    past_deadline = client.zcount(keys.deadlines, "-inf", now_us)  # at the TIME above
    oldest = [score for first in (o0, o1, o2) for _, score in first]
    counters = {k.decode(): int(v) for k, v in counters.items()}
    alive_after = now_us - CONSUMER_ALIVE_S * 1_000_000
    batches = counters.get("batches", 0)
    return QueueStats(
        queue=queue,
        policy=Policy.from_redis(policy).to_dict() if policy else None,
        depth={p.name.lower(): n for p, n in zip(Priority, (d0, d1, d2), strict=True)},
        in_flight_requests=owned,
        in_flight_batches=batches_in_flight,
        oldest_wait_ms=(now_us - min(oldest)) / 1000 if oldest else None,
        consumers_alive=sum(1 for _, beat in consumers if beat >= alive_after),
        processed=counters.get("processed", 0),
        failed=counters.get("failed", 0),
        requeued=counters.get("requeued", 0),
        cancelled=counters.get("cancelled", 0),
        expired=counters.get("expired", 0),
        dead_letters=dead,
        batches=batches,
        mean_batch_size=counters.get("batched_requests", 0) / batches if batches else None,
        queue_wait_ms=_percentiles(waits),
        end_to_end_ms=_percentiles(e2e),
        model_ms=_percentiles([sample.partition(b":")[2] for sample in model]),  # size:us
        delayed=delayed,
        past_deadline=past_deadline,
    )


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
    """Where request `request_id` of `queue` is (see read_lookup)."""
    pipe = client.pipeline(transaction=True)
    queue_lookup(pipe, QueueKeys(queue), request_id)
    return read_lookup(request_id, pipe.execute())


async def request_state_async(client: redis.asyncio.Redis, queue: str,
                              request_id: str) -> Found | None:
    """`request_state` for an asyncio client."""
    pipe = client.pipeline(transaction=True)
    queue_lookup(pipe, QueueKeys(queue), request_id)
    return read_lookup(request_id, await pipe.execute())
