"""Bursts: any number of concurrent submits from one producer succeed, each answered with
its own result, over a small fixed number of Redis connections; submits that arrive
together share round trips; many handles are waited on without a thread each."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import orjson
import pytest
from helpers.servers import ServerProcess, gateway_factory
from helpers.support import configure

from producer import AsyncProducer, DeadlineExceeded, Producer, QueueFull, RequestFailed
from scheduler_core.connection import DEFAULT_MAX_CONNECTIONS
from scheduler_core.ops.stats import queue_stats

# The consumer (in the test process): answers at once, in batches of up to 256.
NOOP = {"strategy": "dynamic", "max_batch_size": 256, "max_queue_delay_ms": 2}
NAME = "burst-producer"
# The producer's pool, its listener's own connection, and a reconnect in between.
CONNECTION_BOUND = DEFAULT_MAX_CONNECTIONS + 1 + 1


@pytest.fixture
def start_gateway() -> Iterator[Callable[..., ServerProcess]]:
    yield from gateway_factory()


@contextmanager
def connections_seen(admin) -> Iterator[list[int]]:
    """Sample how many connections named NAME Redis has, while the block runs."""
    counts: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.01):
            counts.append(sum(c.get("name") == NAME for c in admin.client_list()))

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield counts
    finally:
        stop.set()
        thread.join()


def evalsha_calls(admin) -> int:
    return int(admin.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


def test_10000_concurrent_async_submits(shared_redis, queue, inprocess_consumer):
    inprocess_consumer("consumer.models:noop", redis_url=shared_redis.url, queue=queue,
                       **NOOP)
    admin = shared_redis.client()

    async def burst() -> list[object]:
        async with AsyncProducer(f"{shared_redis.url}?client_name={NAME}", queue) as p:
            async def one(i: int) -> object:
                handle = await p.submit({"i": i})
                return await handle.result(timeout=60)

            return await asyncio.gather(*(one(i) for i in range(10_000)),
                                        return_exceptions=True)

    with connections_seen(admin) as counts:
        results = asyncio.run(burst())
    assert [r for r in results if isinstance(r, BaseException)] == []
    assert results == [{"i": i} for i in range(10_000)]
    assert 2 <= max(counts) <= CONNECTION_BOUND, counts


def test_1000_threads_through_one_sync_producer(shared_redis, queue, inprocess_consumer):
    inprocess_consumer("consumer.models:noop", redis_url=shared_redis.url, queue=queue,
                       **NOOP)
    admin = shared_redis.client()
    results: list[object] = [None] * 1000
    go = threading.Event()
    with Producer(f"{shared_redis.url}?client_name={NAME}", queue) as p:
        def one(i: int) -> None:
            go.wait()
            try:
                results[i] = p.submit({"t": i}).result(timeout=60)
            except Exception as exc:
                results[i] = exc

        threads = [threading.Thread(target=one, args=(i,)) for i in range(1000)]
        with connections_seen(admin) as counts:
            for t in threads:
                t.start()
            go.set()
            for t in threads:
                t.join()
    assert [r for r in results if isinstance(r, BaseException)] == []
    assert results == [{"t": i} for i in range(1000)]
    assert 2 <= max(counts) <= CONNECTION_BOUND, counts


async def post_json(port: int, path: str, body: object, token: str = "") -> tuple[int, object]:
    """One HTTP/1.1 POST on a connection of its own. Not httpx: opening 2,000 connections
    through httpx costs ~5 ms of CPU each, more than the gateway spends answering them."""
    data = orjson.dumps(body)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        auth = f"Authorization: Bearer {token}\r\n".encode() if token else b""
        writer.write(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                     b"\r\n%sContent-Length: %d\r\nConnection: close\r\n\r\n%s"
                     % (path.encode(), auth, len(data), data))
        answer = await reader.read()  # until the server closes
    finally:
        writer.close()
    head, _, payload = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), orjson.loads(payload)


def test_2000_concurrent_http_requests_at_the_gateway(shared_redis, queue, inprocess_consumer,
                                                       start_gateway):
    inprocess_consumer("consumer.models:noop", redis_url=shared_redis.url, queue=queue,
                       **NOOP)
    gateway = start_gateway(shared_redis.url, queue, "--workers", "2", "--token", "s3cret")

    async def burst() -> list[tuple[int, object] | BaseException]:
        return await asyncio.gather(*(
            post_json(gateway.port, "/v1/requests", {"payload": {"i": i}, "wait": True},
                      "s3cret") for i in range(2000)), return_exceptions=True)

    try:
        async def without_token() -> list[tuple[int, object]]:
            return await asyncio.gather(*(post_json(gateway.port, "/v1/requests",
                                                    {"payload": i}) for i in range(20)))

        # The workers have the settings the command was given (the token, here).
        assert {status for status, _ in asyncio.run(without_token())} == {401}
        answers = asyncio.run(burst())
        failed = [a for a in answers if isinstance(a, BaseException) or a[0] != 200]
        assert failed == [], failed[:5]
        assert [a[1]["result"] for a in answers] == [{"i": i} for i in range(2000)]
    finally:
        assert gateway.stop() == 0  # SIGTERM: the workers shut down with it


def test_coalesced_submits_keep_their_own_all_or_nothing(redis_server, queue):
    """Submits made together share one script call, yet each keeps its own answer: one
    caller's QueueFull writes nothing of its own and costs its neighbours nothing."""
    configure(redis_server.url, queue, strategy="dynamic", max_queue_size=10)
    admin = redis_server.client()

    async def together() -> list[object]:
        async with AsyncProducer(redis_server.url, queue) as p:
            return await asyncio.gather(
                p.submit_many(range(6)), p.submit_many(range(4)), p.submit("a"),
                p.submit("b"), return_exceptions=True)

    with Producer(redis_server.url, queue) as p:
        p.submit("warm-up")  # loads the script: NOSCRIPT retries count no more below
    calls = evalsha_calls(admin)
    six, four, a, b = asyncio.run(together())
    # Whichever of the two lists reached Redis second did not fit, and only it failed.
    assert [isinstance(x, QueueFull) for x in (six, four, a, b)] in (
        [False, True, False, False], [True, False, False, False])
    accepted = sum(len(x) for x in (six, four) if not isinstance(x, QueueFull)) + 2
    assert admin.zcard(f"{{bg:{queue}}}:pending:1") == 1 + accepted
    assert evalsha_calls(admin) - calls <= 5  # 6 alone, the rest together, then (after
    # QueueFull) one call each for those three

    async def many() -> None:
        async with AsyncProducer(redis_server.url, queue) as p:
            await asyncio.gather(*(p.submit(i, priority="low") for i in range(1000)))

    admin.hset(f"{{bg:{queue}}}:policy", "max_queue_size", 0)
    calls = evalsha_calls(admin)
    asyncio.run(many())
    assert admin.zcard(f"{{bg:{queue}}}:pending:2") == 1000
    # not one round trip per submit (how many calls the 1,000 share depends on timing)
    assert evalsha_calls(admin) - calls <= 50


