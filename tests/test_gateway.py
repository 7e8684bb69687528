"""`batchgate gateway` as a real process, driven over real HTTP, with real consumers."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator

import pytest

# The gateway and metrics extras: skipped, like the other extras' tests, where absent.
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
text_string_to_metric_families = pytest.importorskip(
    "prometheus_client.parser").text_string_to_metric_families

from helpers.processes import BATCHGATE, RedisServer  # noqa: E402
from helpers.servers import ServerProcess, gateway_factory  # noqa: E402

from producer import DeadlineExceeded, Producer  # noqa: E402
from scheduler_core.admin import store_policy  # noqa: E402
from scheduler_core.keys import QueueKeys  # noqa: E402
from scheduler_core.policy import Policy  # noqa: E402
from scheduler_core.wire import decode_result  # noqa: E402

# The gateway is a real process; the consumers behind it run in this process
# (inprocess_consumer): the routes are what these tests check.
SLOW_MODEL = {"base_ms": 1000}


@pytest.fixture
def start_gateway() -> Iterator[Callable[..., ServerProcess]]:
    yield from gateway_factory()


def client(gateway: ServerProcess, token: str | None = None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=gateway.url, timeout=20, headers=headers)


def poll_state(http: httpx.Client, request_id: str, until: set[str],
               timeout: float = 10.0) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        response = http.get(f"/v1/requests/{request_id}")
        if response.json().get("status") in until:
            return response
        assert time.monotonic() < deadline, response.json()
        time.sleep(0.02)


def test_submit_fetch_stats_health(shared_redis, queue, inprocess_consumer, start_gateway):
    inprocess_consumer("consumer.models:synthetic", redis_url=shared_redis.url, queue=queue)
    gateway = start_gateway(shared_redis.url, queue)
    with client(gateway) as http:
        assert http.get("/healthz").json() == {"status": "ok", "redis": "ok"}

        done = http.post("/v1/requests", json={"payload": {"x": [1, 2.5, None, "é"]},
                                               "priority": "high", "wait": True})
        assert done.status_code == 200, done.text
        assert done.json()["status"] == "done"
        assert done.json()["result"] == {"x": [1, 2.5, None, "é"]}

        queued = http.post("/v1/requests", json={"payload": "later", "priority": 2,
                                                 "deadline_ms": 60_000})
        assert queued.status_code == 202
        request_id = queued.json()["id"]
        assert queued.headers["Location"] == f"/v1/requests/{request_id}"
        fetched = poll_state(http, request_id, {"done"})
        assert fetched.status_code == 200
        assert fetched.json() == {"id": request_id, "status": "done", "result": "later"}

        first = http.post("/v1/requests", json={"payload": 1, "idempotency_key": "order-7"})
        again = http.post("/v1/requests", json={"payload": 1, "idempotency_key": "order-7",
                                                "wait": True, "timeout_s": 5})
        assert again.json()["id"] == first.json()["id"]
        assert again.status_code == 200

        failed = http.post("/v1/requests", json={"payload": {"fail": True}, "wait": True})
        assert failed.status_code == 502
        assert failed.json()["status"] == "failed"
        assert failed.json()["error"]["type"] == "ValueError"

        stats = http.get("/v1/stats").json()
        assert stats["queue"] == queue
        assert stats["processed"] >= 3 and stats["failed"] == 1
        assert stats["consumers_alive"] == 1
        assert set(stats["depth"]) == {"high", "normal", "low"}

        spec = http.get("/openapi.json").json()
        assert {"/v1/requests", "/v1/requests/{request_id}", "/v1/stats",
                "/healthz"} <= set(spec["paths"])
        assert "securitySchemes" not in spec.get("components", {})


def test_bad_input_is_422_with_the_field_unknown_id_404(shared_redis, queue, start_gateway):
    gateway = start_gateway(shared_redis.url, queue)
    cases = [
        ({"payload": 1, "priority": "urgent"}, "priority"),
        ({"payload": 1, "priority": 3}, "priority"),
        ({"payload": 1, "deadline_ms": 0}, "deadline_ms"),
        ({"payload": 1, "timeout_s": -1}, "timeout_s"),
        ({"payload": 1, "idempotency_key": "has space"}, "idempotency_key"),
        ({"payload": 1, "wait": "yes"}, "wait"),
        ({"payload": 1, "deadline": 5}, "deadline"),  # unknown field: a typo, not ignored
        ({"priority": "high"}, "payload"),
        ({"payload": {"n": [1, 2**70]}}, "payload.n[1]"),  # checked by the producer library
        ({"payload": {"items": [1, 2, 3, 2**70]}}, "payload.items[3]"),  # as docs/gateway.md
        ({"payload": [1, 2, 3, 2**70]}, "payload[3]"),
        ({"payload": {"deep": nest(70)}}, None),
    ]
    with client(gateway) as http:
        for body, field in cases:
            response = http.post("/v1/requests", json=body)
            assert response.status_code == 422, (body, response.text)
            problem = response.json()
            assert problem["error"] == "invalid_request"
            assert set(problem) == {"error", "message", "field"}  # the one documented shape
            assert problem["message"].startswith(f"{problem['field']}: ")
            if field is not None:
                assert problem["field"] == field, (body, problem)
            else:
                assert problem["field"].startswith("payload.deep")
        broken = http.post("/v1/requests", content=b'{"payload": ',
                           headers={"Content-Type": "application/json"})
        assert broken.status_code == 422 and broken.json()["field"] == "body"
        form = http.post("/v1/requests", content=b"payload=1",
                         headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert form.status_code == 422 and "Content-Type: application/json" in form.text
        for priority in (5, "urgent", "HIGH"):  # the message says what is accepted
            wrong = http.post("/v1/requests", json={"payload": 1, "priority": priority})
            assert wrong.status_code == 422
            assert wrong.json()["message"] == (f"priority: {priority!r} is not a priority; "
                                               'use "high", "normal", "low" or 0, 1, 2')
        assert http.get("/v1/stats").json()["depth"] == {"high": 0, "normal": 0, "low": 0}
        # A well-formed id nobody submitted, and ids that are not ids: all 404, as
        # documented (a 422 would suggest the request exists).
        for request_id in ("0" * 32, "not-an-id", "A" * 32, "x" * 200):
            for method in ("GET", "DELETE"):
                unknown = http.request(method, f"/v1/requests/{request_id}")
                assert unknown.status_code == 404, (method, request_id, unknown.text)
                assert unknown.json()["error"] == "not_found"
                assert set(unknown.json()) == {"error", "message"}


def nest(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def test_deadline_wait_timeout_and_cancel_without_consumers(shared_redis, queue,
                                                            start_gateway):
    gateway = start_gateway(shared_redis.url, queue)
    with client(gateway) as http:
        start = time.monotonic()
        expired = http.post("/v1/requests", json={"payload": 1, "deadline_ms": 200,
                                                  "wait": True, "timeout_s": 10})
        assert expired.status_code == 504
        assert expired.json()["status"] == "expired"
        assert expired.json()["error"]["type"] == "DeadlineExceeded"
        assert time.monotonic() - start < 3
        assert http.get(f"/v1/requests/{expired.json()['id']}").status_code == 504

        pending = http.post("/v1/requests", json={"payload": 2, "wait": True,
                                                  "timeout_s": 0.2})
        assert pending.status_code == 202
        assert pending.json()["status"] == "queued"
        request_id = pending.json()["id"]

        cancelled = http.delete(f"/v1/requests/{request_id}")
        assert cancelled.status_code == 200
        assert cancelled.json()["status"] == "cancelled"
        assert http.delete(f"/v1/requests/{request_id}").status_code == 200  # idempotent
        gone = http.get(f"/v1/requests/{request_id}")
        assert gone.status_code == 410
        assert gone.json()["error"]["type"] == "Cancelled"

        # a request another producer submitted: its cancellation goes to that one's inbox
        with Producer(shared_redis.url, queue) as producer:
            other = producer.submit("from python")
        assert http.delete(f"/v1/requests/{other.id}").json()["status"] == "cancelled"
        inbox = shared_redis.client().lrange(QueueKeys(queue).inbox(producer.id), 0, -1)
        assert [decode_result(raw).error_type for raw in inbox] == ["Cancelled"]

        stats = http.get("/v1/stats").json()
        assert stats["cancelled"] == 2 and stats["expired"] == 1


def test_a_get_after_the_deadline_answers_expired_though_no_consumer_popped_it(
        shared_redis, queue, start_gateway):
    """The status follows the state: a queued request past its deadline_ms is expired (504)
    when asked about, not reported queued until some consumer pops it. Its producer is
    told too."""
    gateway = start_gateway(shared_redis.url, queue)
    with client(gateway) as http, Producer(shared_redis.url, queue) as producer:
        # A Producer's request is looked up by id once it has ended only if it asked
        # for its result to be stored; the gateway's own requests always do.
        handle = producer.submit({"x": 1}, deadline_ms=300, store_result=True)
        queued = http.post("/v1/requests", json={"payload": 2, "deadline_ms": 300})
        assert queued.status_code == 202
        assert http.get(f"/v1/requests/{handle.id}").json()["status"] == "queued"
        time.sleep(0.5)  # past both deadlines (300 ms), no consumer
        for request_id in (handle.id, queued.json()["id"]):
            late = http.get(f"/v1/requests/{request_id}")
            assert late.status_code == 504, late.json()
            assert late.json()["error"]["type"] == "DeadlineExceeded"
        with pytest.raises(DeadlineExceeded):
            handle.result(timeout=5)
        assert http.get("/v1/stats").json()["expired"] == 2


def test_cancel_too_late_is_409(shared_redis, queue, inprocess_consumer, start_gateway):
    inprocess_consumer("consumer.models:synthetic", redis_url=shared_redis.url, queue=queue,
                       model_args=SLOW_MODEL)
    gateway = start_gateway(shared_redis.url, queue)
    with client(gateway) as http:
        request_id = http.post("/v1/requests", json={"payload": "slow",
                                                      "priority": "high"}).json()["id"]
        poll_state(http, request_id, {"running"})
        late = http.delete(f"/v1/requests/{request_id}")
        assert late.status_code == 409
        assert late.json()["status"] == "running"
        assert poll_state(http, request_id, {"done"}).json()["result"] == "slow"
        assert http.delete(f"/v1/requests/{request_id}").status_code == 409


def test_queue_full_is_429_with_retry_after(shared_redis, queue, start_gateway):
    store_policy(shared_redis.client(), queue, Policy(max_queue_size=2), replace=True)
    gateway = start_gateway(shared_redis.url, queue)
    with client(gateway) as http:
        for i in range(2):
            assert http.post("/v1/requests", json={"payload": i}).status_code == 202
        full = http.post("/v1/requests", json={"payload": 3})
        assert full.status_code == 429
        # No consumer has completed anything: no measured rate (QueueFull.retry_after_s
        # is None), so the gateway's default of 1 s.
        assert full.headers["Retry-After"] == "1" and full.json()["retry_after_s"] == 1.0
        assert full.json()["error"] == "queue_full"
        assert (full.json()["depth"], full.json()["limit"]) == (2, 2)


def test_bearer_token(shared_redis, queue, start_gateway):
    token = "s3cret-token"
    gateway = start_gateway(shared_redis.url, queue, env={"BATCHGATE_GATEWAY_TOKEN": token})
    with client(gateway) as anonymous, client(gateway, "wrong") as wrong, \
            client(gateway, token) as good:
        for http in (anonymous, wrong):
            for method, path in (("POST", "/v1/requests"), ("GET", "/v1/stats"),
                                 ("GET", f"/v1/requests/{'a' * 32}"),
                                 ("DELETE", f"/v1/requests/{'a' * 32}")):
                response = http.request(method, path, json={"payload": 1})
                assert response.status_code == 401, (method, path)
                assert response.headers["WWW-Authenticate"] == "Bearer"
        basic = anonymous.get("/v1/stats", headers={"Authorization": f"Basic {token}"})
        assert basic.status_code == 401
        assert good.post("/v1/requests", json={"payload": 1}).status_code == 202
        assert good.get("/v1/stats").status_code == 200
        # health and metrics stay open for load balancers and Prometheus
        assert anonymous.get("/healthz").status_code == 200
        assert anonymous.get("/metrics").status_code == 200
        spec = anonymous.get("/openapi.json").json()
        assert spec["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"


def test_health_follows_redis(redis_server, queue, start_gateway):
    gateway = start_gateway(redis_server.url, queue)
    with client(gateway) as http:
        assert http.get("/healthz").status_code == 200
        redis_server.kill()
        down = http.get("/healthz")
        assert down.status_code == 503
        assert down.json()["status"] == "unavailable"
        submit = http.post("/v1/requests", json={"payload": 1})
        assert submit.status_code == 503
        assert submit.json()["error"] == "redis_unavailable"
        redis_server.start()
        deadline = time.monotonic() + 10
        while http.get("/healthz").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert http.post("/v1/requests", json={"payload": 1}).status_code == 202


def test_redis_at_maxmemory_is_503(queue, start_gateway):
    server = RedisServer("--maxmemory", "3mb")  # noeviction, as deployed
    try:
        gateway = start_gateway(server.url, queue)
        with client(gateway) as http:
            big = "x" * 200_000
            for _ in range(50):
                response = http.post("/v1/requests", json={"payload": big})
                if response.status_code != 202:
                    break
            assert response.status_code == 503
            assert response.json()["error"] == "redis_full"
            assert http.get("/healthz").status_code == 200  # reachable, just full
    finally:
        server.close()


def metric_samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_scrape(shared_redis, queue, inprocess_consumer, start_gateway):
    inprocess_consumer("consumer.models:noop", redis_url=shared_redis.url, queue=queue)
    gateway = start_gateway(shared_redis.url, queue)
    with client(gateway) as http:
        for _ in range(3):
            assert http.post("/v1/requests", json={"payload": 1, "wait": True}).status_code \
                == 200
        assert http.post("/v1/requests", json={"payload": 1}).status_code == 202
        assert http.post("/v1/requests", json={"payload": 1, "priority": 9}).status_code \
            == 422
        assert http.get(f"/v1/requests/{'f' * 32}").status_code == 404
        scrape = http.get("/metrics")
    assert scrape.status_code == 200
    assert scrape.headers["content-type"].startswith("text/plain")
    samples = metric_samples(scrape.text)

    def requests(endpoint: str, method: str, status: str) -> float:
        labels = frozenset({"endpoint": endpoint, "method": method, "status": status}.items())
        return samples.get(("batchgate_gateway_requests_total", labels), 0.0)

    assert requests("/v1/requests", "POST", "200") == 3
    assert requests("/v1/requests", "POST", "202") == 1
    assert requests("/v1/requests", "POST", "422") == 1
    assert requests("/v1/requests/{request_id}", "GET", "404") == 1
    assert requests("/healthz", "GET", "200") >= 1

    def submit_count(wait: str, status: str) -> float:
        labels = frozenset({"wait": wait, "status": status}.items())
        return samples.get(("batchgate_gateway_submit_seconds_count", labels), 0.0)

    assert submit_count("true", "200") == 3
    assert submit_count("false", "202") == 1
    total = samples[("batchgate_gateway_submit_seconds_sum",
                     frozenset({"wait": "true", "status": "200"}.items()))]
    assert 0 < total < 10
    assert samples[("batchgate_gateway_waiting_requests", frozenset())] == 0


def test_cli_help_and_bad_queue():
    assert BATCHGATE
    help_text = subprocess.run([BATCHGATE, "gateway", "--help"], capture_output=True,
                               text=True, check=True).stdout
    for option in ("--redis-url", "--queue", "--host", "--port", "--token"):
        assert option in help_text
    assert "gateway" in subprocess.run([BATCHGATE, "--help"], capture_output=True, text=True,
                                       check=True).stdout
    bad = subprocess.run([BATCHGATE, "gateway", "--queue", "has space"], capture_output=True,
                         text=True, timeout=30)
    assert bad.returncode == 2 and "queue" in bad.stderr
