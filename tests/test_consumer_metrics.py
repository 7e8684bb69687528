"""A consumer's --metrics-port (metrics_port=): Prometheus metrics scraped from a running
consumer."""

from __future__ import annotations

import pytest
from helpers.metrics import scrape, value
from helpers.processes import free_port
from helpers.support import wait_for

from producer import Priority, Producer
from scheduler_core.errors import RequestFailed

pytest.importorskip("prometheus_client.parser")


def test_metrics_scraped_from_a_running_consumer(shared_redis, queue, inprocess_consumer):
    port = free_port()
    inprocess_consumer("consumer.models:synthetic", redis_url=shared_redis.url, queue=queue,
                       model_args={"base_ms": 1, "per_item_ms": 0}, metrics_port=port)
    before = scrape(port)
    assert value(before, "batchgate_consumer_redis_up", queue=queue) == 1
    assert value(before, "batchgate_consumer_requests_total", queue=queue, outcome="ok") == 0

    with Producer(shared_redis.url, queue) as producer:
        handles = producer.submit_many([{"i": i} for i in range(30)], priority=Priority.LOW)
        handles += [producer.submit({"x": 1}, priority=Priority.HIGH)]
        assert all(h.result(timeout=15) for h in handles)
        with pytest.raises(RequestFailed):
            producer.submit({"fail": True}, priority=Priority.NORMAL).result(timeout=15)

    def settled() -> dict:
        s = scrape(port)
        return s if value(s, "batchgate_consumer_requests_total", queue=queue,
                          outcome="failed") == 1 else {}

    after = wait_for(settled, timeout=10, what="the failure to be counted")
    assert value(after, "batchgate_consumer_requests_total", queue=queue, outcome="ok") == 31
    assert value(after, "batchgate_consumer_batch_size_sum", queue=queue) == 32
    batches = value(after, "batchgate_consumer_batch_size_count", queue=queue)
    assert 3 <= batches <= 32  # LOW went in batches, HIGH and the failure alone or not
    assert value(after, "batchgate_consumer_model_seconds_count", queue=queue) == batches
    assert value(after, "batchgate_consumer_model_seconds_sum", queue=queue) > 0
    assert value(after, "batchgate_consumer_queue_wait_seconds_count", queue=queue,
                 priority="low") == 30
    assert value(after, "batchgate_consumer_queue_wait_seconds_count", queue=queue,
                 priority="high") >= 1
    # per-consumer figures only: the queue's own (depth, in flight) come from the exporter
    # (tests/test_exporter.py), or every consumer would report the whole queue again
    assert not any(name.startswith("batchgate_queue_") for name, _ in after)
