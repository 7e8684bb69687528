"""Failure guarantees (docs/guarantees.md), each injected for real: poison input, hung and
CPU-bound models, graceful shutdown, cancellation, dead producers, overload. Real
redis-server processes, real `batchgate consumer` processes where a process dies, hangs
or is signalled (a crash is os._exit or SIGKILL, a hang is SIGSTOP or a model that sleeps
past --max-batch-ms); a Consumer in the test process for the rest (its log read through
caplog)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import redis
from click.testing import CliRunner
from helpers.failure_support import CountingProducer, executions, serve, start, wait_for
from helpers.support import alive, configure, started

from batchgate.cli import main as cli
from producer import Producer, QueueFull, RequestCancelled, RequestFailed
from scheduler_core.admin import read_policy
from scheduler_core.deadletter import list_dead
from scheduler_core.keys import QueueKeys
from scheduler_core.ops.stats import queue_stats


def stats(server, queue):
    return queue_stats(server.client(), queue)


# -- poison input -----------------------------------------------------------------------
def test_model_raising_for_one_payload_fails_only_that_request(shared_redis, queue,
                                                                inprocess_consumer, tmp_path):
    serve(inprocess_consumer, shared_redis.url, queue, "Poison",
          {"strategy": "dynamic", "max_batch_size": 16, "max_queue_delay_ms": 200},
          log=tmp_path)
    with CountingProducer(shared_redis.url, queue) as p:
        handles = p.submit_many([{"i": i, "raise": i == 5} for i in range(16)])
        for i, h in enumerate(handles):
            if i == 5:
                with pytest.raises(RequestFailed, match="poison payload 5") as info:
                    h.result(timeout=15)
                assert info.value.error_type == "ValueError"
            else:
                assert h.result(timeout=15)["echo"] == {"i": i, "raise": False}
        assert p.delivered_once(handles)
    s = stats(shared_redis, queue)
    assert (s.processed, s.failed, s.requeued, s.batches) == (15, 1, 0, 1)
    # One batch of 16, bisected: the poison ran 1 + log2(16) times, each other at most 5.
    runs = executions(tmp_path)
    assert runs["5"] == 5
    assert all(1 <= runs[str(i)] <= 5 for i in range(16))


def test_a_model_exception_that_cannot_be_printed_fails_only_its_request(
        shared_redis, queue, inprocess_consumer, tmp_path):
    """str() of the model's exception raises: the request fails with the type's name and
    "<unprintable>"; the consumer lives on and its batch-mates are answered, not re-run."""
    consumer = serve(inprocess_consumer, shared_redis.url, queue, "Poison",
                     {"strategy": "dynamic", "max_batch_size": 4, "max_queue_delay_ms": 200},
                     log=tmp_path)
    with CountingProducer(shared_redis.url, queue) as p:
        handles = p.submit_many([{"i": i, "unprintable": i == 2} for i in range(4)])
        with pytest.raises(RequestFailed, match="<unprintable>") as info:
            handles[2].result(timeout=15)
        assert info.value.error_type == "Unprintable"
        assert [h.result(timeout=15)["echo"]["i"] for i, h in enumerate(handles)
                if i != 2] == [0, 1, 3]
        assert p.delivered_once(handles)
    assert not consumer.stopping.is_set()  # it lives on
    s = stats(shared_redis, queue)
    assert (s.processed, s.failed, s.requeued) == (3, 1, 0)


def test_payload_crashing_the_process_is_dead_lettered(redis_server, queue, start_consumer,
                                                       tmp_path):
    """os._exit in the model on one payload: after max_attempts deliveries it is
    dead-lettered and its producer gets RequestFailed(DeadLettered); its batch-mates run
    alone on their retry and are answered. Then `dead-letter list/retry` once cured."""
    url, cured = redis_server.url, tmp_path / "cured"
    policy = ["--strategy", "dynamic", "--max-batch-size", "8", "--max-queue-delay-ms", "100",
              "--max-attempts", "3", "--lease-ms", "500"]
    procs = [start(start_consumer, url, queue, "Poison", *policy, log=tmp_path, cured=cured)]
    stop = threading.Event()

    def supervise() -> None:  # what systemd / Kubernetes would do: restart what dies
        while not stop.is_set():
            alive = [c for c in procs if c.proc.poll() is None]
            if len(alive) < 2:
                procs.append(start(start_consumer, url, queue, "Poison", "--lease-ms", "500",
                                   ready=False, log=tmp_path, cured=cured))
            time.sleep(0.1)

    supervisor = threading.Thread(target=supervise, daemon=True)
    supervisor.start()
    try:
        with CountingProducer(url, queue) as p:
            handles = p.submit_many([{"i": i, "crash": i == 3} for i in range(8)])
            with pytest.raises(RequestFailed, match="max_attempts") as info:
                handles[3].result(timeout=60)
            assert info.value.error_type == "DeadLettered"
            for i, h in enumerate(handles):
                if i != 3:
                    assert h.result(timeout=30)["echo"]["i"] == i
            assert p.delivered_once(handles)
            poison = handles[3].id
        runs = executions(tmp_path)
        assert runs["3"] == 3  # delivered and run max_attempts times, then given up
        assert all(1 <= runs[str(i)] <= 2 for i in range(8) if i != 3)
        s = stats(redis_server, queue)
        assert s.dead_letters == 1 and s.processed == 7 and s.failed == 1
        assert s.requeued >= 8 + 2  # the whole first batch, then the poison twice alone

        runner = CliRunner()
        listed = runner.invoke(cli, ["dead-letter", "list", "--redis-url", url, "--queue",
                                     queue, "--json"])
        assert listed.exit_code == 0, listed.output
        body = json.loads(listed.output)
        assert body["total"] == 1
        [entry] = body["entries"]
        assert entry["id"] == poison and entry["error_type"] == "DeadLettered"
        assert '"crash":true' in entry["payload_preview"]
        # The count listed is the one the message gives: deliveries, 3 = max_attempts.
        assert entry["attempts"] == 3 and "gave up after 3 deliveries" in entry["message"]
        text = runner.invoke(cli, ["dead-letter", "list", "--redis-url", url, "--queue",
                                   queue]).output
        assert f"{poison}  deliveries=3  DeadLettered: gave up after 3 deliveries" in text

        cured.touch()
        retried = runner.invoke(cli, ["dead-letter", "retry", "--redis-url", url, "--queue",
                                      queue, "--all"])
        assert retried.exit_code == 0 and "retried 1, skipped 0" in retried.output
        with Producer(url, queue) as p:
            result = wait_for(lambda: p.fetch(poison), 30, "the retried request's result")
        assert result.ok and result.value["echo"]["i"] == 3
        s = stats(redis_server, queue)
        assert s.dead_letters == 0 and s.processed == 8
    finally:
        stop.set()
        supervisor.join()


def test_malformed_entries_written_by_hand_are_dead_lettered(redis_server, queue,
                                                             start_consumer, tmp_path):
    consumer = start(start_consumer, redis_server.url, queue, "Echo", "--strategy", "fifo",
                     log=tmp_path)
    r, keys = redis_server.client(), QueueKeys(queue)
    # meta: priority 1, arrival 1 us, no deadline, 0 attempts, result not kept, no producer
    meta_ok = b"1:1:0:0:0:|"
    r.hset(keys.jobs, mapping={"garbage": meta_ok + b"\xff\xfenot json",
                               "wrongver": meta_ok + b'{"v":9}', "badmeta": "x:y",
                               "nometa": b'{"v":1,"payload":1}'})  # "nojob": none at all
    r.zadd(keys.pending(1), {"garbage": 1, "wrongver": 2, "nojob": 3, "badmeta": 4,
                             "nometa": 5})
    r.zadd(keys.marker, {"w": 0})
    bad = {"garbage", "wrongver", "nojob", "badmeta", "nometa"}
    wait_for(lambda: r.zcard(keys.dead) == len(bad), 15, "the malformed entries to die")
    with Producer(redis_server.url, queue) as p:  # the consumer is still serving
        assert p.submit({"i": "ok"}).result(timeout=15)["echo"] == {"i": "ok"}
    assert consumer.proc.poll() is None
    assert not executions(tmp_path).keys() - {"ok"}  # none of them reached the model
    total, listed = list_dead(r, queue)
    assert total == len(bad) and {e.id for e in listed} == bad
    reasons = {e.id: e.error_type for e in listed}
    assert reasons["garbage"] == reasons["wrongver"] == "MalformedRequest"

    runner = CliRunner()
    out = runner.invoke(cli, ["dead-letter", "retry", "--redis-url", redis_server.url,
                              "--queue", queue, "nojob", "unknown-id"])
    assert out.exit_code == 0 and "retried 0, skipped 2" in out.output
    out = runner.invoke(cli, ["dead-letter", "purge", "--redis-url", redis_server.url,
                              "--queue", queue])
    assert out.exit_code == 2 and "--all" in out.output
    out = runner.invoke(cli, ["dead-letter", "purge", "--redis-url", redis_server.url,
                              "--queue", queue, "--all"])
    assert out.exit_code == 0 and f"purged {len(bad)}, skipped 0" in out.output
    assert r.zcard(keys.dead) == r.hlen(keys.dead_reason) == 0
    assert not bad & {k.decode() for k in r.hkeys(keys.jobs)}


# -- hung and CPU-bound consumers ---------------------------------------------------------
def _hold_batch(server, queue, n):
    wait_for(lambda: stats(server, queue).in_flight_requests == n, 15, "a batch in flight")


def test_frozen_consumer_loses_its_lease_and_its_late_results_are_refused(
        redis_server, queue, start_consumer, tmp_path):
    """SIGSTOP (a frozen VM, a swap storm): the lease lapses, another consumer re-runs the
    batch; on SIGCONT the stale consumer's completion is refused by the fencing token."""
    url = redis_server.url
    stale = start(start_consumer, url, queue, "Echo", "--strategy", "dynamic",
                  "--max-batch-size", "4", "--lease-ms", "600", log=tmp_path, sleep_ms=1500)
    with CountingProducer(url, queue) as p:
        handles = p.submit_many([{"i": i} for i in range(4)])
        wait_for(lambda: len(executions(tmp_path)) == 4, 15, "the stale consumer to start")
        stale.signal(signal.SIGSTOP)
        rescuer = start(start_consumer, url, queue, "Echo", log=tmp_path)
        results = [h.result(timeout=20) for h in handles]
        assert {r["pid"] for r in results} == {rescuer.proc.pid}
        stale.signal(signal.SIGCONT)
        wait_for(lambda: "were refused" in stale.output(), 15, "the late completion")
        time.sleep(0.5)  # anything the stale consumer might still deliver
        assert p.delivered_once(handles)
    s = stats(redis_server, queue)
    assert (s.processed, s.requeued) == (4, 4)
    assert all(n == 2 for n in executions(tmp_path).values())  # at-least-once, here twice


