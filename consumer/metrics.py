"""Prometheus metrics of one consumer: `batchgate consumer --metrics-port PORT` serves
them at http://HOST:PORT/metrics (needs `prometheus_client`, the `metrics` extra);
`Consumer(..., metrics_registry=R)` records them into the registry R.

| metric                                      | type      | labels                      |
|---------------------------------------------|-----------|-----------------------------|
| `batchgate_consumer_queue_wait_seconds`     | histogram | queue, priority             |
| `batchgate_consumer_batch_size`             | histogram | queue                       |
| `batchgate_consumer_model_seconds`          | histogram | queue                       |
| `batchgate_consumer_requests_total`         | counter   | queue, outcome              |
| `batchgate_consumer_redis_up`               | gauge     | queue                       |
| `batchgate_consumer_max_queue_delay_seconds_in_use` | gauge | queue                  |
| `batchgate_consumer_preempted_sequences_total` | counter | queue (`--preempt` only)   |
| `batchgate_consumer_preempted_steps_total`  | counter   | queue (`--preempt` only)    |

Every figure is this consumer's own, so sums across consumers do not double count; the
queue-wide ones (depth, in flight, consumers alive, the queue's counters, arrival rate,
recommended consumers) come from
`batchgate exporter` (batchgate/exporter.py), once per queue. The histograms and counter
describe this consumer's batches: queue wait is enqueue to pop by Redis' clock,
labelled with the priority the request was served at (aging may promote it); batch size
counts the requests the model ran; outcome is ok, failed, expired (deadline passed before
it ran), dead_letter or retry (the model raised a retry_on exception: it runs again). The
delay in use is the max_queue_delay_ms this consumer passes to pop_batch (under
max_queue_delay_ms=auto the one it derived last, else the stored one); the arrival rate
(requests/s) is the one it derived it from (0 under a fixed delay).
Under `--batching continuous` the model's call is a step: batch size counts the sequences
a step advanced and model time is the step's; with `--preempt`, the running sequences this
consumer gave back to the queue for HIGH work, and the decode steps they had run (thrown
away: recomputed later).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import redis
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from consumer.batch import Answers, Batch
from scheduler_core.policy import Priority
from scheduler_core.wire import Outcome

log = logging.getLogger("batchgate.metrics")

WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                30.0, 60.0, 300.0, 1800.0)
MODEL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                 30.0, 60.0)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)


class RedisUpCollector(Collector):
    """Whether this consumer reaches Redis: one PING at each scrape."""

    def __init__(self, client: redis.Redis, queue: str):
        self.client, self.queue = client, queue

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("batchgate_consumer_redis_up",
                               "1 if this consumer's scrape-time PING reached Redis.",
                               labels=["queue"])
        try:
            self.client.ping()
            up.add_metric([self.queue], 1)
        except redis.RedisError as exc:
            log.debug("metrics scrape cannot reach Redis: %s", exc)
            up.add_metric([self.queue], 0)
        yield up


class DelayCollector(Collector):
    """The delay this consumer applies (the queue's arrival rate is the exporter's)."""

    def __init__(self, consumer: Any):  # a Worker or ShardedConsumer
        self.consumer = consumer

    def collect(self) -> Iterator[Metric]:
        queue = self.consumer.config.queue
        derived, policy = self.consumer.delay.derived, self.consumer.policy
        delay = GaugeMetricFamily("batchgate_consumer_max_queue_delay_seconds_in_use",
                                  "The max_queue_delay this consumer applies (auto: derived).",
                                  labels=["queue"])
        if derived is not None:
            delay.add_metric([queue], derived.delay_ms / 1000)
        elif policy is not None:
            delay.add_metric([queue], policy.max_queue_delay_ms / 1000)
        yield delay


class PreemptionCollector(Collector):
    """A continuous consumer's preemptions (consumer/continuous.py)."""

    def __init__(self, worker: Any):
        self.worker = worker

    def collect(self) -> Iterator[Metric]:
        queue, loop = self.worker.config.queue, self.worker.continuous
        for name, help_text, value in (
                ("batchgate_consumer_preempted_sequences",
                 "Running sequences given back to the queue for HIGH work.", loop.preempted),
                ("batchgate_consumer_preempted_steps",
                 "Decode steps the preempted sequences had run (recomputed later).",
                 loop.wasted_steps)):
            metric = CounterMetricFamily(name, help_text, labels=["queue"])
            metric.add_metric([queue], value)
            yield metric


class ConsumerMetrics:
    """The consumer's batch observer: called once per batch, before its completion."""

    def __init__(self, queue: str, client: redis.Redis,
                 registry: CollectorRegistry | None = None):
        self.queue = queue
        self.registry = registry or CollectorRegistry()
        self.registry.register(RedisUpCollector(client, queue))
        self.wait = Histogram("batchgate_consumer_queue_wait_seconds",
                              "Enqueue to pop, per priority served at.", ["queue", "priority"],
                              buckets=WAIT_BUCKETS, registry=self.registry)
        self.size = Histogram("batchgate_consumer_batch_size", "Requests the model ran at once.",
                              ["queue"], buckets=SIZE_BUCKETS, registry=self.registry)
        self.model = Histogram("batchgate_consumer_model_seconds", "Model time per batch.",
                               ["queue"], buckets=MODEL_BUCKETS, registry=self.registry)
        self.outcomes = Counter("batchgate_consumer_requests", "Requests answered, by outcome.",
                                ["queue", "outcome"], registry=self.registry)
        # Labelled by the outcome's name, each exported at 0 from the start.
        self._answered = {outcome: self.outcomes.labels(queue, outcome.name.lower())
                          for outcome in Outcome if outcome is not Outcome.RUN}

    def on_step(self, size: int, model_us: int) -> None:
        """A continuous consumer's step (consumer/continuous.py): the model's call there."""
        try:
            self.size.labels(self.queue).observe(size)
            self.model.labels(self.queue).observe(model_us / 1e6)
        except Exception:  # metrics must never stop the consumer
            log.exception("metrics observer failed")

    def on_batch(self, batch: Batch, ran: int, model_us: int, outcomes: Answers) -> None:
        try:
            for item in batch.items:
                level = Priority(item.level).name.lower() if 0 <= item.level <= 2 else "other"
                self.wait.labels(self.queue, level).observe(
                    max(0, batch.popped_us - item.arrival_us) / 1e6)
            if ran:
                self.size.labels(self.queue).observe(ran)
                self.model.labels(self.queue).observe(model_us / 1e6)
            for outcome, _ in outcomes.values():
                self._answered[outcome].inc()
        except Exception:  # metrics must never stop the consumer
            log.exception("metrics observer failed")


def serve_metrics(registry: CollectorRegistry, port: int, host: str = "0.0.0.0") -> Any:
    """Serve `registry` on http://host:port/metrics from a thread; the server (its
    shutdown() stops it)."""
    server, _thread = start_http_server(port, addr=host, registry=registry)
    log.info("metrics on http://%s:%d/metrics", host, port)
    return server
