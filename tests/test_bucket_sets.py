"""Cost bucket sets and the costs hash (docs/guarantees.md, "Cost buckets"), against a real
redis-server: every way out of the queue (a batch, a cancel, an expiry) takes the id out of
the bucket set it was put in, also after a cost_buckets change; a consumer dedicated to a
bucket answers a live request however many dead ids an older version left in its set; a
pop learns costs from the costs hash, never from the payloads."""

from __future__ import annotations

import dataclasses
import time
import uuid

import orjson
import pytest
from helpers.support import configure

from producer import Producer
from scheduler_core.admin import read_policy, store_policy
from scheduler_core.deadlines import expire_due
from scheduler_core.keys import QueueKeys
from scheduler_core.scripts import NewRequest, Scripts, enqueue_call, pop_keys
from scheduler_core.wire import split_cost_record, split_job

IDLE_BLOCK_S = 1.0  # consumer/worker.py: how long an idle consumer blocks before it pops again
SLACK_S = 3.0  # the machine is shared and loaded


def bucket_ids(client, keys: QueueKeys) -> dict[int, int]:
    """How many ids each bucket set holds (those that hold any)."""
    sizes = {b: client.zcard(keys.bucket_set(b)) for b in range(1, 6)}
    return {b: n for b, n in sizes.items() if n}


def wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_cancels_expiries_and_answers_leave_no_id_in_the_bucket_sets(
        shared_redis, queue, start_consumer):
    """300 cancelled and 300 expired requests leave nothing in their bucket's set or in the
    costs hash; then, with one consumer dedicated to each bucket, a live request is
    answered within the delay and an idle block (no stall behind dead ids), and once
    everything is answered the sets and the costs hash are empty."""
    delay_ms = 20
    configure(shared_redis.url, queue, strategy="dynamic", max_batch_size=8,
              max_queue_delay_ms=delay_ms, cost_buckets="10")
    client, keys = shared_redis.client(), QueueKeys(queue)
    scripts = Scripts(client)
    with Producer(shared_redis.url, queue) as p:
        cancelled = p.submit_many([f"c{i}" for i in range(300)], cost=5)
        for h in cancelled:
            assert h.cancel() == "cancelled"
        expiring = p.submit_many([f"e{i}" for i in range(300)], cost=5, deadline_ms=50)
        longs = p.submit_many([f"l{i}" for i in range(20)], cost=50)
        time.sleep(0.2)  # past the 50 ms deadline
        expire_due(scripts, keys)  # unless the producer's own sweep did already
        assert wait_until(lambda: all(h.done() for h in expiring), 10)
        assert client.zcard(keys.pending_normal) == 20
        assert bucket_ids(client, keys) == {2: 20}
        assert client.hlen(keys.costs) == 20
        for b in (1, 2):
            start_consumer(shared_redis.url, queue, "--only-bucket", str(b))
        sent = time.monotonic()
        live = p.submit("live", cost=5)
        assert live.result(timeout=30) == "live"
        took = time.monotonic() - sent
        assert [h.result(timeout=30) for h in longs] == [f"l{i}" for i in range(20)]
    assert took < delay_ms / 1000 + IDLE_BLOCK_S + SLACK_S, took
    assert bucket_ids(client, keys) == {}
    assert client.hlen(keys.costs) == 0


def test_a_dedicated_consumer_answers_past_dead_ids_an_older_version_left(
        shared_redis, queue, start_consumer):
    """10,000 ids of requests that wait nowhere sit ahead in bucket 1's set (an older
    version left cancelled and expired ids there). A pop reads at most its window plus
    STALE_BUDGET of them and then pops again at once instead of blocking an idle block:
    a live request is answered within the delay and an idle block, and the dead ids are
    gone."""
    delay_ms = 20
    configure(shared_redis.url, queue, strategy="dynamic", max_batch_size=8,
              max_queue_delay_ms=delay_ms, cost_buckets="10")
    client, keys = shared_redis.client(), QueueKeys(queue)
    client.zadd(keys.bucket_set(1), {f"dead{i}": i + 1 for i in range(10_000)})
    start_consumer(shared_redis.url, queue, "--only-bucket", "1")
    with Producer(shared_redis.url, queue) as p:
        time.sleep(0.2)  # the consumer idles, blocked until a wake-up
        sent = time.monotonic()
        assert p.submit("live", cost=5).result(timeout=60) == "live"
        took = time.monotonic() - sent
    assert took < delay_ms / 1000 + IDLE_BLOCK_S + SLACK_S, took
    assert bucket_ids(client, keys) == {}