def test_model_hung_past_max_batch_ms_is_re_run_elsewhere(redis_server, queue,
                                                          start_consumer, tmp_path):
    """Past --max-batch-ms the lease is no longer renewed; once it has lapsed
    (max_batch_ms + lease_ms) the hung process exits with status 3 and its batch runs
    elsewhere."""
    url = redis_server.url
    hung = start(start_consumer, url, queue, "Echo", "--strategy", "fifo", "--lease-ms",
                 "1000", "--max-batch-ms", "1500", log=tmp_path, sleep_ms=60_000)
    with CountingProducer(url, queue) as p:
        handle = p.submit({"i": 0})
        _hold_batch(redis_server, queue, 1)
        rescuer = start(start_consumer, url, queue, "Echo", log=tmp_path)
        assert handle.result(timeout=20)["pid"] == rescuer.proc.pid
        assert "treating it as hung" in hung.output()
        assert hung.proc.wait(timeout=15) == 3  # not the 60 s the model would take
        assert p.delivered_once([handle])
    s = stats(redis_server, queue)
    assert (s.processed, s.requeued, s.consumers_alive) == (1, 1, 1)


def test_a_hung_model_gives_back_the_batch_fetched_ahead(redis_server, queue,
                                                         start_consumer, tmp_path):
    """The model hangs on one payload while the next batch waits, fetched ahead. Past
    max_batch_ms the consumer lets go of both: the fetched batch goes back to the queue
    at once, before the process exits (max_batch_ms + lease_ms), and every request is
    answered by a healthy consumer."""
    url, r, keys = redis_server.url, redis_server.client(), QueueKeys(queue)
    hung = start(start_consumer, url, queue, "Poison", "--strategy", "fifo",
                 "--max-batch-size", "1", "--lease-ms", "3000", "--max-batch-ms", "1000",
                 log=tmp_path)
    with CountingProducer(url, queue) as p:
        handles = p.submit_many([{"i": 0, "hang": True}, *({"i": i} for i in range(1, 21))])
        _hold_batch(redis_server, queue, 2)  # the hung request and the one fetched ahead
        wait_for(lambda: r.zscore(keys.pending(1), handles[1].id) is not None, 15,
                 "the batch fetched ahead to be given back")
        # ... at max_batch_ms, while the hung one is still held, not at the exit
        assert hung.proc.poll() is None and r.hexists(keys.owner, handles[0].id)
        rescuer = start(start_consumer, url, queue, "Echo", log=tmp_path)
        assert [h.result(timeout=30)["pid"] for h in handles] == [rescuer.proc.pid] * 21
        assert hung.proc.wait(timeout=15) == 3
        assert p.delivered_once(handles)
    assert "given back to the queue" in hung.output()


