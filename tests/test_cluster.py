"""batchgate on Redis Cluster and on Sentinel (docs/deploy.md "Cluster and Sentinel"):
the core behaviour tests run again, unchanged, on a real 6-node cluster and a real
sentinel set (started once for the session, tests/conftest.py), with consumers started
as `batchgate consumer --redis-url redis+cluster://...` (in the test process where the
core test runs its consumer there: the same connect()); then every other entry point
(CLI, gateway, bulk jobs), the URL forms, the version check and `wait_replicas`."""

from __future__ import annotations

import asyncio
import json
import uuid

import httpx
import pytest
from helpers.cli import Ran, batchgate
from helpers.servers import gateway_factory
from helpers.support import configure, queue_pattern, snapshot
from test_api import BAD_SUBMITS
from test_api import test_async_cancel_and_deadline as async_cancel_and_deadline
from test_api import test_async_producer_round_trip as async_round_trip
from test_api import test_connect_does_the_first_submits_setup_ahead as connect_ahead
from test_api import test_deadline_passed_while_waiting_is_not_run as deadline_while_waiting
from test_distributed import (
    test_many_consumers_answer_every_request_exactly_once as exactly_once,
)
from test_recovery import test_recovery_takes_about_the_lease_plus_a_sweep as recovery
from test_strategies import test_dynamic_full_batch_is_released_at_once as dynamic_full
from test_strategies import test_priority_order_high_then_normal_then_low as priority_order
from test_streaming import test_async_stream as async_stream
from test_streaming import test_parts_arrive_in_order_before_the_result as stream_in_order

from producer import AsyncProducer, InvalidRequest, Producer, RequestLost
from producer import base as producer_base
from scheduler_core.compat import describe_server, require_redis_version
from scheduler_core.connection import connect, parse_topology
from scheduler_core.errors import NotReplicated
from scheduler_core.keys import QueueKeys
from scheduler_core.scripts import acks_key

# -- the core behaviour, again ---------------------------------------------------------


def test_strategy_dynamic(topology, queue, inprocess_consumer, tmp_path) -> None:
    dynamic_full(topology, queue, inprocess_consumer, tmp_path)


def test_strategy_priority(topology, queue, inprocess_consumer, tmp_path) -> None:
    priority_order(topology, queue, inprocess_consumer, tmp_path)


def test_exactly_once_with_several_consumers(topology, queue, start_consumer,
                                             tmp_path) -> None:
    exactly_once(topology, queue, start_consumer, tmp_path)


def test_crash_recovery_after_sigkill(topology, queue, start_consumer, tmp_path) -> None:
    recovery(topology, queue, start_consumer, tmp_path)


def test_async_producer(topology, queue, inprocess_consumer) -> None:
    async_round_trip(topology, queue, inprocess_consumer)


def test_connect(topology, queue, inprocess_consumer) -> None:
    connect_ahead(topology, queue, inprocess_consumer)


def test_streaming(topology, queue, inprocess_consumer) -> None:
    stream_in_order(topology, f"{queue}-a", inprocess_consumer)
    async_stream(topology, f"{queue}-b", inprocess_consumer)


def test_async_cancel_and_deadline(topology, queue) -> None:
    async_cancel_and_deadline(topology, queue)


def test_deadline_while_waiting(topology, queue, inprocess_consumer, tmp_path) -> None:
    deadline_while_waiting(topology, queue, inprocess_consumer, tmp_path)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "asyncio"])
def test_a_request_redis_lost_fails_with_request_lost(topology, queue,
                                                      asynchronous) -> None:
    """The producers' poll (a MULTI of the queue's keys with MGET of results) works on
    the topology: a waiting request whose data vanished is reported lost."""
    configure(topology.url, queue, strategy="priority")  # no consumer runs
    client = topology.client()

    def forget(handle_id: str) -> None:
        keys = QueueKeys(queue)
        client.zrem(keys.pending(1), handle_id)
        client.hdel(keys.jobs, handle_id)

    if not asynchronous:
        with Producer(topology.url, queue) as p:
            handle = p.submit({"gone": 1})
            forget(handle.id)
            with pytest.raises(RequestLost):
                handle.result(timeout=15)
        return

    async def main() -> None:
        async with AsyncProducer(topology.url, queue) as p:
            handle = await p.submit({"gone": 1})
            forget(handle.id)
            with pytest.raises(RequestLost):
                await handle.result(timeout=15)
    asyncio.run(main())


