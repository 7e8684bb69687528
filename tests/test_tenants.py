"""Tenants (docs/tenants.md) against a real redis-server: a tenant on every request,
validated with nothing written; per-tenant quotas refused atomically by enqueue.lua
(TenantLimit, a QueueFull, naming the tenant, the quota and when to retry) with nothing
of the request written; per-tenant counters that follow each request to its end."""

from __future__ import annotations

import asyncio
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
import test_clock
from helpers.processes import BATCHGATE
from helpers.support import configure, queue_pattern, snapshot

from producer import DeadlineExceeded, InvalidRequest, Producer, QueueFull, TenantLimit
from scheduler_core.admin import change_policy
from scheduler_core.keys import QueueKeys
from scheduler_core.scripts import (
    NewRequest,
    Scripts,
    configure_keys,
    enqueue_call,
    enqueue_reply,
    pop_keys,
    requeue_keys,
)
from scheduler_core.wire import decode_request, request_tenant, split_job

stepped_redis = test_clock.stepped_redis  # its fixture: a server whose clock steps


def tenants_hash(client: redis.Redis, queue: str) -> dict[str, int]:
    raw = client.hgetall(QueueKeys(queue).tag + ":tenants")
    return {k.decode(): int(v) for k, v in raw.items()}


def request_state(client: redis.Redis, queue: str) -> dict:
    """Every key of the queue but the tenants' counters, the stats and the queue's clock
    (a refused call notes the time it showed)."""
    keys = QueueKeys(queue)
    state = snapshot(client, queue_pattern(queue))
    state.pop((keys.tag + ":tenants").encode(), None)
    state.pop(keys.stats.encode(), None)
    state.pop(keys.clock.encode(), None)
    return state


def test_tenant_travels_in_the_envelope_and_the_default_is_unchanged(shared_redis, queue):
    client = redis.Redis.from_url(shared_redis.url)
    with Producer(shared_redis.url, queue=queue) as p:
        plain = p.submit({"x": 1})
        named = p.submit({"x": 2}, tenant="acme")
        many = p.submit_many([{"x": 3}, {"x": 4}], tenant="team.b:1")
        default = p.submit({"x": 5}, tenant="default")
    jobs = QueueKeys(queue).jobs
    envelopes = {h.id: split_job(client.hget(jobs, h.id))[1]
                 for h in (plain, named, *many, default)}
    assert envelopes[plain.id] == b'{"v":1,"payload":{"x":1}}'  # today's bytes
    assert envelopes[default.id] == b'{"v":1,"payload":{"x":5}}'
    assert request_tenant(envelopes[named.id]) == "acme"
    assert decode_request(envelopes[named.id]) == {"x": 2}
    assert [request_tenant(envelopes[h.id]) for h in many] == ["team.b:1"] * 2
    assert tenants_hash(client, queue) == {"w:acme": 1, "a:acme": 1, "w:team.b:1": 2,
                                           "a:team.b:1": 2}


@pytest.mark.parametrize("bad", ["", "a b", "x" * 65, "é", "a\n", "a{b}", 7, b"acme"])
def test_a_malformed_tenant_is_refused_naming_the_field_with_nothing_written(
        shared_redis, queue, bad):
    client = redis.Redis.from_url(shared_redis.url)
    with Producer(shared_redis.url, queue=queue) as p:
        with pytest.raises(InvalidRequest) as err:
            p.submit({"x": 1}, tenant=bad)
        assert err.value.field == "tenant" and "64" in str(err.value)
        with pytest.raises(InvalidRequest):
            p.submit_many([{"x": 1}], tenant=bad)
    assert snapshot(client, queue_pattern(queue)) == {}


