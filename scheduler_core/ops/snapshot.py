"""What the dashboard, `batchgate top` and the exporter show of a queue, read from Redis
alone: `queue_snapshot` gathers one queue's figures (stats.queue_stats plus consumers,
batch sizes, dead letters and recent failures); `Rates` turns successive snapshots into
per-second rates (Redis keeps counters, not rates).
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Any

import orjson
import redis

from scheduler_core.connection import slot_owner
from scheduler_core.deadletter import list_dead
from scheduler_core.keys import CLOCK_OFFSET, QueueKeys, queue_clock_us
from scheduler_core.ops.stats import queue_stats, top_tenants
from scheduler_core.registry import DEFAULT_MAX_QUEUES, QueueFinder, shown_queues
from scheduler_core.shards import physical_queues

BATCH_SAMPLES_READ = 1000  # the batch-size histogram covers the newest this many batches
DEAD_SHOWN = 20
FAILURES_SHOWN = 20
TENANTS_SHOWN = 10  # the busiest tenants by name, the rest summed as "other"


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _number(raw: Any) -> int | float | str:
    text = _text(raw)
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def queue_snapshot(client: redis.Redis, queue: str, dead_shown: int = DEAD_SHOWN,
                   failures_shown: int = FAILURES_SHOWN) -> dict[str, Any]:
    """One queue's figures as plain JSON-ready data (see docs/dashboard.md); a sharded
    queue's shards are read one after the other and summed. With dead_shown=0 /
    failures_shown=0 those lists are not read (the totals still are)."""
    stats = queue_stats(client, queue).to_dict()
    shards = [_read_shard(client, QueueKeys(name), failures_shown)
              for name in physical_queues(client, queue)]
    now_us = max(shard["now_us"] for shard in shards)
    consumers: dict[str, dict[str, Any]] = {}  # a sharded consumer beats on every shard
    sizes: Counter[int] = Counter()
    recent_failures: list[Any] = []
    for shard in shards:
        sizes.update(shard["sizes"])
        recent_failures += shard["failures"]
        for row in shard["consumers"]:
            seen = consumers.get(row["name"])
            if seen is None:
                consumers[row["name"]] = row
                continue
            seen["beat_us"] = max(seen["beat_us"], row["beat_us"])
            seen["batch"] = seen["batch"] or row["batch"]
            seen["batch_size"] = max(seen["batch_size"], row["batch_size"])
            seen["batches"] += row["batches"]  # each shard counts the batches it ran
            seen["requests"] += row["requests"]
    for row in consumers.values():
        row["heartbeat_age_s"] = round(max(0.0, (now_us - row.pop("beat_us")) / 1e6), 3)
    recent_failures.sort(key=lambda f: f.get("at_ms", 0) if isinstance(f, dict) else 0,
                         reverse=True)
    total_dead, dead = (list_dead(client, queue, limit=dead_shown) if dead_shown
                        else (stats["dead_letters"], []))
    return {
        "queue": queue,
        "time_s": now_us / 1e6,
        **stats,
        # the busiest tenants, the rest as "other" (all of them: `stats --json`)
        "tenants": top_tenants(stats["tenants"], TENANTS_SHOWN),
        "tenant_count": len(stats["tenants"]),
        "completed": stats["processed"] + stats["failed"] + stats["expired"]
        + stats["cancelled"],
        "consumers": list(consumers.values()),
        "batch_sizes": {str(size): n for size, n in sorted(sizes.items())},
        "adaptive_delay": shards[0]["adaptive"],
        "dead": {"total": total_dead, "shown": [d.to_dict() for d in dead]},
        "recent_failures": recent_failures[:failures_shown],
    }


def _read_shard(client: redis.Redis, keys: QueueKeys, failures_shown: int) -> dict[str, Any]:
    """One physical queue's consumers, batch sizes, adaptive delay and failures."""
    client = slot_owner(client, keys.policy)  # a cluster: the slot's primary, for TIME
    pipe = client.pipeline(transaction=False)
    pipe.time()
    pipe.zrange(keys.consumers, 0, -1, withscores=True)
    pipe.hgetall(keys.batches)
    pipe.hgetall(keys.stats)
    pipe.lrange(keys.model_samples, 0, BATCH_SAMPLES_READ - 1)
    pipe.lrange(keys.failures, 0, failures_shown - 1) if failures_shown else pipe.echo("")
    (now_s, now_frac), beats, batches, counters, model, failures = pipe.execute()

    names = [_text(name) for name, _ in beats]
    info_pipe = client.pipeline(transaction=False)
    for name in names:
        info_pipe.hgetall(keys.consumer_info(name))
    infos = info_pipe.execute() if names else []
    holding: dict[str, list[str]] = {}  # consumer -> batch ids it holds (batches hash)
    for batch_id, value in batches.items():
        owner = _text(value).partition("|")[0]
        holding.setdefault(owner, []).append(_text(batch_id))
    consumers = []
    for (name, (_, beat)), info in zip(zip(names, beats, strict=True), infos, strict=True):
        about = {_text(k): _text(v) for k, v in info.items()}
        consumers.append({
            "name": name,
            "host": about.get("host", ""),
            "pid": about.get("pid", ""),
            "device": about.get("device", ""),
            "beat_us": beat,
            "batch": about.get("batch") or ",".join(holding.get(name, [])),
            "batch_size": int(about.get("batch_size") or 0),
            "batches": int(about.get("batches") or 0),
            "requests": int(about.get("requests") or 0),
        })

    sizes: Counter[int] = Counter()
    for sample in model:
        size = _text(sample).partition(":")[0]
        if size.isdigit():
            sizes[int(size)] += 1
    raw_counters = {_text(k): v for k, v in counters.items()}
    recent_failures = []
    for raw in failures if failures_shown else []:
        try:
            recent_failures.append(orjson.loads(raw))
        except orjson.JSONDecodeError:
            continue
    return {
        "now_us": queue_clock_us((now_s, now_frac), raw_counters.get(CLOCK_OFFSET)),
        "consumers": consumers,
        "sizes": sizes,
        # The adaptive delay (max_queue_delay_ms=auto) where the queue has one: any stats
        # field naming a delay, as stored.
        "adaptive": {k: _number(v) for k, v in raw_counters.items() if "delay" in k},
        "failures": recent_failures,
    }


