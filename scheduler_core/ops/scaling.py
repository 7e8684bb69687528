"""The autoscaling signal: the consumers a queue needs for its measured arrival rate,
its P99 target and its stored cost model, as `batchgate stats` and the exporter show it
(`recommended_consumers`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import redis

from scheduler_core.auto_delay import STATS_DELAY_US
from scheduler_core.cost_model import read_cost_model
from scheduler_core.errors import InvalidPolicy
from scheduler_core.keys import QueueKeys
from scheduler_core.load import DEFAULT_WINDOW_S, arrival_rate
from scheduler_core.ops.planner import Costs, Target, recommended_consumers
from scheduler_core.ops.simulation import ModelTime
from scheduler_core.policy import LIMITS, Policy
from scheduler_core.shards import physical_queues


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
    (scheduler_core.ops.planner.recommended_consumers). None where an input is missing: no
    policy, no target, or no cost model yet."""
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