def test_concurrent_submits_with_one_idempotency_key(shared_redis, queue, inprocess_consumer):
    inprocess_consumer("consumer.models:noop", redis_url=shared_redis.url, queue=queue,
                       **NOOP)

    async def same_key() -> list[tuple[str, object]]:
        async with AsyncProducer(shared_redis.url, queue) as p:
            handles = await asyncio.gather(*(p.submit({"order": 17}, idempotency_key="o-17")
                                             for _ in range(50)))
            values = await asyncio.gather(*(h.result(timeout=5) for h in handles))
            return [(h.id, v) for h, v in zip(handles, values, strict=True)]

    answers = asyncio.run(same_key())
    assert len({request_id for request_id, _ in answers}) == 1
    assert all(value == {"order": 17} for _, value in answers)
    assert queue_stats(shared_redis.client(), queue).processed == 1


def test_done_callbacks_and_as_completed(shared_redis, queue, inprocess_consumer):
    inprocess_consumer("consumer.models:noop", redis_url=shared_redis.url, queue=queue,
                       **NOOP)
    seen: list[str] = []
    with Producer(shared_redis.url, queue) as p:
        handles = p.submit_many([{"i": i, "fail": i % 50 == 0} for i in range(500)])
        for h in handles[:5]:
            h.add_done_callback(lambda h: 1 / 0)  # logged; the listener carries on
        for h in handles:
            h.add_done_callback(lambda h: seen.append(h.id))
        ended = list(p.as_completed(handles, timeout=30))
        assert {h.id for h in ended} == {h.id for h in handles} and len(ended) == 500
        for i, h in enumerate(handles):
            if i % 50 == 0:
                with pytest.raises(RequestFailed):
                    h.result(timeout=0)
            else:
                assert h.result(timeout=0) == {"i": i, "fail": False}
        assert sorted(seen) == sorted(h.id for h in handles)

        late: list[str] = []  # added after the end: called at once, in this thread
        handles[1].add_done_callback(lambda h: late.append(threading.current_thread().name))
        assert late == [threading.current_thread().name]

        futures = [h.future for h in p.submit_many([{"f": 1}, {"fail": True}])]
        done, _ = concurrent.futures.wait(futures, timeout=30)
        assert len(done) == 2 and futures[0].result() == {"f": 1}
        assert isinstance(futures[1].exception(), RequestFailed)
        assert p.submit("after").result(timeout=10) == "after"  # the listener is alive


def test_callback_fires_at_the_deadline_with_nobody_waiting(shared_redis, queue):
    configure(shared_redis.url, queue, strategy="fifo")  # no consumer: nothing runs it
    ended = threading.Event()
    with Producer(shared_redis.url, queue) as p:
        handle = p.submit({"late": 1}, deadline_ms=100)
        handle.add_done_callback(lambda h: ended.set())
        started = time.monotonic()
        assert ended.wait(10), "the listener did not expire it"
        assert time.monotonic() - started < 5
        with pytest.raises(DeadlineExceeded):
            handle.result(timeout=0)
        never = p.submit({"waits": 1})
        with pytest.raises(TimeoutError, match="1 of 2"):
            list(p.as_completed([handle, never], timeout=0.3))