def test_bad_input_names_the_field_and_writes_nothing(topology, queue) -> None:
    configure(topology.url, queue, strategy="priority")
    client = topology.client()
    with Producer(topology.url, queue) as p:
        p.submit({"already": "queued"})
        before = snapshot(client, queue_pattern(queue))
        assert p.keys.jobs.encode() in before
        for field, kwargs in BAD_SUBMITS:
            with pytest.raises(InvalidRequest) as info:
                p.submit(**kwargs)
            assert info.value.field.startswith(field)
        assert snapshot(client, queue_pattern(queue)) == before


# -- every entry point takes the URL --------------------------------------------------


def bg(*args: str, check: bool = True) -> Ran:
    result = batchgate(*args)
    assert not check or result.returncode == 0, result.stderr
    return result


def test_cli_commands(topology, queue, inprocess_consumer) -> None:
    inprocess_consumer("consumer.models:noop", redis_url=topology.url, queue=queue)
    assert bg("submit", "--redis-url", topology.url, "--queue", queue, '{"x": 1}',
              "--wait").stdout.strip() == '{"x":1}'
    acks = acks_key(QueueKeys(queue).policy)
    assert topology.client().get(acks) is None
    # Accepted only after a WAIT (each WAIT, or resend of one, follows an INCR of the
    # queue's acks counter).
    assert bg("submit", "--redis-url", topology.url, "--queue", queue, '{"r": 1}',
              "--wait-replicas", "1", "--wait").stdout.strip() == '{"r":1}'
    assert int(topology.client().get(acks)) >= 1
    request_id = bg("submit", "--redis-url", topology.url, "--queue", queue, '{"y": 2}'
                    ).stdout.strip()
    assert '"y"' in bg("result", request_id, "--redis-url", topology.url, "--queue", queue,
                       "--wait").stdout
    stats = bg("stats", "--redis-url", topology.url, "--queue", queue, "--json").stdout
    assert '"processed": 3' in stats
    bg("policy", "set", "--redis-url", topology.url, "--queue", queue, "--max-attempts", "5")
    assert '"max_attempts": 5' in bg("policy", "show", "--redis-url", topology.url,
                                     "--queue", queue).stdout
    assert "0 dead-lettered" in bg("dead-letter", "list", "--redis-url", topology.url,
                                   "--queue", queue).stdout
    # The live views read a queue through its slot's primary too (they need Redis' TIME).
    assert queue in bg("top", "--redis-url", topology.url, "--queue", queue, "--once").stdout
    bg("policy", "set", "--redis-url", topology.url, "--queue", queue,
       "--max-queue-delay-ms", "auto", "--slo-p99-ms", "60")
    auto = json.loads(bg("stats", "--redis-url", topology.url, "--queue", queue,
                         "--json").stdout)
    assert auto["policy"]["delay_mode"] == "auto" and auto["arrival_rate_rps"] >= 0


def test_gateway(topology, queue, inprocess_consumer) -> None:
    inprocess_consumer("consumer.models:noop", redis_url=topology.url, queue=queue)
    factory = gateway_factory()
    start = next(factory)
    try:
        gateway = start(topology.url, queue, "--wait-replicas", "1", "--workers", "2")
        reply = httpx.post(gateway.url + "/v1/requests", json={"payload": {"g": 1}, "wait": True},
                           timeout=30)
        assert reply.status_code == 200 and reply.json()["result"] == {"g": 1}
        # Accepted after a WAIT: each WAIT follows an INCR of the queue's acks counter.
        assert int(topology.client().get(acks_key(QueueKeys(queue).policy))) >= 1
        state = httpx.get(f"{gateway.url}/v1/requests/{reply.json()['id']}", timeout=10)
        assert state.json()["status"] == "done"
        assert httpx.get(gateway.url + "/v1/stats", timeout=10).json()["processed"] >= 1
    finally:
        next(factory, None)


