"""`Consumer`, the in-process consumer API (consumer/api.py, docs/consumer-hosts.md): its
keywords are the flags of `batchgate consumer`, checked the same way; start/stop and
`with`; a stop mid-batch finishes what the consumer holds, as SIGTERM does."""

from __future__ import annotations

import inspect
import threading
import time
from dataclasses import fields
from typing import Any

import pytest
from click.testing import CliRunner
from helpers.support import configure, queue_pattern, snapshot

from batchgate.cli import main as cli
from consumer import Consumer, ConsumerConfig
from consumer.cli import consumer_command
from consumer.config import FLOAT_RANGES, INT_RANGES, OFF_OR_RANGES
from consumer.supervisor import SUPERVISOR_ONLY
from consumer.worker import Worker
from producer import Producer
from scheduler_core.errors import InvalidRequest
from scheduler_core.ops.stats import queue_stats
from scheduler_core.policy import KNOBS, LIMITS

IDLE_STOP_S = 1.0  # an idle loop blocks at most IDLE_BLOCK_S (1 s) before it sees a stop
SLACK_S = 5.0  # a loaded 2-core machine
# The CLI's option names that are not the keyword's (everything else is the same name).
RENAMED = {"model_spec": "model", "model_arg": "model_args"}


class SlowRecorder:
    """A batch model that records what it ran, and takes `model_ms` per batch."""

    def __init__(self, model_ms: float = 0):
        self.model_ms = model_ms
        self.ran: list[int] = []
        self.entered = threading.Event()  # set as a batch starts
        self._lock = threading.Lock()

    def __call__(self, payloads: list[Any]) -> list[Any]:
        self.entered.set()
        time.sleep(self.model_ms / 1000)
        with self._lock:
            self.ran.extend(p["i"] for p in payloads)
        return [{"i": p["i"]} for p in payloads]


def keywords() -> set[str]:
    """Every keyword Consumer(...) takes."""
    named = set(inspect.signature(Consumer).parameters) - {"settings"}
    return named | {f.name for f in fields(ConsumerConfig)} | set(KNOBS)


# -- the keywords are the flags ---------------------------------------------------------
def test_every_flag_of_batchgate_consumer_is_a_keyword_with_the_same_default():
    process_only = set(SUPERVISOR_ONLY)
    assert process_only == {"replicas", "devices"}  # a supervisor's: processes, not one
    defaults = consumer_command.make_context("consumer", []).params  # as the CLI gets them
    given: dict[str, Any] = {}
    for param in consumer_command.params:
        if param.name in process_only:
            continue
        keyword = RENAMED.get(param.name, param.name)
        assert keyword in keywords(), f"--{param.name} has no keyword {keyword}"
        if keyword in ("model", "model_args"):
            continue
        given[keyword] = default = defaults[param.name]
        if keyword in KNOBS:  # unset: the queue's stored policy (or the defaults) rules
            assert default is None, keyword
        elif keyword != "name":  # "": generated
            assert getattr(ConsumerConfig(), keyword) == default, keyword
    assert inspect.signature(Consumer).parameters["model"].default == defaults["model_spec"]
    # ...and Consumer takes every one of them, at the CLI's default.
    consumer = Consumer(lambda payloads: payloads, model_args={}, **given)
    assert consumer.config.redis_url == "redis://127.0.0.1:6379/0"
    assert consumer.config.queue == "default" and consumer.config.policy == {}


def out_of_range() -> list[tuple[str, Any, str]]:
    """(keyword, value, limit) just outside each documented limit of a numeric setting."""
    cases: list[tuple[str, Any, str]] = []
    for name, (low, high) in {**INT_RANGES, **LIMITS, **FLOAT_RANGES}.items():
        cases += [(name, low - 1, f"[{low}, {high}]"), (name, high + 1, f"[{low}, {high}]")]
    for name, (low, high, _unit) in OFF_OR_RANGES.items():
        below = low / 2 if isinstance(low, float) else low // 2
        cases += [(name, below, f"0 (off) or [{low}, {high}]"),
                  (name, high + 1, f"0 (off) or [{low}, {high}]")]
    return cases


@pytest.mark.parametrize(("keyword", "value", "limit"), out_of_range())
def test_a_setting_out_of_range_fails_alike_in_the_cli_and_the_api(keyword, value, limit):
    """Same check, same message: the field and its limit. The URL reaches no Redis, so a
    value the CLI let through would fail differently (status 1, not 2)."""
    param = next(p for p in consumer_command.params if p.name == keyword)
    typed = param.type(str(value), param, None)  # as click hands it to the command
    with pytest.raises(InvalidRequest) as info:
        Consumer(lambda payloads: payloads, **{keyword: typed})
    assert info.value.field == keyword and limit in str(info.value), info.value
    done = CliRunner().invoke(cli, ["consumer", "--redis-url", "redis://127.0.0.1:1/0",
                                    param.opts[0], str(value)])
    assert done.exit_code == 2, done.output
    assert f"Error: {info.value}" in done.output, done.output


