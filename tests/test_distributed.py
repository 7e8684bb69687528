"""Many consumer processes on one queue, crashes and leases: every request is answered
exactly once, and a consumer that lost its lease can never deliver a result."""

from __future__ import annotations

import collections
import signal
import threading
import time

import pytest
from helpers.support import RecordingModel, configure, snapshot, wait_for

from consumer.batch import Batch, parse_pop
from producer import Producer, RequestFailed
from scheduler_core.keys import QueueKeys
from scheduler_core.ops.stats import queue_stats
from scheduler_core.scripts import (
    Scripts,
    complete_keys,
    extend_lease_keys,
    pop_keys,
    requeue_keys,
)
from scheduler_core.wire import decode_result, encode_result


def test_many_consumers_answer_every_request_exactly_once(shared_redis, queue,
                                                          start_consumer, tmp_path):
    total, producers, consumers = 2400, 2, 3
    model = RecordingModel(tmp_path)
    procs = [model.start(start_consumer, shared_redis.url, queue, "--strategy", "dynamic",
                         "--max-batch-size", "32", "--max-queue-delay-ms", "5", ready=False)
             for _ in range(consumers)]
    for proc in procs:
        proc.wait_ready()
    results: dict[int, list[tuple[dict, object]]] = {}
    errors: list[BaseException] = []

    def produce(k: int) -> None:
        try:
            with Producer(shared_redis.url, queue) as p:
                handles = []
                for start in range(0, total // producers, 100):
                    chunk = [{"p": k, "i": i} for i in range(start, start + 100)]
                    handles += list(zip(chunk, p.submit_many(chunk), strict=True))
                    time.sleep(0.005)
                results[k] = [(payload, h.result(timeout=60)) for payload, h in handles]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=produce, args=(k,)) for k in range(producers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not errors, errors
    # Each producer got each of its own results, with the right value.
    for k in range(producers):
        assert len(results[k]) == total // producers
        assert all(payload == value for payload, value in results[k])

    # No request ran in two batches (or twice): the union of all batches, across the
    # consumer processes, holds every request exactly once.
    batches = model.batches()
    ran = collections.Counter((x["p"], x["i"]) for b in batches for x in b["payloads"])
    assert len(ran) == total and set(ran.values()) == {1}
    assert all(len(b["payloads"]) <= 32 for b in batches)
    assert len({b["pid"] for b in batches}) >= 2, "the work was shared between processes"
    assert {b["pid"] for b in batches} <= {proc.proc.pid for proc in procs}

    client = shared_redis.client()
    stats = queue_stats(client, queue)
    assert stats.processed == total and stats.failed == 0 and stats.requeued == 0
    assert stats.in_flight_requests == 0 and stats.in_flight_batches == 0
    assert stats.depth == {"high": 0, "normal": 0, "low": 0}
    assert stats.consumers_alive == consumers
    keys = QueueKeys(queue)
    assert client.hlen(keys.jobs) == 0
    # Each result was delivered once: inboxes drained, nothing left over.
    assert not list(client.scan_iter(match=keys.inbox("*").replace("{", "\\{")
                                     .replace("}", "\\}")))


def test_sigkilled_consumer_batch_is_answered_by_another_after_the_lease(
        shared_redis, queue, start_consumer, tmp_path):
    lease_ms = 1000
    model = RecordingModel(tmp_path)
    doomed = model.start(start_consumer, shared_redis.url, queue, "--strategy", "dynamic",
                         "--max-batch-size", "8", "--max-queue-delay-ms", "0",
                         "--lease-ms", str(lease_ms), delay_ms=60_000)
    client = shared_redis.client()
    with Producer(shared_redis.url, queue) as p:
        payloads = [{"i": i} for i in range(3)]
        handles = p.submit_many(payloads)
        wait_for(lambda: model.batches(doomed.proc.pid), what="the batch to start")
        assert queue_stats(client, queue).in_flight_requests == 3
        doomed.kill()  # SIGKILL mid-batch: no completion, no lease renewal
        killed_at = time.monotonic()
        survivor = model.start(start_consumer, shared_redis.url, queue, "--lease-ms",
                               str(lease_ms))
        assert [h.result(timeout=20) for h in handles] == payloads
        assert time.monotonic() - killed_at < 20
    assert [b["payloads"] for b in model.batches(doomed.proc.pid)] == [payloads]
    # The survivor ran each of them once (re-delivered requests may run in batches of
    # their own, so that a poison payload fails alone).
    assert sorted(x["i"] for b in model.batches(survivor.proc.pid) for x in b["payloads"]) \
        == [0, 1, 2]
    stats = queue_stats(client, queue)
    assert stats.requeued == 3 and stats.processed == 3 and stats.dead_letters == 0
    assert stats.in_flight_requests == 0


def test_a_hung_consumer_loses_its_batch_and_its_late_results_are_refused(
        shared_redis, queue, start_consumer, tmp_path):
    """A consumer frozen (SIGSTOP: model and lease thread alike) past its lease: another
    consumer answers its requests; when it wakes up and completes, it is refused."""
    lease_ms = 500
    model = RecordingModel(tmp_path)
    hung = model.start(start_consumer, shared_redis.url, queue, "--strategy", "fifo",
                       "--max-batch-size", "4", "--lease-ms", str(lease_ms), delay_ms=300,
                       stamp=True)
    client = shared_redis.client()
    with Producer(shared_redis.url, queue) as p:
        payloads = [{"i": i} for i in range(3)]
        handles = p.submit_many(payloads, store_result=True)
        wait_for(lambda: model.batches(hung.proc.pid), what="the batch to start")
        hung.signal(signal.SIGSTOP)
        try:
            other = model.start(start_consumer, shared_redis.url, queue, "--lease-ms",
                                str(lease_ms), delay_ms=300, stamp=True)
            results = [h.result(timeout=20) for h in handles]
        finally:
            hung.signal(signal.SIGCONT)
        assert results == [{"by": other.proc.pid, "payload": x} for x in payloads]
        wait_for(lambda: "results were refused" in hung.output(), what="the late completion")
        # The late results changed nothing: stored results are the other consumer's, and
        # each request counts as processed once.
        for h in handles:
            assert p.fetch(h.id).value["by"] == other.proc.pid
    stats = queue_stats(client, queue)
    assert stats.processed == 3 and stats.requeued == 3 and stats.in_flight_requests == 0
    assert hung.proc.poll() is None  # it carries on serving


def test_a_batch_longer_than_the_lease_is_not_requeued_while_its_consumer_lives(
        shared_redis, queue, start_consumer, tmp_path):
    """The lease is renewed from another thread while the model runs; a second consumer
    sweeping for expired leases must not take the batch away. (A 1 s lease, renewed every
    333 ms, for a 3 s batch: a stall of the lease thread under 0.6 s loses nothing.)"""
    model = RecordingModel(tmp_path)
    procs = [model.start(start_consumer, shared_redis.url, queue, "--strategy", "fifo",
                         "--lease-ms", "1000", delay_ms=3000, ready=False) for _ in range(2)]
    for proc in procs:
        proc.wait_ready()
    with Producer(shared_redis.url, queue) as p:
        assert p.submit({"long": 1}).result(timeout=20) == {"long": 1}
    assert model.payloads() == [{"long": 1}]
    stats = queue_stats(shared_redis.client(), queue)
    assert stats.requeued == 0 and stats.processed == 1


# -- fencing, driven through the Lua scripts as a stale consumer would ------------------


def _pop(scripts: Scripts, keys: QueueKeys, consumer: str, lease_ms: int) -> Batch:
    batch = parse_pop(scripts.pop_batch(keys=pop_keys(keys), args=[consumer, lease_ms]))
    assert isinstance(batch, Batch), batch
    return batch


def _complete(scripts: Scripts, keys: QueueKeys, batch: Batch, value: str) -> list[int]:
    args: list[object] = [batch.id, 600, len(batch.items)]
    for item in batch.items:
        args += [item.id, "ok", encode_result(item.id, value)]
    reply = scripts.complete(
        keys=complete_keys(keys, [(item.id, item.producer) for item in batch.items]),
        args=args)
    return [int(x) for x in reply]


def test_stale_consumer_late_completion_is_refused(redis_server, queue):
    client = redis_server.client()
    scripts, keys = Scripts(client), QueueKeys(queue)
    configure(redis_server.url, queue, strategy="fifo", max_batch_size=4)
    with Producer(redis_server.url, queue) as p:
        handles = p.submit_many([{"i": 0}, {"i": 1}], store_result=True)
        stale = _pop(scripts, keys, "stale", 100)
        assert [item.id for item in stale.items] == [h.id for h in handles]
        time.sleep(0.2)  # the stale consumer hangs past its 100 ms lease
        assert scripts.requeue_expired(keys=requeue_keys(keys), args=[10]) == [1, 2]
        # The stale consumer's heartbeat learns its batch is gone.
        assert scripts.extend_lease(keys=extend_lease_keys(keys),
                                    args=["stale", stale.id, 1000]) == 0

        # Completing after the re-queue, before anyone re-took the requests: refused, and
        # nothing is written (the requests wait for another consumer).
        before = snapshot(client)
        assert _complete(scripts, keys, stale, "stale") == [-1]
        assert snapshot(client) == before
        assert client.zcard(keys.pending(1)) == 2

        fresh = []  # another consumer re-takes both (in one batch or in two)
        while sum(len(b.items) for b in fresh) < 2:
            fresh.append(_pop(scripts, keys, "fresh", 10_000))
        assert stale.id not in {b.id for b in fresh}
        assert [item.attempts for b in fresh for item in b.items] == [2, 2]
        # Completing after another consumer re-took them: refused as well.
        before = snapshot(client)
        assert _complete(scripts, keys, stale, "stale") == [-1]
        assert snapshot(client) == before

        for b in fresh:
            assert _complete(scripts, keys, b, "fresh") == [len(b.items), 0, 0]
        assert [h.result(timeout=5) for h in handles] == ["fresh", "fresh"]
        # And after the fresh result is stored, a late stale one cannot overwrite it.
        assert _complete(scripts, keys, stale, "stale") == [-1]
        for h in handles:
            assert decode_result(client.get(keys.result(h.id))).value == "fresh"
        assert p.fetch(handles[0].id).value == "fresh"
    inbox_items = client.llen(keys.inbox(p.id))
    assert inbox_items == 0  # each result was delivered once, by the fresh batch only
    assert queue_stats(client, queue).processed == 2


def test_request_is_dead_lettered_after_max_attempts(redis_server, queue, inprocess_consumer,
                                                     tmp_path):
    client = redis_server.client()
    scripts, keys = Scripts(client), QueueKeys(queue)
    configure(redis_server.url, queue, strategy="fifo", max_attempts=2)
    model = RecordingModel(tmp_path)
    with Producer(redis_server.url, queue) as p:
        handle = p.submit({"poison": 1})
        for attempt in (1, 2):  # two consumers crash on it in turn
            batch = _pop(scripts, keys, f"crashes-{attempt}", 100)
            assert [(i.attempts, i.state) for i in batch.items] == [(attempt, "run")]
            time.sleep(0.15)
            assert scripts.requeue_expired(keys=requeue_keys(keys), args=[10]) == [1, 1]
        # A real consumer gets the third delivery: it must not run it, but fail it into
        # the dead-letter set.
        model.serve(inprocess_consumer, redis_server.url, queue)
        with pytest.raises(RequestFailed, match="DeadLettered"):
            handle.result(timeout=10)
    assert model.payloads() == []
    assert client.zrange(keys.dead, 0, -1) == [handle.id.encode()]
    assert b"DeadLettered" in client.hget(keys.dead_reason, handle.id)
    stats = queue_stats(client, queue)
    assert stats.dead_letters == 1 and stats.failed == 1 and stats.processed == 0
