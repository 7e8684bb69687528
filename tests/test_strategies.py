"""The scheduling rules (docs/scheduling.md) as users observe them, end to end:
real redis-server, a real Consumer in the test process (as `batchgate consumer` runs one),
timings from Redis' clock."""

from __future__ import annotations

import threading
import time

import pytest
import redis
from helpers.support import RecordingModel, configure, wait_for, wait_samples_ms

from producer import Priority, Producer
from scheduler_core.ops.stats import queue_stats

# -- dynamic -------------------------------------------------------------------------


def test_dynamic_partial_batch_waits_for_the_delay(shared_redis, queue, inprocess_consumer,
                                                   tmp_path):
    delay_ms = 600
    model = RecordingModel(tmp_path)
    model.serve(inprocess_consumer, shared_redis.url, queue, strategy="dynamic",
                max_batch_size=8, max_queue_delay_ms=delay_ms)
    client = shared_redis.client()
    with Producer(shared_redis.url, queue) as p:
        # Three requests trickle in; none fills the batch of 8.
        handles = []
        for i in range(3):
            handles.append(p.submit({"i": i}))
            time.sleep(0.1)
        assert [h.result(timeout=10) for h in handles] == [{"i": i} for i in range(3)]

    # Released together, as one batch, and only once the oldest had waited the delay
    # (measured by Redis: arrival to pop); later arrivals did not release it early.
    assert [b["payloads"] for b in model.batches()] == [[{"i": 0}, {"i": 1}, {"i": 2}]]
    waits = wait_samples_ms(client, queue)
    assert len(waits) == 3
    assert waits[0] >= delay_ms, waits
    assert waits[0] < delay_ms + 3000, waits
    stats = queue_stats(client, queue)
    assert stats.batches == 1 and stats.mean_batch_size == 3


def test_dynamic_single_request_waits_for_the_delay(shared_redis, queue, inprocess_consumer):
    delay_ms = 400
    inprocess_consumer("consumer.models:noop", redis_url=shared_redis.url, queue=queue,
                       strategy="dynamic", max_batch_size=4, max_queue_delay_ms=delay_ms)
    with Producer(shared_redis.url, queue) as p:
        started = time.monotonic()
        assert p.submit("alone").result(timeout=10) == "alone"
        elapsed = time.monotonic() - started
    assert elapsed >= delay_ms / 1000
    (wait,) = wait_samples_ms(shared_redis.client(), queue)
    assert delay_ms <= wait < delay_ms + 3000


def test_dynamic_full_batch_is_released_at_once(shared_redis, queue, inprocess_consumer,
                                                tmp_path):
    delay_ms = 3000
    model = RecordingModel(tmp_path)
    model.serve(inprocess_consumer, shared_redis.url, queue, strategy="dynamic",
                max_batch_size=8, max_queue_delay_ms=delay_ms)
    client = shared_redis.client()
    with Producer(shared_redis.url, queue) as p:
        first = p.submit({"i": 0})
        time.sleep(0.2)  # the consumer now sleeps towards the first request's due time
        rest = [p.submit({"i": i}) for i in range(1, 8)]  # the 8th fills the batch
        results = [h.result(timeout=10) for h in [first, *rest]]
    assert results == [{"i": i} for i in range(8)]
    assert [b["payloads"] for b in model.batches()] == [[{"i": i} for i in range(8)]]
    waits = wait_samples_ms(client, queue)
    # Far less than the 3 s delay: the batch left as soon as it was full.
    assert len(waits) == 8 and max(waits) < delay_ms / 2, waits


def test_dynamic_backlog_is_served_in_full_batches(shared_redis, queue, inprocess_consumer,
                                                   tmp_path):
    model = RecordingModel(tmp_path)
    configure(shared_redis.url, queue, strategy="dynamic", max_batch_size=5,
              max_queue_delay_ms=2000)
    with Producer(shared_redis.url, queue) as p:
        handles = p.submit_many([{"i": i} for i in range(10)])
        started = time.monotonic()
        model.serve(inprocess_consumer, shared_redis.url, queue)
        assert [h.result(timeout=10) for h in handles] == [{"i": i} for i in range(10)]
        assert time.monotonic() - started < 10
    assert [len(b["payloads"]) for b in model.batches()] == [5, 5]


# -- priority ------------------------------------------------------------------------


def test_priority_high_is_served_first_without_waiting(shared_redis, queue, inprocess_consumer,
                                                       tmp_path):
    delay_ms = 1000
    model = RecordingModel(tmp_path)
    model.serve(inprocess_consumer, shared_redis.url, queue, strategy="priority",
                max_batch_size=16, max_queue_delay_ms=delay_ms, aging_ms=60000)
    client = shared_redis.client()
    with Producer(shared_redis.url, queue) as p:
        normal = p.submit_many([{"n": i} for i in range(3)], priority=Priority.NORMAL)
        low = p.submit_many([{"l": i} for i in range(3)], priority="low")
        time.sleep(0.1)
        high = p.submit({"h": 0}, priority=Priority.HIGH)
        assert high.result(timeout=10) == {"h": 0}
        # HIGH came back while NORMAL (not yet due) and LOW (NORMAL waiting) still wait.
        assert not any(h.done() for h in normal + low)
        assert p.fetch(normal[0].id) is None and p.fetch(low[0].id) is None
        assert [h.result(timeout=10) for h in normal] == [{"n": i} for i in range(3)]
        assert [h.result(timeout=10) for h in low] == [{"l": i} for i in range(3)]

    assert [b["payloads"] for b in model.batches()] == [
        [{"h": 0}], [{"n": i} for i in range(3)], [{"l": i} for i in range(3)]]
    waits = wait_samples_ms(client, queue)  # in pop order: HIGH, NORMAL x3, LOW x3
    assert waits[0] < delay_ms / 2, waits
    assert waits[1] >= delay_ms, waits  # NORMAL by the dynamic rule: not before its delay