def test_max_waiting_refuses_whole_calls_with_nothing_written(shared_redis, queue):
    configure(shared_redis.url, queue, strategy="fifo",
              tenant_quotas="acme:max_waiting=3;*:max_waiting=1")
    client = shared_redis.client()
    with Producer(shared_redis.url, queue=queue) as p:
        p.submit_many([1, 2], tenant="acme")
        before = request_state(client, queue)
        with pytest.raises(TenantLimit) as err:
            p.submit_many([3, 4], tenant="acme")  # 2 + 2 > 3: neither is written
        assert isinstance(err.value, QueueFull)
        assert (err.value.tenant, err.value.limit_name, err.value.value) == \
            ("acme", "max_waiting", 3)
        assert err.value.retry_after_s is None and "acme" in str(err.value)
        assert request_state(client, queue) == before
        p.submit(3, tenant="acme")  # exactly at the limit
        p.submit(1, tenant="zed")  # '*' applies to a tenant without its own entry
        with pytest.raises(TenantLimit) as err:
            p.submit(2, tenant="zed")
        assert (err.value.tenant, err.value.value) == ("zed", 1)
        p.submit_many(list(range(20)))  # the default tenant: no quota
        # A tenant at its limit retrying in a loop: refused each time, nothing written.
        before = request_state(client, queue)
        for _ in range(50):
            with pytest.raises(TenantLimit):
                p.submit(0, tenant="acme")
        assert request_state(client, queue) == before
    counts = tenants_hash(client, queue)
    assert counts["w:acme"] == 3 and counts["r:acme"] == 2 + 50
    assert counts["w:zed"] == 1 and counts["r:zed"] == 1


def test_a_burst_larger_than_the_bucket_is_refused_without_retry_hint(shared_redis, queue):
    configure(shared_redis.url, queue, strategy="fifo",
              tenant_quotas="acme:rps=10,burst=4,cps=100,cost_burst=50")
    with Producer(shared_redis.url, queue=queue) as p:
        with pytest.raises(TenantLimit) as err:
            p.submit_many(list(range(5)), tenant="acme")
        assert (err.value.limit_name, err.value.value, err.value.retry_after_s) == \
            ("burst", 4, None)
        with pytest.raises(TenantLimit) as err:
            p.submit(0, tenant="acme", cost=51)
        assert (err.value.limit_name, err.value.value) == ("cost_burst", 50)
        p.submit(0, tenant="acme", cost=40)
        with pytest.raises(TenantLimit) as err:
            p.submit(0, tenant="acme", cost=40)  # 10 tokens left, 100/s: ~0.3 s to wait
        assert err.value.limit_name == "cps"
        assert 0.2 <= err.value.retry_after_s <= 0.31


def test_a_rate_limit_is_sustained_at_its_configured_rate(shared_redis, queue):
    """A tenant submitting as fast as it can, obeying retry_after_s: accepted = burst +
    rate x elapsed, within one request and 5% (the tolerance of the queue's clock against
    this process's, read around the run). The burst holds one second of the rate: a client
    that stalls longer than burst / rate between tries (a loaded test host) leaves tokens
    unused, which is the client's loss, not the limit's."""
    rate, burst, run_s = 40, 40, 2.0
    configure(shared_redis.url, queue, strategy="fifo",
              tenant_quotas=f"acme:rps={rate},burst={burst}")
    accepted = refused = 0
    with Producer(shared_redis.url, queue=queue) as p:
        p.connect()
        start = time.monotonic()
        while time.monotonic() - start < run_s:
            try:
                p.submit(0, tenant="acme")
                accepted += 1
            except TenantLimit as exc:
                refused += 1
                assert exc.limit_name == "rps" and 0 < exc.retry_after_s <= 1 / rate + 1e-3
                time.sleep(exc.retry_after_s)
        elapsed = time.monotonic() - start
    expected = burst + rate * elapsed
    print(f"\nrps={rate} burst={burst}: {accepted} accepted in {elapsed:.2f} s "
          f"(expected {expected:.1f}), {refused} refused")
    assert abs(accepted - expected) <= 1 + 0.05 * expected
    assert refused > 0


