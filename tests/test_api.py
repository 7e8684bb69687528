"""The producer API as a web app uses it: deadlines, QueueFull, input validation (nothing
written on bad input), fetch by id, cancel, failures, and the asyncio client."""

from __future__ import annotations

import asyncio
import math
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import redis
from helpers.support import RecordingModel, configure, queue_pattern, snapshot, wait_for

from producer import (
    AsyncProducer,
    DeadlineExceeded,
    InvalidRequest,
    Priority,
    Producer,
    QueueFull,
    RequestCancelled,
    RequestFailed,
)
from scheduler_core.keys import QueueKeys
from scheduler_core.ops.stats import queue_stats
from scheduler_core.scripts import Scripts

# -- deadlines -----------------------------------------------------------------------


def test_deadline_passed_while_waiting_is_not_run(shared_redis, queue, inprocess_consumer,
                                                  tmp_path):
    """No consumer is free: the waiting handle gives up at its deadline and removes the
    request, which no consumer ever runs afterwards."""
    model = RecordingModel(tmp_path)
    configure(shared_redis.url, queue, strategy="priority")
    client = shared_redis.client()
    with Producer(shared_redis.url, queue) as p:
        # The deadline runs from the enqueue, which a loaded host may answer late: time
        # from before the submit.
        started = time.monotonic()
        handle = p.submit({"late": 1}, deadline_ms=200, store_result=True)
        with pytest.raises(DeadlineExceeded):
            handle.result(timeout=10)
        assert 0.2 <= time.monotonic() - started < 5
        stats = queue_stats(client, queue)
        assert stats.depth == {"high": 0, "normal": 0, "low": 0} and stats.expired == 1
        stored = p.fetch(handle.id)
        assert stored is not None and not stored.ok and stored.error_type == "DeadlineExceeded"
        # A consumer arriving later never sees it.
        model.serve(inprocess_consumer, shared_redis.url, queue)
        assert p.submit({"on_time": 1}).result(timeout=10) == {"on_time": 1}
    assert model.payloads() == [{"on_time": 1}]


def test_deadline_passed_before_a_consumer_pops_it_is_not_run(shared_redis, queue,
                                                              inprocess_consumer, tmp_path):
    """The consumer pops a request whose deadline passed while it was busy: it answers
    DeadlineExceeded without running it."""
    model = RecordingModel(tmp_path)
    model.serve(inprocess_consumer, shared_redis.url, queue, strategy="fifo")
    with Producer(shared_redis.url, queue) as p:
        blocker = p.submit({"sleep_ms": 700})
        wait_for(lambda: model.batches(), what="the blocker to start")
        late = p.submit({"late": 1}, deadline_ms=100)
        on_time = p.submit({"on_time": 1}, deadline_ms=60_000)
        # Not waiting on `late` yet: only the consumer can see that it expired.
        assert blocker.result(timeout=10) == {"sleep_ms": 700}
        assert on_time.result(timeout=10) == {"on_time": 1}
        with pytest.raises(DeadlineExceeded):
            late.result(timeout=10)
    assert {"late": 1} not in model.payloads()
    # Counted as expired (not as a model failure), like a deadline the producer enforces.
    stats = queue_stats(shared_redis.client(), queue)
    assert (stats.processed, stats.failed, stats.expired) == (2, 0, 1)


# -- QueueFull -------------------------------------------------------------------------


def test_queue_full_is_atomic_and_says_depth_and_limit(redis_server, queue):
    configure(redis_server.url, queue, strategy="dynamic", max_queue_size=5)
    client = redis_server.client()
    with Producer(redis_server.url, queue) as p:
        p.submit_many([{"i": i} for i in range(4)])
        before = snapshot(client)
        with pytest.raises(QueueFull) as info:
            p.submit_many([{"i": 4}, {"i": 5}])  # 4 + 2 > 5: none of the two is written
        assert info.value.depth == 4 and info.value.limit == 5
        assert "depth 4" in str(info.value) and "max_queue_size 5" in str(info.value)
        assert snapshot(client) == before
        p.submit({"i": 4})  # exactly fills the queue
        before = snapshot(client)
        with pytest.raises(QueueFull, match="depth 5") as info:
            p.submit({"i": 5}, priority="high")
        assert info.value.depth == 5 and info.value.limit == 5
        assert snapshot(client) == before
    assert sum(queue_stats(client, queue).depth.values()) == 5


