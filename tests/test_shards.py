"""Sharded queues (docs/scaling.md, "Sharded queues"), end to end: real redis-server,
consumers in the test process (the Consumer API) or, where a test measures, kills or
restarts one, started as `batchgate consumer`; producers as users make them."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import zlib

import pytest
from click.testing import CliRunner
from helpers.cli import batchgate
from helpers.failure_support import start as start_failing
from helpers.support import RecordingModel, configure, wait_for

from batchgate.cli import main as cli
from producer import (
    AsyncShardedProducer,
    InvalidRequest,
    Priority,
    Producer,
    RequestFailed,
    ShardedProducer,
)
from scheduler_core.admin import read_policy, request_state
from scheduler_core.deadletter import list_dead
from scheduler_core.keys import QueueKeys
from scheduler_core.ops.snapshot import queue_snapshot
from scheduler_core.ops.stats import queue_stats
from scheduler_core.registry import known_queues
from scheduler_core.shards import shard_name
from scheduler_core.wire import CANCELLED

S = 3


def shard_keys(queue: str, shards: int = S) -> list[QueueKeys]:
    return [QueueKeys(shard_name(queue, i)) for i in range(shards)]


def depth(client, keys: QueueKeys) -> int:
    return sum(client.zcard(k) for k in keys.pending_all)


def test_requests_spread_over_shards_are_answered_exactly_once(
        shared_redis, queue, inprocess_consumer, tmp_path):
    url, client = shared_redis.url, shared_redis.client()
    configure(url, queue, shards=S, strategy="dynamic", max_batch_size=8,
              max_queue_delay_ms=20)
    with ShardedProducer(url, queue) as p:
        assert p.shards == S
        handles = [p.submit({"i": i}, store_result=True) for i in range(60)]
        # Round robin: 20 waiting in each shard, each under its own hash tag.
        assert [depth(client, k) for k in shard_keys(queue)] == [20, 20, 20]
        tags = {key.decode().split("}")[0] for key in client.scan_iter(match="{bg:*")
                if queue in key.decode() and b":pending:" in key}
        assert tags == {f"{{bg:{shard_name(queue, i)}" for i in range(S)}

        model = RecordingModel(tmp_path)
        for _ in range(2):  # a consumer's error would be raised at its stop (teardown)
            model.serve(inprocess_consumer, url, queue)
        assert [h.result(timeout=30) for h in handles] == [{"i": i} for i in range(60)]
        assert sorted(x["i"] for x in model.payloads()) == list(range(60))  # each once
        assert len({b["pid"] for b in model.batches()}) >= 1

        # fetch finds results on every shard
        assert all(p.fetch(h.id).value == {"i": i} for i, h in enumerate(handles))

    # stats of the logical queue are the sums over its shards
    stats = queue_stats(client, queue)
    # (shard 0 is the logical queue itself: its own counters are read raw)
    processed = [int(client.hget(k.stats, "processed")) for k in shard_keys(queue)]
    batches = [int(client.hget(k.stats, "batches")) for k in shard_keys(queue)]
    assert stats.processed == 60 and processed == [20, 20, 20]
    assert stats.batches == sum(batches)
    assert queue_stats(client, shard_name(queue, 1)).processed == 20  # one shard alone
    assert stats.queue_wait_ms["samples"] == 60
    # each consumer counted once, not once per shard (heartbeats: at most 1 s apart)
    wait_for(lambda: queue_stats(client, queue).consumers_alive == 2, 10, "2 consumers")
    out = batchgate("stats", "--redis-url", url, "--queue", queue, "--json")
    assert json.loads(out.stdout)["processed"] == 60
    assert json.loads(out.stdout)["policy"]["shards"] == S
    # readers list the logical queue only
    found = known_queues(client)
    assert queue in found and shard_name(queue, 1) not in found
    # the live view (dashboard, top): each consumer once, batches from every shard
    wait_for(lambda: sum(c["requests"] for c in queue_snapshot(client, queue)["consumers"])
             == 60, 10, "every shard's requests in the consumers' totals")
    snap = queue_snapshot(client, queue)
    assert sorted(c["name"] for c in snap["consumers"]) == sorted(
        {c["name"] for c in snap["consumers"]}) and len(snap["consumers"]) == 2
    assert sum(c["batches"] for c in snap["consumers"]) == stats.batches
    assert sum(int(n) * int(size) for size, n in snap["batch_sizes"].items()) == 60


def test_high_on_another_shard_runs_before_a_due_normal_batch(
        shared_redis, queue, inprocess_consumer, tmp_path):
    """Full NORMAL batches wait on shards 0 and 1 (older), one HIGH on shard 2: the
    consumer's first batch is the HIGH one, though round robin starts at shard 0."""
    url = shared_redis.url
    configure(url, queue, shards=S, strategy="priority", max_batch_size=4,
              max_queue_delay_ms=0)
    with ShardedProducer(url, queue) as p:
        normal = p.submit_many([{"n": i} for i in range(4)])  # shard 0
        normal += p.submit_many([{"n": i} for i in range(4, 8)])  # shard 1
        high = p.submit({"high": 1}, priority=Priority.HIGH)  # shard 2
        assert [depth(shared_redis.client(), k) for k in shard_keys(queue)] == [4, 4, 1]
        model = RecordingModel(tmp_path)
        model.serve(inprocess_consumer, url, queue)
        assert high.result(timeout=30) == {"high": 1}
        assert [h.result(timeout=30) for h in normal] == [{"n": i} for i in range(8)]
    batches = [b["payloads"] for b in model.batches()]
    assert batches[0] == [{"high": 1}]
    assert sorted(batches[1:], key=lambda b: b[0]["n"]) == [[{"n": i} for i in range(4)],
                                                            [{"n": i} for i in range(4, 8)]]


