"""The simulator's continuous batching (scheduler_core/ops/continuous_sim.py) against a
real continuous consumer in this process on the same arrivals (a step-wise model that
only sleeps: its step time is known), and `simulate`/`plan` comparing the two modes."""

from __future__ import annotations

import random
import threading
import time

import pytest
from helpers.step_models import Counter
from prometheus_client import CollectorRegistry

from producer import Producer
from scheduler_core.errors import InvalidRequest
from scheduler_core.ops.continuous_sim import StepTime
from scheduler_core.ops.simulation import ModelTime, SimConfig, simulate
from scheduler_core.policy import Policy
from scheduler_core.wire import Result

STEP_MS = 10
SHORT, LONG = 3, 15  # steps
# How far the simulator's p50 and p99 per cost may be from the real consumer's: a share
# of the real one, plus a few steps for a shared host's stalls (docs/scheduling.md).
TOLERANCE = 0.25
SLACK_MS = 3 * STEP_MS


def replay(url: str, queue: str, times: list[float], costs: list[int]
           ) -> tuple[list[float], dict[int, list[float]]]:
    """Submit each request at its offset; the offsets it was actually submitted at and
    the latencies per cost (submit to result at the producer, ms)."""
    seen: dict[str, float] = {}
    lock = threading.Lock()

    def stamp(result: Result) -> None:
        with lock:
            seen.setdefault(result.id, time.perf_counter())

    sent, handles = [], []
    with Producer(url, queue, on_result=stamp) as p:
        start = time.perf_counter()
        for k, (t, c) in enumerate(zip(times, costs, strict=True)):
            time.sleep(max(0.0, start + t - time.perf_counter()))
            sent.append(time.perf_counter() - start)
            handles.append(p.submit({"i": k, "n": c}, cost=c))
        for h in handles:
            h.result(timeout=30)
            with lock:
                seen.setdefault(h.id, time.perf_counter())
    latency: dict[int, list[float]] = {SHORT: [], LONG: []}
    for k, h in enumerate(handles):
        latency[costs[k]].append((seen[h.id] - start - sent[k]) * 1000)
    return sent, latency


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, round(q * len(ordered) + 0.5) - 1)]


def test_the_simulated_continuous_consumer_tracks_a_real_one(shared_redis, queue,
                                                              inprocess_consumer):
    rng = random.Random(7)
    times, at = [], 0.0
    while at < 2.5:
        at += rng.expovariate(16)
        times.append(at)
    costs = [LONG if rng.random() < 0.2 else SHORT for _ in times]
    inprocess_consumer(Counter(sleep_ms=STEP_MS), redis_url=shared_redis.url, queue=queue,
                       batching="continuous", strategy="fifo", max_batch_size=4,
                       metrics_registry=CollectorRegistry())
    sent, real = replay(shared_redis.url, queue, times, costs)
    config = SimConfig(Policy.build("fifo", max_batch_size=4), ModelTime(STEP_MS), 1,
                       batching="continuous", step=StepTime(STEP_MS))
    sim = simulate(config, sent, [1] * len(sent), costs).latency_by_cost
    for cost in (SHORT, LONG):
        for q, key in ((0.5, "p50"), (0.99, "p99")):
            measured = pct(real[cost], q)
            assert abs(sim[cost][key] - measured) <= TOLERANCE * measured + SLACK_MS, \
                (cost, key, sim[cost], measured)