def test_priority_order_high_then_normal_then_low(shared_redis, queue, inprocess_consumer,
                                                  tmp_path):
    """A backlog is served HIGH first, NORMAL next, and LOW only once NORMAL is empty,
    although the LOW requests arrived first."""
    model = RecordingModel(tmp_path)
    configure(shared_redis.url, queue, strategy="priority", max_batch_size=4,
              max_queue_delay_ms=50, aging_ms=60000)
    with Producer(shared_redis.url, queue) as p:
        handles = p.submit_many([{"p": "low", "i": i} for i in range(6)], priority="low")
        handles += p.submit_many([{"p": "normal", "i": i} for i in range(6)],
                                 priority="normal")
        handles += p.submit_many([{"p": "high", "i": i} for i in range(2)], priority="high")
        time.sleep(0.06)  # NORMAL is due (50 ms) by the time the consumer starts
        model.serve(inprocess_consumer, shared_redis.url, queue)
        for h in handles:
            h.result(timeout=10)
    batches = [b["payloads"] for b in model.batches()]
    served = [(x["p"], x["i"]) for batch in batches for x in batch]
    assert served == ([("high", i) for i in range(2)] + [("normal", i) for i in range(6)]
                      + [("low", i) for i in range(6)])
    # Never mixed: each batch holds one priority, at most max_batch_size requests.
    assert all(len({x["p"] for x in batch}) == 1 and len(batch) <= 4 for batch in batches)


def test_priority_aged_low_is_served_under_continuous_high_load(shared_redis, queue,
                                                                inprocess_consumer, tmp_path):
    aging_ms = 200
    model = RecordingModel(tmp_path)
    model.serve(inprocess_consumer, shared_redis.url, queue, strategy="priority",
                max_batch_size=4, aging_ms=aging_ms, delay_ms=20)
    client = shared_redis.client()
    stop = threading.Event()
    flood_errors: list[BaseException] = []

    def flood(p: Producer) -> None:
        # ~10x what the consumer can serve (4 requests per >= 20 ms batch).
        try:
            n = 0
            while not stop.is_set():
                p.submit_many([{"high": n + i} for i in range(10)], priority="high")
                n += 10
                time.sleep(0.01)
        except (redis.RedisError, RuntimeError) as exc:
            flood_errors.append(exc)

    with Producer(shared_redis.url, queue) as p, Producer(shared_redis.url, queue) as fp:
        blocker = p.submit({"blocker": 1, "sleep_ms": 300}, priority="high")
        wait_for(lambda: model.batches(), what="the blocker to start")
        low = p.submit({"low": 1}, priority="low")
        thread = threading.Thread(target=flood, args=(fp,), daemon=True)
        thread.start()
        try:
            assert low.result(timeout=20) == {"low": 1}
            high_waiting = queue_stats(client, queue).depth["high"]
        finally:
            stop.set()
            thread.join(10)
        assert blocker.result(timeout=1) == {"blocker": 1, "sleep_ms": 300}
    assert not flood_errors
    # Served while HIGH requests were still waiting: aging, not an idle gap, let it in.
    assert high_waiting > 0
    batches = [b["payloads"] for b in model.batches()]
    low_at = next(i for i, b in enumerate(batches) if {"low": 1} in b)
    assert any("high" in x for b in batches[1:low_at] for x in b), \
        "HIGH batches ran first while the LOW request was young"


# -- arrival order -------------------------------------------------------------------


@pytest.mark.parametrize(("strategy", "extra", "batch"), [
    ("fifo", {}, 1),
    ("fifo", {"max_batch_size": 4}, 4),
    ("dynamic", {"max_batch_size": 4, "max_queue_delay_ms": 50}, 4),
])
def test_arrival_order_across_priorities(shared_redis, queue, inprocess_consumer, tmp_path,
                                         strategy, extra, batch):
    model = RecordingModel(tmp_path)
    configure(shared_redis.url, queue, strategy=strategy, **extra)
    priorities = ["low", "high", "normal"]
    with Producer(shared_redis.url, queue) as p:
        handles = [p.submit({"i": i}, priority=priorities[i % 3]) for i in range(20)]
        time.sleep(0.06)
        model.serve(inprocess_consumer, shared_redis.url, queue)
        assert [h.result(timeout=10) for h in handles] == [{"i": i} for i in range(20)]
    batches = [b["payloads"] for b in model.batches()]
    # Strict arrival order, priorities ignored, in consecutive batches of `batch`.
    expected = [[{"i": i} for i in range(s, min(s + batch, 20))] for s in range(0, 20, batch)]
    assert batches == expected


def test_fifo_is_one_by_one_in_arrival_order_while_running(shared_redis, queue,
                                                           inprocess_consumer, tmp_path):
    model = RecordingModel(tmp_path)
    model.serve(inprocess_consumer, shared_redis.url, queue, strategy="fifo", delay_ms=5)
    with Producer(shared_redis.url, queue) as p:
        handles = [p.submit({"i": i}, priority=("high" if i % 2 else "low"))
                   for i in range(15)]
        assert [h.result(timeout=10) for h in handles] == [{"i": i} for i in range(15)]
    assert [b["payloads"] for b in model.batches()] == [[{"i": i}] for i in range(15)]