# -- bad input: a ValueError naming the field, and nothing written ----------------------


class NotJson:
    pass


BAD_SUBMITS = [
    ("payload", dict(payload=NotJson())),
    ("payload", dict(payload={1, 2})),
    ("payload", dict(payload=b"bytes")),
    ("payload", dict(payload=math.nan)),
    ("payload", dict(payload={"x": [1.0, math.inf]})),
    ("payload", dict(payload={1: "non-string key"})),
    ("payload", dict(payload=2**70)),
    ("priority", dict(payload={}, priority="urgent")),
    ("priority", dict(payload={}, priority=3)),
    ("priority", dict(payload={}, priority=True)),
    ("deadline_ms", dict(payload={}, deadline_ms=-5)),
    ("deadline_ms", dict(payload={}, deadline_ms=0)),
    ("deadline_ms", dict(payload={}, deadline_ms="soon")),
    ("idempotency_key", dict(payload={}, idempotency_key="has space")),
]


@pytest.fixture(scope="module")
def busy_queue(shared_redis) -> Iterator[tuple[Producer, redis.Redis]]:
    """A queue with a policy and a waiting request, and a producer on it (one for the
    module: closing a producer waits for its listener)."""
    queue = f"t-bad-{uuid.uuid4().hex[:8]}"
    configure(shared_redis.url, queue, strategy="priority")
    with Producer(shared_redis.url, queue) as p:
        p.submit({"already": "queued"})
        yield p, shared_redis.client()


@pytest.mark.parametrize(("field", "kwargs"), BAD_SUBMITS,
                         ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_SUBMITS)])
def test_bad_input_raises_value_error_naming_the_field_and_writes_nothing(
        busy_queue, field, kwargs):
    p, client = busy_queue
    before = snapshot(client, queue_pattern(p.keys.queue))  # a producer writes nowhere else
    assert p.keys.jobs.encode() in before
    with pytest.raises(ValueError) as info:
        p.submit(**kwargs)
    assert isinstance(info.value, InvalidRequest)
    assert info.value.field.startswith(field)
    assert field in str(info.value)
    assert snapshot(client, queue_pattern(p.keys.queue)) == before


def test_payload_over_the_size_limit_is_rejected(redis_server, queue):
    client = redis_server.client()
    with Producer(redis_server.url, queue, max_payload_bytes=1024) as small, \
            Producer(redis_server.url, queue) as default:
        with pytest.raises(InvalidRequest, match="limit of 1024") as info:
            small.submit("x" * 2000)
        assert info.value.field == "payload"
        with pytest.raises(ValueError, match="payload"):
            default.submit("x" * (1 << 20))  # the documented default limit: 1 MiB encoded
    assert snapshot(client) == {}


def test_one_bad_payload_in_submit_many_writes_none(redis_server, queue):
    client = redis_server.client()
    with Producer(redis_server.url, queue) as p:
        with pytest.raises(InvalidRequest) as info:
            p.submit_many([{"ok": 1}, {"bad": math.nan}, {"ok": 3}])
        assert info.value.field == "payloads[1]"
        with pytest.raises(InvalidRequest, match="payloads"):
            p.submit_many([])
    assert snapshot(client) == {}


@pytest.mark.parametrize("name", ["has space", "{braces}", "", "x" * 129, "naïve"])
def test_bad_queue_name(redis_server, name):
    with pytest.raises(ValueError) as info:
        Producer(redis_server.url, name)
    assert isinstance(info.value, InvalidRequest) and info.value.field == "queue"
    assert snapshot(redis_server.client()) == {}


# -- results: fetch by id, failures, cancel ---------------------------------------------


def test_fetch_by_id_from_another_producer(shared_redis, queue, inprocess_consumer):
    inprocess_consumer("consumer.models:noop", redis_url=shared_redis.url, queue=queue)
    with Producer(shared_redis.url, queue) as p:
        handle = p.submit({"x": [1, "two", None, 3.5]}, priority=Priority.HIGH,
                          store_result=True)
        assert handle.result(timeout=10) == {"x": [1, "two", None, 3.5]}
    # Any process can look a result up by id later (e.g. after a web app restart).
    with Producer(shared_redis.url, queue) as other:
        stored = other.fetch(handle.id)
        assert stored is not None and stored.ok and stored.id == handle.id
        assert stored.value == {"x": [1, "two", None, 3.5]}
        assert other.fetch("0" * 32) is None