def test_counters_follow_each_request_to_its_end(shared_redis, queue, inprocess_consumer):
    """waiting/in-flight/served per tenant through cancel, deadline expiry, a lease that
    runs out (re-queued), and completion; the quota counts what really waits."""
    configure(shared_redis.url, queue, strategy="fifo", max_batch_size=1,
              tenant_quotas="acme:max_waiting=4")
    client, keys = shared_redis.client(), QueueKeys(queue)
    scripts = Scripts(client)
    with Producer(shared_redis.url, queue=queue) as p:
        handles = p.submit_many([1, 2, 3], tenant="acme", cost=[5, 6, 7])
        expiring = p.submit(4, tenant="acme", deadline_ms=50)
        assert tenants_hash(client, queue).get("w:acme", 0) == 4
        assert handles[2].cancel() == "cancelled"
        assert tenants_hash(client, queue).get("w:acme", 0) == 3
        time.sleep(0.1)
        with pytest.raises(DeadlineExceeded):
            expiring.result(timeout=10)
        wait_until(lambda: tenants_hash(client, queue).get("w:acme", 0) == 2)
        # Popped under a lease of 100 ms that no one renews: back to waiting.
        reply = scripts.pop_batch(keys=pop_keys(keys), args=["gone", 100])
        assert int(reply[0]) > 0
        assert gauges(client, queue) == (1, 1)
        time.sleep(0.15)
        scripts.requeue_expired(keys=requeue_keys(keys), args=[10])
        assert gauges(client, queue) == (2, 0)
        p.submit_many([8, 9], tenant="acme")  # 2 + 2 = 4: room again
        inprocess_consumer(lambda payloads: payloads, redis_url=shared_redis.url, queue=queue)
        assert sorted(h.result(timeout=30) for h in handles[:2]) == [1, 2]
        wait_until(lambda: tenants_hash(client, queue).get("s:acme") == 4)
    counts = tenants_hash(client, queue)
    assert counts["s:acme"] == 4
    assert "w:acme" not in counts and "f:acme" not in counts  # gauges at 0 are removed
    assert counts["sc:acme"] == 5 + 6 + 1 + 1


def gauges(client: redis.Redis, queue: str, tenant: str = "acme") -> tuple[int, int]:
    """(waiting, in flight) of `tenant`: 0 where its field is absent."""
    counts = tenants_hash(client, queue)
    return counts.get(f"w:{tenant}", 0), counts.get(f"f:{tenant}", 0)


def wait_until(check, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.02)


def test_gateway_takes_a_tenant_from_the_body_or_x_tenant_and_answers_429(shared_redis,
                                                                          queue):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from helpers.servers import gateway_factory
    configure(shared_redis.url, queue, strategy="fifo", tenant_quotas="acme:rps=1,burst=2")
    client = shared_redis.client()
    factory = gateway_factory()
    start = next(factory)
    try:
        gateway = start(shared_redis.url, queue)
        with httpx.Client(base_url=gateway.url, timeout=20) as http:
            first = http.post("/v1/requests", json={"payload": 1, "tenant": "acme"})
            second = http.post("/v1/requests", json={"payload": 2},
                               headers={"X-Tenant": "acme"})
            assert (first.status_code, second.status_code) == (202, 202)
            for answer in (first, second):
                raw = client.hget(QueueKeys(queue).jobs, answer.json()["id"])
                assert request_tenant(split_job(raw)[1]) == "acme"
            before = request_state(client, queue)
            over = http.post("/v1/requests", json={"payload": 3, "tenant": "acme"})
            assert over.status_code == 429, over.text
            body = over.json()
            assert (body["error"], body["tenant"], body["quota"], body["limit"]) == \
                ("tenant_limit", "acme", "rps", 1)
            assert 0 < body["retry_after_s"] <= 1.0
            assert over.headers["Retry-After"] == "1"
            for bad in ({"json": {"payload": 1, "tenant": "a b"}},
                        {"json": {"payload": 1}, "headers": {"X-Tenant": "{x}"}},
                        {"json": {"payload": 1, "tenant": "b"},
                         "headers": {"X-Tenant": "acme"}}):
                answer = http.post("/v1/requests", **bad)
                assert answer.status_code == 422, answer.text
                assert answer.json()["field"] in ("tenant", "X-Tenant")
            assert request_state(client, queue) == before
    finally:
        factory.close()


