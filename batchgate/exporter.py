"""`batchgate exporter`: Prometheus metrics of every queue, read from Redis alone.

No consumer needs to run, so an autoscaler (KEDA, an HPA on external metrics) can start
consumers from zero; and each queue is reported once, however many consumers serve it.
The queues come from --queue, or are found (scheduler_core/registry.py: a SCAN pass at
most every 5 s, the --max-queues most active). Every scrape reads Redis afresh: one MULTI
per queue (a consistent snapshot of that queue, with Redis' TIME;
scheduler_core/ops/reading.py), with the newest --samples latency samples of each, within
--scrape-timeout-s (a Redis that does not answer in time is reported down). Metric names:
docs/observability.md.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import click
import redis

from scheduler_core.errors import InvalidRequest
from scheduler_core.keys import CONSUMER_ALIVE_S, validate_queue_name
from scheduler_core.ops.options import FloatRange, env_option, redis_url_option
from scheduler_core.ops.reading import (
    SAMPLES_READ,
    QueueReading,
    quantile,
    read_queue,
)
from scheduler_core.ops.scaling import scaling_signal
from scheduler_core.ops.stats import (
    OTHER_TENANTS,
    delay_in_use,
    fairness,
    summed,
    tenant_stats,
)
from scheduler_core.policy import LIMITS, Policy, Priority
from scheduler_core.registry import DEFAULT_MAX_QUEUES, QueueFinder, shown_queues

log = logging.getLogger("batchgate.exporter")

DEFAULT_PORT = 9120
DEFAULT_SAMPLES = 1000
# Well under Prometheus' default scrape_timeout (10 s), so that it receives redis_up 0.
DEFAULT_SCRAPE_TIMEOUT_S = 5.0
MAX_SCRAPE_TIMEOUT_S = 60.0
MAX_SAMPLES = SAMPLES_READ  # what the sample lists keep (scheduler_core/lua/_common.lua)
QUANTILES = (0.5, 0.9, 0.99)
DEFAULT_TENANT_LABELS = 20  # tenants with a label of their own per queue; the rest: "other"
MAX_TENANT_LABELS = 1000
# {bg:q}:stats counter -> (metric, outcome label or None)
REQUEST_COUNTERS = {"processed": "ok", "failed": "failed", "expired": "expired",
                    "cancelled": "cancelled"}
OTHER_COUNTERS = {
    "requeued": ("batchgate_queue_requeued_requests",
                 "Requests returned to the queue after their batch's lease expired."),
    "batches": ("batchgate_queue_batches", "Batches popped."),
    "batched_requests": ("batchgate_queue_batched_requests",
                         "Requests popped in batches (divide by batches: mean batch size)."),
    "dead_retried": ("batchgate_queue_dead_letters_retried",
                     "Dead letters sent back to the queue (dead-letter retry)."),
    "dead_purged": ("batchgate_queue_dead_letters_purged", "Dead letters purged."),
    "retried": ("batchgate_queue_retried_requests",
                "Runs that raised a retry_on exception, scheduled to run again."),
    "preempted": ("batchgate_queue_preempted_requests",
                  "Running requests given back to the queue for HIGH work (--preempt)."),
    "preempted_steps": ("batchgate_queue_preempted_steps",
                        "Decode steps the preempted requests had run (recomputed later)."),
}
# Policy knob -> (gauge, unit divisor to seconds or 1)
POLICY_GAUGES = {
    "max_batch_size": ("batchgate_queue_policy_max_batch_size", 1),
    "max_queue_delay_ms": ("batchgate_queue_policy_max_queue_delay_seconds", 1000),
    "aging_ms": ("batchgate_queue_policy_aging_seconds", 1000),
    "max_queue_size": ("batchgate_queue_policy_max_queue_size", 1),
    "max_attempts": ("batchgate_queue_policy_max_attempts", 1),
    "result_ttl_s": ("batchgate_queue_policy_result_ttl_seconds", 1),
    "max_cost": ("batchgate_queue_policy_max_cost", 1),
    "max_batch_cost": ("batchgate_queue_policy_max_batch_cost", 1),
    "slo_p99_ms": ("batchgate_queue_policy_slo_p99_seconds", 1000),
    "timeout_high_ms": ("batchgate_queue_policy_timeout_high_seconds", 1000),
    "timeout_normal_ms": ("batchgate_queue_policy_timeout_normal_seconds", 1000),
    "timeout_low_ms": ("batchgate_queue_policy_timeout_low_seconds", 1000),
    "allow_timeout_override": ("batchgate_queue_policy_allow_timeout_override", 1),
    "shards": ("batchgate_queue_policy_shards", 1),
    "retry_max": ("batchgate_queue_policy_retry_max", 1),
    "retry_backoff_ms": ("batchgate_queue_policy_retry_backoff_seconds", 1000),
    "retry_backoff_max_ms": ("batchgate_queue_policy_retry_backoff_max_seconds", 1000),
    "retry_jitter": ("batchgate_queue_policy_retry_jitter", 1),
}
assert set(POLICY_GAUGES) == set(LIMITS), "every policy knob is exported"


@dataclass(frozen=True)
class ExporterConfig:
    queues: tuple[str, ...] = ()  # only these (found or not); empty: those found
    max_queues: int = DEFAULT_MAX_QUEUES
    samples: int = DEFAULT_SAMPLES
    scrape_timeout_s: float = DEFAULT_SCRAPE_TIMEOUT_S
    tenant_labels: int = DEFAULT_TENANT_LABELS

    def __post_init__(self) -> None:
        for name in self.queues:
            validate_queue_name(name)
        if (isinstance(self.scrape_timeout_s, bool)
                or not isinstance(self.scrape_timeout_s, int | float)
                or not 0.1 <= self.scrape_timeout_s <= MAX_SCRAPE_TIMEOUT_S):
            raise InvalidRequest("scrape_timeout_s", f"{self.scrape_timeout_s!r} is outside "
                                 f"[0.1, {MAX_SCRAPE_TIMEOUT_S:g}] seconds")
        for field, value, low, high in (("max_queues", self.max_queues, 1, 10_000),
                                        ("samples", self.samples, 1, MAX_SAMPLES),
                                        ("tenant_labels", self.tenant_labels, 0,
                                         MAX_TENANT_LABELS)):
            if (isinstance(value, bool) or not isinstance(value, int)
                    or not low <= value <= high):
                raise InvalidRequest(field, f"{value!r} is outside [{low}, {high}]")


class Families:
    """The metric families of one scrape, filled queue by queue."""

    def __init__(self, tenant_labels: int = DEFAULT_TENANT_LABELS) -> None:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        self.tenant_labels = tenant_labels

        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        q = ["queue"]
        self.depth = gauge("batchgate_queue_depth", "Requests waiting, per priority "
                           "(delayed: past their deadline, on_timeout=delay).",
                           labels=["queue", "priority"])
        self.oldest = gauge("batchgate_queue_oldest_wait_seconds",
                            "Age of the oldest waiting request (0 when none waits).", labels=q)
        self.in_flight = gauge("batchgate_queue_in_flight_requests",
                               "Requests in a batch being run.", labels=q)
        self.in_flight_batches = gauge("batchgate_queue_in_flight_batches",
                                       "Batches being run (leases held).", labels=q)
        self.consumers = gauge("batchgate_queue_consumers_alive",
                               f"Consumers that heartbeat in the last {CONSUMER_ALIVE_S:g} s.",
                               labels=q)
        self.dead = gauge("batchgate_queue_dead_letters", "Requests in the dead-letter set.",
                          labels=q)
        self.requests = counter("batchgate_queue_requests",
                                "Requests answered, by outcome (every consumer).",
                                labels=["queue", "outcome"])
        self.others = {field: counter(name, text, labels=q)
                       for field, (name, text) in OTHER_COUNTERS.items()}
        self.wait = gauge("batchgate_queue_wait_seconds",
                          "Enqueue to pop, quantile of the newest samples.",
                          labels=["queue", "quantile"])
        self.e2e = gauge("batchgate_queue_end_to_end_seconds",
                         "Enqueue to result, quantile of the newest samples.",
                         labels=["queue", "quantile"])
        self.model = gauge("batchgate_queue_model_seconds",
                           "Model time per batch, quantile of the newest samples.",
                           labels=["queue", "quantile"])
        self.samples = gauge("batchgate_queue_latency_samples",
                             "Samples the quantiles were taken from, per kind.",
                             labels=["queue", "kind"])
        self.policy_info = gauge("batchgate_queue_policy_info",
                                 "The queue's stored policy (value 1; absent: no policy yet).",
                                 labels=["queue", "strategy"])
        self.arrival_rate = gauge("batchgate_queue_arrival_rate",
                                  "Requests enqueued per second, over the last 10 s.", labels=q)
        self.recommended = gauge("batchgate_recommended_consumers",
                                 "Consumers the planner says the queue's policy needs to meet "
                                 "its slo_p99_ms at the measured arrival rate.", labels=q)
        self.delay = gauge("batchgate_queue_max_queue_delay_seconds_in_use",
                           "The max_queue_delay_ms pop_batch applies, in seconds: the policy's "
                           "(delay_mode fixed) or the one the consumers derived (auto; absent "
                           f"when none did in the last {CONSUMER_ALIVE_S:g} s).",
                           labels=["queue", "delay_mode"])
        self.policy = {knob: gauge(name, f"Policy knob {knob}" + (" (in seconds)." if div > 1
                                                                 else "."), labels=q)
                       for knob, (name, div) in POLICY_GAUGES.items()}
        qt = ["queue", "tenant"]
        other = (f" The {tenant_labels} tenants with the most requests accepted have a "
                 "label each, the rest are summed as tenant=\"other\" (docs/tenants.md).")
        self.tenants = {
            "waiting": gauge("batchgate_tenant_waiting", "Requests waiting, per tenant." +
                             other, labels=qt),
            "in_flight": gauge("batchgate_tenant_in_flight", "Requests in a batch being run, "
                               "per tenant." + other, labels=qt),
            "served": counter("batchgate_tenant_served", "Requests run (ok or failed), per "
                              "tenant." + other, labels=qt),
            "served_cost": counter("batchgate_tenant_served_cost", "Cost of the requests "
                                   "run, per tenant." + other, labels=qt),
            "rejected": counter("batchgate_tenant_rejected", "Requests refused by a tenant "
                                "quota (TenantLimit)." + other, labels=qt),
        }
        self.share = gauge("batchgate_tenant_share", "A backlogged tenant's fraction of the "
                           "weighted service among the backlogged tenants (absent for one "
                           "with nothing waiting)." + other, labels=qt)
        self.backlogged = gauge("batchgate_tenant_backlogged", "Named tenants with requests "
                                "waiting.", labels=q)
        self.jain = gauge("batchgate_tenant_fairness_jain", "Jain's fairness index over the "
                          "backlogged tenants' weighted service (1: equal; absent when none "
                          "is backlogged).", labels=["queue", "unit"])
        self.tenant_fields = gauge("batchgate_tenant_counter_fields", "Fields of the "
                                   "tenants' counter hash; past the read cap no tenant series "
                                   "is exported (docs/tenants.md).", labels=q)

    def add(self, queue: str, r: QueueReading, policy: Policy | None = None) -> None:
        for level, count in zip(Priority, r.depth, strict=True):
            self.depth.add_metric([queue, level.name.lower()], count)
        self.depth.add_metric([queue, "delayed"], r.delayed)
        self.oldest.add_metric([queue], max(0, r.now_us - min(r.oldest_us)) / 1e6
                               if r.oldest_us else 0)
        self.in_flight.add_metric([queue], r.owned)
        self.in_flight_batches.add_metric([queue], r.batches_in_flight)
        self.consumers.add_metric([queue], r.consumers_alive)
        self.dead.add_metric([queue], r.dead)
        for field, outcome in REQUEST_COUNTERS.items():
            self.requests.add_metric([queue, outcome], r.counters.get(field, 0))
        for field, family in self.others.items():
            family.add_metric([queue], r.counters.get(field, 0))
        for family, kind, values in ((self.wait, "wait", r.waits), (self.e2e, "end_to_end", r.e2e),
                                     (self.model, "model", r.model)):
            self.samples.add_metric([queue, kind], len(values))
            if values:  # no samples, no quantile (not a misleading 0)
                for q in QUANTILES:
                    family.add_metric([queue, f"{q:g}"], quantile(values, q) / 1e6)
        if policy is not None:
            self.policy_info.add_metric([queue, policy.strategy.value], 1)
            in_use = delay_in_use(policy, r.counters,
                                  r.now_us - CONSUMER_ALIVE_S * 1_000_000)
            if in_use is not None:
                self.delay.add_metric([queue, policy.delay_mode], in_use / 1000)
            for knob, (_, div) in POLICY_GAUGES.items():
                self.policy[knob].add_metric([queue], getattr(policy, knob) / div)

        self.tenant_fields.add_metric([queue], r.tenant_fields)
        if r.tenants_read:
            self.add_tenants(queue, tenant_stats(r.tenants, sum(r.depth) + r.delayed,
                                                 r.owned, policy), policy)

    def add_tenants(self, queue: str, tenants: dict[str, dict[str, Any]],
                    policy: Policy | None = None) -> None:
        """The tenant_labels tenants with the most accepted requests, a label each (a
        ranking by a total changes slowly, so labels seldom come and go); the rest as
        "other": the label count stays bounded whatever the number of tenants. Jain's
        index is over every backlogged tenant, labelled or not."""
        ranked = sorted(tenants.items(), key=lambda item: (-item[1]["accepted"], item[0]))
        rows = ranked[:self.tenant_labels]
        if len(ranked) > self.tenant_labels:
            rows.append((OTHER_TENANTS, summed([t for _, t in ranked[self.tenant_labels:]])))
        for tenant, t in rows:
            for name, family in self.tenants.items():
                family.add_metric([queue, tenant], t[name])
            if t["share"] is not None:
                self.share.add_metric([queue, tenant], t["share"])
        fair = fairness(tenants, policy)
        self.backlogged.add_metric([queue], fair.backlogged)
        if fair.jain_index is not None:
            self.jain.add_metric([queue, fair.unit], fair.jain_index)

    def add_scaling(self, queue: str, signal: dict[str, Any]) -> None:
        self.arrival_rate.add_metric([queue], signal["arrival_rate_rps"])
        if signal["recommended_consumers"] is not None:  # no target or no cost model yet
            self.recommended.add_metric([queue], signal["recommended_consumers"])

    def all(self) -> Iterator[Any]:
        yield from (self.depth, self.oldest, self.in_flight, self.in_flight_batches,
                    self.consumers, self.dead, self.requests, *self.others.values(), self.wait,
                    self.e2e, self.model, self.samples, self.policy_info, self.delay,
                    *self.policy.values(), self.arrival_rate, self.recommended,
                    *self.tenants.values(), self.share, self.backlogged, self.jain,
                    self.tenant_fields)


class Reader:
    """Runs one read at a time on a thread of its own, so that a scrape can stop waiting:
    a hung Redis holds that thread until the client's socket timeout and retries, while
    each scrape answers at its deadline. A daemon thread: it must not hold up an exit."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = \
            queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True, name="batchgate-exporter-read").start()

    def _run(self) -> None:
        while True:
            read, future = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue  # its scrape gave up before it started
            try:
                future.set_result(read())
            except BaseException as exc:  # handed to the scrape
                future.set_exception(exc)

    def submit(self, read: Callable[[], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        self._jobs.put((read, future))
        return future


class QueueCollector:
    """A prometheus_client collector: reads Redis at each scrape, nothing in between."""

    def __init__(self, client: redis.Redis, config: ExporterConfig):
        self.client, self.config = client, config
        self.finder = QueueFinder(client)
        self._warned: set[str] = set()  # say once per problem, not once per scrape
        self._lock = threading.Lock()
        self._reader = Reader()

    def queues(self) -> tuple[list[str], int]:
        """The queues to read this scrape, and how many found ones the cap left out."""
        names, left_out = shown_queues(self.client, list(self.config.queues),
                                       self.config.max_queues, self.finder)
        if left_out:
            self._warn("cap", "%d more queues found than --max-queues; exporting the %d "
                       "most active", left_out, len(names))
        return names, left_out

    def policy(self, queue: str, reading: QueueReading) -> Policy | None:
        """The queue's stored policy; None if it has none, or one that does not parse
        (written by hand or by a newer version: the rest of the queue is still exported)."""
        if not reading.policy:
            return None
        try:
            return Policy.from_redis(reading.policy)
        except ValueError as exc:  # InvalidPolicy too
            self._warn(f"policy:{queue}", "queue %r: stored policy not exported: %s", queue,
                       exc)
            return None

    def add_scaling(self, families: Families, queue: str) -> None:
        """Arrival rate and recommended consumers (scheduler_core.ops.scaling; the
        planner caches its answers per rate band, policy and cost model)."""
        try:
            families.add_scaling(queue, scaling_signal(self.client, queue))
        except (redis.ConnectionError, redis.TimeoutError):
            raise
        except Exception as exc:  # a planner failure (or a queue's bad key) drops these two
            self._warn(f"scaling:{queue}", "queue %r: recommended_consumers failed: %s",
                       queue, exc)

    def _warn(self, key: str, message: str, *args: Any) -> None:
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        log.warning(message, *args)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        started = time.perf_counter()
        up = GaugeMetricFamily("batchgate_exporter_redis_up",
                               "1 if the last scrape read Redis, else 0.")
        exported = GaugeMetricFamily("batchgate_exporter_queues", "Queues exported.")
        skipped = GaugeMetricFamily("batchgate_exporter_queues_skipped",
                                    "Queues found but left out by --max-queues.")
        families = Families(self.config.tenant_labels)

        def read() -> tuple[list[str], int, int]:
            unreadable = 0
            names, left_out = self.queues()
            for name in names:
                try:
                    reading = read_queue(self.client, name, self.config.samples)
                except redis.ResponseError as exc:  # this queue's keys, not Redis: skip it
                    self._warn(f"read:{name}", "queue %r not exported: %s", name, exc)
                    unreadable += 1
                    continue
                families.add(name, reading, self.policy(name, reading))
                self.add_scaling(families, name)
            return names, left_out, unreadable

        future = self._reader.submit(read)
        problem = None
        try:
            names, left_out, unreadable = future.result(
                timeout=self.config.scrape_timeout_s)
        except TimeoutError:  # Redis hangs, or is too slow: the read goes on without us
            future.cancel()
            problem = f"no answer within {self.config.scrape_timeout_s:g} s"
        except redis.RedisError as exc:
            problem = str(exc)
        if problem is not None:
            log.warning("scrape cannot read Redis: %s", problem)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        exported.add_metric([], len(names) - unreadable)
        skipped.add_metric([], left_out)
        yield from families.all()
        seconds = GaugeMetricFamily("batchgate_exporter_scrape_seconds",
                                    "Time this scrape took to read Redis.")
        seconds.add_metric([], time.perf_counter() - started)
        yield from (up, exported, skipped, seconds)


def build_registry(client: redis.Redis, config: ExporterConfig) -> Any:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    registry.register(QueueCollector(client, config))
    return registry


@click.command("exporter")
@redis_url_option
@click.option("--queue", "queues", multiple=True,
              help="Export only this queue, found or not (repeat for more). "
                   "Default: the most active queues found, up to --max-queues.")
@env_option("--host", envvar="BATCHGATE_EXPORTER_HOST", default="0.0.0.0", show_default=True,
            help="Address to serve /metrics on.")
@env_option("--port", envvar="BATCHGATE_EXPORTER_PORT", default=DEFAULT_PORT,
            show_default=True, type=click.IntRange(1, 65535), help="Port to serve /metrics on.")
@env_option("--max-queues", envvar="BATCHGATE_EXPORTER_MAX_QUEUES", default=DEFAULT_MAX_QUEUES,
            show_default=True, type=click.IntRange(1, 10_000),
            help="Most queues read per scrape without --queue: the most active (requests "
                 "waiting or running, then consumers, then last seen); the rest are counted "
                 "in batchgate_exporter_queues_skipped.")
@env_option("--samples", envvar="BATCHGATE_EXPORTER_SAMPLES", default=DEFAULT_SAMPLES,
            show_default=True, type=click.IntRange(1, MAX_SAMPLES),
            help="Newest latency samples per list the quantiles are taken from.")
@env_option("--scrape-timeout-s", envvar="BATCHGATE_EXPORTER_SCRAPE_TIMEOUT_S",
            default=DEFAULT_SCRAPE_TIMEOUT_S, show_default=True,
            type=FloatRange(0.1, MAX_SCRAPE_TIMEOUT_S),
            help="Seconds a scrape waits for Redis; past them it answers "
                 "batchgate_exporter_redis_up 0. Keep it under Prometheus' scrape_timeout.")
@env_option("--tenant-labels", envvar="BATCHGATE_EXPORTER_TENANT_LABELS",
            default=DEFAULT_TENANT_LABELS, show_default=True,
            type=click.IntRange(0, MAX_TENANT_LABELS),
            help="Tenants per queue with a label of their own (those with the most "
                 "requests accepted); the rest are summed as tenant=\"other\".")
def exporter_command(redis_url: str, queues: tuple[str, ...], host: str, port: int,
                     max_queues: int, samples: int, scrape_timeout_s: float,
                     tenant_labels: int) -> None:
    """Serve Prometheus metrics of every queue (depth, in flight, consumers, counters,
    latency quantiles, policy), read from Redis at each scrape: no consumer needed."""
    try:
        from prometheus_client import start_http_server
    except ImportError:
        raise click.ClickException("the exporter needs prometheus_client: pip install "
                                   "'batchgate[metrics]'") from None
    from scheduler_core.connection import connect

    config = ExporterConfig(tuple(queues), max_queues, samples, scrape_timeout_s,
                            tenant_labels)
    client = connect(redis_url)
    server, thread = start_http_server(port, addr=host, registry=build_registry(client, config))
    log.info("exporter ready on http://%s:%d/metrics (%s)", host, port,
             ", ".join(config.queues) if config.queues else "the queues found")
    try:
        thread.join()
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
