"""Requests of different cost (docs/scheduling.md, "Requests of different cost"), end to end:
a real redis-server, real Consumers in the test process (as `batchgate consumer` runs
one; a process where one is SIGKILLed), a model that opts into the costs
(helpers/cost_models.py); the CLI through click's CliRunner. The cost is validated at
the edge with nothing written; max_cost refuses or caps; max_batch_cost bounds every
batch (sum and padded), a request above it runs alone; cost buckets are never mixed in a
batch and each bucket's oldest waits at most the delay (bounds from the configured delay,
with generous slack)."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis
from helpers.cli import batchgate
from helpers.cost_models import CostRecorder, batches
from helpers.failure_support import HERE
from helpers.support import configure, queue_pattern, snapshot

from producer import AsyncProducer, InvalidRequest, Producer
from scheduler_core.admin import read_policy, store_policy
from scheduler_core.errors import InvalidPolicy
from scheduler_core.keys import QueueKeys
from scheduler_core.policy import Policy
from scheduler_core.scripts import Scripts, configure_keys
from scheduler_core.wire import split_job

SLACK_MS = 3000  # the machine is shared and loaded


def start_recorder(start_consumer, url: str, queue: str, out, *args: str):
    """A `batchgate consumer` process running CostRecorder (for a test that kills it)."""
    out.mkdir(exist_ok=True)
    return start_consumer(url, queue, "--model", "cost_models:CostRecorder", "--model-arg",
                          f"out={out}", *args, cwd=str(HERE))


def serve_recorder(inprocess_consumer, url: str, queue: str, out, model=None, **settings):
    """A Consumer in this process running CostRecorder(out, **model)."""
    out.mkdir(exist_ok=True)
    return inprocess_consumer(CostRecorder(str(out), **(model or {})), redis_url=url,
                              queue=queue, **settings)


# -- a cost per request: validated at the edge --------------------------------------------
@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "3", None, 10**9 + 1])
def test_a_bad_cost_names_the_field_and_writes_nothing(shared_redis, queue, bad):
    client = shared_redis.client()
    with Producer(shared_redis.url, queue) as p:
        with pytest.raises(InvalidRequest) as err:
            p.submit({"x": 1}, cost=bad)
        assert err.value.field == "cost"
        assert "1" in str(err.value)  # the limit: [1, 1000000000] or ">= 1"
        with pytest.raises(InvalidRequest) as err:
            p.submit_many([1, 2, 3], cost=[1, bad, 2])
        assert err.value.field == "cost[1]"
        with pytest.raises(InvalidRequest) as err:
            p.submit_many([1, 2, 3], cost=[1, 2])  # not one per payload
        assert err.value.field == "cost"

    async def aio() -> None:
        async with AsyncProducer(shared_redis.url, queue) as ap:
            with pytest.raises(InvalidRequest) as aerr:
                await ap.submit({"x": 1}, cost=bad)
            assert aerr.value.field == "cost"
    asyncio.run(aio())
    assert snapshot(client, queue_pattern(queue)) == {}


def test_submit_many_takes_one_cost_or_one_per_payload(shared_redis, queue):
    client = shared_redis.client()
    with Producer(shared_redis.url, queue) as p:
        one = p.submit_many(["a", "b"], cost=7)
        each = p.submit_many(["c", "d"], cost=[1, 300])
    jobs = QueueKeys(queue).jobs
    stored = [split_job(client.hget(jobs, h.id))[0] for h in [*one, *each]]
    assert [(m.cost, m.requested) for m in stored] == [(7, 7), (7, 7), (1, 1), (300, 300)]
    # the cost is the 7th field of the meta (keys.py), absent when 1
    raw = [client.hget(jobs, h.id).split(b"|")[0].decode() for h in [*one, *each]]
    assert [m.split(":")[6:] for m in raw] == [["7"], ["7"], [], ["300"]]


def test_the_cli_takes_a_cost_and_refuses_a_bad_one(shared_redis, queue):
    client = shared_redis.client()
    for bad in ("0", "x", "1000000001"):
        done = batchgate("submit", "--redis-url", shared_redis.url, "--queue", queue,
                         "--cost", bad, "{}")
        assert done.returncode != 0 and "cost" in done.stderr, done.stderr
    assert snapshot(client, queue_pattern(queue)) == {}
    done = batchgate("submit", "--redis-url", shared_redis.url, "--queue", queue,
                     "--cost", "12", "{}")
    assert done.returncode == 0, done.stderr
    request_id = done.stdout.strip()
    assert split_job(client.hget(QueueKeys(queue).jobs, request_id))[0].cost == 12


# -- max_cost ------------------------------------------------------------------------------
def test_max_cost_reject_refuses_at_enqueue_and_writes_nothing(shared_redis, queue):
    configure(shared_redis.url, queue, max_cost=100)
    client = shared_redis.client()
    before = snapshot(client, queue_pattern(queue))
    with Producer(shared_redis.url, queue) as p:
        with pytest.raises(InvalidRequest) as err:
            p.submit("long", cost=101)
        assert err.value.field == "cost" and "101" in str(err.value) and "100" in str(err.value)
        with pytest.raises(InvalidRequest) as err:  # all or nothing
            p.submit_many(["a", "b", "c"], cost=[5, 500, 5])
        assert err.value.field == "cost"
        assert snapshot(client, queue_pattern(queue)) == before
        h = p.submit("at the cap", cost=100)
    assert client.zscore(QueueKeys(queue).pending_normal, h.id) is not None


def test_max_cost_truncate_caps_the_cost_and_tells_the_model(shared_redis, queue,
                                                            inprocess_consumer, tmp_path):
    configure(shared_redis.url, queue, max_cost=100, over_cost="truncate", strategy="fifo")
    serve_recorder(inprocess_consumer, shared_redis.url, queue, tmp_path / "out")
    with Producer(shared_redis.url, queue) as p:
        long = p.submit("long", cost=5000).result(timeout=15)
        short = p.submit("short", cost=30).result(timeout=15)
    assert long == {"payload": "long", "cost": 100, "requested": 5000, "truncated": True}
    assert short == {"payload": "short", "cost": 30, "requested": 30, "truncated": False}


# -- max_batch_cost ------------------------------------------------------------------------
@pytest.mark.parametrize(("mode", "budget", "costs", "expected"), [
    ("sum", 10, [4, 4, 4, 4, 20, 1, 1], [[4, 4], [4, 4], [20], [1, 1]]),
    ("padded", 32, [2, 2, 2, 8, 8, 8, 8, 40, 1], [[2, 2, 2, 8], [8, 8, 8], [40], [1]]),
])
def test_a_batch_never_exceeds_max_batch_cost(shared_redis, queue, inprocess_consumer,
                                             tmp_path, mode, budget, costs, expected):
    """The backlog is queued first, then one consumer takes it: batches in arrival order,
    each within the budget (sum of costs, or size x largest), a request above the budget
    alone; the last partial batch waits out the delay."""
    delay_ms = 300
    configure(shared_redis.url, queue, strategy="dynamic", max_batch_size=8,
              max_queue_delay_ms=delay_ms, max_batch_cost=budget, cost_mode=mode)
    with Producer(shared_redis.url, queue) as p:
        handles = p.submit_many(list(range(len(costs))), cost=costs)
        serve_recorder(inprocess_consumer, shared_redis.url, queue, tmp_path / "out")
        results = [h.result(timeout=20) for h in handles]
    assert [r["cost"] for r in results] == costs
    ran = [b["costs"] for b in batches(tmp_path / "out")]
    assert ran == expected
    for b in ran:
        size = sum(b) if mode == "sum" else len(b) * max(b)
        assert size <= budget or len(b) == 1, ran


def test_a_batch_full_by_its_budget_leaves_at_once(shared_redis, queue, inprocess_consumer,
                                                   tmp_path):
    """Two requests of cost 8 under a budget of 10: the first is a full batch as soon as the
    second arrives (it does not fit), though the queue is far from max_batch_size."""
    delay_ms = 1500
    serve_recorder(inprocess_consumer, shared_redis.url, queue, tmp_path / "out",
                   strategy="dynamic", max_batch_size=32, max_queue_delay_ms=delay_ms,
                   max_batch_cost=10)
    with Producer(shared_redis.url, queue) as p:
        first = p.submit("a", cost=8)
        time.sleep(0.2)
        second = p.submit("b", cost=8)
        assert first.result(timeout=15)["cost"] == 8
        assert second.result(timeout=15)["cost"] == 8
    waits = [int(x) / 1000 for x in
             reversed(shared_redis.client().lrange(QueueKeys(queue).wait_samples, 0, -1))]
    assert len(waits) == 2
    assert waits[0] < delay_ms, waits  # released by the second's arrival, not the delay
    assert waits[1] >= delay_ms, waits  # alone and partial: its window
    assert [b["costs"] for b in batches(tmp_path / "out")] == [[8], [8]]


# -- cost buckets --------------------------------------------------------------------------
def test_buckets_are_never_mixed_and_each_bucket_waits_at_most_the_delay(
        shared_redis, queue, inprocess_consumer, tmp_path):
    delay_ms = 500
    serve_recorder(inprocess_consumer, shared_redis.url, queue, tmp_path / "out",
                   strategy="dynamic", max_batch_size=8, max_queue_delay_ms=delay_ms,
                   cost_buckets="32,1024")
    client = shared_redis.client()
    assert read_policy(client, queue).cost_buckets == "32,1024"
    costs = [16, 512, 16, 4000, 16, 512, 8, 900, 32, 33, 2000, 1]
    with Producer(shared_redis.url, queue) as p:
        handles, sent = [], []
        for i, cost in enumerate(costs):
            sent.append(time.monotonic())
            handles.append(p.submit({"i": i}, cost=cost))
            time.sleep(0.05)
        results = [h.result(timeout=20) for h in handles]
        done = time.monotonic()
    assert [r["cost"] for r in results] == costs
    policy = Policy(cost_buckets="32,1024")
    ran = batches(tmp_path / "out")
    for b in ran:
        assert len({policy.bucket_of(c) for c in b["costs"]}) == 1, ran
    # Every batch is partial (12 requests in 3 buckets, batches of 8): each left when its
    # own oldest had waited the delay, not before, and none waited much longer (the later
    # arrivals of another bucket did not hold it back).
    assert len(ran) >= 3 and sum(len(b["costs"]) for b in ran) == len(costs), ran
    waits = [int(x) / 1000 for x in client.lrange(QueueKeys(queue).wait_samples, 0, -1)]
    assert len(waits) == len(costs)
    assert max(waits) < delay_ms + SLACK_MS, waits
    assert sum(w >= delay_ms for w in waits) >= len(ran), (waits, ran)
    assert done - sent[0] < (12 * 0.05) + (delay_ms + SLACK_MS) / 1000


def test_a_full_bucket_leaves_at_once_while_another_waits_its_delay(
        shared_redis, queue, inprocess_consumer, tmp_path):
    delay_ms = 1000
    serve_recorder(inprocess_consumer, shared_redis.url, queue, tmp_path / "out",
                   strategy="priority", max_batch_size=4, max_queue_delay_ms=delay_ms,
                   cost_buckets="32")
    with Producer(shared_redis.url, queue) as p:
        short = p.submit("short", cost=16)
        started = time.monotonic()
        longs = p.submit_many(["l1", "l2", "l3", "l4"], cost=100)  # a full batch of long
        for h in longs:
            h.result(timeout=10)
        longs_done = time.monotonic() - started
        assert short.result(timeout=10 + delay_ms / 1000)["cost"] == 16
    assert longs_done < delay_ms / 1000, longs_done  # not held back by the short one
    assert [b["costs"] for b in batches(tmp_path / "out")] == [[100] * 4, [16]]


# -- the settings: stored, validated in Python and in configure.lua -----------------------
def test_policy_set_and_show_the_cost_settings(shared_redis, queue):
    url = shared_redis.url
    done = batchgate("policy", "set", "--redis-url", url, "--queue", queue, "--max-cost",
                     "4096", "--over-cost", "truncate", "--max-batch-cost", "8192",
                     "--cost-mode", "padded", "--cost-buckets", "32, 1024")
    assert done.returncode == 0, done.stderr
    shown = batchgate("policy", "show", "--redis-url", url, "--queue", queue)
    assert '"cost_buckets": "32,1024"' in shown.stdout and '"cost_mode": "padded"' in \
        shown.stdout and '"max_batch_cost": 8192' in shown.stdout, shown.stdout
    client = shared_redis.client()
    before = snapshot(client, queue_pattern(queue))
    for args in (["--cost-buckets", "1024,32"], ["--cost-buckets", "1,2,3,4,5"],
                 ["--cost-buckets", "a"], ["--max-batch-cost", "-1"]):
        bad = batchgate("policy", "set", "--redis-url", url, "--queue", queue, *args)
        assert bad.returncode != 0, args
        assert args[0][2:].replace("-", "_") in bad.stderr, (args, bad.stderr)
    for args in (["--cost-mode", "max"], ["--over-cost", "clip"]):
        assert batchgate("policy", "set", "--redis-url", url, "--queue", queue,
                         *args).returncode == 2
    assert snapshot(client, queue_pattern(queue)) == before


@pytest.mark.parametrize(("field", "value"), [("cost_buckets", "32,16"),
                                              ("cost_buckets", "0"), ("cost_mode", "max"),
                                              ("over_cost", "drop")])
def test_configure_lua_refuses_a_bad_cost_setting(shared_redis, queue, field, value):
    with pytest.raises(InvalidPolicy):
        Policy(**{field: value})
    client: redis.Redis = shared_redis.client()
    args: list[object] = ["replace"]
    for name, stored in {**Policy().to_redis(), field: value}.items():
        args += [name, stored]
    reply = Scripts(client).configure(keys=configure_keys(QueueKeys(queue)), args=args)
    assert reply == [-3, field.encode()]
    assert client.exists(QueueKeys(queue).policy) == 0


def test_a_policy_stored_before_the_cost_settings_runs_without_them(shared_redis, queue,
                                                                   inprocess_consumer,
                                                                   tmp_path):
    client = shared_redis.client()
    store_policy(client, queue, Policy(strategy="fifo"), replace=True)
    key = QueueKeys(queue).policy
    client.hdel(key, "max_cost", "over_cost", "max_batch_cost", "cost_mode", "cost_buckets")
    assert read_policy(client, queue).cost_buckets == ""
    serve_recorder(inprocess_consumer, shared_redis.url, queue, tmp_path / "out")
    with Producer(shared_redis.url, queue) as p:
        assert p.submit("x", cost=9).result(timeout=15)["cost"] == 9


# -- the gateway's "cost" ------------------------------------------------------------------
def test_the_gateway_takes_a_cost_and_refuses_a_bad_one(shared_redis, queue,
                                                        inprocess_consumer, tmp_path):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from helpers.servers import gateway_factory

    configure(shared_redis.url, queue, max_cost=100, strategy="fifo")
    client = shared_redis.client()
    factory = gateway_factory()
    start_gateway = next(factory)
    try:
        gateway = start_gateway(shared_redis.url, queue)
        with httpx.Client(base_url=gateway.url, timeout=20) as http:
            before = snapshot(client, queue_pattern(queue))
            for bad in (0, -3, 1.5, "7", True, 10**9 + 1):
                answer = http.post("/v1/requests", json={"payload": 1, "cost": bad})
                assert answer.status_code == 422, (bad, answer.text)
                assert answer.json()["field"] == "cost", answer.json()
            over = http.post("/v1/requests", json={"payload": 1, "cost": 101})
            assert over.status_code == 422 and over.json()["field"] == "cost"
            assert "100" in over.json()["message"]
            assert snapshot(client, queue_pattern(queue)) == before
            serve_recorder(inprocess_consumer, shared_redis.url, queue, tmp_path / "out")
            done = http.post("/v1/requests", json={"payload": "x", "cost": 64, "wait": True})
            assert done.status_code == 200, done.text
            assert done.json()["result"]["cost"] == 64
    finally:
        next(factory, None)


def test_a_consumer_serves_its_preferred_bucket_first_when_it_is_due(
        shared_redis, queue, inprocess_consumer, tmp_path):
    """Both buckets due when the consumer starts: without a preference the older (short)
    goes first; --prefer-bucket 2 takes the long one first."""
    configure(shared_redis.url, queue, strategy="dynamic", max_batch_size=8,
              max_queue_delay_ms=100, cost_buckets="32")
    with Producer(shared_redis.url, queue) as p:
        handles = [p.submit("short", cost=16), p.submit("long", cost=100)]
        time.sleep(0.3)  # both past their delay
        serve_recorder(inprocess_consumer, shared_redis.url, queue, tmp_path / "out",
                       prefer_bucket=2)
        assert [h.result(timeout=15)["cost"] for h in handles] == [16, 100]
    assert [b["costs"] for b in batches(tmp_path / "out")] == [[100], [16]]


def test_prefer_and_only_bucket_are_validated():
    from consumer.worker import ConsumerConfig

    for knob in ("prefer_bucket", "only_bucket"):
        for bad in (-1, 6, True, "1"):
            with pytest.raises(InvalidRequest) as err:
                ConsumerConfig(**{knob: bad})
            assert err.value.field == knob and "5" in str(err.value)
        flag = "--" + knob.replace("_", "-")
        done = batchgate("consumer", flag, "6")
        assert done.returncode == 2 and f"{knob}: 6 is outside [0, 5]" in done.stderr
    with pytest.raises(InvalidRequest) as err:
        ConsumerConfig(prefer_bucket=1, only_bucket=2)
    assert err.value.field == "only_bucket" and "prefer_bucket" in str(err.value)


def test_a_consumer_dedicated_to_a_bucket_serves_it_alone_past_a_busy_long_batch(
        shared_redis, queue, inprocess_consumer, tmp_path):
    """--only-bucket 1 beside a consumer that serves every bucket: while that one runs a
    long batch (2 s), short requests are answered by the dedicated one within their
    delay and a fraction of the long batch; the dedicated consumer never runs a long
    request, even idle with longs waiting."""
    delay_ms, slow_ms = 50, 2000
    configure(shared_redis.url, queue, strategy="dynamic", max_batch_size=4,
              max_queue_delay_ms=delay_ms, cost_buckets="32")
    model = {"slow_over": 32, "slow_ms": slow_ms}
    serve_recorder(inprocess_consumer, shared_redis.url, queue, tmp_path / "any", model)
    serve_recorder(inprocess_consumer, shared_redis.url, queue, tmp_path / "short", model,
                   only_bucket=1)
    with Producer(shared_redis.url, queue) as p:
        longs = p.submit_many([f"l{i}" for i in range(8)], cost=100)  # two full batches
        client, keys = shared_redis.client(), QueueKeys(queue)
        deadline = time.monotonic() + 15
        while not client.zcard(keys.inflight) and time.monotonic() < deadline:
            time.sleep(0.005)  # until the first long batch is in flight
        shorts, sent = [], time.monotonic()
        for i in range(6):
            shorts.append(p.submit(f"s{i}", cost=8))
            time.sleep(0.02)
        for h in shorts:
            assert h.result(timeout=15)["cost"] == 8
        shorts_took = time.monotonic() - sent
        assert all(h.result(timeout=30)["cost"] == 100 for h in longs)
    assert shorts_took < slow_ms / 1000 / 2, shorts_took  # not behind a long batch
    dedicated = [b["costs"] for b in batches(tmp_path / "short")]
    general = [b["costs"] for b in batches(tmp_path / "any")]
    assert dedicated and all(c <= 32 for b in dedicated for c in b), dedicated
    assert sorted(c for b in general for c in b if c > 32) == [100] * 8, general


def test_an_arrival_for_another_bucket_wakes_a_consumer_that_serves_it(
        shared_redis, queue, inprocess_consumer, tmp_path):
    """Idle consumers: one dedicated to bucket 1, one serving every bucket. A long request
    wakes the second at once (the dedicated one blocks on its bucket's own marker, so it
    cannot take the wake-up and leave the long request until an idle block times out)."""
    delay_ms = 20
    configure(shared_redis.url, queue, strategy="dynamic", max_batch_size=4,
              max_queue_delay_ms=delay_ms, cost_buckets="32")
    serve_recorder(inprocess_consumer, shared_redis.url, queue, tmp_path / "any")
    serve_recorder(inprocess_consumer, shared_redis.url, queue, tmp_path / "short",
                   only_bucket=1)
    with Producer(shared_redis.url, queue) as p:
        assert p.submit("warm", cost=100).result(timeout=15)["cost"] == 100
        took = []
        for i in range(10):
            time.sleep(0.15)  # both idle, blocked
            sent = time.monotonic()
            assert p.submit(f"l{i}", cost=100).result(timeout=15)["cost"] == 100
            took.append(time.monotonic() - sent)
    # IDLE_BLOCK_S (1 s) is what a lost wake-up costs; the delay is 20 ms.
    assert max(took) < 0.6, took
    assert not batches(tmp_path / "short")


def test_a_dedicated_consumer_finds_its_bucket_behind_a_long_backlog(
        shared_redis, queue, inprocess_consumer, tmp_path):
    """Only a consumer dedicated to bucket 1 runs: 300 long requests wait ahead of the
    short ones (far beyond the max_batch_size x buckets requests a pop reads of a level),
    yet it answers the short ones, including one sent after a cancelled one, and leaves
    every long one waiting."""
    configure(shared_redis.url, queue, strategy="dynamic", max_batch_size=4,
              max_queue_delay_ms=20, cost_buckets="32")
    with Producer(shared_redis.url, queue) as p:
        longs = p.submit_many([f"l{i}" for i in range(300)], cost=100)
        cancelled = p.submit("gone", cost=8)
        assert cancelled.cancel() == "cancelled"
        serve_recorder(inprocess_consumer, shared_redis.url, queue, tmp_path / "short",
                       only_bucket=1)
        shorts = p.submit_many([f"s{i}" for i in range(3)], cost=8)
        assert [h.result(timeout=15)["payload"] for h in shorts] == ["s0", "s1", "s2"]
        assert not any(h.done() for h in longs)
    client, keys = shared_redis.client(), QueueKeys(queue)
    assert client.zcard(keys.pending_normal) == 300
    assert client.zcard(keys.bucket_set(2)) == 300
    assert client.zcard(keys.bucket_set(1)) == 0  # the cancelled one's entry left it too
    assert all(c <= 32 for b in batches(tmp_path / "short") for c in b["costs"])


def test_a_short_request_re_queued_after_a_crash_reaches_its_dedicated_consumer(
        shared_redis, queue, start_consumer, inprocess_consumer, tmp_path):
    """A consumer dedicated to bucket 1 is SIGKILLed mid-batch; its request goes back to
    the queue (and to its bucket's set) when the lease lapses, and the next dedicated
    consumer runs it: nothing accepted is lost with dedicated consumers only."""
    configure(shared_redis.url, queue, strategy="dynamic", max_batch_size=4,
              max_queue_delay_ms=20, cost_buckets="32")
    doomed = start_recorder(start_consumer, shared_redis.url, queue, tmp_path / "doomed",
                            "--model-arg", "delay_ms=60000", "--lease-ms", "300",
                            "--only-bucket", "1")
    client, keys = shared_redis.client(), QueueKeys(queue)
    with Producer(shared_redis.url, queue) as p:
        handle = p.submit("short", cost=8)
        deadline = time.monotonic() + 15
        while not client.zcard(keys.inflight) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert client.zcard(keys.bucket_set(1)) == 0  # in flight: out of its set
        doomed.kill()
        serve_recorder(inprocess_consumer, shared_redis.url, queue, tmp_path / "next",
                       lease_ms=300, only_bucket=1)
        assert handle.result(timeout=20)["payload"] == "short"
    assert [b["payloads"] for b in batches(tmp_path / "next")] == [["short"]]