def test_coalesced_submissions_of_several_tenants_are_refused_one_by_one(shared_redis,
                                                                           queue):
    """Concurrent submits share one enqueue call; a refusal there is sent again per
    submission, so that only the tenant over its quota is refused, and counted once."""
    configure(shared_redis.url, queue, strategy="fifo", tenant_quotas="full:max_waiting=2")
    with Producer(shared_redis.url, queue=queue) as p:
        p.connect()
        def one(i: int) -> str:
            try:
                p.submit(i, tenant="full" if i % 2 else f"ok{i}")
                return "accepted"
            except TenantLimit as exc:
                assert exc.tenant == "full"
                return "refused"
        with ThreadPoolExecutor(16) as pool:
            outcomes = list(pool.map(one, range(64)))
    assert outcomes.count("refused") == 32 - 2
    assert all(outcomes[i] == "accepted" for i in range(0, 64, 2))
    counts = tenants_hash(shared_redis.client(), queue)
    assert (counts["w:full"], counts["r:full"]) == (2, 30)


def drive(p: Producer, tenant: str, seconds: float) -> tuple[int, float]:
    """Submit as fast as the quota lets `tenant`, obeying retry_after_s: (accepted,
    elapsed seconds)."""
    accepted, start = 0, time.monotonic()
    while time.monotonic() - start < seconds:
        try:
            p.submit(0, tenant=tenant)
            accepted += 1
        except TenantLimit as exc:
            time.sleep(exc.retry_after_s or 0.01)
    return accepted, time.monotonic() - start


def test_a_clock_step_neither_locks_a_tenant_out_nor_gives_more_than_a_burst(
        stepped_redis, queue):
    """The buckets run on the queue's clock: after a real backward step of the server's
    clock a drained bucket refills at its rate (not after the step); a forward step
    refills it to its burst at most."""
    server, step = stepped_redis
    rate, burst = 20, 5
    configure(server.url, queue, strategy="fifo",
              tenant_quotas=f"acme:rps={rate},burst={burst}")
    with Producer(server.url, queue=queue) as p:
        drive(p, "acme", 0.5)  # drained
        step(-60_000_000)
        accepted, elapsed = drive(p, "acme", 1.0)
        assert abs(accepted - rate * elapsed) <= 2 + 0.05 * rate * elapsed, accepted
        step(0)  # the clock set right again: a forward step of 60 s
        accepted, elapsed = drive(p, "acme", 1.0)
        assert accepted <= burst + rate * elapsed + 2, accepted


def test_quota_changes_apply_to_the_next_enqueue(shared_redis, queue):
    """A policy change mid-flight: lowering max_waiting keeps what waits and refuses new
    requests; raising it or dropping the quotas lets them in; a new burst caps the
    tokens a bucket kept."""
    configure(shared_redis.url, queue, strategy="fifo", tenant_quotas="acme:max_waiting=3")
    client = shared_redis.client()
    with Producer(shared_redis.url, queue=queue) as p:
        p.submit_many([1, 2, 3], tenant="acme")
        change_policy(client, queue, {"tenant_quotas": "acme:max_waiting=1"})
        with pytest.raises(TenantLimit):
            p.submit(4, tenant="acme")
        assert gauges(client, queue)[0] == 3  # nothing waiting was dropped
        change_policy(client, queue, {"tenant_quotas": ""})
        p.submit_many(list(range(10)), tenant="acme")
        change_policy(client, queue, {"tenant_quotas": "acme:rps=1,burst=100"})
        p.submit_many(list(range(50)), tenant="acme")  # 50 tokens left
        change_policy(client, queue, {"tenant_quotas": "acme:rps=1,burst=2"})
        p.submit_many([1, 2], tenant="acme")  # the new burst caps the old bucket's tokens
        with pytest.raises(TenantLimit) as err:
            p.submit(3, tenant="acme")
        assert err.value.limit_name == "rps"


