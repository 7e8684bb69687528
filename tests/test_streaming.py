"""Streaming partial results (issue 16 §4, docs/streaming.md): parts arrive before the
result and in order, the result arrives once, a crash re-runs the request from the start
behind a restart marker (a real consumer process, SIGKILLed), and a fenced-out batch cannot
append. What does not need a process boundary runs on the in-process consumer."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
from helpers.failure_support import CountingProducer, wait_for
from helpers.stream_models import Steps

from producer import AsyncProducer, Producer, RequestFailed, Restart
from scheduler_core.keys import QueueKeys
from scheduler_core.scripts import Scripts, stream_keys

HELPERS = str(Path(__file__).resolve().parent / "helpers")


def steps(start_consumer, url, queue, *args, parts=5, sleep_ms=100, ready=True):
    """`batchgate consumer` running stream_models:Steps (for the crash test)."""
    return start_consumer(url, queue, "--model", "stream_models:Steps", "--model-arg",
                          f"parts={parts}", "--model-arg", f"sleep_ms={sleep_ms}", *args,
                          cwd=HELPERS, ready=ready)


def serve_steps(inprocess_consumer, url, queue, parts=5, sleep_ms=100, **settings):
    """The same model on the in-process consumer; `settings` as Consumer takes them."""
    return inprocess_consumer(Steps(parts, sleep_ms), redis_url=url, queue=queue, **settings)


def test_parts_arrive_in_order_before_the_result(shared_redis, queue, inprocess_consumer):
    serve_steps(inprocess_consumer, shared_redis.url, queue, parts=5, sleep_ms=150,
                strategy="dynamic", max_batch_size=4, max_queue_delay_ms=50)
    with CountingProducer(shared_redis.url, queue) as p:
        handles = p.submit_many([{"i": i} for i in range(3)])
        seen, done_at_part = [], []
        for part in handles[0].stream(timeout=30):
            seen.append(part)
            done_at_part.append(handles[0].done())
        assert seen == [{"i": 0, "step": s} for s in range(5)]
        assert not any(done_at_part[:-1])  # the parts came while the batch ran
        assert handles[0].result(timeout=0.1) == {"i": 0, "parts": 5}
        assert [list(h.stream(timeout=30)) for h in handles[1:]] == \
            [[{"i": i, "step": s} for s in range(5)] for i in (1, 2)]
        assert [h.result(timeout=5)["i"] for h in handles] == [0, 1, 2]
        time.sleep(0.3)
        assert all(p.deliveries[h.id] == 1 for h in handles)


def test_many_streams_share_one_reading_connection(redis_server, queue, inprocess_consumer):
    """16 streams read at once, by a producer with a pool of 2: every stream gets its parts
    in order, and at any time at most one connection blocks in XREAD (the producer's one
    stream reader), not one per stream."""
    url = redis_server.url
    serve_steps(inprocess_consumer, url, queue, parts=6, sleep_ms=100, strategy="dynamic",
                max_batch_size=16, max_queue_delay_ms=300)
    admin = redis_server.client()
    readers, results = [], {}
    with Producer(url, queue, max_connections=2) as p:
        handles = p.submit_many([{"i": i} for i in range(16)])
        threads = [threading.Thread(target=lambda h=h: results.__setitem__(
            h.id, list(h.stream(timeout=30)))) for h in handles]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            readers.append(sum(1 for c in admin.client_list() if c["cmd"] == "xread"
                               and "b" in c["flags"]))
            time.sleep(0.02)
    assert [results[h.id] for h in handles] == \
        [[{"i": i, "step": s} for s in range(6)] for i in range(16)]
    assert max(readers) == 1


def test_async_stream(shared_redis, queue, inprocess_consumer):
    serve_steps(inprocess_consumer, shared_redis.url, queue, parts=4, sleep_ms=100)

    async def main():
        async with AsyncProducer(shared_redis.url, queue) as p:
            handle = await p.submit({"i": 7})
            parts = [part async for part in handle.stream(timeout=30)]
            return parts, await handle.result(timeout=1)

    parts, result = asyncio.run(main())
    assert parts == [{"i": 7, "step": s} for s in range(4)]
    assert result == {"i": 7, "parts": 4}


def test_a_model_that_does_not_stream_yields_nothing(shared_redis, queue, inprocess_consumer):
    inprocess_consumer("consumer.models:noop", redis_url=shared_redis.url, queue=queue)
    with Producer(shared_redis.url, queue) as p:
        handle = p.submit({"x": 1})
        assert list(handle.stream(timeout=30)) == []
        assert handle.done()


def test_a_crash_mid_stream_restarts_it(redis_server, queue, start_consumer):
    """SIGKILL after some parts: a second consumer re-runs the request once the lease
    lapses; the stream shows the first run's parts, a Restart(2), then the full sequence;
    the result arrives once."""
    url = redis_server.url
    first = steps(start_consumer, url, queue, "--lease-ms", "500", parts=6, sleep_ms=150)
    with CountingProducer(url, queue) as p:
        handle = p.submit({"i": 1})
        events = []
        for event in handle.stream(timeout=60):
            events.append(event)
            if len(events) == 2:
                first.kill()
                steps(start_consumer, url, queue, "--lease-ms", "500", parts=6, sleep_ms=150)
        assert events[:2] == [{"i": 1, "step": 0}, {"i": 1, "step": 1}]
        assert events[2:] == [Restart(2), *({"i": 1, "step": s} for s in range(6))]
        assert handle.result(timeout=1) == {"i": 1, "parts": 6}
        time.sleep(0.3)
        assert p.deliveries[handle.id] == 1


def test_a_batch_split_around_a_failure_restarts_its_mates_streams(shared_redis, queue,
                                                                  inprocess_consumer):
    """The model raises on one request after a step: the batch is split, each half runs
    again, so the other request's stream restarts (Restart(1)) then runs in full."""
    serve_steps(inprocess_consumer, shared_redis.url, queue, parts=3, sleep_ms=50,
                strategy="dynamic", max_batch_size=2, max_queue_delay_ms=500)
    with Producer(shared_redis.url, queue) as p:
        good, bad = p.submit_many([{"i": 0}, {"i": 1, "raise": True}])
        assert list(good.stream(timeout=30)) == [
            {"i": 0, "step": 0}, Restart(1), *({"i": 0, "step": s} for s in range(3))]
        assert good.result(timeout=1) == {"i": 0, "parts": 3}
        assert list(bad.stream(timeout=30)) == [
            {"i": 1, "step": 0}, Restart(1), {"i": 1, "step": 0}]
        with pytest.raises(RequestFailed, match="poison payload"):
            bad.result(timeout=1)


