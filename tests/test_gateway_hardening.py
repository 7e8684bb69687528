"""Hardening of `batchgate gateway` (docs/gateway.md, docs/guarantees.md): hostile or
broken clients cannot make it read, hold or parse more than it allows, nor grow its
/metrics; answers stay truthful when Redis lost a request or an idempotency key outlived
its result. A real gateway process over real sockets, on loopback only, bounded in count
and time."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import orjson
import pytest
from helpers import metrics
from helpers.servers import ServerProcess, gateway_factory
from helpers.support import configure, wait_for
from prometheus_client.parser import text_string_to_metric_families

from producer.base import LOST_CHECK_AFTER_S, POLL_S
from producer.gateway.metrics import METHODS
from scheduler_core.keys import QueueKeys
from scheduler_core.wire import split_job

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SLACK_S = 10.0


@pytest.fixture
def start_gateway() -> Iterator[Callable[..., ServerProcess]]:
    yield from gateway_factory()


def connect(gateway: ServerProcess, timeout: float = SLACK_S) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", gateway.port), timeout=timeout)
    sock.settimeout(timeout)
    return sock


def read_answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of the one answer on `sock`, read until the server
    closes the connection (every answer tested here closes it)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


POST_HEAD = ("POST /v1/requests HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
             "{auth}{length}\r\n")


def post_head(length: str, auth: bool) -> bytes:
    return POST_HEAD.format(auth=f"Authorization: Bearer {TOKEN}\r\n" if auth else "",
                            length=length).encode()


# -- the token before the body, the body's size ------------------------------------------
def test_the_token_is_checked_before_the_body_is_read(shared_redis, queue, start_gateway):
    """A 25 MB Content-Length without a token: 401 from the headers alone, connection
    closed; nothing of the body is ever sent."""
    gateway = start_gateway(shared_redis.url, queue, "--token", TOKEN)
    for auth in ("", "Authorization: Bearer wrong\r\n"):
        with connect(gateway) as sock:
            sock.sendall(POST_HEAD.format(auth=auth, length="Content-Length: 25000000\r\n")
                         .encode())
            status, headers, body = read_answer(sock)
        assert status == 401
        assert headers["www-authenticate"] == "Bearer"
        assert orjson.loads(body)["error"] == "unauthorized"


def test_a_body_over_the_limit_is_413_at_once(shared_redis, queue, start_gateway):
    limit = 64 << 10
    gateway = start_gateway(shared_redis.url, queue, "--token", TOKEN,
                            "--max-body-bytes", str(limit))
    # Content-Length over the limit: answered from the headers.
    with connect(gateway) as sock:
        sock.sendall(post_head(f"Content-Length: {limit + 1}\r\n", auth=True))
        status, headers, body = read_answer(sock)
    problem = orjson.loads(body)
    assert status == 413 and headers["connection"] == "close"
    assert problem["field"] == "body" and str(limit) in problem["message"]
    assert "--max-body-bytes" in problem["message"]
    # Chunked: counted while it streams; answered once over the limit, long before the
    # 64 MB the client would send, and the gateway does not keep what it received.
    rss_before = rss_bytes(gateway.proc.pid)
    chunk = b"4000\r\n" + b" " * 0x4000 + b"\r\n"
    sent, answered = 0, b""
    with connect(gateway) as sock:
        sock.sendall(post_head("Transfer-Encoding: chunked\r\n", auth=True))
        try:
            while sent < 64 << 20 and not answered:
                sock.sendall(chunk)
                sent += len(chunk)
                if select.select([sock], [], [], 0)[0]:
                    answered = sock.recv(65536)
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed by the gateway after its answer
        answered = answered or sock.recv(65536)
    assert answered.startswith(b"HTTP/1.1 413"), answered[:100]
    assert sent < 64 << 20
    assert rss_bytes(gateway.proc.pid) - rss_before < 32 << 20
    # Within the limit, with the token: served as before.
    with httpx.Client(base_url=gateway.url, headers=AUTH) as http:
        assert http.post("/v1/requests", json={"payload": "x" * 1000}).status_code == 202


def test_large_bodies_are_parsed_off_the_event_loop(shared_redis, queue, start_gateway):
    """Bodies near the default limit (1.5 MB of small integers, the costliest to check)
    are parsed and checked in a thread: /healthz, polled meanwhile, never waits for one
    (measured: a max stall of 53-85 ms, against ~650 ms when parsed on the event loop)."""
    gateway = start_gateway(shared_redis.url, queue)
    body = b'{"payload": [' + b", ".join([b"1"] * 500_000) + b'], "priority": "low"}'
    latencies: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=gateway.url, timeout=30) as http:
            while not stop.is_set():
                start = time.monotonic()
                assert http.get("/healthz").status_code == 200
                latencies.append(time.monotonic() - start)
                time.sleep(0.01)

    prober = threading.Thread(target=probe)
    prober.start()
    durations = []
    try:
        with httpx.Client(base_url=gateway.url, timeout=60) as http:
            for _ in range(3):
                start = time.monotonic()
                answer = http.post("/v1/requests", content=body,
                                   headers={"Content-Type": "application/json"})
                durations.append(time.monotonic() - start)
                assert answer.status_code == 202, answer.text
    finally:
        stop.set()
        prober.join()
    # Parsed on the event loop, /healthz would wait about as long as a whole submit.
    assert max(latencies) < 0.5 * min(durations), (max(latencies), durations)
    job = shared_redis.client().hget(QueueKeys(queue).jobs, answer.json()["id"])
    _, envelope = split_job(job)
    assert orjson.loads(envelope)["payload"] == [1] * 500_000


def test_large_bodies_are_answered_as_small_ones(shared_redis, queue, start_gateway):
    """The thread's parse changes nothing a client sees: each bad body, padded past the
    size parsed in a thread, gets the answer the small one gets."""
    gateway = start_gateway(shared_redis.url, queue)
    pad = " " * (100 << 10)  # JSON whitespace
    cases = [
        b'{"payload": ',  # not JSON
        b'[1, 2]',  # not an object
        b'{"payload": {"n": [1, 2, 1180591620717411303424]}}',  # 2**70
        b'{"payload": {"x": NaN}}',
        b'{"payload": 1, "priority": "urgent"}',
        b'{"payload": 1, "deadline": 5}',  # unknown field
        b'{"priority": "high"}',  # no payload
        b'{"payload": "' + b"x" * (1 << 20) + b'"}',  # over the 1 MiB payload limit
        b'\xff\xfe{}',  # not UTF-8
    ]
    with httpx.Client(base_url=gateway.url, timeout=30,
                      headers={"Content-Type": "application/json"}) as http:
        for case in cases:
            small = http.post("/v1/requests", content=case)
            large = http.post("/v1/requests", content=pad.encode() + case + pad.encode())
            assert small.status_code == large.status_code == 422, (case[:40], large.text)
            small_problem, large_problem = small.json(), large.json()
            assert large_problem["field"] == small_problem["field"], case[:40]
            if small_problem["field"] != "body":  # a decode error's position moves
                assert large_problem == small_problem, case[:40]
        done = http.post("/v1/requests", content=pad.encode() + b'{"payload": {"a": [1.5, '
                         b'null, "\\u00e9"]}, "priority": 2}' + pad.encode())
        assert done.status_code == 202
    _, envelope = split_job(shared_redis.client().hget(QueueKeys(queue).jobs,
                                                       done.json()["id"]))
    assert orjson.loads(envelope)["payload"] == {"a": [1.5, None, "é"]}


# -- slow clients ------------------------------------------------------------------------
def test_slow_headers_and_idle_connections_are_cut(shared_redis, queue, start_gateway):
    """Slowloris: 20 connections that send nothing and 20 that trickle header lines are
    answered 408 and closed request_timeout_s after they opened (1 s here)."""
    timeout_s = 1.0
    gateway = start_gateway(shared_redis.url, queue, "--request-timeout-s", str(timeout_s))
    opened = time.monotonic()
    idle = [connect(gateway) for _ in range(20)]
    slow = [connect(gateway) for _ in range(20)]
    for sock in slow:
        sock.sendall(b"GET /healthz HTTP/1.1\r\n")
    still_open = set(idle + slow)
    timed_out = 0
    deadline = opened + timeout_s + SLACK_S
    try:
        while still_open and time.monotonic() < deadline:
            readable = select.select(list(still_open), [], [], 0.2)[0]
            for sock in readable:
                try:
                    data = sock.recv(4096)
                except ConnectionResetError:
                    data = b""
                timed_out += data.startswith(b"HTTP/1.1 408")
                if not data:
                    still_open.discard(sock)
            for sock in still_open & set(slow):
                try:
                    sock.sendall(b"X-Slow: 1\r\n")
                except OSError:
                    still_open.discard(sock)
        assert not still_open, f"{len(still_open)} of 40 slow connections still open"
        assert time.monotonic() - opened >= timeout_s
        assert timed_out >= 20
    finally:
        for sock in idle + slow:
            sock.close()
    with httpx.Client(base_url=gateway.url) as http:  # everyone else is served
        assert http.get("/healthz").status_code == 200


def test_a_slow_body_is_408(shared_redis, queue, start_gateway):
    timeout_s = 1.0
    gateway = start_gateway(shared_redis.url, queue, "--request-timeout-s", str(timeout_s))
    for framing, first in (("Content-Length: 100\r\n", b'{"payload": '),
                           ("Transfer-Encoding: chunked\r\n", b'5\r\n{"pay\r\n')):
        with connect(gateway) as sock:
            sock.sendall(post_head(framing, auth=False) + first)
            start = time.monotonic()
            status, headers, body = read_answer(sock)
        assert status == 408, body
        assert timeout_s <= time.monotonic() - start + 0.1 < timeout_s + SLACK_S
        assert headers["connection"] == "close"
        assert orjson.loads(body)["field"] == "body"
        assert "--request-timeout-s" in orjson.loads(body)["message"]


def test_workers_apply_the_limits(shared_redis, queue, start_gateway):
    gateway = start_gateway(shared_redis.url, queue, "--workers", "2",
                            "--max-body-bytes", "2048", "--request-timeout-s", "1")
    with httpx.Client(base_url=gateway.url) as http:
        assert http.post("/v1/requests", json={"payload": "x" * 4096}).status_code == 413
        assert http.post("/v1/requests", json={"payload": "x"}).status_code == 202
    with connect(gateway) as sock:
        status, _, _ = read_answer(sock)  # sent nothing
    assert status == 408


def listening_inode(port: int) -> str:
    """The inode of the socket listening on 127.0.0.1:`port` (Linux /proc/net/tcp)."""
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if fields[1] == f"0100007F:{port:04X}" and fields[3] == "0A":  # LISTEN
                return fields[9]
    raise AssertionError(f"nothing listens on {port}")


def fd_targets(pid: str) -> set[str]:
    targets = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):  # closed meanwhile
            targets.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return targets


def test_two_workers_accept_on_one_socket(shared_redis, queue, start_gateway):
    """`--workers 2`: two worker processes, each holding the one listening socket (the
    parent binds it; the kernel hands each new connection to one of them)."""
    gateway = start_gateway(shared_redis.url, queue, "--workers", "2")
    inode = listening_inode(gateway.port)

    def holders() -> list[str]:
        pid = gateway.proc.pid
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = f.read().split()
        found = []
        for child in children:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"multiprocessing.spawn" not in f.read():
                    continue  # multiprocessing's resource tracker
            if f"socket:[{inode}]" in fd_targets(child):
                found.append(child)
        return found

    wait_for(lambda: len(holders()) == 2, SLACK_S, "two workers on the listening socket")
    with httpx.Client(base_url=gateway.url) as http:
        assert http.post("/v1/requests", json={"payload": 1}).status_code == 202


def read_one(sock: socket.socket, buffered: bytes = b"",
             head_only: bool = False) -> tuple[bytes, bytes, bytes]:
    """One answer's head and body from a kept-alive connection (by its Content-Length;
    none for a HEAD), and what was received after it."""
    data = buffered
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536) or b""
    head, _, rest = data.partition(b"\r\n\r\n")
    fields = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:])
    length = 0 if head_only or head.startswith(b"HTTP/1.1 100") else \
        int(fields.get(b"content-length", b"0"))
    while len(rest) < length:
        rest += sock.recv(65536)
    return head, rest[:length], rest[length:]


def test_answers_whole_on_a_kept_alive_connection(shared_redis, queue, inprocess_consumer,
                                                  start_gateway):
    """The gateway writes an answer's head together with its body (protocol.HeldHead):
    an interim 100 Continue still goes out before the body is sent, a HEAD answer (no
    body) is not held back, and answers on one connection follow one another whole."""
    inprocess_consumer("consumer.models:noop", redis_url=shared_redis.url, queue=queue)
    gateway = start_gateway(shared_redis.url, queue)
    body = b'{"payload": {"n": 1}, "wait": true, "timeout_s": 20}'
    with connect(gateway) as sock:
        sock.sendall(b"POST /v1/requests HTTP/1.1\r\nHost: gw\r\nContent-Type: "
                     b"application/json\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n"
                     % len(body))
        interim, _, rest = read_one(sock)
        assert interim.startswith(b"HTTP/1.1 100 "), interim
        sock.sendall(body)
        head, answered, rest = read_one(sock, rest)
        assert head.startswith(b"HTTP/1.1 200 "), head
        done = orjson.loads(answered)
        assert done["result"] == {"n": 1}
        path = f"/v1/requests/{done['id']}".encode()
        sock.sendall(b"HEAD %s HTTP/1.1\r\nHost: gw\r\n\r\nGET %s HTTP/1.1\r\nHost: gw\r\n\r\n"
                     % (path, path))  # pipelined
        head, _, rest = read_one(sock, rest, head_only=True)
        assert head.startswith(b"HTTP/1.1 200 ") and b"content-length: " in head.lower()
        head, answered, rest = read_one(sock, rest)
        assert head.startswith(b"HTTP/1.1 200 ") and orjson.loads(answered) == done
        assert rest == b""


# -- metrics, health, redirects ----------------------------------------------------------
def scrape(http: httpx.Client) -> tuple[str, set[str], set[str]]:
    text = http.get("/metrics", headers={}).text
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples
               if s.name.startswith("batchgate_gateway_request")]
    return (text, {s.labels["method"] for s in samples if "method" in s.labels},
            {s.labels["endpoint"] for s in samples if "endpoint" in s.labels})


def test_metrics_labels_come_from_a_fixed_set(shared_redis, queue, start_gateway):
    """Unusual methods and made-up paths do not become label values: /metrics stays the
    same size however many a client sends (it needs no token: read by Prometheus)."""
    gateway = start_gateway(shared_redis.url, queue, "--token", TOKEN)
    exotic = ["PROPFIND", "PROPPATCH", "MKCOL", "COPY", "MOVE", "LOCK", "UNLOCK", "SEARCH",
              "PURGE", "REPORT", "MKACTIVITY", "CHECKOUT", "MERGE", "NOTIFY", "SUBSCRIBE",
              "UNSUBSCRIBE", "LINK", "UNLINK", "MKCALENDAR", "ACL", "BIND", "REBIND",
              "UNBIND", "SOURCE"]
    with httpx.Client(base_url=gateway.url, headers=AUTH) as http:

        def send(round_: int) -> None:
            for method in exotic:
                for path in ("/v1/stats", f"/v1/requests/{'a' * 32}", "/healthz"):
                    http.request(method, path)
            for i in range(200):
                http.get(f"/made-up/{round_}/{i}/{'x' * 200}")

        scrape(http)  # its own series, counted once it is answered
        send(0)
        before, _, _ = scrape(http)
        send(1)
        send(2)
        after, methods, endpoints = scrape(http)
    assert methods <= METHODS | {"other"}, methods - METHODS
    assert endpoints <= {"/v1/requests", "/v1/requests/{request_id}", "/v1/stats",
                         "/healthz", "/metrics", "unmatched"}, endpoints
    # The same series, larger counts: a few more digits, no new lines.
    assert after.count("\n") == before.count("\n")
    assert len(after) < len(before) + 500, (len(before), len(after))


def test_healthz_tells_no_one_where_redis_is(redis_server, queue, start_gateway):
    gateway = start_gateway(redis_server.url, queue)
    with httpx.Client(base_url=gateway.url) as http:
        redis_server.kill()
        down = http.get("/healthz")
        redis_server.start()
    assert down.status_code == 503
    assert down.json() == {"status": "unavailable", "redis": "ConnectionError"}
    assert str(redis_server.port) not in down.text and "127.0.0.1" not in down.text
    wait_for(lambda: "Redis unavailable" in gateway.output(), 10, "the gateway's log")
    assert str(redis_server.port) in gateway.output()  # the operator sees it in the log


def test_a_trailing_slash_is_not_redirected_to_the_host_header(shared_redis, queue,
                                                               start_gateway):
    gateway = start_gateway(shared_redis.url, queue)
    with httpx.Client(base_url=gateway.url, headers={"Host": "evil.example"}) as http:
        for path in ("/v1/stats/", "/v1/requests/", "/healthz/"):
            answer = http.get(path)
            assert answer.status_code == 404, (path, answer.status_code)
            assert "location" not in answer.headers
        # 405 names every method of the path (GET and DELETE for a request).
        allowed = http.post(f"/v1/requests/{'a' * 32}")
        assert allowed.status_code == 405
        assert allowed.headers["allow"] == "DELETE, GET"


# -- truthful answers ---------------------------------------------------------------------
def test_an_idempotency_key_whose_result_expired_runs_again(redis_server, queue,
                                                           inprocess_consumer, start_gateway):
    """Resubmitting after the result expired runs the request again: 202 with a Location
    that leads to the new result, not to a 404."""
    configure(redis_server.url, queue, result_ttl_s=1)
    inprocess_consumer("consumer.models:noop", redis_url=redis_server.url, queue=queue)
    gateway = start_gateway(redis_server.url, queue)
    client = redis_server.client()
    body = {"payload": {"order": 17}, "idempotency_key": "order-17"}
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        first = http.post("/v1/requests", json={**body, "wait": True, "timeout_s": 10})
        assert first.status_code == 200
        first_id = first.json()["id"]
        wait_for(lambda: not client.exists(QueueKeys(queue).result(first_id)), 10,
                 "the result expiring")
        again = http.post("/v1/requests", json=body)
        assert again.status_code == 202
        assert again.json()["id"] != first_id
        location = again.headers["Location"]
        wait_for(lambda: http.get(location).status_code == 200, 10, "the new result")
        assert http.get(location).json()["result"] == {"order": 17}


def test_a_waiting_submit_whose_request_redis_lost_answers_failed(redis_server, queue,
                                                                 start_gateway):
    """Redis restarted without persistence while a submit waits for its result: it is
    answered 502 failed (RequestLost) once the gateway's producer notices, not 202 at the
    end of timeout_s with a Location that would answer 404."""
    gateway = start_gateway(redis_server.url, queue)
    keys = QueueKeys(queue)
    answers: list[httpx.Response] = []

    def submit() -> None:
        with httpx.Client(base_url=gateway.url, timeout=120) as http:
            answers.append(http.post("/v1/requests", json={"payload": 1, "wait": True,
                                                           "timeout_s": 120}))
    waiter = threading.Thread(target=submit)
    waiter.start()
    client = redis_server.client()
    wait_for(lambda: client.zcard(keys.pending_normal), 10, "the request queued")
    # Accepted by the gateway too: restarted before its reply reaches the gateway, the
    # enqueue would be re-sent to the new, empty server and queued there.
    wait_for(lambda: metrics.value(metrics.scrape(gateway.port),
                                   "batchgate_gateway_waiting_requests") == 1,
             10, "the gateway waiting for the result")
    redis_server.restart()
    lost_at = time.monotonic()
    waiter.join(2 * LOST_CHECK_AFTER_S + 2 * POLL_S + SLACK_S)
    assert answers, "no answer yet"
    assert time.monotonic() - lost_at < 2 * LOST_CHECK_AFTER_S + 2 * POLL_S + SLACK_S
    answer = answers[0]
    assert answer.status_code == 502, f"{answer.text}\ngateway log:\n{gateway.output()}"
    assert answer.json()["status"] == "failed"
    assert answer.json()["error"]["type"] == "RequestLost"
    with httpx.Client(base_url=gateway.url) as http:
        assert http.get(f"/v1/requests/{answer.json()['id']}").status_code == 404
