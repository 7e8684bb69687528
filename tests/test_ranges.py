"""Every documented range (docs/configuration.md, docs/producer.md; docs/guarantees.md "Bad
input", "Size limits"), pinned at each bound and one past it, through the public entry
points: `Policy.build` and `batchgate policy set`, `ConsumerConfig` and `batchgate
consumer`, `Producer(...)` and `submit`. Out of range: an InvalidRequest whose field and
message name the culprit and the limit, and nothing written. And `policy set` / `policy
show` on a live queue."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from helpers.support import RecordingModel, configure, queue_pattern, snapshot, wait_for

from batchgate.cli import main as cli
from consumer.worker import ConsumerConfig
from producer import InvalidRequest, Priority, Producer
from scheduler_core.admin import read_policy
from scheduler_core.errors import InvalidPolicy
from scheduler_core.keys import QueueKeys
from scheduler_core.policy import LIMITS, Policy

# The tables of docs/configuration.md, copied by hand: the code must agree with what users read.
POLICY_RANGES = {
    "max_batch_size": (1, 4096),
    "max_queue_delay_ms": (0, 600_000),
    "aging_ms": (0, 86_400_000),
    "max_queue_size": (0, 10**9),
    "max_attempts": (1, 100),
    "result_ttl_s": (1, 2_592_000),
    "max_cost": (0, 10**9),
    "max_batch_cost": (0, 10**9),
    "slo_p99_ms": (0, 600_000),
    "timeout_high_ms": (0, 86_400_000),
    "timeout_normal_ms": (0, 86_400_000),
    "timeout_low_ms": (0, 86_400_000),
    "allow_timeout_override": (0, 1),
    "shards": (1, 64),  # docs/scaling.md
    # docs/failure-modes.md, "Retries"
    "retry_max": (1, 100),
    "retry_backoff_ms": (0, 3_600_000),
    "retry_backoff_max_ms": (0, 86_400_000),
    "retry_jitter": (0, 1),
}
CONSUMER_RANGES = {"lease_ms": (100, 86_400_000), "max_result_bytes": (16, 536_870_912)}
PRODUCER_RANGES = {"max_payload_bytes": (16, 512 << 20), "idempotency_ttl_s": (1, 2_592_000)}


def around(low: int, high: int) -> list[tuple[int, bool]]:
    """Each bound and one past it, with whether it is in range."""
    return [(low - 1, False), (low, True), (high, True), (high + 1, False)]


def cases(ranges: dict[str, tuple[int, int]]) -> list[tuple[str, int, bool]]:
    return [(name, value, ok) for name, (low, high) in ranges.items()
            for value, ok in around(low, high)]


def names_field_and_limit(exc: InvalidRequest, field: str, low: int, high: int) -> None:
    assert exc.field == field, exc
    assert field in str(exc) and str(low) in str(exc) and str(high) in str(exc), exc


# -- the queue policy -------------------------------------------------------------------
def test_the_policy_limits_are_the_documented_ones():
    assert LIMITS == POLICY_RANGES


@pytest.mark.parametrize(("field", "value", "ok"), cases(POLICY_RANGES))
def test_policy_build_accepts_exactly_the_documented_range(field, value, ok):
    if ok:
        assert getattr(Policy.build("dynamic", **{field: value}), field) == value
        return
    with pytest.raises(InvalidPolicy) as info:
        Policy.build("dynamic", **{field: value})
    names_field_and_limit(info.value, field, *POLICY_RANGES[field])


@pytest.mark.parametrize("strategy", ["bogus", "FIFO", "", 1])
def test_an_unknown_strategy_names_the_field(strategy):
    with pytest.raises(InvalidPolicy) as info:
        Policy.build(strategy)
    assert info.value.field == "strategy" and "fifo, dynamic or priority" in str(info.value)


def test_policy_set_accepts_exactly_the_documented_range(shared_redis, queue):
    runner, client = CliRunner(), shared_redis.client()
    configure(shared_redis.url, queue, strategy="dynamic")
    base = ["policy", "set", "--redis-url", shared_redis.url, "--queue", queue]
    for field, value, ok in cases(POLICY_RANGES):
        stored = client.hgetall(QueueKeys(queue).policy)
        done = runner.invoke(cli, [*base, f"--{field.replace('_', '-')}", str(value)])
        if ok:
            assert done.exit_code == 0, (field, value, done.output)
            assert json.loads(done.output)[field] == value
            assert getattr(read_policy(client, queue), field) == value
        else:
            low, high = POLICY_RANGES[field]
            assert done.exit_code == 2, (field, value, done.output)
            assert f"{field}: {value} is outside [{low}, {high}]" in done.output, done.output
            assert client.hgetall(QueueKeys(queue).policy) == stored  # nothing written
    done = runner.invoke(cli, [*base, "--strategy", "bogus"])
    assert done.exit_code == 2 and "--strategy" in done.output


def test_policy_set_takes_flags_only_not_the_consumer_environment(shared_redis, queue):
    """A consumer host's environment must not change a queue's policy by accident."""
    configure(shared_redis.url, queue, strategy="dynamic", max_batch_size=16)
    env = {"BATCHGATE_STRATEGY": "fifo", "BATCHGATE_MAX_BATCH_SIZE": "7",
           "BATCHGATE_AGING_MS": "1", "BATCHGATE_RESULT_TTL_S": "9"}
    done = CliRunner().invoke(cli, ["policy", "set", "--redis-url", shared_redis.url,
                                    "--queue", queue, "--max-queue-delay-ms", "20"], env=env)
    assert done.exit_code == 0, done.output
    stored = read_policy(shared_redis.client(), queue)
    assert (stored.strategy.value, stored.max_batch_size, stored.max_queue_delay_ms,
            stored.aging_ms, stored.result_ttl_s) == ("dynamic", 16, 20, 5000, 600)


# -- consumer settings ------------------------------------------------------------------
@pytest.mark.parametrize(("field", "value", "ok"), cases(CONSUMER_RANGES) + [
    ("max_batch_ms", 0, True), ("max_batch_ms", 1, False), ("max_batch_ms", 99, False),
    ("max_batch_ms", 100, True), ("max_batch_ms", 86_400_000, True),
    ("max_batch_ms", 86_400_001, False), ("max_batch_ms", -1, False)])
def test_consumer_config_accepts_exactly_the_documented_range(field, value, ok):
    if ok:
        assert getattr(ConsumerConfig(**{field: value}), field) == value
        return
    with pytest.raises(InvalidRequest) as info:
        ConsumerConfig(**{field: value})
    names_field_and_limit(info.value, field, *CONSUMER_RANGES.get(field, (100, 86_400_000)))


@pytest.mark.parametrize(("flag", "value", "says"), [
    ("--lease-ms", "99", "lease_ms: 99 is outside [100, 86400000]"),
    ("--lease-ms", "86400001", "lease_ms: 86400001 is outside [100, 86400000]"),
    ("--max-batch-ms", "99", "max_batch_ms: 99: use 0 (off) or [100, 86400000]"),
    ("--max-result-bytes", "15", "max_result_bytes: 15 is outside [16, 536870912]"),
    ("--max-result-bytes", "536870913",
     "max_result_bytes: 536870913 is outside [16, 536870912]"),
    ("--torch-threads", "0", "torch_threads: 0 is outside [1, 1024]"),
    ("--torch-threads", "1025", "torch_threads: 1025 is outside [1, 1024]"),
    ("--max-batch-size", "4097", "max_batch_size: 4097 is outside [1, 4096]"),
    ("--queue", "q" * 129, "1-128 characters"),
])
def test_batchgate_consumer_refuses_out_of_range_settings(shared_redis, queue, flag, value,
                                                          says):
    args = ["consumer", "--redis-url", shared_redis.url, "--queue", queue, flag, value]
    if flag == "--queue":
        args = ["consumer", "--redis-url", shared_redis.url, flag, value]
    done = CliRunner().invoke(cli, args)
    assert done.exit_code == 2, done.output
    assert says in done.output, done.output
    assert snapshot(shared_redis.client(), queue_pattern(queue)) == {}  # no policy stored


# -- producer arguments -----------------------------------------------------------------
@pytest.mark.parametrize(("field", "value", "ok"), cases(PRODUCER_RANGES))
def test_producer_settings_accept_exactly_their_range(shared_redis, queue, field, value, ok):
    if ok:
        with Producer(shared_redis.url, queue, **{field: value}) as p:
            assert getattr(p.config, field) == value
        return
    with pytest.raises(InvalidRequest) as info:
        Producer(shared_redis.url, queue, **{field: value})
    names_field_and_limit(info.value, field, *PRODUCER_RANGES[field])


@pytest.mark.parametrize(("name", "ok"), [("", False), ("q", True), ("q" * 128, True),
                                          ("q" * 129, False), ("q\n", False),
                                          ("A-z_0.9:x", True), ("{q}", False)])
def test_queue_names(shared_redis, name, ok):
    if ok:
        Producer(shared_redis.url, name).close()
        return
    with pytest.raises(InvalidRequest) as info:
        Producer(shared_redis.url, name)
    assert info.value.field == "queue" and "1-128 characters" in str(info.value)


LIMIT = 1024  # max_payload_bytes below; "x" * n encodes to n + 2 bytes


def nest(depth: int) -> object:
    value: object = 0
    for _ in range(depth):
        value = [value]
    return value


SUBMITS = [  # (submit keyword arguments, accepted, the field, words in the message)
    ({"deadline_ms": 0}, False, "deadline_ms", "[1, 86400000]"),
    ({"deadline_ms": 86_400_000}, True, "", ""),
    ({"deadline_ms": 86_400_001}, False, "deadline_ms", "[1, 86400000]"),
    ({"priority": -1}, False, "priority", "0-2"),
    ({"priority": 0}, True, "", ""),
    ({"priority": 2}, True, "", ""),
    ({"priority": 3}, False, "priority", "0-2"),
    ({"priority": "High"}, True, "", ""),
    ({"priority": "urgent"}, False, "priority", "high, normal or low"),
    ({"idempotency_key": ""}, False, "idempotency_key", "1-200 characters"),
    ({"idempotency_key": "k"}, True, "", ""),
    ({"idempotency_key": "k" * 200}, True, "", ""),
    ({"idempotency_key": "k" * 201}, False, "idempotency_key", "1-200 characters"),
    ({"idempotency_key": "k\n"}, False, "idempotency_key", "1-200 characters"),
    ({"payload": "x" * (LIMIT - 2)}, True, "", ""),
    ({"payload": "x" * (LIMIT - 1)}, False, "payload", f"over the limit of {LIMIT}"),
    ({"payload": nest(64)}, True, "", ""),
    ({"payload": nest(65)}, False, "payload", "deeper than 64 levels"),
    ({"payload": -(2**63)}, True, "", ""),
    ({"payload": -(2**63) - 1}, False, "payload", "64 bits"),
    ({"payload": 2**64 - 1}, True, "", ""),
    ({"payload": 2**64}, False, "payload", "64 bits"),
    # Last: its producer expires it within a second, which would change the queue's keys
    # under a later row's nothing-written comparison.
    ({"deadline_ms": 1}, True, "", ""),
]


def test_submit_accepts_exactly_the_documented_ranges_and_writes_nothing_else(
        shared_redis, queue):
    client = shared_redis.client()
    with Producer(shared_redis.url, queue, max_payload_bytes=LIMIT) as p:
        for kwargs, ok, field, words in SUBMITS:
            call = {"payload": {}, **kwargs}
            before = snapshot(client, queue_pattern(queue))
            if ok:
                handle = p.submit(**call)
                assert client.hexists(QueueKeys(queue).jobs, handle.id), kwargs
                continue
            with pytest.raises(InvalidRequest) as info:
                p.submit(**call)
            assert info.value.field.startswith(field), (kwargs, info.value)
            assert words in str(info.value), (kwargs, info.value)
            assert snapshot(client, queue_pattern(queue)) == before, kwargs
    assert Priority.parse("High") is Priority.HIGH


# -- policy set / show on a live queue ----------------------------------------------------
def test_policy_set_reaches_running_consumers_and_show_prints_it(shared_redis, queue,
                                                                 inprocess_consumer,
                                                                 tmp_path):
    """A consumer keeps running; `policy set` changes what it does from its next batch on:
    a partial batch that would have waited a minute is released, the batch size changes,
    results are kept for the new result_ttl_s."""
    url, client = shared_redis.url, shared_redis.client()
    runner = CliRunner()
    model = RecordingModel(tmp_path)
    consumer = model.serve(inprocess_consumer, url, queue, strategy="dynamic",
                           max_batch_size=8, max_queue_delay_ms=60000, lease_ms=400)

    def policy(*args: str) -> dict:
        done = runner.invoke(cli, ["policy", *args, "--redis-url", url, "--queue", queue])
        assert done.exit_code == 0, done.output
        return json.loads(done.output[done.output.index("{"):])

    assert policy("show") == {"strategy": "dynamic", "max_batch_size": 8,
                              "max_queue_delay_ms": 60000, "aging_ms": 5000,
                              "max_queue_size": 0, "max_attempts": 3, "result_ttl_s": 600,
                              "max_cost": 0, "over_cost": "reject", "max_batch_cost": 0,
                              "cost_mode": "sum", "cost_buckets": "",
                              "slo_p99_ms": 0, "delay_mode": "fixed",
                              "timeout_high_ms": 0, "timeout_normal_ms": 0,
                              "timeout_low_ms": 0, "allow_timeout_override": 1,
                              "on_timeout": "reject", "shards": 1, "retry_on": "",
                              "retry_max": 1, "retry_backoff_ms": 1000,
                              "retry_backoff_max_ms": 60000, "retry_jitter": 0,
                              "tenant_quotas": "", "fairness": "none"}
    with Producer(url, queue) as p:
        waiting = p.submit({"i": 0})
        wait_for(lambda: client.zcard(QueueKeys(queue).pending(1)) == 1, what="it to queue")
        assert policy("set", "--max-queue-delay-ms", "0")["max_queue_delay_ms"] == 0
        assert waiting.result(timeout=30) == {"i": 0}  # not after the minute it was due

        assert policy("set", "--max-batch-size", "2", "--result-ttl-s", "77")[
            "result_ttl_s"] == 77
        shown = policy("show")
        assert (shown["max_batch_size"], shown["max_queue_delay_ms"],
                shown["result_ttl_s"]) == (2, 0, 77)

        def fresh_result_ttl() -> int:
            handle = p.submit({"probe": 1}, store_result=True)
            handle.result(timeout=15)
            return client.ttl(QueueKeys(queue).result(handle.id))

        # Each consumer re-reads the policy within one sweep interval (lease / 4).
        wait_for(lambda: 0 < fresh_result_ttl() <= 77, 10, "results kept for 77 s")
        handles = p.submit_many([{"i": i} for i in range(1, 7)])
        assert [h.result(timeout=15) for h in handles] == [{"i": i} for i in range(1, 7)]
    sizes = [len(b["payloads"]) for b in model.batches() if "i" in b["payloads"][0]]
    assert sizes[0] == 1 and sizes[1:] and max(sizes[1:]) == 2, sizes
    assert not consumer.stopping.is_set()  # the same consumer all along


@pytest.mark.parametrize("only_bucket", [0, 1], ids=["every-bucket", "dedicated"])
def test_the_largest_batch_runs_with_cost_buckets(shared_redis, queue, inprocess_consumer,
                                                  only_bucket):
    """max_batch_size 4096 (the top of its range) with two cost buckets: a pop reads
    2 x 4096 waiting requests, a batch moves 4096 in flight (8,192 values for its owners),
    its completion answers 4096 at once; none of it may exceed what one Lua call takes."""
    configure(shared_redis.url, queue, strategy="dynamic", max_batch_size=4096,
              max_queue_delay_ms=0, cost_buckets="32")
    with Producer(shared_redis.url, queue) as p:
        handles = [h for i in range(9) for h in p.submit_many(list(range(1000)), cost=8)]
        inprocess_consumer("consumer.models:noop", redis_url=shared_redis.url, queue=queue,
                           only_bucket=only_bucket)
        assert sum(1 for h in handles if h.result(timeout=60) is not None) == 9000
    keys = QueueKeys(queue)
    batches = shared_redis.client().hget(keys.stats, "batches")
    assert int(batches) == 3  # 4096, 4096, 808
