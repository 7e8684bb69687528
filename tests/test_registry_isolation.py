"""How readers find queues, against another credential (issue 33 §8; scheduler_core/
registry.py, docs/guarantees.md#security): a tenant confined by the documented ACL can
neither hide nor remove another tenant's queue, and the dashboard and the exporter do
bounded work however many queues exist."""

from __future__ import annotations

import time

import pytest
import redis
from helpers.metrics import scrape, value
from helpers.processes import BATCHGATE, LoggedProcess, free_port
from helpers.support import wait_for
from redis.exceptions import NoPermissionError
from test_security import acl_rule

from producer import Producer
from scheduler_core.keys import QueueKeys
from scheduler_core.registry import DEFAULT_MAX_QUEUES, known_queues

LEGACY_REGISTRY = "batchgate:queues"  # the shared zset readers once trusted
# docs/guarantees.md#security: what the exporter and a read-only dashboard need.
READER_RULE = ["on", ">r3ader-pw", "resetkeys", "~{bg:*", "resetchannels", "-@all", "+@read",
               "+ping", "+time", "+multi", "+exec", "+set", "+del"]


def reader_url(server) -> str:
    server.client().execute_command("ACL", "SETUSER", "reader", "reset", *READER_RULE)
    return f"redis://reader:r3ader-pw@127.0.0.1:{server.port}/0"


def exporter(redis_url: str) -> tuple[LoggedProcess, int]:
    port = free_port()
    proc = LoggedProcess([BATCHGATE, "exporter", "--redis-url", redis_url, "--host",
                          "127.0.0.1", "--port", str(port)], "bg-exporter-")
    wait_for(lambda: "exporter ready on" in proc.output(), 30, "the exporter to start")
    return proc, port


def test_a_confined_tenant_cannot_hide_or_remove_another_queue(redis_server):
    pytest.importorskip("prometheus_client")
    pytest.importorskip("fastapi")
    import orjson

    from batchgate.dashboard.app import Feed

    admin = redis_server.client()
    with Producer(redis_server.url, "prod") as p:
        p.submit({"i": 1})  # one request waiting in prod
    # The documented one-queue rule, plus the old recipe's grant of the shared zset: what
    # the tenant writes there must not matter.
    admin.execute_command("ACL", "SETUSER", "tenantA", "reset",
                          *acl_rule("~{bg:tenantA}:*"), f"~{LEGACY_REGISTRY}")
    tenant_url = f"redis://tenantA:s3cret-pw@127.0.0.1:{redis_server.port}/0"
    tenant = redis.Redis.from_url(tenant_url)
    with Producer(tenant_url, "tenantA") as p:
        p.submit({"i": 1})
    far = int(time.time() * 1000) + 10 * 365 * 86400_000
    tenant.zadd(LEGACY_REGISTRY, {f"aaa-{i:03}": far for i in range(100)})
    tenant.zrem(LEGACY_REGISTRY, "prod")
    for forged in (("SET", QueueKeys("aaa-000").seen, far), ("DEL", QueueKeys("prod").seen)):
        with pytest.raises(NoPermissionError):
            tenant.execute_command(*forged)
    # Keys under its own tag that end like a mark name no queue.
    tenant.set(QueueKeys("tenantA").idempotency("x}:seen"), far)
    assert known_queues(admin) == ["prod", "tenantA"]
    url = reader_url(redis_server)
    proc, port = exporter(url)
    try:
        samples = scrape(port)
        assert value(samples, "batchgate_exporter_redis_up") == 1
        assert value(samples, "batchgate_exporter_queues") == 2
        assert value(samples, "batchgate_queue_depth", queue="prod", priority="normal") == 1
        # Its own keys of the wrong type leave its queue out, not everyone's.
        own = QueueKeys("tenantA")
        tenant.delete(own.consumers, own.pending(1))
        tenant.set(own.consumers, "x")
        tenant.set(own.pending(1), "x")
        samples = scrape(port)
    finally:
        proc.close()
    assert value(samples, "batchgate_exporter_redis_up") == 1
    assert value(samples, "batchgate_exporter_queues") == 1
    assert value(samples, "batchgate_queue_depth", queue="prod", priority="normal") == 1
    page = orjson.loads(Feed(redis.Redis.from_url(url), 0.5, None)._read())
    assert [q["queue"] for q in page["queues"]] == ["prod"]
    assert page["unreadable"] == ["tenantA"]


def test_dashboard_and_exporter_stay_bounded_with_2100_junk_queues(redis_server):
    """2,100 idle queues marked by a credential that may (a `~{bg:*` one): a dashboard
    refresh and a scrape read at most --max-queues queues (default 100), prod first: it
    has work."""
    pytest.importorskip("fastapi")
    import orjson

    from batchgate.dashboard.app import Feed

    admin = redis_server.client()
    with Producer(redis_server.url, "prod") as p:
        p.submit({"i": 1})
    now = int(time.time() * 1000)
    pipe = admin.pipeline(transaction=False)
    for i in range(2100):
        pipe.set(QueueKeys(f"aaa-{i:04}").seen, now + 86400_000)  # "seen" tomorrow
    pipe.execute()

    started = time.perf_counter()
    body = Feed(redis.Redis.from_url(reader_url(redis_server)), 0.5, None)._read()
    took = time.perf_counter() - started
    page = orjson.loads(body)
    shown = [q["queue"] for q in page["queues"]]
    assert len(shown) == DEFAULT_MAX_QUEUES and "prod" in shown
    assert page["queues_left_out"] == 2101 - DEFAULT_MAX_QUEUES
    print(f"dashboard refresh: {took:.3f} s, {len(body)} bytes, {len(shown)} queues")

    proc, port = exporter(reader_url(redis_server))
    try:
        samples = scrape(port)
    finally:
        proc.close()
    assert value(samples, "batchgate_exporter_redis_up") == 1
    assert value(samples, "batchgate_exporter_queues") == DEFAULT_MAX_QUEUES
    assert value(samples, "batchgate_exporter_queues_skipped") == 2101 - DEFAULT_MAX_QUEUES
    assert value(samples, "batchgate_queue_depth", queue="prod", priority="normal") == 1


def test_queues_are_found_on_every_node_of_a_cluster(redis_cluster, queue):
    """A mark lives in its queue's slot: SCAN must visit every primary."""
    from scheduler_core.connection import connect
    from scheduler_core.registry import QueueFinder, register_queue, shown_queues

    client = connect(redis_cluster.url)
    names = [f"{queue}-{i}" for i in range(12)]  # 12 tags: spread over the 3 primaries
    for name in names:
        register_queue(client, name)
    found = known_queues(client)
    assert set(names) <= set(found)
    shown, left_out = shown_queues(client, None, 4, QueueFinder(client))
    assert len(shown) == 4 and left_out == len(found) - 4
