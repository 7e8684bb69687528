"""The simulator's continuous batching (scheduler_core/ops/continuous_sim.py) against a
real continuous consumer in this process on the same arrivals (a step-wise model that
only sleeps: its step time is known), and `simulate`/`plan` comparing the two modes."""

from __future__ import annotations

import random
import threading
import time

import orjson
import pytest
from helpers.cli import batchgate
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
# How far the simulator's percentiles per cost may be from the real consumer's: a share
# of the real one plus a few steps; wider in the tail, where a shared host's stalls land
# (docs/scheduling.md, "Simulating continuous batching").
TOLERANCE = {"p50": (0.25, 3 * STEP_MS), "p95": (0.5, 6 * STEP_MS)}


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
    model = Counter(sleep_ms=STEP_MS)
    model.streams = False  # as the generator by default: no stream write per step
    inprocess_consumer(model, redis_url=shared_redis.url, queue=queue,
                       batching="continuous", strategy="fifo", max_batch_size=4,
                       metrics_registry=CollectorRegistry())
    sent, real = replay(shared_redis.url, queue, times, costs)
    config = SimConfig(Policy.build("fifo", max_batch_size=4), ModelTime(STEP_MS), 1,
                       batching="continuous", step=StepTime(STEP_MS))
    sim = simulate(config, sent, [1] * len(sent), costs).latency_by_cost
    # p50 of both, p95 of the short ones: some 40 and 10 samples, whose p99 would be
    # their maximum, one stall of a shared host.
    for cost, q, key in ((SHORT, 0.5, "p50"), (SHORT, 0.95, "p95"), (LONG, 0.5, "p50")):
        measured = pct(real[cost], q)
        share, slack = TOLERANCE[key]
        assert abs(sim[cost][key] - measured) <= share * measured + slack, \
            (cost, key, sim[cost], measured)


# A generation workload: 80% of requests ask 16 tokens, 20% 256; a static batch is padded
# to its longest, a continuous step costs 0.2 ms plus 0.1 ms per sequence.
LENGTHS = ["--rate", "8", "--cost-mix", "16:80,256:20", "--cost-ms", "2+1.1*c",
           "--cost-mode", "padded", "--step-ms", "0.2+0.1*n", "--prefill-ms", "2",
           "--mix", "normal=1"]


def test_a_short_request_leaves_a_running_long_one_in_the_simulation():
    """One consumer, a long request, then a short one: static, the short waits for the
    long batch; continuous, it joins at the next step and is done in its own 4 steps."""
    policy = Policy.build("fifo", max_batch_size=4)
    step = StepTime(1.0)
    results = {mode: simulate(SimConfig(policy, ModelTime(0, 0, 1.0), 1, batching=mode,
                                        step=step, step_overhead_ms=0),
                              [0.0, 0.02], [1, 1], [100, 4]).latency_by_cost
               for mode in ("static", "continuous")}
    assert results["static"][4]["p50"] > 80  # waited for the long one's 100 ms
    assert results["continuous"][4]["p50"] < 10  # 1 step until the pop is read + 4
    assert 100 <= results["continuous"][100]["p50"] < 110


def test_simulate_compares_the_two_modes_and_names_the_better():
    done = batchgate("simulate", "--strategy", "fifo", "--max-batch-size", "8",
                     "--duration-s", "20", *LENGTHS, "--batching", "compare")
    assert done.returncode == 0, done.stderr
    assert "static" in done.stdout and "continuous" in done.stdout
    assert "better: continuous" in done.stdout
    out = orjson.loads(batchgate("simulate", "--strategy", "fifo", "--max-batch-size", "8",
                                 "--duration-s", "20", *LENGTHS, "--batching", "compare",
                                 "--json").stdout)
    assert out["better"] == "continuous"
    short = {m: out[m]["latency_by_cost_ms"]["16"]["p99"] for m in ("static", "continuous")}
    assert short["continuous"] < short["static"] / 2
    single = batchgate("simulate", "--duration-s", "2", *LENGTHS, "--batching",
                       "continuous")
    assert single.returncode == 0 and "continuous batching: a step = 0.2+0.1*n ms" \
        in single.stdout


def test_plan_compares_the_two_modes_and_names_the_better():
    done = batchgate("plan", "--slo-p99-ms", "600", "--requests", "200", *LENGTHS,
                     "--batching", "compare")
    assert done.returncode == 0, done.stderr
    assert "-- static batching --" in done.stdout and "-- continuous batching --" \
        in done.stdout
    assert "better: continuous batching" in done.stdout
    out = orjson.loads(batchgate("plan", "--slo-p99-ms", "600", "--requests", "200",
                                 *LENGTHS, "--batching", "compare", "--json").stdout)
    assert out["batching"] == "continuous" and set(out["compared"]) == {"static",
                                                                        "continuous"}
    assert out["consumers"] <= out["compared"]["static"]["consumers"]


def test_bad_continuous_settings_are_refused_naming_the_field():
    for args, field in ((["--batching", "continuous", "--step-ms", "fast"], "step_ms"),
                        (["--batching", "continuous", "--step-overhead-ms", "-1"],
                         "step_overhead_ms"),
                        (["--batching", "sometimes"], "--batching")):
        done = batchgate("simulate", "--duration-s", "1", *args)
        assert done.returncode == 2 and field in done.stdout + done.stderr, (args, done)
    with pytest.raises(InvalidRequest, match="batching"):
        SimConfig(batching="sometimes")
    with pytest.raises(InvalidRequest, match="prefill_ms"):
        StepTime(0, 0, -1)
