"""`batchgate consumer --batching continuous` (issue 36 §2), with the built-in generator
(tiny, short generations; in this process, a real process for the crash): a short request
joins a running long one and is answered while the long one still runs; every result
equals the request generated alone; tokens stream as they come; a bad payload fails alone;
a consumer SIGKILLed mid-generation has its requests re-run elsewhere, each answered once
with its solo output; a model that cannot step is refused naming --batching. With a
step-wise model that only sleeps (helpers/step_models.py): at most max_batch_size
sequences within max_batch_cost, requests past their deadline while no slot is free
expired, a failing step fails its sequences only, a stop finishes the sequences in hand,
and --preempt gives LOW sequences back for HIGH work. Timing claims are the benchmark's
(`python -m bench.continuous`)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.failure_support import CountingProducer
from helpers.processes import BATCHGATE
from helpers.step_models import Counter
from helpers.support import wait_for
from prometheus_client import CollectorRegistry
from redis import Redis

from batchgate.exporter import ExporterConfig, QueueCollector
from batchgate.present import stats_table
from consumer import Consumer
from producer import DeadlineExceeded, Producer, RequestFailed, Restart
from scheduler_core.keys import QueueKeys
from scheduler_core.ops.stats import queue_stats

HELPERS = str(Path(__file__).resolve().parent / "helpers")
ROOT = str(Path(__file__).resolve().parent.parent)
MODEL = {"vocab": 512, "layers": 2, "dim": 64, "heads": 2, "positions": 512}
ARGS = [a for k, v in MODEL.items() for a in ("--model-arg", f"{k}={v}")]


@pytest.fixture(scope="module")
def gpt2():
    """gpt2(**kwargs) -> the tiny seeded generator (MODEL), built in this process."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from consumer.models.decoder import Generator, build_gpt2

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield lambda **kwargs: Generator(build_gpt2(**MODEL), warmup_batches=(),
                                     max_new_tokens_cap=500, **kwargs)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def solo(gpt2):
    """The request's output generated alone, in process (static, one request a batch)."""
    model = gpt2()
    return lambda payload: model([payload])[0]


def continuous(start_consumer, url, queue, *args):
    return start_consumer(url, queue, "--model", "consumer.models:generator", *ARGS,
                          "--model-arg", "stream=true", "--model-arg",
                          "max_new_tokens_cap=500", "--batching", "continuous",
                          "--torch-threads", "1", "--strategy", "fifo", *args)


def test_a_short_request_joins_a_running_long_one_and_leaves_first(
        shared_redis, queue, inprocess_consumer, gpt2, solo):
    inprocess_consumer(gpt2(stream=True), redis_url=shared_redis.url, queue=queue,
                       batching="continuous", strategy="fifo", max_batch_size=4,
                       metrics_registry=CollectorRegistry())
    long_payload = {"prompt": "a long one", "max_new_tokens": 480}
    shorts = [{"prompt": f"short {i}", "max_new_tokens": 4 + i} for i in range(3)]
    with Producer(shared_redis.url, queue) as p:
        long = p.submit(long_payload)
        parts = long.stream(timeout=60)
        first = next(parts)  # the long request is running
        handles = p.submit_many([*shorts, {"prompt": "x", "max_new_tokens": -3}])
        results = [h.result(timeout=60) for h in handles[:3]]
        # Answered while the long one still runs: the batch never waited for it.
        assert not long.done()
        with pytest.raises(RequestFailed, match="'max_new_tokens' must be an integer >= 1"):
            handles[3].result(timeout=60)
        streamed = [first, *parts]
        long_result = long.result(timeout=60)
        for h, r in zip(handles[:3], results, strict=True):
            assert [part["token"] for part in h.stream(timeout=5)] == r["tokens"]
    assert [part["token"] for part in streamed] == long_result["tokens"]
    assert long_result == solo(long_payload)
    assert results == [solo(s) for s in shorts]