def test_bulk_run(topology, queue, inprocess_consumer, tmp_path) -> None:
    """A bulk job's keys (batchgate:bulk:<job>, its lease) lie outside the queue's slot."""
    inprocess_consumer("consumer.models:noop", redis_url=topology.url, queue=queue)
    source = tmp_path / "in.jsonl"
    source.write_text("".join(f'{{"i": {i}}}\n' for i in range(50)))
    job = uuid.uuid4().hex
    shown = bg("bulk", "run", str(source), "-o", str(tmp_path / "out.jsonl"), "--redis-url",
               topology.url, "--queue", queue, "--job-id", job, "--quiet")
    assert shown.returncode == 0
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 50
    assert "50/50" in bg("bulk", "status", job, "--redis-url", topology.url).stdout


# -- URLs, version, wait_replicas ---------------------------------------------------------


@pytest.mark.parametrize(("url", "kind", "nodes", "service", "db", "tls"), [
    ("redis+cluster://a:7000,b:7001/", "cluster", (("a", 7000), ("b", 7001)), "", 0, False),
    ("rediss+cluster://u:p@a:7000/", "cluster", (("a", 7000),), "", 0, True),
    ("redis+sentinel://s1:26379,s2:26379/mymaster", "sentinel",
     (("s1", 26379), ("s2", 26379)), "mymaster", 0, False),
    ("rediss+sentinel://s1:26379/mymaster/2", "sentinel", (("s1", 26379),), "mymaster", 2,
     True),
])
def test_url_forms(url, kind, nodes, service, db, tls) -> None:
    topo = parse_topology(url)
    assert (topo.kind, topo.nodes, topo.service, topo.db, topo.tls) == \
        (kind, nodes, service, db, tls)
    assert "p@" not in topo.display() and topo.display().startswith(url.split("://")[0])
    assert parse_topology("redis://localhost:6379/0") is None


@pytest.mark.parametrize(("url", "says"), [
    ("redis+cluster://a:7000/3", "only database 0"),
    ("redis+cluster://a/", "not host:port"),
    ("redis+sentinel://s1:26379/", "names its service"),
    ("redis+sentinel://s1:26379/m/x", "names its service"),
    ("redis+sentinel://s1:99999/m", "not host:port"),
])
def test_malformed_urls_name_the_field(url, says) -> None:
    with pytest.raises(InvalidRequest, match=says) as info:
        connect(url)
    assert info.value.field == "redis_url"


def test_version_check_and_description(topology) -> None:
    client = topology.client()
    require_redis_version(client)  # every node of the cluster answered INFO
    assert describe_server(client) == topology.url


def test_wait_replicas_acknowledges_after_the_replicas(topology, queue,
                                                       start_consumer) -> None:
    start_consumer(topology.url, queue, "--model", "consumer.models:noop",
                   "--wait-replicas", "1")
    with Producer(topology.url, queue, wait_replicas=1) as p:
        assert [h.result(timeout=20) for h in p.submit_many([{"i": i} for i in range(20)])] \
            == [{"i": i} for i in range(20)]

    async def main() -> None:
        async with AsyncProducer(topology.url, queue, wait_replicas=1) as p:
            assert await (await p.submit({"a": 1})).result(timeout=20) == {"a": 1}
    asyncio.run(main())


def test_wait_replicas_after_redis_forgot_the_scripts(topology, queue,
                                                     start_consumer) -> None:
    """NOSCRIPT (a promoted replica, a flushed cache): the script is loaded, the call run
    again, and its own WAIT confirms it."""
    start_consumer(topology.url, queue, "--model", "consumer.models:noop")
    topology.client().script_flush()
    with Producer(topology.url, queue, wait_replicas=1) as p:
        assert p.submit({"after": "flush"}).result(timeout=20) == {"after": "flush"}


def test_wait_replicas_beyond_the_replicas_is_not_acknowledged(topology, queue,
                                                              monkeypatch) -> None:
    """More replicas than exist: WAIT never confirms, and the submit fails with
    NotReplicated once the resend budget is spent (rather than claim it is safe)."""
    monkeypatch.setattr(producer_base, "WAIT_BUDGET_S", 0.5)
    import producer.sync
    monkeypatch.setattr(producer.sync, "WAIT_BUDGET_S", 0.5)
    with Producer(topology.url, queue, wait_replicas=5, wait_timeout_ms=50) as p, \
            pytest.raises(NotReplicated, match="0 of 5|1 of 5|2 of 5"):
        p.submit({"x": 1})
    with pytest.raises(InvalidRequest, match="wait_replicas"):
        Producer(topology.url, queue, wait_replicas=-1)