def test_a_cost_buckets_change_leaves_no_id_in_the_old_bucket_set(shared_redis, queue,
                                                                  start_consumer):
    """300 requests of cost 50 wait in bucket 2's set under cost_buckets "32"; the
    boundaries become "64" (cost 50 is bucket 1 now). A consumer answers them all and
    no id stays in any set: each leaves the set it was put in, not the one the new
    boundaries name."""
    configure(shared_redis.url, queue, strategy="fifo", max_batch_size=16,
              cost_buckets="32")
    client, keys = shared_redis.client(), QueueKeys(queue)
    with Producer(shared_redis.url, queue) as p:
        handles = p.submit_many([f"r{i}" for i in range(300)], cost=50)
        assert bucket_ids(client, keys) == {2: 300}
        assert split_cost_record(client.hget(keys.costs, handles[0].id)) == (50, 2)
        policy = read_policy(client, queue)
        store_policy(client, queue, dataclasses.replace(policy, cost_buckets="64"), replace=True)
        start_consumer(shared_redis.url, queue)
        assert [h.result(timeout=60) for h in handles] == [f"r{i}" for i in range(300)]
    assert bucket_ids(client, keys) == {}
    assert client.hlen(keys.costs) == 0


def _enqueue(scripts: Scripts, keys: QueueKeys, costs: list[int], envelope: bytes,
             path: str = "sets") -> list[str]:
    """Requests of these costs, the cheap ones (<= 32) NORMAL and the others LOW (two
    levels). path "sets": the pop reads the bucket sets; "window": the first request is
    in no set (as an older version listed it), so the pop weighs its whole window."""
    requests = [NewRequest(id=uuid.uuid4().hex, priority=1 if cost <= 32 else 2,
                           deadline_ms=0, envelope=envelope, cost=cost) for cost in costs]
    script_keys, args = enqueue_call(keys, "", requests, 60)
    assert int(scripts.enqueue(keys=script_keys, args=args)[0]) == 1
    if path == "window":
        scripts.client.zrem(keys.bucket_set(1), requests[0].id)
    return [r.id for r in requests]


@pytest.mark.parametrize("path", ["sets", "window"])
def test_a_pop_takes_costs_from_the_costs_hash_not_from_the_jobs_values(shared_redis,
                                                                        queue, path):
    """fifo, cost_buckets "32", batch 4: one short request, then seven long ones (another
    level). Their jobs values are rewritten without meta (as if the pop could not read
    their cost from them): the pop still groups them by the cost they were enqueued with,
    so the batch is the short request alone, whether it reads the bucket sets or weighs
    all eight."""
    configure(shared_redis.url, queue, strategy="fifo", max_batch_size=4, cost_buckets="32")
    client, keys = shared_redis.client(), QueueKeys(queue)
    scripts = Scripts(client)
    ids = _enqueue(scripts, keys, [8] + [100] * 7, orjson.dumps({"v": 1, "payload": 1}), path)
    for rid in ids[1:]:
        meta, envelope = split_job(client.hget(keys.jobs, rid))
        assert meta is not None and meta.cost == 100
        client.hset(keys.jobs, rid, envelope)  # no meta: read there, its cost would be 1
    reply = scripts.pop_batch(keys=pop_keys(keys), args=["c1", 60_000])
    assert [reply[i].decode() for i in range(4, len(reply), 5)] == [ids[0]]


def _pop_ms(client, scripts: Scripts, keys: QueueKeys, pops: int) -> float:
    """The least Redis-side time (SLOWLOG) of `pops` pops that find nothing due."""
    pop = f"evalsha {scripts.pop_batch.sha} ".encode()
    took = []
    for _ in range(pops):
        client.slowlog_reset()
        assert int(scripts.pop_batch(keys=pop_keys(keys), args=["c1", 60_000])[0]) == 0
        took += [e["duration"] / 1000 for e in client.slowlog_get(16)
                 if e["command"].lower().startswith(pop)]
    return min(took)


@pytest.mark.parametrize("path", ["sets", "window"])
def test_a_pops_work_does_not_grow_with_the_payloads_of_the_requests_it_weighs(
        shared_redis, queue, path):
    """dynamic (nothing due for a minute), cost_buckets "32", batch 4: a pop weighs the
    six waiting requests (on two levels; from the bucket sets, or the costs of its whole
    window). With 4 MB payloads it takes no longer than with 1-byte ones (reading them
    would copy 24 MB into the script: several ms at least): the least of 5 pops each,
    within 2 ms plus twice the small one's."""
    client = shared_redis.client()
    scripts = Scripts(client)
    client.config_set("slowlog-log-slower-than", 0)
    try:
        times = {}
        for size in (1, 4 << 20):
            keys = QueueKeys(f"{queue}-{size}")
            configure(shared_redis.url, keys.queue, strategy="dynamic", max_batch_size=4,
                      max_queue_delay_ms=60_000, cost_buckets="32")
            _enqueue(scripts, keys, [8, 100] * 3, b"x" * size, path)
            times[size] = _pop_ms(client, scripts, keys, 5)
            client.delete(*keys.shared)
    finally:
        client.config_set("slowlog-log-slower-than", 10_000)
    assert times[4 << 20] < 2 + 2 * times[1], times