def test_hand_written_tenant_state_never_fails_a_script(shared_redis, queue,
                                                        inprocess_consumer):
    """Garbage in the tenants' keys or a tenant prefix a producer would never write: the
    scripts refuse the request naming `tenant`, or read the garbage as nothing."""
    configure(shared_redis.url, queue, strategy="fifo", tenant_quotas="acme:rps=5,burst=5")
    client, keys = shared_redis.client(), QueueKeys(queue)
    scripts = Scripts(client)
    client.hset(keys.tenant_rate, mapping={"q:acme": "nan:abc"})
    client.hset(keys.tenants, mapping={"w:acme": "x"})
    with Producer(shared_redis.url, queue=queue) as p:
        p.submit(1, tenant="acme")  # the bucket read as full, the count as 0
        assert gauges(client, queue) == (1, 0)
        client.delete(keys.tenants)
        client.set(keys.tenants, "not a hash")
        handle = p.submit(2, tenant="acme")  # not counted, never half-written
        inprocess_consumer(lambda payloads: payloads, redis_url=shared_redis.url, queue=queue)
        assert handle.result(timeout=30) == 2
        client.delete(keys.tenants)
        for envelope in (b'{"v":1,"tenant":"' + b"x" * 65 + b'","payload":1}',
                         b'{"v":1,"tenant":"a b","payload":1}',
                         b'{"v":1,"tenant":"","payload":1}'):
            request = NewRequest("abc" + str(len(envelope)), 1, 0, envelope)
            script_keys, args = enqueue_call(keys, p.id, [request], 60)
            with pytest.raises(InvalidRequest) as err:
                enqueue_reply(keys, scripts.enqueue(keys=script_keys, args=args))
            assert err.value.field == "tenant"


def test_a_rate_limit_holds_across_producer_processes(shared_redis, queue):
    """3 producer processes of one tenant, each as fast as the quota lets it, over the same
    span T: together they get burst + rate x T, within 3 requests and 5%."""
    from bench.tenants import rate_across
    rate, burst, seconds = 30, 5, 3.0
    counts = rate_across(shared_redis.url, 3, seconds, rate, burst, queue)
    expected = burst + rate * seconds
    print(f"\n3 processes, rps={rate} burst={burst} over {seconds:g} s: {counts} = "
          f"{sum(counts)} accepted (expected {expected:g})")
    assert abs(sum(counts) - expected) <= 3 + 0.05 * expected
    assert all(c > 0 for c in counts)


def test_async_and_sharded_producers_carry_the_tenant(shared_redis, queue):
    from producer import AsyncProducer, ShardedProducer
    configure(shared_redis.url, queue, strategy="fifo", shards=2,
              tenant_quotas="acme:max_waiting=3")
    client = shared_redis.client()

    async def run() -> list[str]:
        async with AsyncProducer(shared_redis.url, queue=queue) as p:
            ids = [(await p.submit(1, tenant="acme")).id]
            ids += [h.id for h in await p.submit_many([2], tenant="acme")]
            with pytest.raises(TenantLimit):
                await p.submit_many([3, 4], tenant="acme")
            return ids
    ids = asyncio.run(run())
    with ShardedProducer(shared_redis.url, queue) as sharded:
        handles = sharded.submit_many([5, 6], tenant="team-b")
        one = sharded.submit(7, tenant="team-b")
    tenants = {}
    for name in (queue, f"{queue}#1"):
        jobs = QueueKeys(name).jobs
        for rid in [*ids, *(h.id for h in handles), one.id]:
            raw = client.hget(jobs, rid)
            if raw is not None:
                tenants[rid] = request_tenant(split_job(raw)[1])
    assert tenants == {ids[0]: "acme", ids[1]: "acme", handles[0].id: "team-b",
                       handles[1].id: "team-b", one.id: "team-b"}