def test_a_payload_hanging_the_model_is_dead_lettered_and_hung_consumers_replaced(
        redis_server, queue, start_consumer, tmp_path):
    """Each delivery of the poison hangs one supervised consumer; each exits (status 3)
    once max_batch_ms + lease_ms have passed and is restarted, so the poison reaches
    max_attempts and is dead-lettered, and the other requests are all answered."""
    url = redis_server.url
    sup = start(start_consumer, url, queue, "Poison", "--replicas", "2", "--max-batch-ms",
                "1000", "--lease-ms", "1000", ready=False, log=tmp_path)
    wait_for(lambda: sup.output().count("ready on queue") >= 2, 60, "two ready consumers")
    with CountingProducer(url, queue) as p:
        poison = p.submit({"i": "hang", "hang": True})
        handles = p.submit_many([{"i": i} for i in range(40)])
        assert [h.result(timeout=60)["echo"]["i"] for h in handles] == list(range(40))
        with pytest.raises(RequestFailed, match="max_attempts") as info:
            poison.result(timeout=60)
        assert info.value.error_type == "DeadLettered"
        assert p.delivered_once([poison, *handles])
    assert executions(tmp_path)["hang"] == 3
    # The last one may exit just after another consumer's sweep re-queued the poison.
    wait_for(lambda: sup.output().count("exiting with status 3") == 3, 15, "3 hung exits")
    s = stats(redis_server, queue)
    assert (s.processed, s.dead_letters) == (40, 1)