def test_a_fenced_out_batch_cannot_append(redis_server, queue, inprocess_consumer):
    """Only the batch holding the request's lease may write its stream: a stale batch id
    is refused and nothing is written."""
    url = redis_server.url
    serve_steps(inprocess_consumer, url, queue, parts=3, sleep_ms=300)
    client = redis_server.client()
    keys = QueueKeys(queue)
    with Producer(url, queue) as p:
        handle = p.submit({"i": 3})
        wait_for(lambda: client.hlen(keys.owner) == 1, 15, "the request in flight")
        batch = client.hget(keys.owner, handle.id).decode()
        stale = str(int(batch) + 1000)
        append = Scripts(client).stream_append
        reply = append(keys=stream_keys(keys, [handle.id]),
                       args=[stale, 60, 100, 1, handle.id, "p", b'"forged"'])
        assert reply == [-1]
        # A live batch that does not own the request is refused entry by entry.
        other = p.submit({"i": 4})
        reply = append(keys=stream_keys(keys, [other.id]),
                       args=[batch, 60, 100, 1, other.id, "p", b'"forged"'])
        assert reply == [0, 1]
        assert list(handle.stream(timeout=30)) == [{"i": 3, "step": s} for s in range(3)]
        assert list(other.stream(timeout=30)) == [{"i": 4, "step": s} for s in range(3)]


def test_generator_streams_its_tokens(shared_redis, queue, inprocess_consumer):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from test_generator import TINY

    inprocess_consumer("consumer.models:generator", redis_url=shared_redis.url, queue=queue,
                       model_args={**TINY, "stream": True}, strategy="dynamic",
                       max_batch_size=4, max_queue_delay_ms=100)
    with Producer(shared_redis.url, queue) as p:
        handles = p.submit_many([{"prompt": "Hello", "max_new_tokens": 6},
                                 {"prompt": "abc", "max_new_tokens": 3}])
        streams = [list(h.stream(timeout=60)) for h in handles]
        results = [h.result(timeout=5) for h in handles]
    for parts, result in zip(streams, results, strict=True):
        assert [part["token"] for part in parts] == result["tokens"]
        assert "".join(part["text"] for part in parts) == \
            "".join(chr(t % 256) for t in result["tokens"])


def sse_events(response) -> list[tuple[str, object, float]]:
    """(event, data, arrival time) of each server-sent event, read as it arrives."""
    import json

    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            events.append((name, json.loads(line[len("data: "):]), time.monotonic()))
    return events


def test_gateway_streams_server_sent_events(shared_redis, queue, inprocess_consumer):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from helpers.servers import gateway_factory

    serve_steps(inprocess_consumer, shared_redis.url, queue, parts=4, sleep_ms=200)
    factory = gateway_factory()
    start_gateway = next(factory)
    try:
        gateway = start_gateway(shared_redis.url, queue)
        with httpx.Client(base_url=gateway.url, timeout=30) as http:
            sent = time.monotonic()
            with http.stream("POST", "/v1/requests",
                             json={"payload": {"i": 5}, "stream": True}) as response:
                assert response.status_code == 200
                assert response.headers["content-type"].startswith("text/event-stream")
                request_id = response.headers["x-request-id"]
                events = sse_events(response)
            assert [(e, d) for e, d, _ in events] == [
                *(("part", {"i": 5, "step": s}) for s in range(4)),
                ("result", {"id": request_id, "status": "done",
                            "result": {"i": 5, "parts": 4}})]
            # The first part came while the model still ran (3 more steps of 200 ms).
            assert events[0][2] - sent < events[-1][2] - sent - 0.3
            spec = http.get("/openapi.json").json()["components"]["schemas"]["SubmitRequest"]
            assert spec["properties"]["stream"]["type"] == "boolean"
            bad = http.post("/v1/requests", json={"payload": 1, "stream": "yes"})
            assert bad.status_code == 422 and bad.json()["field"] == "stream"
    finally:
        next(factory, None)