def test_bad_settings_name_the_field_and_limit_and_write_nothing(shared_redis, queue):
    for settings, says in [
        ({"lease_ms": 99}, "lease_ms: 99 is outside [100, 86400000]"),
        ({"max_batch_size": 0}, "max_batch_size: 0 is outside [1, 4096]"),
        ({"wait_replicas": 65}, "wait_replicas: 65 is outside [0, 64]"),
        ({"cost_refit_s": 0.05}, "cost_refit_s: 0.05: use 0 (off) or [0.1, 86400] s"),
        ({"overlap": "yes"}, "overlap: 'yes' is not true or false"),
        ({"strategy": "lifo"}, "strategy: unknown strategy 'lifo'"),
        ({"prefer_bucket": 1, "only_bucket": 2}, "only_bucket: a consumer dedicated"),
        ({"otel_exporter": "jaeger"}, "otel_exporter: 'jaeger': use none or console"),
    ]:
        with pytest.raises(InvalidRequest) as info:
            Consumer(lambda payloads: payloads, redis_url=shared_redis.url, queue=queue,
                     **settings)
        assert says in str(info.value), info.value
    with pytest.raises(InvalidRequest, match="model_args: keys must be argument names"):
        Consumer("consumer.models:synthetic", redis_url=shared_redis.url, queue=queue,
                 model_args={"not a name": 1})
    with pytest.raises(TypeError, match="unknown consumer setting leasems"):
        Consumer(lambda payloads: payloads, redis_url=shared_redis.url, queue=queue,
                 leasems=100)
    assert snapshot(shared_redis.client(), queue_pattern(queue)) == {}  # no policy stored


# -- serving ----------------------------------------------------------------------------
def test_start_serve_and_stop_in_process(shared_redis, queue):
    model = SlowRecorder()
    consumer = Consumer(model, redis_url=shared_redis.url, queue=queue, strategy="fifo",
                        max_batch_size=4).start()
    assert consumer.policy is not None and consumer.policy.max_batch_size == 4
    with Producer(shared_redis.url, queue) as p:
        handles = [p.submit({"i": i}) for i in range(10)]
        assert [h.result(timeout=30) for h in handles] == [{"i": i} for i in range(10)]
    assert queue_stats(shared_redis.client(), queue).consumers_alive == 1
    began = time.monotonic()
    assert consumer.stop(timeout=IDLE_STOP_S + SLACK_S) is True
    assert time.monotonic() - began <= IDLE_STOP_S + SLACK_S
    assert queue_stats(shared_redis.client(), queue).consumers_alive == 0  # it left
    assert sorted(model.ran) == list(range(10))
    with pytest.raises(RuntimeError, match="started already"):
        consumer.start()


def test_with_consumer_serves_inside_the_block(redis_server):
    """Defaults but the URL: the default queue, the default policy, the CLI's model
    given as a MODULE:ATTR with its arguments."""
    with Consumer("consumer.models:synthetic", redis_url=redis_server.url,
                  model_args={"base_ms": 0, "per_item_ms": 0}, device="cpu") as consumer:
        assert consumer.config.queue == "default"
        with Producer(redis_server.url, "default") as p:
            assert p.submit({"x": 1}).result(timeout=30) == {"x": 1}
        assert consumer.loop is not None and consumer.loop.info["device"] == "cpu"
    assert consumer._thread is not None and not consumer._thread.is_alive()
    stats = queue_stats(redis_server.client(), "default")
    assert stats.consumers_alive == 0 and stats.policy["strategy"] == "priority"


def test_metrics_into_the_callers_registry(shared_redis, queue, inprocess_consumer):
    prometheus = pytest.importorskip("prometheus_client")
    registry = prometheus.CollectorRegistry()
    inprocess_consumer(lambda payloads: payloads, redis_url=shared_redis.url, queue=queue,
                       metrics_registry=registry, policy={"strategy": "fifo"})
    with Producer(shared_redis.url, queue) as p:
        assert [p.submit(i).result(timeout=30) for i in range(3)] == [0, 1, 2]
    labels = {"queue": queue, "outcome": "ok"}
    assert registry.get_sample_value("batchgate_consumer_requests_total", labels) == 3
    assert registry.get_sample_value("batchgate_consumer_batch_size_count",
                                     {"queue": queue}) == 3  # fifo: one by one


def test_a_model_that_cannot_load_fails_start_naming_the_keyword(shared_redis, queue):
    consumer = Consumer("consumer.models:synthetic", redis_url=shared_redis.url,
                        queue=queue, model_args={"colour": 1})
    with pytest.raises(InvalidRequest) as info:
        consumer.start()
    assert info.value.field == "model_args"
    assert "takes no argument colour (it takes: base_ms, per_item_ms, device)" in \
        str(info.value)
    with pytest.raises(InvalidRequest, match="model: cannot import module 'nope'"):
        Consumer("nope:model", redis_url=shared_redis.url, queue=queue).start()
    with pytest.raises(InvalidRequest, match="model: 42 is neither"):
        Consumer(42, redis_url=shared_redis.url, queue=queue)  # type: ignore[arg-type]