def test_children_die_with_a_killed_supervisor_even_mid_batch(redis_server, queue,
                                                              start_consumer, tmp_path):
    """SIGKILL of the supervisor: its children are killed too (parent-death signal), not
    asked to finish the 60 s batch in hand, which a hung model never would."""
    sup = start(start_consumer, redis_server.url, queue, "Echo", "--replicas", "2",
                "--strategy", "fifo", "--no-overlap", ready=False, log=tmp_path,
                sleep_ms=60_000)
    wait_for(lambda: sup.output().count("ready on queue") >= 2, 60, "two ready consumers")
    with Producer(redis_server.url, queue) as p:
        p.submit_many([{"i": i} for i in range(2)])
        wait_for(lambda: len(executions(tmp_path)) == 2, 15, "both children in a batch")
    children = [pid for _, pid in started(sup.output())]
    sup.kill()
    wait_for(lambda: not any(alive(pid) for pid in children), 10, "the children to die")


def test_cpu_bound_model_keeps_its_lease(redis_server, queue, start_consumer, tmp_path):
    """A pure-Python busy loop 3x longer than the lease: the lease thread still renews it,
    so an idle second consumer never re-queues it."""
    url = redis_server.url
    busy = start(start_consumer, url, queue, "Busy", "--strategy", "fifo", "--lease-ms",
                 "1000", log=tmp_path, busy_ms=3000)
    with CountingProducer(url, queue) as p:
        handle = p.submit({"i": 0})
        _hold_batch(redis_server, queue, 1)
        start(start_consumer, url, queue, "Echo", log=tmp_path)  # would steal a lapsed lease
        assert handle.result(timeout=20)["pid"] == busy.proc.pid
    s = stats(redis_server, queue)
    assert (s.processed, s.requeued) == (1, 0)
    assert executions(tmp_path) == {"0": 1}


def test_the_consumer_freezes_its_start_up_heap(shared_redis, queue, start_consumer):
    """A full garbage collection must not walk the model and the libraries loaded at
    start-up (~110 ms once torch is imported, a stall in the middle of a batch): the
    consumer freezes that heap once the model is loaded; only what the loop allocates is
    left for the collector."""
    start(start_consumer, shared_redis.url, queue, "GcReport")
    with Producer(shared_redis.url, queue) as p:
        state = p.submit({"i": 0}).result(timeout=15)
    assert state["frozen"] >= 20_000, state  # click, redis, orjson, the consumer, ...
    assert state["frozen"] > state["tracked"], state


# -- graceful shutdown ------------------------------------------------------------------
def test_sigterm_finishes_the_batch_in_hand(redis_server, queue, start_consumer, tmp_path):
    consumer = start(start_consumer, redis_server.url, queue, "Echo", "--strategy",
                     "dynamic", "--max-batch-size", "4", log=tmp_path, sleep_ms=1500)
    with CountingProducer(redis_server.url, queue) as p:
        handles = p.submit_many([{"i": i} for i in range(4)])
        wait_for(lambda: len(executions(tmp_path)) == 4, 15, "the batch to start")
        consumer.signal(signal.SIGTERM)
        assert consumer.proc.wait(timeout=15) == 0
        assert [h.result(timeout=5)["pid"] for h in handles] == [consumer.proc.pid] * 4
        assert p.delivered_once(handles)
    s = stats(redis_server, queue)
    assert (s.processed, s.requeued, s.in_flight_batches) == (4, 0, 0)
    assert all(n == 1 for n in executions(tmp_path).values())
    assert "finishing the batch in hand" in consumer.output()


def test_second_sigterm_exits_promptly_and_the_sweep_recovers(redis_server, queue,
                                                              start_consumer, tmp_path):
    url = redis_server.url
    consumer = start(start_consumer, url, queue, "Echo", "--strategy", "dynamic",
                     "--max-batch-size", "2", "--lease-ms", "500", log=tmp_path,
                     sleep_ms=60_000)
    with CountingProducer(url, queue) as p:
        handles = p.submit_many([{"i": i} for i in range(2)])
        wait_for(lambda: len(executions(tmp_path)) == 2, 15, "the batch to start")
        consumer.signal(signal.SIGTERM)
        # the first one handled (not merged with the second on a busy host)
        wait_for(lambda: "finishing the batch in hand" in consumer.output(), 15,
                 "the consumer to take the first SIGTERM")
        started = time.monotonic()
        consumer.signal(signal.SIGTERM)
        assert consumer.proc.wait(timeout=10) == 128 + signal.SIGTERM
        assert time.monotonic() - started < 5  # not the 60 s the model would take
        rescuer = start(start_consumer, url, queue, "Echo", log=tmp_path)
        assert {h.result(timeout=20)["pid"] for h in handles} == {rescuer.proc.pid}
        assert p.delivered_once(handles)
    assert stats(redis_server, queue).requeued == 2