def test_a_result_is_stored_by_id_only_when_asked(shared_redis, queue, inprocess_consumer):
    """Every result reaches its handle (the inbox); only store_result=True, or an
    idempotency key, also stores it under result:<id> for fetch."""
    inprocess_consumer("consumer.models:noop", redis_url=shared_redis.url, queue=queue)
    client, keys = shared_redis.client(), QueueKeys(queue)
    with Producer(shared_redis.url, queue) as p:
        plain = p.submit_many([{"i": i} for i in range(20)])
        kept = p.submit_many([{"k": i} for i in range(3)], store_result=True)
        keyed = p.submit({"key": 1}, idempotency_key=f"stored-{queue}")
        assert [h.result(timeout=15) for h in plain] == [{"i": i} for i in range(20)]
        assert [h.result(timeout=15) for h in kept] == [{"k": i} for i in range(3)]
        assert keyed.result(timeout=15) == {"key": 1}
        assert all(p.fetch(h.id) is None and not client.exists(keys.result(h.id))
                   for h in plain)
        assert [p.fetch(h.id).value for h in kept] == [{"k": i} for i in range(3)]
        assert p.fetch(keyed.id).value == {"key": 1}
        assert client.hlen(keys.jobs) == 0  # nothing else kept per request
        before = snapshot(client, queue_pattern(queue))
        with pytest.raises(InvalidRequest) as err:
            p.submit({"x": 1}, store_result="yes")
        assert err.value.field == "store_result"
        assert snapshot(client, queue_pattern(queue)) == before


def test_a_failing_request_fails_alone(shared_redis, queue, inprocess_consumer):
    inprocess_consumer("consumer.models:synthetic", redis_url=shared_redis.url, queue=queue,
                       model_args={"base_ms": 0, "per_item_ms": 0}, strategy="dynamic",
                       max_batch_size=4)
    with Producer(shared_redis.url, queue) as p:
        handles = p.submit_many([{"i": 0}, {"fail": True}, {"i": 2}, {"i": 3}],
                                store_result=True)
        with pytest.raises(RequestFailed, match="synthetic failure"):
            handles[1].result(timeout=10)
        assert [handles[i].result(timeout=10) for i in (0, 2, 3)] == [
            {"i": 0}, {"i": 2}, {"i": 3}]
        stored = p.fetch(handles[1].id)
        assert stored is not None and not stored.ok and stored.error_type == "ValueError"
    stats = queue_stats(shared_redis.client(), queue)
    assert stats.processed == 3 and stats.failed == 1


def test_cancel_a_waiting_request(shared_redis, queue, inprocess_consumer, tmp_path):
    model = RecordingModel(tmp_path)
    configure(shared_redis.url, queue, strategy="fifo")
    client = shared_redis.client()
    keys = QueueKeys(queue)
    with Producer(shared_redis.url, queue) as p:
        handle = p.submit({"cancel": "me"}, priority="low")
        assert handle.cancel() == "cancelled"
        with pytest.raises(RequestCancelled):
            handle.result(timeout=5)
        assert not client.hexists(keys.jobs, handle.id)
        assert sum(queue_stats(client, queue).depth.values()) == 0
        assert queue_stats(client, queue).cancelled == 1
        assert handle.cancel() == "finished"
        model.serve(inprocess_consumer, shared_redis.url, queue)
        assert p.submit({"keep": 1}).result(timeout=10) == {"keep": 1}
    assert model.payloads() == [{"keep": 1}]


def test_cancel_a_running_or_finished_request(shared_redis, queue, inprocess_consumer,
                                              tmp_path):
    model = RecordingModel(tmp_path)
    model.serve(inprocess_consumer, shared_redis.url, queue, strategy="fifo")
    with Producer(shared_redis.url, queue) as p:
        handle = p.submit({"sleep_ms": 500})
        wait_for(lambda: model.batches(), what="the request to start")
        assert handle.cancel() == "running"  # too late: it completes normally
        assert handle.result(timeout=10) == {"sleep_ms": 500}
        assert handle.cancel() == "finished"


