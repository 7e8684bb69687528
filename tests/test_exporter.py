"""`batchgate exporter`: every queue's metrics from Redis alone, no consumer needed."""

from __future__ import annotations

import os
import signal
import time

import pytest
import redis
from helpers.metrics import names, scrape, value
from helpers.processes import BATCHGATE, LoggedProcess, free_port
from helpers.support import wait_for

from producer import Priority, Producer
from scheduler_core.errors import RequestFailed
from scheduler_core.keys import QueueKeys
from scheduler_core.registry import register_queue

pytest.importorskip("prometheus_client")


@pytest.fixture
def start_exporter():
    """start_exporter(redis_url, *args) -> the port its /metrics answers on."""
    started: list[LoggedProcess] = []

    def start(redis_url: str, *args: str) -> int:
        port = free_port()
        proc = LoggedProcess([BATCHGATE, "exporter", "--redis-url", redis_url, "--host",
                              "127.0.0.1", "--port", str(port), *args], "bg-exporter-")
        started.append(proc)

        def ready() -> bool:
            assert proc.proc.poll() is None, proc.output()
            return "exporter ready on" in proc.output()
        wait_for(ready, 30, "the exporter to start")
        return port

    yield start
    for proc in started:
        proc.close()


def test_depth_from_redis_alone_then_counters_move_with_a_consumer(
        redis_server, queue, start_exporter, start_consumer):
    client = redis.Redis.from_url(redis_server.url)
    register_queue(client, queue)
    port = start_exporter(redis_server.url)
    empty = scrape(port)
    assert value(empty, "batchgate_exporter_redis_up") == 1
    assert value(empty, "batchgate_exporter_queues") == 1
    assert value(empty, "batchgate_queue_depth", -1, queue=queue, priority="high") == 0

    counts = {Priority.HIGH: 3, Priority.NORMAL: 5, Priority.LOW: 7}
    with Producer(redis_server.url, queue) as producer:
        handles = [h for level, n in counts.items()
                   for h in producer.submit_many([{"i": i} for i in range(n)], priority=level)]
        waiting = scrape(port)  # no consumer has ever run on this queue
        for level, n in counts.items():
            assert value(waiting, "batchgate_queue_depth", queue=queue,
                         priority=level.name.lower()) == n
        assert value(waiting, "batchgate_queue_consumers_alive", -1, queue=queue) == 0
        assert value(waiting, "batchgate_queue_in_flight_requests", -1, queue=queue) == 0
        assert value(waiting, "batchgate_queue_requests_total", -1, queue=queue,
                     outcome="ok") == 0
        assert value(waiting, "batchgate_queue_oldest_wait_seconds", queue=queue) >= 0
        assert ("batchgate_queue_policy_info", (("queue", queue), ("strategy", "priority"))) \
            not in waiting  # no policy stored yet
        time.sleep(0.5)  # every request waits at least this long before a consumer pops it
        assert value(scrape(port), "batchgate_queue_oldest_wait_seconds", queue=queue) >= 0.5

        start_consumer(redis_server.url, queue, "--model", "consumer.models:synthetic",
                       "--model-arg", "base_ms=1", "--model-arg", "per_item_ms=0")
        assert all(h.result(timeout=30) for h in handles)
        with pytest.raises(RequestFailed):
            producer.submit({"fail": True}).result(timeout=30)

    served = scrape(port)
    assert value(served, "batchgate_queue_requests_total", queue=queue, outcome="ok") == 15
    assert value(served, "batchgate_queue_requests_total", queue=queue, outcome="failed") == 1
    for level in counts:
        assert value(served, "batchgate_queue_depth", -1, queue=queue,
                     priority=level.name.lower()) == 0
    assert value(served, "batchgate_queue_in_flight_requests", -1, queue=queue) == 0
    assert value(served, "batchgate_queue_consumers_alive", queue=queue) == 1
    assert value(served, "batchgate_queue_batched_requests_total", queue=queue) == 16
    assert 2 <= value(served, "batchgate_queue_batches_total", queue=queue) <= 16
    assert value(served, "batchgate_queue_latency_samples", queue=queue, kind="wait") == 16
    # the 15 waited >= 0.5 s (the median is one of them); the failure came later
    assert value(served, "batchgate_queue_wait_seconds", queue=queue, quantile="0.5") >= 0.5
    assert value(served, "batchgate_queue_end_to_end_seconds", queue=queue,
                 quantile="0.99") >= 0.5
    assert value(served, "batchgate_queue_model_seconds", queue=queue, quantile="0.5") > 0
    assert value(served, "batchgate_queue_policy_info", queue=queue, strategy="priority") == 1
    assert value(served, "batchgate_queue_policy_max_batch_size", queue=queue) == 32
    assert value(served, "batchgate_queue_policy_max_queue_delay_seconds", queue=queue) == 0.05
    # The delay in use, with its mode: a fixed one is the policy's (auto: test_live.py).
    assert value(served, "batchgate_queue_max_queue_delay_seconds_in_use", queue=queue,
                 delay_mode="fixed") == 0.05
    assert value(served, "batchgate_queue_dead_letters", -1, queue=queue) == 0