@pytest.mark.parametrize(("sleep_ms", "batch", "count", "ran_first"),
                         [(400, 2, 20, 4), (0, 32, 20_000, 2000)], ids=["model", "fast"])
def test_sigterm_during_a_backlog_leaves_nothing_in_flight(redis_server, queue,
                                                          start_consumer, tmp_path,
                                                          sleep_ms, batch, count, ran_first):
    """With a backlog the consumer fetches its next batch while the model runs and writes
    results beside the next batch; with a model faster than a pop (fast) only the
    completions go beside the next pop (consumer/overlap.py). A stop must still run what
    was fetched, write every computed result and leave no batch in flight for the sweep."""
    url = redis_server.url
    consumer = start(start_consumer, url, queue, "Echo", "--strategy", "fifo",
                     "--max-batch-size", str(batch), log=tmp_path, sleep_ms=sleep_ms)
    with CountingProducer(url, queue) as p:
        handles = [h for first in range(0, count, 10_000) for h in p.submit_many(
            [{"i": i} for i in range(first, min(count, first + 10_000))])]
        wait_for(lambda: len(executions(tmp_path)) >= ran_first, 30,
                 f"{ran_first} requests to run")
        consumer.signal(signal.SIGTERM)
        assert consumer.proc.wait(timeout=15) == 0
        s = stats(redis_server, queue)
        ran = executions(tmp_path)
        assert (s.in_flight_batches, s.requeued) == (0, 0)
        assert s.processed == len(ran) and sum(s.depth.values()) == count - len(ran)
        start(start_consumer, url, queue, "Echo", log=tmp_path)  # serves the rest
        assert [h.result(timeout=60)["echo"]["i"] for h in handles] == list(range(count))
        assert p.delivered_once(handles)
    assert all(n == 1 for n in executions(tmp_path).values())


def test_a_batch_fetched_ahead_keeps_its_lease(shared_redis, queue, start_consumer, tmp_path):
    """A batch fetched while the model runs waits for it; with a model 2.5x longer than
    the lease, its lease must be renewed too, or a second consumer would re-queue it. (A
    1 s lease renewed every 333 ms: a stall of the lease thread under 0.6 s loses nothing.)"""
    url = shared_redis.url
    for _ in range(2):
        start(start_consumer, url, queue, "Echo", "--strategy", "fifo", "--lease-ms", "1000",
              "--max-batch-size", "2", log=tmp_path, sleep_ms=2500)
    with CountingProducer(url, queue) as p:
        handles = p.submit_many([{"i": i} for i in range(8)])
        assert [h.result(timeout=30)["echo"]["i"] for h in handles] == list(range(8))
    s = stats(shared_redis, queue)
    assert (s.processed, s.requeued) == (8, 0)
    assert all(n == 1 for n in executions(tmp_path).values())


@pytest.mark.parametrize(("flag", "requeued"), [("--overlap", 4), ("--no-overlap", 2)])
def test_a_crash_re_runs_the_batch_fetched_ahead_too(redis_server, queue, start_consumer,
                                                     tmp_path, flag, requeued):
    """SIGKILL while the first batch of a backlog runs. With the overlap (the default) the
    next batch is fetched at once (no model time known yet) and is lost with it: both
    are re-queued and answered by another consumer. --no-overlap holds only the one."""
    url = redis_server.url
    consumer = start(start_consumer, url, queue, "Echo", "--strategy", "fifo",
                     "--max-batch-size", "2", "--lease-ms", "500", flag, log=tmp_path,
                     sleep_ms=3000)
    with CountingProducer(url, queue) as p:
        handles = p.submit_many([{"i": i} for i in range(8)])
        wait_for(lambda: len(executions(tmp_path)) == 2, 15, "the first batch to start")
        # The kill lands once the consumer holds what it will hold: the batch it runs, and
        # with the overlap the one fetched ahead (in flight too, its lease renewed).
        wait_for(lambda: stats(redis_server, queue).in_flight_requests == requeued, 15,
                 "the batch fetched ahead")
        consumer.signal(signal.SIGKILL)
        consumer.proc.wait(timeout=5)
        start(start_consumer, url, queue, "Echo", log=tmp_path, sleep_ms=10)
        assert [h.result(timeout=30)["echo"]["i"] for h in handles] == list(range(8))
        assert p.delivered_once(handles)
    s = stats(redis_server, queue)
    assert (s.processed, s.requeued, s.in_flight_batches) == (8, requeued, 0)