def test_after_a_cost_buckets_change_dedicated_consumers_find_every_request(
        shared_redis, queue, start_consumer):
    """Only consumers dedicated to a bucket run. 200 requests of cost 50 wait under
    cost_buckets "32" (bucket 2) and 100 of cost 5 were enqueued before the queue had
    cost buckets (in no set); the boundaries become "64": every one of them is bucket 1's
    now, and the consumer dedicated to bucket 1 answers all 300 (the pops move them to
    the set the new boundaries name, a bounded step each); the sets end empty."""
    configure(shared_redis.url, queue, strategy="fifo", max_batch_size=16)
    client, keys = shared_redis.client(), QueueKeys(queue)
    with Producer(shared_redis.url, queue) as p:
        unlisted = p.submit_many([f"u{i}" for i in range(100)], cost=5)
        policy = read_policy(client, queue)
        store_policy(client, queue, dataclasses.replace(policy, cost_buckets="32"),
                     replace=True)
        listed = p.submit_many([f"r{i}" for i in range(200)], cost=50)
        assert bucket_ids(client, keys) == {2: 200}
        store_policy(client, queue, dataclasses.replace(policy, cost_buckets="64"),
                     replace=True)
        start_consumer(shared_redis.url, queue, "--only-bucket", "1")
        assert [h.result(timeout=60) for h in unlisted] == [f"u{i}" for i in range(100)]
        assert [h.result(timeout=60) for h in listed] == [f"r{i}" for i in range(200)]
    assert bucket_ids(client, keys) == {}
    assert client.hlen(keys.costs) == 0


def _pop_commands(client, scripts: Scripts, keys: QueueKeys) -> dict[str, int]:
    """The Redis commands one pop runs (commandstats' calls, its script's included), for
    a pop that finds nothing due."""
    before = {k: v["calls"] for k, v in client.info("commandstats").items()}
    assert int(scripts.pop_batch(keys=pop_keys(keys), args=["c1", 60_000])[0]) == 0
    after = {k: v["calls"] for k, v in client.info("commandstats").items()}
    return {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}


def test_ids_in_a_set_beyond_the_bucket_count_leave_it_a_bounded_step_a_pop(shared_redis,
                                                                           queue):
    """cost_buckets "10,100,1000": 4 buckets, sets 1..4. 600 ids written by hand into
    bucket 5's set, and a waiting request (cost 50, bucket 2) listed there instead of in
    its own: each pop (nothing due for a minute) takes at most 256 of them out, the
    waiting one moves to bucket 2's set, and once the set is empty a pop runs the same
    Redis commands as on a queue that never had them (the bucket sets' path, where it
    weighed the whole window while they stayed)."""
    client = shared_redis.client()
    scripts = Scripts(client)
    clean, dirty = QueueKeys(f"{queue}-clean"), QueueKeys(f"{queue}-dirty")
    for keys in (clean, dirty):
        configure(shared_redis.url, keys.queue, strategy="dynamic", max_batch_size=4,
                  max_queue_delay_ms=60_000, cost_buckets="10,100,1000")
        ids = _enqueue(scripts, keys, [5, 50, 500, 5000] * 2, b"x")
    moved = ids[1]
    client.zadd(dirty.bucket_set(5), {f"junk-{i}": i for i in range(600)})
    arrival = client.zscore(dirty.bucket_set(2), moved)
    client.zrem(dirty.bucket_set(2), moved)
    client.zadd(dirty.bucket_set(5), {moved: arrival})
    client.hset(dirty.costs, moved, "50:5:2")
    assert _pop_commands(client, scripts, clean) != _pop_commands(client, scripts, dirty)
    left = [client.zcard(dirty.bucket_set(5))]
    while left[-1] and len(left) < 10:
        _pop_commands(client, scripts, dirty)
        left.append(client.zcard(dirty.bucket_set(5)))
    assert left == [601 - 256, 601 - 2 * 256, 0], left
    assert bucket_ids(client, dirty) == bucket_ids(client, clean) == {1: 2, 2: 2, 3: 2, 4: 2}
    assert client.zscore(dirty.bucket_set(2), moved) == arrival
    assert split_cost_record(client.hget(dirty.costs, moved)) == (50, 2)
    assert _pop_commands(client, scripts, clean) == _pop_commands(client, scripts, dirty)
