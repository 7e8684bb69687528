"""Queue statistics, read from Redis alone: what `batchgate stats`, the gateway's /stats
and the live views show of a queue."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import redis

from scheduler_core.auto_delay import STATS_AT_US, STATS_DELAY_US
from scheduler_core.keys import CONSUMER_ALIVE_S
from scheduler_core.load import rate_from
from scheduler_core.ops import reading
from scheduler_core.ops.reading import quantile, read_queue
from scheduler_core.policy import Policy, Priority
from scheduler_core.rules import tenant_share
from scheduler_core.wire import DEFAULT_TENANT


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
    retried: int = 0  # runs that raised a retry_on exception and were scheduled again
    retrying: int = 0  # waiting out a retry's backoff now
    # --batching continuous --preempt: running requests given back to the queue for HIGH
    # work (preempt.lua), and the decode steps they had run (recomputed later)
    preempted: int = 0
    preempted_steps: int = 0
    # requests/s enqueued over the last 10 complete seconds (enqueue.lua's counts)
    arrival_rate_rps: float = 0.0
    # the max_queue_delay_ms pop_batch applies: the stored one, or under
    # max_queue_delay_ms=auto the one a consumer derived within CONSUMER_ALIVE_S (None
    # when no consumer did)
    max_queue_delay_ms_in_use: float | None = None
    # per tenant (docs/tenants.md): waiting, in_flight, accepted, served, served_cost,
    # rejected, share; the default tenant's waiting and in_flight are what no named
    # tenant holds
    tenants: dict[str, dict[str, Any]] = field(default_factory=dict)
    # fair share among the backlogged tenants: unit, backlogged, jain_index (Fairness)
    tenant_fairness: dict[str, Any] = field(default_factory=dict)
    # the tenants hash read: fields, read_cap, read (False: over the cap, tenants empty)
    tenant_counters: dict[str, Any] = field(default_factory=dict)

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
    tenants = tenant_stats(r.tenants, sum(r.depth) + r.delayed, r.owned, stored)
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
        retried=counters.get("retried", 0),
        retrying=r.retrying,
        preempted=counters.get("preempted", 0),
        preempted_steps=counters.get("preempted_steps", 0),
        arrival_rate_rps=rate_from(r.arrivals, r.now_us // 1_000_000),
        max_queue_delay_ms_in_use=delay_in_use(stored, counters,
                                                r.now_us - CONSUMER_ALIVE_S * 1_000_000),
        tenants=tenants,
        tenant_fairness=asdict(fairness(tenants, stored)),
        tenant_counters={"fields": r.tenant_fields, "read_cap": reading.TENANT_FIELDS_READ,
                         "read": r.tenants_read},
    )


# The tenants hash's field prefixes (lua/_tenants.lua) and what stats call them.
TENANT_FIELDS = {"w": "waiting", "f": "in_flight", "a": "accepted", "s": "served",
                 "sc": "served_cost", "r": "rejected"}


def tenant_stats(counters: dict[str, int], waiting: int, in_flight: int,
                 policy: Policy | None = None) -> dict[str, dict[str, Any]]:
    """Per tenant, its counters by name (0 where absent) and its share (shares()),
    busiest first (waiting + in flight, then served); the default tenant, when it holds
    any request, with what the named ones do not hold (its other counters are not kept)."""
    table: dict[str, dict[str, Any]] = {}
    for name, value in counters.items():
        prefix, _, tenant = name.partition(":")
        if prefix in TENANT_FIELDS and tenant:
            row = table.get(tenant)
            if row is None:
                row = table[tenant] = dict.fromkeys(TENANT_FIELDS.values(), 0)
            row[TENANT_FIELDS[prefix]] = value
    rest_waiting = waiting - sum(row["waiting"] for row in table.values())
    rest_flight = in_flight - sum(row["in_flight"] for row in table.values())
    if table and (rest_waiting > 0 or rest_flight > 0) and DEFAULT_TENANT not in table:
        table[DEFAULT_TENANT] = {**dict.fromkeys(TENANT_FIELDS.values(), 0),
                                 "waiting": max(0, rest_waiting),
                                 "in_flight": max(0, rest_flight)}
    share = shares(weighted_service(table, policy))
    for tenant, row in table.items():
        row["share"] = share.get(tenant)
    return dict(sorted(table.items(), key=lambda item: (
        -(item[1]["waiting"] + item[1]["in_flight"]), -item[1]["served"], item[0])))


def service_unit(policy: Policy | None) -> str:
    """What a tenant's service is counted in: cost under fairness=cost, else requests."""
    return "cost" if policy is not None and policy.fairness == "cost" else "requests"


def weighted_service(tenants: dict[str, dict[str, Any]], policy: Policy | None
                     ) -> dict[str, float]:
    """Each backlogged named tenant's (requests waiting) weighted service: what it was
    served since its counters began, in service_unit, over its weight. The default
    tenant's service is not counted, so it is left out."""
    unit = "served_cost" if service_unit(policy) == "cost" else "served"
    return {tenant: row[unit] / (tenant_share(policy, tenant)[0] if policy else 1)
            for tenant, row in tenants.items()
            if row["waiting"] > 0 and tenant != DEFAULT_TENANT}


def shares(service: dict[str, float]) -> dict[str, float]:
    """Each tenant's fraction of the weighted service (1/n each when none has any)."""
    total = sum(service.values())
    return {t: (x / total if total else 1 / len(service)) for t, x in service.items()}


def jain_index(values: list[float]) -> float | None:
    """Jain's fairness index (Σx)² / (n·Σx²): 1 when all are equal, 1/n when one has
    everything; 1 when all are 0, None for no value."""
    if not values:
        return None
    squares = sum(x * x for x in values)
    return sum(values) ** 2 / (len(values) * squares) if squares else 1.0


@dataclass
class Fairness:
    unit: str  # "cost" or "requests" (service_unit)
    backlogged: int  # named tenants with requests waiting
    jain_index: float | None  # over their weighted service; None when none is backlogged


def fairness(tenants: dict[str, dict[str, Any]], policy: Policy | None) -> Fairness:
    service = weighted_service(tenants, policy)
    return Fairness(service_unit(policy), len(service), jain_index(list(service.values())))


OTHER_TENANTS = "other"


def summed(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Tenants' rows added up: their counters, and their shares (None if none has one)."""
    total: dict[str, Any] = {name: sum(t[name] for t in rows) for name in TENANT_FIELDS.values()}
    held = [t["share"] for t in rows if t.get("share") is not None]
    total["share"] = sum(held) if held else None
    return total


def top_tenants(tenants: dict[str, dict[str, Any]], n: int) -> dict[str, dict[str, Any]]:
    """The first `n` rows of tenant_stats' table and, if there are more, "other": the
    rest summed (what `stats` and the dashboard show of many tenants)."""
    rows = list(tenants.items())
    shown = dict(rows[:n])
    if len(rows) > n:
        shown[OTHER_TENANTS] = summed([t for _, t in rows[n:]])
    return shown


def delay_in_use(policy: Policy | None, counters: dict[str, int],
                 alive_after: float) -> float | None:
    """The max_queue_delay_ms pop_batch applies (QueueStats.max_queue_delay_ms_in_use)."""
    if policy is None:
        return None
    if not policy.auto_delay:
        return policy.max_queue_delay_ms
    if counters.get(STATS_AT_US, 0) < alive_after:
        return None
    return counters.get(STATS_DELAY_US, 0) / 1000