def test_a_crash_with_a_fast_model_re_runs_the_pop_sent_ahead(redis_server, queue,
                                                              start_consumer, tmp_path):
    """With a model faster than a pop and a backlog, the consumer sends its next pop before
    the model runs and reads it after (consumer/overlap.py): a SIGKILL then loses up to
    five batches (running or blocked handing its results over, sent for, up to three
    being written). Their leases lapse, another consumer runs them, and every request is
    answered exactly once."""
    url = redis_server.url
    count = 20_000
    consumer = start(start_consumer, url, queue, "Echo", "--strategy", "fifo",
                     "--max-batch-size", "32", "--lease-ms", "2000", log=tmp_path, sleep_ms=0)
    with CountingProducer(url, queue) as p:
        handles = [h for first in range(0, count, 10_000) for h in p.submit_many(
            [{"i": i} for i in range(first, first + 10_000)])]
        wait_for(lambda: len(executions(tmp_path)) >= 2000, 30, "2000 requests to run")
        consumer.signal(signal.SIGKILL)
        consumer.proc.wait(timeout=5)
        start(start_consumer, url, queue, "Echo", log=tmp_path, sleep_ms=0)
        assert [h.result(timeout=60)["echo"]["i"] for h in handles] == list(range(count))
        assert p.delivered_once(handles)
    s = stats(redis_server, queue)
    assert (s.processed, s.in_flight_batches) == (count, 0)
    assert s.requeued <= 5 * 32


# -- cancellation -----------------------------------------------------------------------
def test_cancel_waiting_running_and_finished(redis_server, queue, inprocess_consumer,
                                            tmp_path):
    serve(inprocess_consumer, redis_server.url, queue, "Echo", {"strategy": "fifo"},
          log=tmp_path, sleep_ms=1000)
    with CountingProducer(redis_server.url, queue) as p:
        running = p.submit({"i": "running"})
        wait_for(lambda: executions(tmp_path), 15, "the first request to start")
        waiting = p.submit({"i": "waiting"})
        assert waiting.cancel() == "cancelled"
        with pytest.raises(RequestCancelled):
            waiting.result(timeout=1)
        assert running.cancel() == "running"
        assert running.result(timeout=15)["echo"] == {"i": "running"}
        assert running.cancel() == "finished"
        assert waiting.cancel() == "finished"
        after = p.submit({"i": "after"})  # the consumer went on; the cancelled never ran
        assert after.result(timeout=15)["echo"] == {"i": "after"}
    assert executions(tmp_path) == {"running": 1, "after": 1}
    s = stats(redis_server, queue)
    assert (s.processed, s.cancelled) == (2, 1)


# -- producer gone ----------------------------------------------------------------------
DEAD_PRODUCER = """
import os, sys
from producer import Producer
p = Producer(sys.argv[1], sys.argv[2])
for start in range(0, int(sys.argv[3]), 250):  # half of them stored by id as well
    p.submit_many([{"i": i} for i in range(start, min(start + 250, int(sys.argv[3])))],
                  store_result=start % 500 == 0)
os._exit(0)  # gone: never reads a result, never closes
"""


def test_results_of_dead_producers_expire(redis_server, queue, inprocess_consumer):
    """Producers that submit and die: their inboxes and the results stored by id (half
    of the requests ask for it) expire after result_ttl_s and Redis returns to its key
    count and (about) its memory of before."""
    full = os.environ.get("BATCHGATE_FULL") == "1"
    producers, per_producer = (10, 10_000) if full else (4, 500)
    url, r, ttl = redis_server.url, redis_server.client(), 2
    serve(inprocess_consumer, url, queue, "Echo", {"strategy": "dynamic", "max_batch_size": 64,
                                                   "max_queue_delay_ms": 5, "result_ttl_s": ttl})
    keys = QueueKeys(queue)
    with Producer(url, queue) as p:  # warm-up: creates the queue's standing keys
        warm = p.submit({"i": -1})
        assert warm.result(timeout=15)
        warm_keys = (keys.result(warm.id), keys.inbox(p.id))
    # the baseline is taken once the warm-up's own result has expired
    wait_for(lambda: not r.exists(*warm_keys), ttl + 15, "the warm-up's result to expire")
    # ... and the consumer's info hash is written (its lease thread's first tick)
    wait_for(lambda: r.keys(keys.tag + ":consumer:*"), 15, "the consumer's info hash")
    transient = (keys.marker.encode(), keys.tag.encode() + b":wake:")

    def standing() -> set[bytes]:
        return {k for k in r.keys("*") if not k.startswith(transient)}

    baseline_keys, baseline_mem = standing(), r.info("memory")["used_memory"]
    started = time.monotonic()
    dead = [subprocess.Popen([sys.executable, "-c", DEAD_PRODUCER, url, queue,
                              str(per_producer)]) for _ in range(producers)]  # together
    assert [proc.wait(timeout=120) for proc in dead] == [0] * producers
    total = producers * per_producer
    wait_for(lambda: stats(redis_server, queue).processed == total + 1, 60 + total / 500,
             "every request to be processed")
    peak_keys = r.dbsize()
    assert peak_keys > len(baseline_keys) + 100  # results waiting for nobody (some expired)
    wait_for(lambda: standing() == baseline_keys, ttl + 15, "the results to expire")
    elapsed = time.monotonic() - started
    mem = r.info("memory")["used_memory"]
    print(f"\nsoak: {total} requests from {producers} dead producers; peak {peak_keys} keys; "
          f"back to {len(baseline_keys)} keys after {elapsed:.1f}s; used_memory "
          f"{baseline_mem} -> {mem} bytes")
    assert r.hlen(keys.jobs) == r.hlen(keys.owner) == 0
    # What stays: the capped latency samples (<= 10,000 entries each) and counters.
    assert mem - baseline_mem < 2 << 20


