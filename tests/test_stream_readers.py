"""Readers of one request's partial results (issue 33 §6, §7; docs/streaming.md), with real
gateway processes (the consumers in this process, but for a model that hangs): several
readers of one stream each get every part and the end; a retried keyed streaming submit
starts from the first part (or after Last-Event-ID); a gateway releases the stream of a
client that hung up at once."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest
from helpers.stream_models import Steps
from helpers.support import queue_pattern, snapshot, wait_for

from producer import Producer

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

HELPERS = str(Path(__file__).resolve().parent / "helpers")


def steps(start_consumer, url, queue, parts, sleep_ms, *args):
    """`batchgate consumer` running stream_models:Steps: for a model that hangs past the
    test (a process is killed at the end; a thread would be waited for)."""
    return start_consumer(url, queue, "--model", "stream_models:Steps", "--model-arg",
                          f"parts={parts}", "--model-arg", f"sleep_ms={sleep_ms}", *args,
                          cwd=HELPERS)


def serve_steps(inprocess_consumer, url, queue, parts, sleep_ms):
    """The same model on the in-process consumer (the gateway is the process under test)."""
    return inprocess_consumer(Steps(parts, sleep_ms), redis_url=url, queue=queue)


@pytest.fixture
def start_gateway():
    from helpers.servers import gateway_factory

    factory = gateway_factory()
    yield next(factory)
    next(factory, None)


def sse(lines) -> list[tuple[str | None, str, object]]:
    """(id, event, data) of each server-sent event."""
    events, entry_id, name = [], None, None
    for line in lines:
        if line.startswith("id: "):
            entry_id = line[len("id: "):]
        elif line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            events.append((entry_id, name, json.loads(line[len("data: "):])))
            entry_id = None
    return events


def parts(i: int, count: int, start: int = 0) -> list[tuple[str, object]]:
    return [("part", {"i": i, "step": s}) for s in range(start, count)]


def test_two_handles_of_one_keyed_request_each_read_every_part(shared_redis, queue,
                                                                 inprocess_consumer):
    serve_steps(inprocess_consumer, shared_redis.url, queue, 5, 150)
    with Producer(shared_redis.url, queue) as p:
        first = p.submit({"i": 1}, idempotency_key="k1")
        again = p.submit({"i": 1}, idempotency_key="k1")
        assert again.id == first.id
        seen: dict[int, list] = {}
        threads = [threading.Thread(target=lambda n=n, h=h: seen.__setitem__(
            n, list(h.entries(timeout=30)))) for n, h in enumerate((first, again, first))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        want = [{"i": 1, "step": s} for s in range(5)]
        assert [[e for _, e in seen[n]] for n in range(3)] == [want] * 3
        ids = [i for i, _ in seen[0]]
        # Resuming after the second entry yields the three after it.
        assert list(first.stream(timeout=5, after=ids[1])) == want[2:]
        assert p._stream_reader is not None and p._stream_reader.readers() == 0
        assert first.result(timeout=1) == {"i": 1, "parts": 5}


def test_two_clients_stream_one_keyed_request(shared_redis, queue, inprocess_consumer,
                                              start_gateway):
    serve_steps(inprocess_consumer, shared_redis.url, queue, 4, 200)
    gateway = start_gateway(shared_redis.url, queue)
    body = {"payload": {"i": 7}, "stream": True, "idempotency_key": "both"}
    got: dict[int, list] = {}

    def read(n: int) -> None:
        with httpx.Client(base_url=gateway.url, timeout=30) as http, \
                http.stream("POST", "/v1/requests", json=body) as response:
            assert response.status_code == 200
            got[n] = sse(response.iter_lines())

    threads = [threading.Thread(target=read, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for n in range(2):
        assert [(e, d) for _, e, d in got[n]][:-1] == parts(7, 4), got[n]
        final = got[n][-1]
        assert final[1] == "result" and final[2]["result"] == {"i": 7, "parts": 4}
        assert all(i is not None for i, _, _ in got[n][:-1])  # each part has its id


def test_a_retry_after_a_hang_up_streams_from_the_start(shared_redis, queue,
                                                        inprocess_consumer, start_gateway):
    serve_steps(inprocess_consumer, shared_redis.url, queue, 5, 300)
    gateway = start_gateway(shared_redis.url, queue)
    body = {"payload": {"i": 3}, "stream": True, "idempotency_key": "retry"}
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        with http.stream("POST", "/v1/requests", json=body) as response:
            lines = response.iter_lines()
            first = []
            for line in lines:  # up to the first part, then hang up
                first.append(line)
                if line.startswith("data: "):
                    break
        [(first_id, event, data)] = sse(first)
        assert (event, data) == ("part", {"i": 3, "step": 0})
        with http.stream("POST", "/v1/requests", json=body) as response:
            again = sse(response.iter_lines())
        assert [(e, d) for _, e, d in again][:-1] == parts(3, 5)
        assert again[-1][1] == "result"
        assert again[0][0] == first_id
        # Last-Event-ID: from the part after it, then the final event.
        with http.stream("POST", "/v1/requests", json=body,
                         headers={"Last-Event-ID": again[2][0]}) as response:
            resumed = sse(response.iter_lines())
        assert [(e, d) for _, e, d in resumed] == [*parts(3, 5, start=3),
                                                   ("result", again[-1][2])]
        bad = http.post("/v1/requests", json={**body, "idempotency_key": "other"},
                        headers={"Last-Event-ID": "soon"})
        assert bad.status_code == 422 and bad.json()["field"] == "Last-Event-ID"


@pytest.mark.parametrize("last", ["18446744073709551616-0", "0-99999999999999999999"])
def test_a_last_event_id_past_64_bits_is_refused_and_nothing_written(shared_redis, queue,
                                                                      start_gateway, last):
    """Redis' entry ids are two unsigned 64-bit numbers: a larger one is refused up front
    (before, it was submitted and its stream answered "redis_unavailable")."""
    gateway = start_gateway(shared_redis.url, queue)
    before = snapshot(shared_redis.client(), queue_pattern(queue))
    body = {"payload": {"i": 1}, "stream": True, "idempotency_key": "big"}
    bad = httpx.post(gateway.url + "/v1/requests", json=body, timeout=30,
                     headers={"Last-Event-ID": last})
    assert bad.status_code == 422, bad.text
    assert bad.json()["field"] == "Last-Event-ID" and "64" in bad.json()["message"]
    assert snapshot(shared_redis.client(), queue_pattern(queue)) == before


def gauge(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def open_submit(port: int, n: int, mode: str) -> socket.socket:
    """A submit with `"stream": true` whose answer has begun (its status line is in), or
    with `"wait": true` (sent)."""
    body = json.dumps({"payload": {"i": n}, mode: True, "timeout_s": 300}).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(b"POST /v1/requests HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    if mode == "stream":
        assert sock.recv(64).startswith(b"HTTP/1.1 200")
    return sock


def test_the_gateway_releases_the_streams_of_clients_that_hung_up(
        redis_server, queue, start_consumer, start_gateway):
    """100 streaming clients and 50 waiting ones (`"wait": true`) of a model that takes a
    minute hang up: within 5 s (the gateway notices a hang-up as soon as its event loop
    reads the socket) it holds no stream, no waiting submit, and no stream reader blocks
    in Redis."""
    steps(start_consumer, redis_server.url, queue, 2, 30_000, "--max-batch-size", "8")
    gateway = start_gateway(redis_server.url, queue)
    admin = redis_server.client()

    def blocked_readers() -> int:
        return sum(1 for c in admin.client_list() if c["cmd"] == "xread" and "b" in c["flags"])

    socks = [open_submit(gateway.port, n, "stream") for n in range(100)]
    socks += [open_submit(gateway.port, n, "wait") for n in range(100, 150)]
    assert gauge(gateway.url, "batchgate_gateway_open_streams") == 100
    wait_for(lambda: gauge(gateway.url, "batchgate_gateway_waiting_requests") == 150,
             timeout=10, interval=0.1)
    wait_for(lambda: blocked_readers() == 1, timeout=10)
    for sock in socks:
        sock.close()
    hung_up = time.monotonic()
    wait_for(lambda: gauge(gateway.url, "batchgate_gateway_open_streams") == 0, timeout=5,
             interval=0.1)
    assert gauge(gateway.url, "batchgate_gateway_waiting_requests") == 0
    wait_for(lambda: blocked_readers() == 0, timeout=5)
    released_s = time.monotonic() - hung_up
    print(f"150 hung-up clients released in {released_s:.2f} s")
    assert released_s < 5
