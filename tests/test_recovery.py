"""Crash recovery (docs/failure-modes.md, docs/guarantees.md "Consumer crash"), with
consumers SIGKILLed mid-batch: the lease lapses, the requests go back to the head of
their level (arrival time kept) ahead of newer arrivals, a re-queued request can be
cancelled, and recovery takes about lease_ms + one sweep interval."""

from __future__ import annotations

import signal
import time

import pytest
from helpers.support import RecordingModel, configure, wait_for

from producer import Producer, RequestCancelled
from scheduler_core.keys import QueueKeys
from scheduler_core.ops.stats import queue_stats
from scheduler_core.scripts import Scripts, requeue_keys


def lease_lapsed(client, queue: str) -> bool:
    """Every in-flight batch's lease deadline has passed, by Redis' clock."""
    seconds, micros = client.time()
    leases = client.zrange(QueueKeys(queue).inflight, 0, -1, withscores=True)
    return bool(leases) and all(score < seconds * 1e6 + micros for _, score in leases)


def doomed_batch(server, queue, start_consumer, model, lease_ms, payloads,
                 priority="normal", delay_ms=60_000):
    """Submit `payloads` to a consumer that starts running them (for `delay_ms`): returns
    (that consumer, the producer, the handles)."""
    doomed = model.start(start_consumer, server.url, queue, "--lease-ms", str(lease_ms),
                         delay_ms=delay_ms, stamp=True)
    p = Producer(server.url, queue)
    handles = p.submit_many(payloads, priority=priority, store_result=True)
    wait_for(lambda: model.batches(doomed.proc.pid), what="the batch to start")
    assert [b["payloads"] for b in model.batches(doomed.proc.pid)] == [payloads]
    return doomed, p, handles


def test_recovery_takes_about_the_lease_plus_a_sweep(shared_redis, queue, start_consumer,
                                                     tmp_path):
    lease_ms = 1000
    sweep_s = min(lease_ms / 4000, 5.0)  # how often a live consumer sweeps
    configure(shared_redis.url, queue, strategy="dynamic", max_batch_size=4,
              max_queue_delay_ms=0)
    model = RecordingModel(tmp_path)
    payloads = [{"i": i} for i in range(3)]
    doomed, p, handles = doomed_batch(shared_redis, queue, start_consumer, model, lease_ms,
                                      payloads)
    with p:
        survivor = model.start(start_consumer, shared_redis.url, queue, "--lease-ms",
                               str(lease_ms), stamp=True)  # idle, sweeping
        doomed.kill()
        killed_at = time.monotonic()
        results = [h.result(timeout=30) for h in handles]
        recovered_s = time.monotonic() - killed_at
    print(f"\nrecovered {recovered_s:.2f}s after the SIGKILL (lease {lease_ms} ms, sweep "
          f"every {sweep_s:.2f}s)")
    assert results == [{"by": survivor.proc.pid, "payload": x} for x in payloads]
    # Not before the lease lapsed: it was renewed every lease/3 until the kill.
    assert recovered_s >= lease_ms / 1000 * 2 / 3 - 0.05
    assert recovered_s <= 3 * (lease_ms / 1000 + sweep_s)
    stats = queue_stats(shared_redis.client(), queue)
    assert (stats.requeued, stats.processed, stats.in_flight_requests) == (3, 3, 0)


def test_a_requeued_request_goes_to_the_head_of_its_level(shared_redis, queue,
                                                          start_consumer, tmp_path):
    """LOW requests of a crashed batch go back ahead of LOW requests that arrived after
    them (and behind nothing of their level), so they are served first, each alone."""
    lease_ms = 300
    configure(shared_redis.url, queue, strategy="priority", max_batch_size=8)
    model = RecordingModel(tmp_path)
    crashed = [{"crashed": i} for i in range(2)]
    doomed, p, handles = doomed_batch(shared_redis, queue, start_consumer, model, lease_ms,
                                      crashed, priority="low")
    doomed.kill()
    with p:
        newer = [{"newer": i} for i in range(3)]
        handles += p.submit_many(newer, priority="low")
        client = shared_redis.client()
        wait_for(lambda: lease_lapsed(client, queue), what="the lease to lapse")
        survivor = model.start(start_consumer, shared_redis.url, queue)  # sweeps, then pops
        assert [h.result(timeout=15) for h in handles] == crashed + newer
    # Re-delivered requests run alone (a poison payload fails alone), then the rest.
    assert [b["payloads"] for b in model.batches(survivor.proc.pid)] == [
        [crashed[0]], [crashed[1]], newer]
    assert queue_stats(client, queue).requeued == 2


def test_a_requeued_request_can_be_cancelled(shared_redis, queue, start_consumer, tmp_path):
    """Its consumer frozen (SIGSTOP) past the lease, the request is re-queued: waiting
    again, so cancellable; the frozen consumer's late result, once it wakes up, is refused
    and the request stays cancelled."""
    lease_ms = 300
    configure(shared_redis.url, queue, strategy="fifo")
    model = RecordingModel(tmp_path)
    stale, p, [handle] = doomed_batch(shared_redis, queue, start_consumer, model, lease_ms,
                                      [{"crashed": 0}], delay_ms=1500)
    stale.signal(signal.SIGSTOP)
    with p:
        client = shared_redis.client()
        assert handle.cancel() == "running"  # in the frozen consumer's batch
        wait_for(lambda: lease_lapsed(client, queue), what="the lease to lapse")
        # The sweep any live consumer runs puts it back: waiting again, so cancellable.
        keys = QueueKeys(queue)
        assert Scripts(client).requeue_expired(keys=requeue_keys(keys), args=[10]) == [1, 1]
        assert client.zscore(keys.pending(1), handle.id) is not None
        assert handle.cancel() == "cancelled"
        with pytest.raises(RequestCancelled):
            handle.result(timeout=5)
        stale.signal(signal.SIGCONT)
        wait_for(lambda: "results were refused" in stale.output(), what="the late result")
        assert p.fetch(handle.id).error_type == "Cancelled"
        assert p.submit({"after": 1}).result(timeout=15)["payload"] == {"after": 1}
    assert model.payloads().count({"crashed": 0}) == 1  # never re-run
    stats = queue_stats(client, queue)
    assert (stats.requeued, stats.cancelled, stats.processed) == (1, 1, 1)
