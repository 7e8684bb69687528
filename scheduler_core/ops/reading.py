"""One read of a queue's state, the one `batchgate stats`, the exporter and the live views
are built from: one MULTI per shard with Redis' TIME (on a cluster, on the primary serving
the shard's slot), summed over a sharded queue's shards (docs/scaling.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis

from scheduler_core.auto_delay import STATS_AT_US, STATS_DELAY_US
from scheduler_core.connection import refresh_topology, slot_owner
from scheduler_core.keys import (
    CLOCK_OFFSET,
    CLOCK_SEEN,
    CONSUMER_ALIVE_S,
    QueueKeys,
    queue_clock_us,
)
from scheduler_core.shards import physical_queues

SAMPLES_READ = 10_000  # the sample lists hold this many, plus up to 500 between trims
# Most fields of {bg:q}:tenants a reading takes (six per busy tenant, four per idle one:
# 3,300-5,000 tenants; HGETALL of that many holds Redis a few ms). Past it the per-tenant
# counters are not read at all (a part would show wrong rows): QueueReading.tenant_fields
# says how many there are.
TENANT_FIELDS_READ = 20_000


def quantile(values: list[int], q: float) -> int:
    """Nearest-rank quantile of sorted `values` (not empty)."""
    return values[min(len(values) - 1, max(0, int(q * len(values) + 0.5) - 1))]


@dataclass
class QueueReading:
    now_us: int  # Redis' TIME at the logical queue's read
    policy: dict[bytes, bytes]  # the logical queue's policy hash, as stored
    depth: list[int]  # waiting, per priority level
    oldest_us: list[int]  # arrival of the oldest waiting request, per non-empty level
    owned: int  # requests in flight
    batches_in_flight: int
    heartbeats: dict[bytes, int]  # consumer -> its newest heartbeat on any shard (µs)
    counters: dict[str, int]
    dead: int
    waits: list[int]  # the newest samples, sorted (µs)
    e2e: list[int]
    model: list[int]  # model time per batch (µs)
    arrivals: dict[str, int]  # epoch second -> requests enqueued
    delayed: int  # past their deadline under on_timeout=delay, run when idle
    past_deadline: int  # waiting past their deadline, about to be expired
    tenants: dict[str, int]  # the named tenants' counters ("w:acme" -> n; keys.tenants)
    retrying: int = 0  # waiting out a retry's backoff (the retry set)
    tenant_fields: int = 0  # fields in keys.tenants (on a sharded queue: the most any has)
    tenants_read: bool = True  # False: over TENANT_FIELDS_READ, `tenants` left empty

    @property
    def consumers_alive(self) -> int:
        alive_after = self.now_us - CONSUMER_ALIVE_S * 1_000_000
        return sum(1 for beat in self.heartbeats.values() if beat >= alive_after)


def read_queue(client: redis.Redis, queue: str, samples: int = SAMPLES_READ) -> QueueReading:
    """The queue's reading, with the newest `samples` of each latency list per shard."""
    readings = []
    for name in physical_queues(client, queue):
        keys = QueueKeys(name)
        try:
            readings.append(_read_shard(slot_owner(client, keys.policy), keys, samples))
        except redis.RedisError as exc:
            refresh_topology(client, exc)
            raise
    return readings[0] if len(readings) == 1 else _summed(readings)


def _read_shard(owner: Any, keys: QueueKeys, samples: int) -> QueueReading:
    # Counted first (a round trip): what the MULTI then reads is bounded, give or take
    # the fields written in between.
    tenants_read = owner.hlen(keys.tenants) <= TENANT_FIELDS_READ
    pipe = owner.pipeline(transaction=True)
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
    pipe.lrange(keys.wait_samples, 0, samples - 1)
    pipe.lrange(keys.e2e_samples, 0, samples - 1)
    pipe.lrange(keys.model_samples, 0, samples - 1)
    pipe.hgetall(keys.arrivals)
    pipe.zcard(keys.delayed)
    pipe.zcard(keys.retry)
    pipe.hgetall(keys.tenants) if tenants_read else pipe.hlen(keys.tenants)
    (now_s, now_frac), policy, d0, d1, d2, o0, o1, o2, owned, batches, beats, counters, \
        dead, waits, e2e, model, arrivals, delayed, retrying, tenants = pipe.execute()
    numbers = _numbers(counters)
    numbers.pop(CLOCK_SEEN, None)
    now_us = queue_clock_us((now_s, now_frac), numbers.pop(CLOCK_OFFSET, 0))  # the scripts'
    return QueueReading(
        now_us=now_us, policy=policy, depth=[d0, d1, d2],
        oldest_us=[int(score) for first in (o0, o1, o2) for _, score in first],
        owned=owned, batches_in_flight=batches,
        heartbeats={name: int(beat) for name, beat in beats},
        counters=numbers, dead=dead, waits=_ints(waits), e2e=_ints(e2e),
        model=_ints(sample.partition(b":")[2] for sample in model),  # "size:model_us"
        arrivals=_numbers(arrivals), delayed=delayed, retrying=retrying,
        past_deadline=owner.zcount(keys.deadlines, "-inf", now_us),  # at the TIME above
        tenants=_numbers(tenants) if tenants_read else {},
        tenant_fields=len(tenants) if tenants_read else tenants, tenants_read=tenants_read)


def _summed(readings: list[QueueReading]) -> QueueReading:
    first = readings[0]  # the logical queue: its policy, its clock
    counters: dict[str, int] = {}
    arrivals: dict[str, int] = {}
    heartbeats: dict[bytes, int] = {}  # a sharded consumer heartbeats on every shard
    tenants: dict[str, int] = {}
    for r in readings:
        for name, value in r.tenants.items():
            tenants[name] = tenants.get(name, 0) + value
        for name, value in r.counters.items():
            counters[name] = counters.get(name, 0) + value
        for second, count in r.arrivals.items():
            arrivals[second] = arrivals.get(second, 0) + count
        for name, beat in r.heartbeats.items():
            heartbeats[name] = max(beat, heartbeats.get(name, 0))
    for name in (STATS_AT_US, STATS_DELAY_US):  # a time and a delay: the logical queue's
        counters.pop(name, None)
        if name in first.counters:
            counters[name] = first.counters[name]
    return QueueReading(
        now_us=first.now_us, policy=first.policy,
        depth=[sum(r.depth[level] for r in readings) for level in range(3)],
        oldest_us=[at for r in readings for at in r.oldest_us],
        owned=sum(r.owned for r in readings),
        batches_in_flight=sum(r.batches_in_flight for r in readings),
        heartbeats=heartbeats, counters=counters, dead=sum(r.dead for r in readings),
        waits=sorted(x for r in readings for x in r.waits),
        e2e=sorted(x for r in readings for x in r.e2e),
        model=sorted(x for r in readings for x in r.model),
        arrivals=arrivals, delayed=sum(r.delayed for r in readings),
        past_deadline=sum(r.past_deadline for r in readings),
        retrying=sum(r.retrying for r in readings),
        tenants=tenants if all(r.tenants_read for r in readings) else {},
        tenant_fields=max(r.tenant_fields for r in readings),
        tenants_read=all(r.tenants_read for r in readings))


def _numbers(raw: dict[bytes, bytes]) -> dict[Any, int]:
    """A hash's integer fields (str keys for counters); a hand-written entry that is not
    a number is skipped, not fatal."""
    return {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()
            if v.lstrip(b"-").isdigit()}


def _ints(raw: Any) -> list[int]:
    return sorted(int(x) for x in raw if x.isdigit())