def test_registry_filter_cap_and_redis_down(redis_server, start_exporter):
    client = redis.Redis.from_url(redis_server.url)
    for name in ("qa", "qb", "qc"):
        register_queue(client, name)
    client.set("{bg:not a queue}:seen", 1)  # like a mark, but no queue's: skipped
    # a policy written by hand that does not parse: the queue is exported without it
    client.hset(QueueKeys("qc").policy, mapping={"strategy": "fifo", "max_batch_size": "x"})
    every = scrape(start_exporter(redis_server.url))
    assert {dict(labels)["queue"] for name, labels in every
            if name == "batchgate_queue_depth"} == {"qa", "qb", "qc"}
    assert value(every, "batchgate_queue_policy_info", queue="qc", strategy="fifo") == 0

    # --queue: only those, registered or not
    only = scrape(start_exporter(redis_server.url, "--queue", "qb", "--queue", "unregistered"))
    assert {dict(labels)["queue"] for name, labels in only
            if name == "batchgate_queue_depth"} == {"qb", "unregistered"}

    # The cap keeps the most active: qa has a request waiting, qc was seen after qb.
    with Producer(redis_server.url, "qa") as producer:
        producer.submit(1)
    now_ms = int(time.time() * 1000)
    client.set(QueueKeys("qb").seen, now_ms - 60_000)
    client.set(QueueKeys("qc").seen, now_ms)
    capped = scrape(start_exporter(redis_server.url, "--max-queues", "2"))
    assert {dict(labels)["queue"] for name, labels in capped
            if name == "batchgate_queue_depth"} == {"qa", "qc"}
    assert value(capped, "batchgate_exporter_queues_skipped") == 1

    nothing = f"redis://127.0.0.1:{free_port()}/0"  # no server there
    down = scrape(start_exporter(nothing))
    assert value(down, "batchgate_exporter_redis_up", -1) == 0
    assert "batchgate_queue_depth" not in names(down)


def test_hung_redis_is_reported_down_within_the_scrape_timeout(redis_server, start_exporter):
    """A Redis that hangs (SIGSTOP: connections open, no answer) is reported
    redis_up 0 within --scrape-timeout-s, not after the client's socket timeout and
    retries; once it answers again, so does the next scrape."""
    timeout_s = 1.0
    register_queue(redis.Redis.from_url(redis_server.url), "qa")
    port = start_exporter(redis_server.url, "--scrape-timeout-s", str(timeout_s))
    assert value(scrape(port), "batchgate_exporter_redis_up") == 1
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        for _ in range(2):  # the second waits behind the first's read, still hung
            started = time.monotonic()
            hung = scrape(port)
            took = time.monotonic() - started
            assert value(hung, "batchgate_exporter_redis_up", -1) == 0
            assert "batchgate_queue_depth" not in names(hung)
            assert took < timeout_s + 3.0, f"the scrape took {took:.1f} s"
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    back = scrape(port)
    assert value(back, "batchgate_exporter_redis_up") == 1
    assert value(back, "batchgate_queue_depth", queue="qa", priority="normal", default=-1) == 0