def test_a_consumer_killed_mid_generation_has_each_request_rerun_and_answered_once(
        redis_server, queue, start_consumer, inprocess_consumer, gpt2, solo):
    """The re-run is on a consumer in this process (the killed one is a real process)."""
    url = redis_server.url
    first = continuous(start_consumer, url, queue, "--max-batch-size", "3", "--lease-ms",
                       "1000")
    payloads = [{"prompt": f"request {i}", "max_new_tokens": 100 + 20 * i} for i in range(5)]
    with CountingProducer(url, queue) as p:
        handles = p.submit_many(payloads)
        events = handles[0].stream(timeout=60)
        seen = [next(events) for _ in range(3)]
        first.kill()  # SIGKILL, three tokens into request 0
        inprocess_consumer(gpt2(stream=True), redis_url=url, queue=queue,
                           batching="continuous", strategy="fifo", max_batch_size=3,
                           lease_ms=1000, metrics_registry=CollectorRegistry())
        seen += list(events)
        results = [h.result(timeout=120) for h in handles]
        time.sleep(0.5)  # a second delivery would land now
        assert all(p.deliveries[h.id] == 1 for h in handles)
    assert results == [solo(x) for x in payloads]
    assert Restart(2) in seen
    rerun = seen[seen.index(Restart(2)) + 1:]
    assert [part["token"] for part in rerun] == results[0]["tokens"]