@pytest.mark.parametrize(("bad", "field"), [
    ("acme", "tenant_quotas"), ("a b:rps=1", "tenant_quotas['a b']"),
    ("acme:max_in_flight=3", "tenant_quotas: max_in_flight needs fairness"),
    ("acme:weight=1001", "tenant_quotas['acme'].weight"),
    ("acme:rps=-1", "tenant_quotas['acme'].rps"), ("acme:rps=1.5", "tenant_quotas['acme'].rps"),
    ("acme:rps=1000001", "tenant_quotas['acme'].rps"),
    ("default:rps=1", "tenant_quotas['default']"), ('{"acme": 5}', "tenant_quotas['acme']"),
    ("{not json", "tenant_quotas"), (";".join(f"t{i}:rps=1" for i in range(2000)),
                                     "tenant_quotas")])
def test_policy_set_refuses_bad_quotas_naming_the_field_with_nothing_written(
        shared_redis, queue, bad, field):
    configure(shared_redis.url, queue, strategy="fifo", tenant_quotas="acme:rps=5")
    client = shared_redis.client()
    before = snapshot(client, queue_pattern(queue))
    done = subprocess.run([BATCHGATE, "policy", "set", "--redis-url", shared_redis.url,
                           "--queue", queue, "--tenant-quotas", bad],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and f"Error: {field}" in done.stderr, done.stderr
    assert snapshot(client, queue_pattern(queue)) == before


def test_the_dashboard_shows_the_busiest_tenants_and_other(shared_redis, queue):
    pytest.importorskip("fastapi")
    sync_api = pytest.importorskip("playwright.sync_api")
    import test_dashboard
    with Producer(shared_redis.url, queue=queue) as p:
        for i in range(12):
            p.submit_many(list(range(i + 1)), tenant=f"t{i:02d}")
    with test_dashboard.queue_card(shared_redis.url, queue) as card:
        rows = card.locator(".tenants tbody tr")
        sync_api.expect(rows).to_have_count(11, timeout=10_000)  # 10 + other
        sync_api.expect(rows.first).to_contain_text("t11")
        sync_api.expect(rows.last).to_contain_text("other")
        sync_api.expect(rows.last.locator("td").nth(1)).to_have_text("3")  # 1 + 2


def test_configure_stores_only_quotas_the_policy_reads_back(shared_redis, queue):
    """configure.lua's check of tenant_quotas against Policy's: what the script stores,
    Policy.from_redis reads; every normal form Policy writes, the script stores."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from scheduler_core.admin import read_policy
    from scheduler_core.errors import InvalidPolicy
    from scheduler_core.policy import Policy, format_tenant_quotas
    client = shared_redis.client()
    script = Scripts(client).configure
    keys = configure_keys(QueueKeys(queue))
    pieces = st.sampled_from(["acme", "*", "default", "a:b", "", ":", ";", ",", "=", "rps",
                              "burst", "cps", "max_waiting", "cost_burst", "max_in_flight",
                              "1", "0", "01", "1000001", "9" * 14, " ", "x" * 65, "é"])

    seen: list[str] = []

    @settings(max_examples=400, deadline=None, database=None)
    @given(st.lists(pieces, max_size=12).map("".join))
    def check(text: str) -> None:
        seen.append(text)
        base = Policy().to_redis()
        reply = script(keys=keys, args=["replace", *(x for kv in {**base, "tenant_quotas":
                                                                   text}.items() for x in kv)])
        if int(reply[0]) == 1:
            assert read_policy(client, queue).tenant_quotas == format_tenant_quotas(text)
        try:
            normal = format_tenant_quotas(text)
        except InvalidPolicy:
            return
        reply = script(keys=keys, args=["replace", *(x for kv in {**base, "tenant_quotas":
                                                                   normal}.items() for x in kv)])
        assert int(reply[0]) == 1, (text, normal, reply)
    check()
    assert len(seen) >= 100


def test_counters_through_delayed_deadlines_dead_letters_and_their_retry(
        shared_redis, queue, inprocess_consumer):
    """on_timeout=delay keeps a late request waiting (counted) until it runs; a request
    dead-lettered at its pop leaves in flight without being served; retried, it waits
    again and is served."""
    from dataclasses import replace

    from scheduler_core import deadletter
    from scheduler_core.wire import format_job
    configure(shared_redis.url, queue, strategy="fifo", on_timeout="delay")
    client, keys = shared_redis.client(), QueueKeys(queue)
    with Producer(shared_redis.url, queue=queue) as p:
        late = p.submit(1, tenant="acme", deadline_ms=20, store_result=True)
        doomed = p.submit(2, tenant="acme", store_result=True)
        meta, envelope = split_job(client.hget(keys.jobs, doomed.id))
        client.hset(keys.jobs, doomed.id, format_job(replace(meta, attempts=3), envelope))
        time.sleep(0.05)
        assert gauges(client, queue) == (2, 0)
        inprocess_consumer(lambda payloads: payloads, redis_url=shared_redis.url, queue=queue,
                           policy={"strategy": "fifo", "on_timeout": "delay"})
        wait_until(lambda: client.zcard(keys.dead) == 1 and gauges(client, queue) == (0, 0)
                   and tenants_hash(client, queue).get("s:acme") == 1)
        assert deadletter.retry(client, queue, [doomed.id]) == (1, 0)
        wait_until(lambda: tenants_hash(client, queue).get("s:acme") == 2)
        assert p.fetch(late.id).ok and p.fetch(doomed.id).ok
    assert gauges(client, queue) == (0, 0)


def test_x_tenant_sent_twice_is_refused_not_read_first_wins(shared_redis, queue):
    """A proxy that adds its X-Tenant beside the client's (instead of replacing it) must
    not let the client's copy, sent first, choose the tenant: 422 naming X-Tenant,
    nothing written."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from producer.gateway.app import create_app
    configure(shared_redis.url, queue, strategy="fifo")
    client = shared_redis.client()
    before = request_state(client, queue)
    with TestClient(create_app(shared_redis.url, queue)) as http:
        answer = http.post("/v1/requests", json={"payload": 1},
                           headers=[("X-Tenant", "victim"), ("X-Tenant", "proxy-set")])
        assert answer.status_code == 422, answer.text
        assert answer.json()["field"] == "X-Tenant"
        assert "at most once" in answer.json()["message"]
        assert request_state(client, queue) == before
        once = http.post("/v1/requests", json={"payload": 1}, headers={"X-Tenant": "acme"})
        assert once.status_code == 202, once.text


def test_the_openai_endpoints_take_the_tenant_from_x_tenant(shared_redis, queue):
    """A proxy's X-Tenant binds the OpenAI-compatible endpoints as it does /v1/requests:
    without it a client there would be the default tenant, which no quota binds."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from producer.gateway.app import create_app
    configure(shared_redis.url, queue, strategy="fifo", tenant_quotas="acme:rps=1,burst=1")
    client = shared_redis.client()
    body = {"model": queue, "prompt": "x"}
    timeout = {"X-Request-Timeout-Ms": "200"}  # no consumer: the first one expires
    with TestClient(create_app(shared_redis.url, queue)) as http:
        http.post("/v1/completions", json=body, headers={**timeout, "X-Tenant": "acme"})
        assert client.hget(QueueKeys(queue).tenants, "a:acme") == b"1"
        before = request_state(client, queue)
        over = http.post("/v1/completions", json=body, headers={**timeout, "X-Tenant": "acme"})
        assert over.status_code == 429, over.text
        assert over.headers["Retry-After"] == "1"
        bad = http.post("/v1/completions", json=body,
                        headers=[("X-Tenant", "acme"), ("X-Tenant", "other")])
        assert bad.status_code == 400 and "X-Tenant" in bad.text, bad.text
        assert request_state(client, queue) == before