def test_a_stop_mid_batch_loses_nothing(shared_redis, queue, inprocess_consumer):
    """Stopped while its model runs a batch (and, overlap on, with the next one fetched
    ahead), a consumer runs what it holds and writes the results before it leaves; a
    second consumer serves the rest. Every request is answered once and run once."""
    model_ms, batch, total = 300, 4, 16
    url = shared_redis.url
    configure(url, queue, strategy="fifo", max_batch_size=batch)
    first, second = SlowRecorder(model_ms), SlowRecorder()
    with Producer(url, queue) as p:
        handles = [p.submit({"i": i}) for i in range(total)]
        stopping = inprocess_consumer(first, redis_url=url, queue=queue)
        assert first.entered.wait(SLACK_S + 10)
        # The precondition, made true: the stop lands while a batch is held (leased).
        assert queue_stats(shared_redis.client(), queue).in_flight_batches >= 1
        began = time.monotonic()
        # At most the batch in the model and one fetched ahead are left to run.
        assert stopping.stop(timeout=2 * model_ms / 1000 + SLACK_S) is True
        assert time.monotonic() - began <= 2 * model_ms / 1000 + SLACK_S
        held = sorted(first.ran)
        assert held in (list(range(batch)), list(range(2 * batch))), held
        stats = queue_stats(shared_redis.client(), queue)
        assert stats.in_flight_requests == 0 and stats.consumers_alive == 0
        assert [h.result(timeout=SLACK_S) for h in handles[:len(held)]] == \
            [{"i": i} for i in held]  # answered before the second consumer started
        inprocess_consumer(second, redis_url=url, queue=queue)
        assert [h.result(timeout=30) for h in handles] == [{"i": i} for i in range(total)]
    assert sorted(first.ran + second.ran) == list(range(total))  # each run exactly once
    assert queue_stats(shared_redis.client(), queue).requeued == 0


def test_the_loop_takes_the_default_config(shared_redis):
    """Worker(model) without a config: its defaults (it used to read `config.name` of
    None)."""
    loop = Worker(lambda payloads: payloads, client=shared_redis.client())
    assert loop.config.queue == "default" and loop.config.name in loop.outage.what


def test_run_blocks_until_stopped_from_another_thread(shared_redis, queue):
    consumer = Consumer(lambda payloads: payloads, redis_url=shared_redis.url, queue=queue)
    stopper = threading.Timer(0.5, consumer.stop)
    stopper.start()
    began = time.monotonic()
    consumer.run()
    assert 0.5 <= time.monotonic() - began <= 0.5 + IDLE_STOP_S + SLACK_S
    assert consumer.policy is not None
    assert queue_stats(shared_redis.client(), queue).consumers_alive == 0
    with pytest.raises(RuntimeError, match="runs once"):
        consumer.run()


def test_start_from_several_threads_at_once_starts_one_loop(shared_redis, queue):
    """start() raced from threads: exactly one starts the loop, the others get "started
    already"; stop() then joins that loop and raises nothing (before, every caller got a
    thread, all but one died on "runs once" and stop() raised that error)."""
    consumer = Consumer(lambda payloads: payloads, redis_url=shared_redis.url, queue=queue)
    # Not prepared: the first start() connects and loads while the others arrive.
    gate, outcomes = threading.Barrier(4), []

    def start() -> None:
        gate.wait()
        try:
            consumer.start()
            outcomes.append("started")
        except RuntimeError as exc:
            outcomes.append(str(exc))

    threads = [threading.Thread(target=start) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert outcomes.count("started") == 1
    assert all("started already" in o for o in outcomes if o != "started")
    with Producer(shared_redis.url, queue) as p:
        assert p.submit({"i": 1}).result(timeout=SLACK_S) == {"i": 1}
    assert consumer.stop(IDLE_STOP_S + SLACK_S) is True
    assert queue_stats(shared_redis.client(), queue).consumers_alive == 0


def test_a_metrics_port_in_use_fails_start_naming_the_keyword(shared_redis, queue):
    from helpers.processes import free_port

    port = free_port()
    with Consumer(lambda payloads: payloads, redis_url=shared_redis.url, queue=queue,
                  metrics_port=port):
        second = Consumer(lambda payloads: payloads, redis_url=shared_redis.url,
                          queue=queue, metrics_port=port)
        with pytest.raises(InvalidRequest, match="metrics_port") as refused:
            second.start()
        assert refused.value.field == "metrics_port" and str(port) in str(refused.value)


def test_stop_after_prepare_alone_closes_the_metrics_server(shared_redis, queue):
    """prepare() without start(): stop() releases what prepare opened (the metrics port
    and its thread), as a run's end does."""
    import socket

    from helpers.processes import free_port

    port = free_port()
    consumer = Consumer(lambda payloads: payloads, redis_url=shared_redis.url, queue=queue,
                        metrics_port=port)
    consumer.prepare()
    assert consumer.stop() is True
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("0.0.0.0", port))  # free again