def test_a_model_that_cannot_step_is_refused_naming_the_flag(shared_redis, queue):
    """So is --preempt without continuous batching."""
    out = subprocess.run([BATCHGATE, "consumer", "--redis-url", shared_redis.url, "--queue",
                          queue, "--model", "consumer.models:noop", "--batching",
                          "continuous"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "batching" in out.stderr and "step-wise model" in out.stderr
    bad = subprocess.run([BATCHGATE, "consumer", "--batching", "sometimes"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--batching" in bad.stderr
    static = subprocess.run([BATCHGATE, "consumer", "--preempt"], capture_output=True,
                            text=True, timeout=60)
    assert static.returncode != 0 and "preempt" in static.stderr \
        and "--batching continuous" in static.stderr


# -- scheduling, with a step-wise model that only sleeps (tests/helpers/step_models.py) --
@pytest.fixture
def counter_consumer(shared_redis, queue):
    started = []

    def start(model, **settings):
        consumer = Consumer(model, redis_url=shared_redis.url, queue=queue,
                            batching="continuous", lease_ms=2000,
                            metrics_registry=CollectorRegistry(), **settings).start()
        started.append(consumer)
        return consumer

    yield start
    for consumer in started:
        consumer.stop()


def test_at_most_max_batch_size_sequences_run_within_the_cost_budget(
        shared_redis, queue, counter_consumer):
    model = Counter(sleep_ms=10)
    counter_consumer(model, strategy="fifo", max_batch_size=3)
    with Producer(shared_redis.url, queue) as p:
        handles = p.submit_many([{"i": i, "n": 3 + i % 4} for i in range(10)])
        assert [h.result(timeout=60) for h in handles] == \
            [{"i": i, "steps": 3 + i % 4} for i in range(10)]
    assert model.most == 3
    # Each sequence ran exactly its n steps, joining as others left.
    ran = [i for step in model.ran for i in step]
    assert all(ran.count(i) == 3 + i % 4 for i in range(10))


def test_the_cost_budget_bounds_the_running_sequences(shared_redis, queue, counter_consumer):
    model = Counter(sleep_ms=10)
    counter_consumer(model, strategy="fifo", max_batch_size=8, max_batch_cost=10)
    with Producer(shared_redis.url, queue) as p:
        handles = p.submit_many([{"i": i, "n": 4} for i in range(6)], cost=4)
        assert [h.result(timeout=60)["i"] for h in handles] == list(range(6))
    assert model.most == 2  # 2 x 4 <= 10 < 3 x 4


def test_requests_past_their_deadline_while_no_slot_is_free_are_expired(
        shared_redis, queue, counter_consumer):
    """Two long sequences fill both slots; of the requests that arrive then, one popped
    (it waits here for a slot) and one still queued pass their deadline: both are answered
    DeadlineExceeded, the long ones run to their end."""
    model = Counter(sleep_ms=20)
    counter_consumer(model, strategy="fifo", max_batch_size=2)
    with Producer(shared_redis.url, queue) as p:
        long = p.submit_many([{"i": 0, "n": 60}, {"i": 1, "n": 60}])
        wait_for(lambda: model.most == 2, timeout=30)
        late = p.submit_many([{"i": 2, "n": 1}, {"i": 3, "n": 1}, {"i": 4, "n": 1}],
                             deadline_ms=300)
        for h in late:
            with pytest.raises(DeadlineExceeded):
                h.result(timeout=30)
        assert [h.result(timeout=30)["steps"] for h in long] == [60, 60]
    assert not any(i in step for step in model.ran for i in (2, 3, 4))


def test_a_step_that_raises_fails_its_sequences_and_the_consumer_goes_on(
        shared_redis, queue, counter_consumer):
    model = Counter(sleep_ms=10)
    counter_consumer(model, strategy="fifo", max_batch_size=4)
    with Producer(shared_redis.url, queue) as p:
        bad = p.submit_many([{"i": 0, "n": 5}, {"i": 1, "n": 5, "boom": True}])
        for h in bad:
            with pytest.raises(RequestFailed, match="boom"):
                h.result(timeout=30)
        assert p.submit({"i": 2, "n": 2}).result(timeout=30) == {"i": 2, "steps": 2}
        with pytest.raises(RequestFailed, match="'n' must be an integer"):
            p.submit({"i": 3, "n": -1}).result(timeout=30)
        with pytest.raises(RequestFailed, match="step\\(\\) must return") as info:
            p.submit({"i": 4, "n": 3, "garbage": True}).result(timeout=30)
        assert info.value.error_type == "ModelContractError"
        assert p.submit({"i": 5, "n": 1}).result(timeout=30) == {"i": 5, "steps": 1}


def test_a_stop_finishes_the_sequences_in_hand(shared_redis, queue, counter_consumer):
    model = Counter(sleep_ms=20)
    consumer = counter_consumer(model, strategy="fifo", max_batch_size=4)
    with Producer(shared_redis.url, queue) as p:
        handles = p.submit_many([{"i": i, "n": 20} for i in range(3)])
        wait_for(lambda: model.most == 3, timeout=30)
        assert consumer.stop(timeout=30)
        assert [h.result(timeout=5)["steps"] for h in handles] == [20, 20, 20]


@pytest.mark.parametrize("preempt", [True, False])
def test_preemption_gives_running_low_sequences_back_for_high_work(
        shared_redis, queue, counter_consumer, preempt):
    """Both slots run LOW work when a HIGH request arrives. With --preempt the latest LOW
    sequence goes back to the queue (its stream gets a restart marker), the HIGH one runs
    from the next step, and the LOW one is recomputed from the start later, answered once;
    without it, the HIGH request waits for a slot."""
    model = Counter(sleep_ms=20)
    consumer = counter_consumer(model, strategy="priority", max_batch_size=2, aging_ms=0,
                                preempt=preempt)
    with CountingProducer(shared_redis.url, queue) as p:
        low = p.submit_many([{"i": 0, "n": 40}, {"i": 1, "n": 40}], priority="LOW")
        wait_for(lambda: model.most == 2, timeout=30)
        high = p.submit({"i": 9, "n": 3}, priority="HIGH")
        assert high.result(timeout=30) == {"i": 9, "steps": 3}
        assert [h.result(timeout=60) for h in low] == [{"i": 0, "steps": 40},
                                                       {"i": 1, "steps": 40}]
        events = list(low[1].stream(timeout=5))
        time.sleep(0.3)
        assert all(p.deliveries[h.id] == 1 for h in [*low, high])
    first_high = next(k for k, step in enumerate(model.ran) if 9 in step)
    ran_before = [i for step in model.ran[:first_high] for i in step]
    client = Redis.from_url(shared_redis.url)
    stats = queue_stats(client, queue)
    exported = CollectorRegistry()
    exported.register(QueueCollector(client, ExporterConfig(queues=(queue,))))
    shown = "\n".join(stats_table(stats.to_dict()))
    if preempt:
        assert ran_before.count(1) < 40 and 1 not in model.ran[first_high]  # evicted
        assert ran_before.count(0) < 40 and 0 in model.ran[first_high]  # kept running
        assert Restart(1) in events
        rerun = events[events.index(Restart(1)) + 1:]
        assert rerun == [{"i": 1, "step": s} for s in range(40)]
        # The queue's counters: `batchgate stats`, the dashboard, the exporter.
        wasted = ran_before.count(1)
        assert (stats.preempted, stats.preempted_steps) == (1, wasted)
        assert f"1 running requests given back for HIGH work, {wasted} decode steps" in shown
        assert exported.get_sample_value("batchgate_queue_preempted_requests_total",
                                         {"queue": queue}) == 1
        assert exported.get_sample_value("batchgate_queue_preempted_steps_total",
                                         {"queue": queue}) == wasted
        registry = consumer.metrics.registry
        assert registry.get_sample_value("batchgate_consumer_preempted_sequences_total",
                                         {"queue": queue}) == 1
        assert registry.get_sample_value("batchgate_consumer_preempted_steps_total",
                                         {"queue": queue}) == ran_before.count(1)
    else:
        assert ran_before.count(0) == ran_before.count(1) == 40  # waited for a slot
        assert Restart(1) not in events
        assert (stats.preempted, stats.preempted_steps) == (0, 0)
        assert exported.get_sample_value("batchgate_queue_preempted_requests_total",
                                         {"queue": queue}) == 0
    # Each step is the model's call: the consumer's batch size histogram counts steps.
    steps = consumer.metrics.registry.get_sample_value(
        "batchgate_consumer_batch_size_count", {"queue": queue})
    assert steps == len(model.ran)
    # A step is no batch of t(b): no model samples for the live refit or the auto delay.
    assert client.llen(QueueKeys(queue).model_samples) == 0
    assert client.llen(QueueKeys(queue).e2e_samples) == 3


def test_a_hung_step_makes_the_consumer_exit_and_its_sequences_run_elsewhere(
        redis_server, queue, start_consumer):
    """A step stuck past --max-batch-ms: the process exits with status 3 (as for a hung
    static batch) and its sequences, the hung one's batch-mates included, re-run on
    another consumer, each answered once; re-delivered, each runs alone, so the poison
    request does not hang its batch-mate again."""
    url = redis_server.url
    args = ("--model", "step_models:Counter", "--model-arg", "sleep_ms=20", "--batching",
            "continuous", "--strategy", "fifo", "--max-batch-size", "4", "--lease-ms", "500")
    hung = start_consumer(url, queue, *args, "--max-batch-ms", "300", cwd=HELPERS)
    with CountingProducer(url, queue) as p:
        mate = p.submit({"i": 1, "n": 30})
        wait_for(lambda: next(mate.stream(timeout=30)) is not None, timeout=30)
        poison = p.submit({"i": 2, "n": 5, "hang": True})
        assert hung.proc.wait(timeout=30) == 3
        start_consumer(url, queue, *args, cwd=HELPERS)
        assert mate.result(timeout=30) == {"i": 1, "steps": 30}
        time.sleep(0.5)
        assert p.deliveries[mate.id] == 1
        poison.cancel()


def test_the_benchmark_harness_replays_measures_and_judges(
        shared_redis, queue, inprocess_consumer, gpt2):
    """bench.continuous' replay, checks and report on four requests against a consumer in
    this process: the harness, not the numbers (those: `python -m bench.continuous`)."""
    from bench import continuous as bench

    inprocess_consumer(gpt2(), redis_url=shared_redis.url, queue=queue,
                       batching="continuous", strategy="fifo", max_batch_size=4,
                       metrics_registry=CollectorRegistry())
    costs = [bench.SHORT, bench.LONG, bench.SHORT, bench.SHORT]
    run = bench.replay(shared_redis.url, queue, [0.0, 0.01, 0.02, 0.03], costs,
                       drain_timeout_s=30)
    assert run["answered"] == run["submitted"] == 4 and not run["failed"]
    assert run["latency_ms"][str(bench.SHORT)]["n"] == 3
    assert run["tokens_per_s"] == pytest.approx(sum(costs) / run["elapsed_s"], rel=0.01)
    results = {"static": run | {"config": "static"}, "continuous": run}
    checks = bench.checks(results, solo_short_ms=1.0)
    assert len(checks) == 3 and checks[2]["ok"]  # the same run: the same tokens/s
    crashed = bench.checks(results, 1.0, {"requests": 2, "answered_once": 2,
                                          "equal_to_solo": 1})
    assert len(crashed) == 4 and not crashed[0]["ok"] and "1 of 2 equal" in \
        crashed[0]["value"]
    report = {"workload": {"rate": 1.0, "duration_s": 1.0, "load": 0.5, "requests": 4,
                           "short": 3, "long": 1, "solo_short_ms": 1.0,
                           "solo_long_ms": 10.0},
              "consumers": 1, "torch_threads": 1, "configs": results, "high": [],
              "checks": checks, "host": {"load_1m": 0.0, "cores": 2}}
    text = bench.render(report)
    assert "| continuous |" in text and "| static |" in text
    assert text.endswith(f"summary: {sum(c['ok'] for c in checks)} of 3 checks met"
                         + ("" if all(c["ok"] for c in checks) else
                            " (host load 0.0 on 2 core(s))"))


def test_the_benchmark_refuses_an_unknown_configuration():
    out = subprocess.run([sys.executable, "-m", "bench.continuous", "--configs", "bogus"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 2 and "--configs: unknown bogus" in out.stderr