# -- asyncio ---------------------------------------------------------------------------


def test_async_producer_round_trip(shared_redis, queue, inprocess_consumer):
    inprocess_consumer("consumer.models:noop", redis_url=shared_redis.url, queue=queue,
                       strategy="priority")

    async def main() -> None:
        async with AsyncProducer(shared_redis.url, queue) as p:
            handle = await p.submit({"a": 1}, priority="high", store_result=True)
            assert await handle.result(timeout=10) == {"a": 1}
            handles = await p.submit_many([{"i": i} for i in range(40)], priority="low")
            results = await asyncio.gather(*(h.result(timeout=10) for h in handles))
            assert results == [{"i": i} for i in range(40)]
            stored = await p.fetch(handle.id)
            assert stored is not None and stored.value == {"a": 1}
            with pytest.raises(InvalidRequest, match="priority"):
                await p.submit({}, priority="urgent")

    asyncio.run(main())


def test_connect_does_the_first_submits_setup_ahead(redis_server, queue, inprocess_consumer):
    """connect(), sync and asyncio: the enqueue script is loaded and the result listener
    runs before any request (so the first request does not pay for them); submits then
    work as before, and a closed producer refuses it."""
    client = redis_server.client()
    client.script_flush()  # every node's cache, where the server is a cluster
    sha = Scripts(client).enqueue.sha

    def listeners() -> int:
        return sum(t.name.startswith("batchgate-listener-") for t in threading.enumerate())

    before = listeners()
    inprocess_consumer("consumer.models:noop", redis_url=redis_server.url, queue=queue)
    with Producer(redis_server.url, queue) as p:
        assert p.connect() is p
        assert client.script_exists(sha) == [True]
        assert listeners() == before + 1
        assert p.submit({"a": 1}).result(timeout=10) == {"a": 1}
    with pytest.raises(RuntimeError, match="closed"):
        p.connect()

    async def main() -> None:
        client.script_flush()
        async with AsyncProducer(redis_server.url, queue) as ap:
            assert await ap.connect() is ap
            assert client.script_exists(sha) == [True]
            assert await (await ap.submit({"b": 2})).result(timeout=10) == {"b": 2}
        with pytest.raises(RuntimeError, match="closed"):
            await ap.connect()

    asyncio.run(main())


def test_consumer_loads_its_scripts_before_the_first_batch(redis_server, queue,
                                                           inprocess_consumer):
    """A started consumer has loaded the scripts of its loop (pop, complete, lease, the
    sweeps) before any request arrives, so that the first batch's completion is not a
    NOSCRIPT, a load and a second call on its requests' time."""
    client = redis_server.client()
    client.script_flush()
    scripts = Scripts(client)
    loop = [scripts.pop_batch, scripts.complete, scripts.extend_lease,
            scripts.requeue_expired, scripts.expire_due]
    assert client.script_exists(*(s.sha for s in loop)) == [False] * len(loop)
    inprocess_consumer("consumer.models:noop", redis_url=redis_server.url, queue=queue)
    assert client.script_exists(*(s.sha for s in loop)) == [True] * len(loop)
    with Producer(redis_server.url, queue) as p:
        assert p.submit({"a": 1}).result(timeout=10) == {"a": 1}


def test_async_cancel_and_deadline(shared_redis, queue):
    configure(shared_redis.url, queue, strategy="priority")  # no consumer runs

    async def main() -> None:
        async with AsyncProducer(shared_redis.url, queue) as p:
            handle = await p.submit({"c": 1})
            assert await handle.cancel() == "cancelled"
            with pytest.raises(RequestCancelled):
                await handle.result(timeout=5)
            late = await p.submit({"d": 1}, deadline_ms=150)
            with pytest.raises(DeadlineExceeded):
                await late.result(timeout=10)
            with pytest.raises(TimeoutError):
                await (await p.submit({"w": 1})).result(timeout=0.2)

    asyncio.run(main())
    assert queue_stats(shared_redis.client(), queue).depth["normal"] == 1