def snapshot_all(client: redis.Redis, only: list[str] | None = None,
                 max_queues: int = DEFAULT_MAX_QUEUES,
                 finder: QueueFinder | None = None) -> list[dict[str, Any]]:
    """The snapshot of each queue `shown_queues` names that can be read."""
    queues, _ = shown_queues(client, only, max_queues, finder)
    return readable_snapshots(client, queues)[0]


def readable_snapshots(client: redis.Redis,
                       queues: list[str]) -> tuple[list[dict[str, Any]], list[str]]:
    """The snapshots of `queues`, and the queues whose keys could not be read (one of the
    wrong type, written by hand or by that queue's own users): those are left out, the
    others shown. Redis unreachable still raises."""
    snaps, unreadable = [], []
    for queue in queues:
        try:
            snaps.append(queue_snapshot(client, queue))
        except redis.ResponseError:
            unreadable.append(queue)
    return snaps, unreadable


class Rates:
    """Per-second rates from successive snapshots of the same queues (kept per viewer),
    over the last `window_s` seconds of snapshots (or since the first one).

    completed/s counts requests answered (processed, failed, expired, cancelled);
    arrived/s is derived: completed plus the change in what waits or runs (depth, in
    flight, dead letters), so it counts requests as they enter the queue.
    """

    def __init__(self, window_s: float = 5.0) -> None:
        self.window_s = window_s
        self._seen: dict[str, deque[tuple[float, int, int, int, dict[str, int]]]] = {}

    @staticmethod
    def _held(snap: dict[str, Any]) -> int:
        return (sum(snap["depth"].values()) + snap["in_flight_requests"]
                + snap["dead_letters"])

    def update(self, snap: dict[str, Any]) -> dict[str, Any]:
        """Add "rates" (None on the first sight of a queue) and each consumer's
        "batches_per_s" to `snap`; returns it."""
        queue, now = snap["queue"], snap["time_s"]
        seen = self._seen.setdefault(queue, deque())
        while len(seen) > 1 and now - seen[1][0] >= self.window_s:
            seen.popleft()  # keep one sample at least window_s old
        last = seen[0] if seen else None
        seen.append((now, snap["completed"], self._held(snap), snap["batches"],
                     {c["name"]: c["batches"] for c in snap["consumers"]}))
        for consumer in snap["consumers"]:
            consumer["batches_per_s"] = None
        snap["rates"] = None
        if last is None or now <= last[0]:
            return snap
        then, completed, held, batches, consumers_then = last
        span = now - then
        done = max(0, snap["completed"] - completed)
        snap["rates"] = {
            "completed_per_s": done / span,
            "arrived_per_s": max(0.0, (done + self._held(snap) - held) / span),
            "batches_per_s": max(0, snap["batches"] - batches) / span,
            "interval_s": span,
        }
        for consumer in snap["consumers"]:
            before = consumers_then.get(consumer["name"])
            if before is not None and consumer["batches"] >= before:
                consumer["batches_per_s"] = (consumer["batches"] - before) / span
        return snap