# -- overload ---------------------------------------------------------------------------
def test_overload_fails_fast_with_a_retry_hint_and_answers_all_accepted(
        redis_server, queue, start_consumer):
    url, r, limit = redis_server.url, redis_server.client(), 100
    start(start_consumer, url, queue, "Echo", "--strategy", "dynamic", "--max-batch-size",
          "10", "--max-queue-delay-ms", "5", "--max-queue-size", str(limit), sleep_ms=20)
    keys = QueueKeys(queue)
    accepted, rejections, depths, errors = [], [], [], []
    stop = threading.Event()
    baseline_mem = r.info("memory")["used_memory"]

    def produce(p: Producer) -> None:
        n = 0
        while not stop.is_set():
            began = time.monotonic()
            try:
                accepted.append(p.submit({"i": n}))
            except QueueFull as exc:
                rejections.append((time.monotonic() - began, exc.retry_after_s, exc))
                time.sleep(min(exc.retry_after_s or 0.05, 0.2))
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
            n += 1

    def watch() -> None:
        while not stop.is_set():
            depths.append(sum(r.zcard(k) for k in keys.pending_all))
            time.sleep(0.02)

    with Producer(url, queue) as p1, Producer(url, queue) as p2:
        threads = [threading.Thread(target=produce, args=(p,)) for p in (p1, p2, p1)]
        threads.append(threading.Thread(target=watch))
        for t in threads:
            t.start()
        time.sleep(4)
        stop.set()
        for t in threads:
            t.join()
        peak_mem = r.info("memory")["used_memory"]
        for h in accepted:
            h.result(timeout=30)
    assert not errors
    assert rejections and accepted
    assert max(depths) <= limit
    slowest = max(latency for latency, _, _ in rejections)
    assert slowest < 1.0  # one round trip, not a wait for room
    hints = [hint for _, hint, _ in rejections[len(rejections) // 2:]]
    assert all(h is not None and 0 < h < 5 for h in hints)
    rate = stats(redis_server, queue).processed / 4
    exc = rejections[-1][2]
    expected = max(1, exc.depth + 1 - limit) / rate
    print(f"\noverload: {len(accepted)} accepted, {len(rejections)} QueueFull (slowest "
          f"{slowest * 1000:.1f} ms), last hint {exc.retry_after_s * 1000:.1f} ms vs "
          f"{expected * 1000:.1f} ms from the mean rate {rate:.0f}/s; peak depth "
          f"{max(depths)}; used_memory +{(peak_mem - baseline_mem) / 1024:.0f} KiB")
    assert expected / 4 < exc.retry_after_s < expected * 4
    assert "retry after" in str(exc)
    assert peak_mem - baseline_mem < 16 << 20


def test_consumer_survives_redis_out_of_memory(redis_server, queue, inprocess_consumer,
                                               caplog):
    """maxmemory reached under noeviction: Redis refuses writes with OOM. The consumer
    waits it out with backoff instead of exiting, and serves again once there is room."""
    caplog.set_level(logging.INFO, logger="batchgate")
    inprocess_consumer("consumer.models:noop", redis_url=redis_server.url, queue=queue)
    client = redis_server.client()
    client.config_set("maxmemory", "1mb")  # below what is used: every write gets OOM
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        client.set("probe", "x")
    # The idle consumer's pops (each heartbeats: a write) now fail.
    wait_for(lambda: "maxmemory" in caplog.text, 15, "a pop refused for OOM")
    client.config_set("maxmemory", "0")
    with Producer(redis_server.url, queue) as p:  # the one consumer serves again
        assert p.submit({"after": "oom"}).result(timeout=20) == {"after": "oom"}
    assert caplog.text.count("Redis unavailable") == 1  # logged once, not per attempt


def test_results_computed_while_redis_is_out_of_memory_are_kept(redis_server, queue,
                                                                inprocess_consumer, tmp_path,
                                                                caplog):
    """maxmemory reached while a batch runs: complete.lua gets OOM. The results are
    offered again with backoff (the lease kept), not thrown away and the batch re-run."""
    caplog.set_level(logging.INFO, logger="batchgate")
    url, client = redis_server.url, redis_server.client()
    serve(inprocess_consumer, url, queue, "Echo", {"strategy": "dynamic", "max_batch_size": 8,
                                                   "max_queue_delay_ms": 100, "lease_ms": 5000},
          log=tmp_path, sleep_ms=1000)
    with CountingProducer(url, queue) as p:
        handles = p.submit_many([{"i": i} for i in range(8)])
        wait_for(lambda: len(executions(tmp_path)) == 8, 15, "the batch to start")
        client.config_set("maxmemory", "1mb")
        wait_for(lambda: "maxmemory" in caplog.text, 15, "the completion refused")
        client.config_set("maxmemory", "0")
        assert [h.result(timeout=20)["echo"]["i"] for h in handles] == list(range(8))
        assert p.delivered_once(handles)
    s = stats(redis_server, queue)
    assert (s.processed, s.requeued) == (8, 0)
    assert all(n == 1 for n in executions(tmp_path).values())


# -- the policy, as it changes under running consumers -----------------------------------
def test_the_policy_survives_redis_losing_its_data(redis_server, queue, inprocess_consumer,
                                                   caplog):
    """Redis restarted without persistence: every key is gone. A consumer started
    without flags stores the policy it last ran with again, not the defaults."""
    url = redis_server.url
    configure(url, queue, strategy="dynamic", max_batch_size=8, max_queue_delay_ms=5,
              max_queue_size=1000, result_ttl_s=60)
    caplog.set_level(logging.INFO, logger="batchgate")
    inprocess_consumer("consumer.models:noop", redis_url=url, queue=queue)
    before = read_policy(redis_server.client(), queue)
    redis_server.restart()
    client = redis_server.client()
    assert wait_for(lambda: read_policy(client, queue), 15, "the policy again") == before
    # Its log line can come after the policy reaches Redis.
    assert wait_for(lambda: "lost its policy" in caplog.text, 10, "the consumer to say")
    with Producer(url, queue) as p:
        assert p.submit({"after": "loss"}).result(timeout=15) == {"after": "loss"}


def _policy_set(url: str, queue: str, *args: str) -> None:
    out = CliRunner().invoke(cli, ["policy", "set", "--redis-url", url, "--queue", queue,
                                   *args])
    assert out.exit_code == 0, out.output


def test_consumers_follow_a_changed_policy_and_flag_a_conflict_loudly(shared_redis, queue,
                                                                      inprocess_consumer,
                                                                      caplog):
    """Two consumers in this process, one started with --strategy dynamic: both follow the
    change; only that one (the other has no flag to contradict) says so loudly."""
    caplog.set_level(logging.INFO, logger="batchgate")
    url = shared_redis.url
    flagged = inprocess_consumer("consumer.models:noop", redis_url=url, queue=queue,
                                 strategy="dynamic")
    plain = inprocess_consumer("consumer.models:noop", redis_url=url, queue=queue)

    def said(text: str) -> list[str]:
        return [r.getMessage() for r in caplog.records if text in r.getMessage()]

    _policy_set(url, queue, "--strategy", "fifo")
    wait_for(lambda: len(said("policy changed (strategy dynamic -> fifo")) == 2, 15,
             "both consumers to notice")
    wait_for(lambda: said("contradicts this consumer's flags"), 15,
             "the flagged consumer to object")
    (objection,) = said("contradicts")  # one consumer objects: the flagged one
    assert "strategy=fifo (flag: dynamic)" in objection
    with Producer(url, queue) as p:  # both keep serving, under the stored policy
        assert p.submit({"i": 1}).result(timeout=15) == {"i": 1}
    assert not flagged.stopping.is_set() and not plain.stopping.is_set()


def test_running_consumers_apply_a_changed_result_ttl_s(shared_redis, queue, inprocess_consumer,
                                                        caplog):
    caplog.set_level(logging.INFO, logger="batchgate")
    url, r, keys = shared_redis.url, shared_redis.client(), QueueKeys(queue)
    inprocess_consumer("consumer.models:noop", redis_url=url, queue=queue)
    with Producer(url, queue) as p:
        first = p.submit({"i": 0}, store_result=True)
        first.result(timeout=15)
        assert r.ttl(keys.result(first.id)) > 60  # the default, 600 s
        _policy_set(url, queue, "--result-ttl-s", "5")

        def stored_for_5_s() -> bool:
            handle = p.submit({"i": 1}, store_result=True)
            handle.result(timeout=15)
            return 0 < r.ttl(keys.result(handle.id)) <= 5

        # The consumer re-reads the policy every min(lease_ms / 3, 1 s).
        wait_for(stored_for_5_s, 15, "a result stored for the new result_ttl_s", 0.1)
    assert "result_ttl_s 600 -> 5" in caplog.text


def test_cancelled_and_expired_results_get_the_queue_result_ttl_s(shared_redis, queue):
    """Results a producer (or the gateway: the same script) writes itself, for a cancel
    or a passed deadline, expire after the queue's result_ttl_s, not the producer's."""
    url, r, keys = shared_redis.url, shared_redis.client(), QueueKeys(queue)
    configure(url, queue, result_ttl_s=5)  # and no consumer: requests stay waiting
    with Producer(url, queue) as p:
        assert p.config.result_ttl_s == 600
        cancelled = p.submit({"i": 0}, store_result=True)
        assert cancelled.cancel() == "cancelled"
        expired = p.submit({"i": 1}, deadline_ms=1, store_result=True)
        with pytest.raises(RequestFailed):
            expired.result(timeout=15)
    for handle in (cancelled, expired):
        assert 0 < r.ttl(keys.result(handle.id)) <= 5