def cpu_s(pid: int) -> float:
    """User + system CPU time of a process, from /proc."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_dedicated_consumer_passes_over_other_buckets_high_on_another_shard(
        shared_redis, queue, start_consumer, tmp_path):
    """Priority, cost buckets, 3 shards and only a consumer dedicated to bucket 1: a long
    HIGH request on one shard is not its to take; it serves the short NORMAL ones on the
    others, and then idles (it does not pop again and again for the HIGH one)."""
    url = shared_redis.url
    configure(url, queue, shards=S, strategy="priority", max_batch_size=4,
              max_queue_delay_ms=20, cost_buckets="32")
    with ShardedProducer(url, queue) as p:
        long_high = p.submit({"long": 1}, priority=Priority.HIGH, cost=100)
        model = RecordingModel(tmp_path)
        proc = model.start(start_consumer, url, queue, "--only-bucket", "1")
        shorts = p.submit_many([{"n": i} for i in range(6)], cost=8)
        assert [h.result(timeout=30) for h in shorts] == [{"n": i} for i in range(6)]
        before = cpu_s(proc.proc.pid)
        time.sleep(2)
        idle_cpu = cpu_s(proc.proc.pid) - before
        assert not long_high.done()
    assert idle_cpu < 0.5, idle_cpu  # a loop popping without pause takes a core's 2 s


def test_cancel_and_fetch_on_a_non_zero_shard(shared_redis, queue):
    url, client = shared_redis.url, shared_redis.client()
    configure(url, queue, shards=S)
    with ShardedProducer(url, queue) as p:
        # stored by id: fetched below
        first, second = p.submit({"i": 0}, store_result=True), p.submit({"i": 1},
                                                                        store_result=True)
        assert client.hexists(shard_keys(queue)[1].jobs, second.id)
        assert request_state(client, queue, second.id).status == "queued"
        assert second.cancel() == "cancelled"
        assert p.fetch(second.id).error_type == CANCELLED
        assert request_state(client, queue, second.id).status == "cancelled"
        result = CliRunner().invoke(cli, ["result", "--redis-url", url, "--queue", queue,
                                          "--json", second.id])
        assert result.exit_code == 1 and json.loads(result.stdout)["status"] == "cancelled"
        assert request_state(client, queue, first.id).status == "queued"
        assert p.fetch("no-such-id") is None
    assert queue_stats(client, queue).cancelled == 1


def test_least_depth_placement_fills_the_emptiest_shard(shared_redis, queue):
    url, client = shared_redis.url, shared_redis.client()
    configure(url, queue, shards=S)
    with Producer(url, queue) as direct:  # a plain Producer uses shard 0 only
        direct.submit_many([{"pre": i} for i in range(5)])
    with ShardedProducer(url, queue, placement="least_depth") as p:
        for i in range(10):
            p.submit({"i": i})
    # 5 + 10 over three shards, the emptiest first: 5, 5, 5
    assert [depth(client, k) for k in shard_keys(queue)] == [5, 5, 5]
    with pytest.raises(InvalidRequest, match="placement"):
        ShardedProducer(url, queue, placement="random")


def test_idempotency_keys_find_their_shard(shared_redis, queue):
    url = shared_redis.url
    configure(url, queue, shards=S)
    with ShardedProducer(url, queue) as p:
        keys = [f"k{i}" for i in range(6)]
        first = p.submit_many([{"i": i} for i in range(6)], idempotency_keys=keys)
        again = [p.submit({"other": i}, idempotency_key=k) for i, k in enumerate(keys)]
        assert [h.id for h in again] == [h.id for h in first]
    assert sum(depth(shared_redis.client(), k) for k in shard_keys(queue)) == 6


def test_dead_letters_are_listed_across_shards(redis_server, queue, start_consumer,
                                              tmp_path):
    """A payload that kills its consumer, on shard 0 and on shard 1, with max_attempts=1:
    both dead-lettered; `dead-letter list` shows both, `retry` finds each in its shard."""
    url = redis_server.url
    configure(url, queue, shards=2, strategy="fifo", max_attempts=1)
    with ShardedProducer(url, queue) as p:
        crash = [p.submit({"i": i, "crash": True}) for i in range(2)]  # shards 0, 1
    procs = []
    deadline = time.monotonic() + 60
    client = redis_server.client()
    while client.zcard(QueueKeys(queue).dead) + \
            client.zcard(QueueKeys(shard_name(queue, 1)).dead) < 2:
        assert time.monotonic() < deadline, "no dead letters within 60 s"
        if not any(c.proc.poll() is None for c in procs):  # restart what died
            procs.append(start_failing(start_consumer, url, queue, "Poison", "--lease-ms",
                                       "300", ready=False, log=tmp_path))
        time.sleep(0.1)
    total, listed = list_dead(client, queue)
    assert total == 2 and {e.id for e in listed} == {h.id for h in crash}
    assert {e.error_type for e in listed} == {"DeadLettered"}
    out = CliRunner().invoke(cli, ["dead-letter", "list", "--redis-url", url, "--queue",
                                   queue, "--json"])
    assert out.exit_code == 0 and json.loads(out.output)["total"] == 2
    assert queue_stats(client, queue).dead_letters == 2
    out = CliRunner().invoke(cli, ["dead-letter", "purge", "--redis-url", url, "--queue",
                                   queue, crash[1].id, "unknown-id"])
    assert out.exit_code == 0 and "purged 1, skipped 1" in out.output, out.output
    assert list_dead(client, queue)[0] == 1


def test_bad_shards_value_is_refused_naming_the_field_and_limit(shared_redis, queue):
    url, client = shared_redis.url, shared_redis.client()
    for bad in ("0", "65"):
        out = batchgate("consumer", "--redis-url", url, "--queue", queue, "--shards", bad)
        assert out.returncode != 0
        assert "shards" in out.stderr and "[1, 64]" in out.stderr, out.stderr
        out = CliRunner().invoke(cli, ["policy", "set", "--redis-url", url, "--queue", queue,
                                       "--shards", bad])
        assert out.exit_code != 0 and "shards" in out.output and "[1, 64]" in out.output
    assert read_policy(client, queue) is None  # nothing written
    assert not list(client.scan_iter(match=f"{{bg:{queue}*"))


def test_shard_count_conflicts_and_cannot_drop_a_busy_shard(shared_redis, queue):
    url, client = shared_redis.url, shared_redis.client()
    runner = CliRunner()
    out = runner.invoke(cli, ["policy", "set", "--redis-url", url, "--queue", queue,
                              "--shards", "3"])
    assert out.exit_code == 0, out.output
    # every shard's policy mirrors the logical one
    assert all(read_policy(client, shard_name(queue, i)).shards == 3 for i in range(3))
    out = batchgate("consumer", "--redis-url", url, "--queue", queue, "--shards", "2")
    assert out.returncode != 0 and "shards=3 (asked 2)" in out.stderr, out.stderr
    with ShardedProducer(url, queue) as p:
        for i in range(3):
            p.submit({"i": i})
    out = runner.invoke(cli, ["policy", "set", "--redis-url", url, "--queue", queue,
                              "--shards", "2"])
    assert out.exit_code != 0 and "still holds requests" in out.output
    assert read_policy(client, queue).shards == 3


def test_a_dropped_shard_takes_no_request_from_a_producer_that_missed_the_change(
        shared_redis, queue, inprocess_consumer, tmp_path):
    """`policy set --shards 2` retires shard 2 atomically while it is empty: a producer
    still placing on 3 shards is refused there (nothing written), re-reads the count and
    places the request on a live shard, where a consumer answers it."""
    url, client = shared_redis.url, shared_redis.client()
    configure(url, queue, shards=3)
    with ShardedProducer(url, queue) as stale, ShardedProducer(url, queue) as keyed:
        assert stale.shards == 3
        out = CliRunner().invoke(cli, ["policy", "set", "--redis-url", url, "--queue", queue,
                                       "--shards", "2"])
        assert out.exit_code == 0, out.output
        # direct submits to the dropped shard are refused, naming the field
        with Producer(url, shard_name(queue, 2)) as direct, \
                pytest.raises(InvalidRequest, match="shards"):
            direct.submit({"x": 1})
        handles = [stale.submit({"i": i}, store_result=True) for i in range(9)]
        assert stale.shards == 2  # re-read on the refusal, before its interval
        many = keyed.submit_many([{"k": i} for i in range(6)],
                                 idempotency_keys=[f"key-{i}" for i in range(6)])
        assert keyed.shards == 2
        dropped = QueueKeys(shard_name(queue, 2))
        assert client.hlen(dropped.jobs) == 0 and depth(client, dropped) == 0
        model = RecordingModel(tmp_path)
        model.serve(inprocess_consumer, url, queue)
        assert [h.result(timeout=30) for h in handles] == [{"i": i} for i in range(9)]
        assert [h.result(timeout=30) for h in many] == [{"k": i} for i in range(6)]
    assert queue_stats(client, queue).processed == 15


def test_a_refused_shard_drop_leaves_the_shard_serving(shared_redis, queue):
    url, client = shared_redis.url, shared_redis.client()
    configure(url, queue, shards=4)
    with Producer(url, shard_name(queue, 3)) as direct:
        direct.submit({"held": True})
        out = CliRunner().invoke(cli, ["policy", "set", "--redis-url", url, "--queue", queue,
                                       "--shards", "2"])
        assert out.exit_code != 0 and "shards" in out.output and "still holds" in out.output
        assert read_policy(client, queue).shards == 4
        # shard 2 was retired first, then restored: both still take requests
        direct.submit({"again": True})
        with Producer(url, shard_name(queue, 2)) as other:
            other.submit({"two": True})
    assert client.hget(QueueKeys(shard_name(queue, 2)).policy, "retired") is None


def test_producers_and_the_gateway_place_on_added_shards_without_a_restart(
        shared_redis, queue, start_gateway, monkeypatch):
    import producer.sharded
    monkeypatch.setattr(producer.sharded, "SHARDS_REFRESH_S", 0.2)
    url, client = shared_redis.url, shared_redis.client()
    configure(url, queue, shards=1)
    with gateway_http(start_gateway, url, queue) as http, ShardedProducer(url, queue) as p:
        assert http.post("/v1/requests", json={"payload": 1}).status_code == 202
        out = CliRunner().invoke(cli, ["policy", "set", "--redis-url", url, "--queue", queue,
                                       "--shards", "3"])
        assert out.exit_code == 0, out.output
        time.sleep(0.3)
        on = [p.submit({"i": i}, store_result=True) for i in range(3)]
        assert p.shards == 3
        assert sorted(shard_of(client, queue, h.id) for h in on) == [0, 1, 2]
        # the gateway (another process, refreshing every 2 s) finds them and places on all
        wait_for(lambda: all(http.get(f"/v1/requests/{h.id}").status_code == 202
                             for h in on), 10, "the gateway to see the new shards")
        ids = [http.post("/v1/requests", json={"payload": i}).json()["id"] for i in range(6)]
        assert {shard_of(client, queue, i) for i in ids} == {0, 1, 2}


def test_shards_on_different_cluster_nodes(redis_cluster, queue, inprocess_consumer, tmp_path):
    """On a real 6-node cluster the shards' hash tags fall on different primaries; two
    consumers (waking on each shard's marker from a thread per shard) answer every
    request once, and a HIGH on another shard still goes first."""
    url, client = redis_cluster.url, redis_cluster.client()
    shards = 6
    configure(url, queue, shards=shards, strategy="priority", max_batch_size=4,
              max_queue_delay_ms=0)
    nodes = {client.get_node_from_key(k.policy).name for k in shard_keys(queue, shards)}
    assert len(nodes) >= 2, nodes
    model = RecordingModel(tmp_path)
    with ShardedProducer(url, queue) as p:
        normal = p.submit_many([{"n": i} for i in range(4)])  # shard 0
        high = p.submit({"high": 1}, priority=Priority.HIGH)  # shard 1
        model.serve(inprocess_consumer, url, queue)
        assert high.result(timeout=30) == {"high": 1}
        assert [h.result(timeout=30) for h in normal] == [{"n": i} for i in range(4)]
        assert model.batches()[0]["payloads"] == [{"high": 1}]
        model.serve(inprocess_consumer, url, queue)
        # idle consumers wake for arrivals on any shard
        handles = [p.submit({"i": i}) for i in range(40)]
        assert [h.result(timeout=30) for h in handles] == [{"i": i} for i in range(40)]
    ran = [x["i"] for x in model.payloads() if "i" in x]
    assert sorted(ran) == list(range(40))
    assert queue_stats(client, queue).processed == 45


def test_async_sharded_producer_round_trip(shared_redis, queue, inprocess_consumer, tmp_path):
    url = shared_redis.url
    configure(url, queue, shards=S, strategy="fifo")
    RecordingModel(tmp_path).serve(inprocess_consumer, url, queue)

    async def main() -> None:
        async with AsyncShardedProducer(url, queue, placement="least_depth") as p:
            assert p.shards == S
            handles = [await p.submit({"i": i}) for i in range(9)]
            handles += await p.submit_many([{"i": i} for i in range(9, 12)], store_result=True,
                                           idempotency_keys=["a", "b", "c"])
            assert await asyncio.gather(*(h.result(timeout=30) for h in handles)) == \
                [{"i": i} for i in range(12)]
            assert (await p.fetch(handles[-1].id)).value == {"i": 11}

    asyncio.run(main())
    assert queue_stats(shared_redis.client(), queue).processed == 12


def test_sharded_producers_connect_every_shard_ahead(shared_redis, queue, inprocess_consumer,
                                                     tmp_path):
    """connect() sets up each shard's producer before traffic (its result listener, the
    enqueue script), sync and asyncio; submits then work as before."""
    url = shared_redis.url
    configure(url, queue, shards=S, strategy="fifo")
    RecordingModel(tmp_path).serve(inprocess_consumer, url, queue)

    def listeners() -> int:
        return sum(t.name.startswith("batchgate-listener-") for t in threading.enumerate())

    before = listeners()
    with ShardedProducer(url, queue) as p:
        assert p.connect() is p
        assert listeners() == before + S
        assert [p.submit({"i": i}).result(timeout=30) for i in range(S)] == \
            [{"i": i} for i in range(S)]

    async def main() -> None:
        async with AsyncShardedProducer(url, queue) as ap:
            assert await ap.connect() is ap
            assert ap.shards == S
            assert all(shard._listener is not None for shard in ap.producers)
            assert await (await ap.submit({"b": 2})).result(timeout=30) == {"b": 2}

    asyncio.run(main())


def test_exporter_sums_a_sharded_queue(shared_redis, queue):
    from scheduler_core.ops.reading import read_queue

    url, client = shared_redis.url, shared_redis.client()
    configure(url, queue, shards=S)
    with ShardedProducer(url, queue) as p:
        p.submit_many([{"i": i} for i in range(4)])  # shard 0
        p.submit({"i": 4}, priority=Priority.HIGH)  # shard 1
        p.submit({"i": 5}, priority=Priority.LOW)  # shard 2
    reading = read_queue(client, queue, 100)
    assert reading.depth == [1, 4, 1]
    assert len(reading.oldest_us) == 3


def test_consumers_exit_to_be_restarted_when_shards_grow(shared_redis, queue, start_consumer,
                                                         tmp_path):
    url = shared_redis.url
    configure(url, queue, shards=2)
    consumer = RecordingModel(tmp_path).start(start_consumer, url, queue, "--lease-ms", "600")
    out = CliRunner().invoke(cli, ["policy", "set", "--redis-url", url, "--queue", queue,
                                   "--shards", "3"])
    assert out.exit_code == 0, out.output
    # the lease thread reads the policy every min(lease_ms / 3, 1 s)
    assert consumer.proc.wait(timeout=20) == 4, consumer.output()
    assert "shards changed 2 -> 3" in consumer.output()
    assert read_policy(shared_redis.client(), shard_name(queue, 2)).shards == 3


# -- the other entry points: gateway, `batchgate submit`/`result`, `batchgate bulk` -------
def gateway_http(start_gateway, url: str, queue: str):
    httpx = pytest.importorskip("httpx")
    gateway = start_gateway(url, queue)
    return httpx.Client(base_url=gateway.url, timeout=30)


@pytest.fixture
def start_gateway():
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from helpers.servers import gateway_factory
    yield from gateway_factory()


def shard_of(client, queue: str, request_id: str) -> int:
    """The shard whose keys know the request (its job, or its stored result)."""
    held = [i for i, keys in enumerate(shard_keys(queue))
            if client.hexists(keys.jobs, request_id) or client.exists(keys.result(request_id))]
    assert len(held) == 1, held
    return held[0]


def test_gateway_places_over_the_shards_and_answers(shared_redis, queue, inprocess_consumer,
                                                    start_gateway, tmp_path):
    url, client = shared_redis.url, shared_redis.client()
    model = RecordingModel(tmp_path)
    model.serve(inprocess_consumer, url, queue, shards=S)  # stores shards=3
    with gateway_http(start_gateway, url, queue) as http:
        ids = []
        for i in range(6):
            done = http.post("/v1/requests", json={"payload": {"i": i}, "wait": True})
            assert done.status_code == 200, done.text
            assert done.json()["result"] == {"i": i}
            ids.append(done.json()["id"])
        # round robin: two on each shard, each shard's keys under its own hash tag
        assert sorted(shard_of(client, queue, rid) for rid in ids) == [0, 0, 1, 1, 2, 2]
        for i, rid in enumerate(ids):  # found in whichever shard ran it
            got = http.get(f"/v1/requests/{rid}")
            assert got.status_code == 200 and got.json()["result"] == {"i": i}, got.text
        streamed = http.post("/v1/requests", json={"payload": {"i": 6}, "stream": True})
        assert streamed.status_code == 200 and "event: result" in streamed.text
        assert http.get("/v1/stats").json()["processed"] == 7
    assert sorted(p["i"] for p in model.payloads()) == list(range(7))  # each once


def test_gateway_finds_and_cancels_requests_on_any_shard(shared_redis, queue, start_gateway):
    url, client = shared_redis.url, shared_redis.client()
    configure(url, queue, shards=S)
    with gateway_http(start_gateway, url, queue) as http, ShardedProducer(url, queue) as p:
        # Stored by id, as the gateway's own submits are: read back through GET.
        on = [p.submit({"i": i}, store_result=True) for i in range(S)]  # shards 0, 1, 2
        late = p.submit({"late": True}, deadline_ms=300, store_result=True)  # shard 0
        soon = p.submit({"soon": True}, deadline_ms=300, store_result=True)  # shard 1
        assert [shard_of(client, queue, h.id) for h in on] == [0, 1, 2]
        assert shard_of(client, queue, soon.id) == 1
        got = http.get(f"/v1/requests/{on[2].id}")
        assert got.status_code == 202 and got.json()["status"] == "queued", got.text
        cancelled = http.delete(f"/v1/requests/{on[1].id}")
        assert cancelled.status_code == 200, cancelled.text
        assert cancelled.json()["status"] == "cancelled"
        assert http.get(f"/v1/requests/{on[1].id}").status_code == 410
        with pytest.raises(RequestFailed, match=CANCELLED):  # its producer hears of it
            on[1].result(timeout=10)
    assert request_state(client, queue, on[1].id).status == "cancelled"
    assert request_state(client, queue, on[2].id).status == "queued"
    with gateway_http(start_gateway, url, queue) as http:
        time.sleep(0.4)  # past both deadlines; no consumer popped them
        for handle in (late, soon):
            expired = http.get(f"/v1/requests/{handle.id}")
            assert expired.status_code == 504 and expired.json()["status"] == "expired"
        assert http.delete(f"/v1/requests/{'0' * 32}").status_code == 404
        assert http.get(f"/v1/requests/{'0' * 32}").status_code == 404
    assert queue_stats(client, queue).cancelled == 1


def test_cli_submit_and_result_on_a_sharded_queue(shared_redis, queue, inprocess_consumer,
                                                  tmp_path):
    url, client = shared_redis.url, shared_redis.client()
    configure(url, queue, shards=S)
    base = ["--redis-url", url, "--queue", queue]
    ids = []
    for i in range(S):  # one process each: the emptiest shard each time
        out = CliRunner().invoke(cli, ["submit", *base, json.dumps({"i": i})])
        assert out.exit_code == 0, out.output
        ids.append(out.stdout.strip())
    assert sorted(shard_of(client, queue, rid) for rid in ids) == [0, 1, 2]
    queued = CliRunner().invoke(cli, ["result", *base, "--json", ids[2]])
    assert queued.exit_code == 3 and "queued" in queued.output, queued.output
    RecordingModel(tmp_path).serve(inprocess_consumer, url, queue)
    for i, rid in enumerate(ids):
        got = CliRunner().invoke(cli, ["result", *base, "--wait", "--timeout", "30", rid])
        assert got.exit_code == 0 and json.loads(got.stdout) == {"i": i}, got.output
    waited = CliRunner().invoke(cli, ["submit", *base, "--wait", '{"i": 9}'])
    assert waited.exit_code == 0 and json.loads(waited.stdout) == {"i": 9}, waited.output


def test_bulk_run_spreads_its_lines_over_the_shards(shared_redis, queue, inprocess_consumer,
                                                    tmp_path):
    """Each line goes to the shard its idempotency key hashes to; a line whose earlier
    request vanished (a key left by a run that died long ago, on that key's shard) is
    submitted again; every line gets one record and runs once."""
    from producer.bulk.engine import BulkSpec, create_state, run_bulk
    from producer.bulk.state import StateStore

    url, client = shared_redis.url, shared_redis.client()
    model = RecordingModel(tmp_path)
    model.serve(inprocess_consumer, url, queue, shards=S, delay_ms=5)
    lines = 90
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"i": i}) + "\n"
                                               for i in range(1, lines + 1)))
    spec = BulkSpec(job_id=f"shards-{queue}", input=str(tmp_path / "in.jsonl"),
                    output=str(tmp_path / "out.jsonl"), redis_url=url, queue=queue,
                    window=16, lease_s=1)
    state = create_state(StateStore(client, spec.job_id), spec)
    key = f"bulk:{spec.job_id}:{state.epoch}:1"
    with ShardedProducer(url, queue) as p:
        home = p.producers[zlib.crc32(key.encode()) % S].config.queue
    client.set(QueueKeys(home).idempotency(key), "gone1")
    final = run_bulk(spec)
    assert (final.state, final.done, final.errors) == ("done", lines, 0)
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["line"] for r in records] == list(range(1, lines + 1))
    assert [r["result"] for r in records] == [{"i": i} for i in range(1, lines + 1)]
    assert sorted(p["i"] for p in model.payloads()) == list(range(1, lines + 1))  # once
    processed = [int(client.hget(k.stats, "processed") or 0) for k in shard_keys(queue)]
    assert sum(processed) == lines and all(n > 0 for n in processed), processed


def test_gateway_on_a_sharded_queue_across_cluster_nodes(redis_cluster, queue, inprocess_consumer,
                                                          start_gateway, tmp_path):
    """The gateway's one pipeline over the shards spans several primaries."""
    url, client = redis_cluster.url, redis_cluster.client()
    shards = 6
    configure(url, queue, shards=shards)
    nodes = {client.get_node_from_key(k.policy).name for k in shard_keys(queue, shards)}
    assert len(nodes) >= 2, nodes
    with gateway_http(start_gateway, url, queue) as http, ShardedProducer(url, queue) as p:
        queued = [p.submit({"q": i}, store_result=True) for i in range(shards)]  # each shard
        for handle in queued:
            got = http.get(f"/v1/requests/{handle.id}")
            assert got.status_code == 202 and got.json()["status"] == "queued", got.text
        assert http.delete(f"/v1/requests/{queued[4].id}").status_code == 200
        assert http.get(f"/v1/requests/{queued[4].id}").status_code == 410
        RecordingModel(tmp_path).serve(inprocess_consumer, url, queue)
        ids = []
        for i in range(shards):
            done = http.post("/v1/requests", json={"payload": {"i": i}, "wait": True})
            assert done.status_code == 200 and done.json()["result"] == {"i": i}, done.text
            ids.append(done.json()["id"])
        for handle in queued[:4] + queued[5:]:
            assert handle.result(timeout=30)["q"] in range(shards)
        for rid in ids + [h.id for h in queued[:4]]:
            assert http.get(f"/v1/requests/{rid}").status_code == 200
    placed = {i for i, keys in enumerate(shard_keys(queue, shards)) for rid in ids
              if client.exists(keys.result(rid))}
    assert placed == set(range(shards))


def test_a_gateway_started_while_redis_is_down_reads_the_shards_at_its_first_request(
        redis_server, queue, start_gateway):
    url = redis_server.url
    redis_server.kill()
    with gateway_http(start_gateway, url, queue) as http:
        assert http.get("/healthz").status_code == 503
        redis_server.start()
        configure(url, queue, shards=S)
        ids = [http.post("/v1/requests", json={"payload": {"i": i}}).json()["id"]
               for i in range(S)]
        client = redis_server.client()
        assert sorted(shard_of(client, queue, rid) for rid in ids) == [0, 1, 2]
        assert all(http.get(f"/v1/requests/{rid}").status_code == 202 for rid in ids)
