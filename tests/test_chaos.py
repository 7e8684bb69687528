"""Chaos: consumers SIGKILLed under load, Redis killed and restarted under load (AOF,
appendfsync always), client connections killed mid-run. Every acknowledged request gets
exactly one result at its producer.

Reduced sizes by default (a few seconds each); BATCHGATE_FULL=1 runs the full sizes whose
figures are recorded in docs/guarantees.md.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time

import pytest
import redis
from helpers.failure_support import (
    CountingProducer,
    batches_held,
    executions,
    start,
    wait_for,
    wait_holding,
)
from helpers.processes import RedisServer

from scheduler_core.keys import QueueKeys
from scheduler_core.ops.stats import queue_stats
from scheduler_core.scripts import NewRequest, Scripts, enqueue_call, enqueue_reply
from scheduler_core.wire import encode_request

FULL = os.environ.get("BATCHGATE_FULL") == "1"
LONG_OUTAGE_S = 2.5


def submit_paced(p: CountingProducer, n: int, rate: float, chunk: int = 50,
                 idempotent: bool = False) -> list:
    """Submit n requests {"i": i} at about `rate` per second, in chunks; a chunk whose
    enqueue hit a connection error is resent under the same idempotency keys until Redis
    acknowledges it (only acknowledged requests get a handle)."""
    handles, began = [], time.monotonic()
    for first in range(0, n, chunk):
        payloads = [{"i": i} for i in range(first, min(first + chunk, n))]
        keys = [f"req-{p.id}-{i}" for i in range(first, first + len(payloads))]
        while True:
            try:
                handles += p.submit_many(payloads, idempotency_keys=keys if idempotent
                                         else None)
                break
            except (redis.ConnectionError, redis.TimeoutError):
                assert idempotent, "a connection error without idempotency keys"
                time.sleep(0.05)
        ahead = began + (first + len(payloads)) / rate - time.monotonic()
        if ahead > 0:
            time.sleep(ahead)
    return handles


def check_exactly_once(p: CountingProducer, handles: list, n: int, timeout: float,
                       inbox_may_lose: bool = False) -> None:
    deadline = time.monotonic() + timeout
    t0 = time.monotonic()
    for i, h in enumerate(handles):
        result = h.result(timeout=max(1.0, deadline - time.monotonic()))
        assert result["echo"] == {"i": i}
    assert len({h.id for h in handles}) == n
    time.sleep(0.3)  # let anything late reach the inbox
    counts = [p.deliveries[h.id] for h in handles]
    print(f"\nresults collected in {time.monotonic() - t0:.1f}s; inbox deliveries 0: "
          f"{counts.count(0)}")
    assert max(counts) == 1, "a result was delivered twice"
    if not inbox_may_lose:
        assert min(counts) == 1


# -- consumers killed -------------------------------------------------------------------
def test_consumers_sigkilled_under_load(redis_server, queue, start_consumer, tmp_path):
    n, kill_every, rate = (10_000, 2.0, 400) if FULL else (1_500, 1.0, 300)
    url = redis_server.url
    policy = ["--strategy", "dynamic", "--max-batch-size", "16", "--max-queue-delay-ms", "20",
              "--max-attempts", "20", "--lease-ms", "1000"]
    consumers = [start(start_consumer, url, queue, "Echo", *policy, log=tmp_path,
                       sleep_ms=60)]
    consumers += [start(start_consumer, url, queue, "Echo", "--lease-ms", "1000",
                        log=tmp_path, sleep_ms=60) for _ in range(2)]
    stop, kills, landed = threading.Event(), [], []
    rng = random.Random(0)
    client = redis_server.client()

    def chaos() -> None:
        # Each kill lands on a batch in flight: the victim is killed once it holds one
        # (the batches hash says so), not whenever the timer fires. Kills go on past the
        # load until one landed (10 tries at most), so that a re-queue is surely tested.
        tries = 0
        while not (stop.is_set() and (landed or tries >= 10)):
            time.sleep(kill_every)
            tries += stop.is_set()
            alive = [c for c in consumers if c.proc.poll() is None]
            if not alive:
                continue
            victim = rng.choice(alive)
            if not wait_holding(client, queue, victim.proc.pid, kill_every):
                continue
            victim.kill()
            kills.append(victim.proc.pid)
            if batches_held(client, queue, victim.proc.pid):  # dead: held until re-queued
                landed.append(victim.proc.pid)
            consumers.append(start(start_consumer, url, queue, "Echo", "--lease-ms", "1000",
                                   ready=False, log=tmp_path, sleep_ms=60))

    killer = threading.Thread(target=chaos, daemon=True)
    began = time.monotonic()
    with CountingProducer(url, queue) as p:
        killer.start()
        try:
            handles = submit_paced(p, n, rate)
        finally:
            stop.set()
        check_exactly_once(p, handles, n, timeout=60 + n / 100)
        killer.join()
    elapsed = time.monotonic() - began
    s = queue_stats(redis_server.client(), queue)
    runs = executions(tmp_path)
    rerun = sum(1 for count in runs.values() if count > 1)
    print(f"\nchaos: {n} requests, 3 consumers, {len(kills)} SIGKILLs in {elapsed:.1f}s; "
          f"requeued {s.requeued}, re-executed {rerun}, processed {s.processed}, failed "
          f"{s.failed}, dead {s.dead_letters}; e2e p50/p99 {s.end_to_end_ms['p50']}/"
          f"{s.end_to_end_ms['p99']} ms")
    assert len(kills) >= 3 and landed, (kills, landed)
    assert (s.processed, s.failed, s.dead_letters) == (n, 0, 0)
    assert s.requeued > 0  # crashes hit batches in flight, which were retried
    assert len(runs) == n and rerun <= s.requeued
    r, keys = redis_server.client(), QueueKeys(queue)
    assert r.hlen(keys.jobs) == r.hlen(keys.owner) == r.zcard(keys.inflight) == 0


# -- Redis restarted --------------------------------------------------------------------
@pytest.mark.parametrize("fsync", ["always", "everysec"] if FULL else ["always"])
def test_redis_restart_under_load_loses_no_acknowledged_request(
        queue, start_consumer, tmp_path, caplog, fsync):
    n, restarts, rate = (5_000, 5, 250) if FULL else (1_200, 2, 300)
    server = RedisServer("--appendonly", "yes", "--appendfsync", fsync)
    try:
        url = server.url
        consumers = [start(start_consumer, url, queue, "Echo", "--strategy", "dynamic",
                           "--max-batch-size", "16", "--max-queue-delay-ms", "20",
                           "--max-attempts", "20", "--lease-ms", "2000", log=tmp_path,
                           sleep_ms=20)]
        consumers.append(start(start_consumer, url, queue, "Echo", "--lease-ms", "2000",
                               log=tmp_path, sleep_ms=20))
        stop, downtime = threading.Event(), []

        def restart_loop() -> None:
            gap = n / rate / (restarts + 1)
            for k in range(restarts):
                if stop.wait(gap):
                    return
                t = time.monotonic()
                server.kill()  # SIGKILL; then start again on the same port and dir
                if k == restarts - 1:  # the last outage outlasts redis-py's own retries
                    time.sleep(LONG_OUTAGE_S)
                server.start()
                downtime.append(time.monotonic() - t)

        caplog.set_level(logging.WARNING, logger="batchgate")
        restarter = threading.Thread(target=restart_loop, daemon=True)
        with CountingProducer(url, queue) as p:
            restarter.start()
            try:
                handles = submit_paced(p, n, rate, idempotent=True)
            finally:
                restarter.join()
            # A BLMPOP reply lost in a restart loses its inbox items; the handle then finds
            # the result stored by id (Handle polls result:<id>), so <= 1 inbox delivery.
            check_exactly_once(p, handles, n, timeout=60 + n / 100, inbox_may_lose=True)
        s = queue_stats(server.client(), queue)
        runs = executions(tmp_path)
        print(f"\nrestart: {n} requests, {len(downtime)} Redis SIGKILL+restarts "
              f"(down {', '.join(f'{d:.2f}' for d in downtime)} s); processed {s.processed}, "
              f"requeued {s.requeued}, re-executed "
              f"{sum(1 for c in runs.values() if c > 1)}")
        assert len(downtime) == restarts
        assert (s.processed, s.failed, s.dead_letters) == (n, 0, 0)
        # Short outages are absorbed by redis-py's own retries; the long one is logged
        # once when it starts and once when it ends, not once per reconnection attempt,
        # by each loop that met it (the main loop; a completion being retried, whose end
        # may come after the last result, when its batch was re-run elsewhere meanwhile).
        for c in consumers:
            wait_for(lambda c=c: c.output().count("Redis unavailable")
                     == c.output().count("Redis is back"), 15, "every outage's end logged")
            out = c.output()
            assert 1 <= out.count("Redis unavailable") <= restarts, out[-3000:]
        listener = [m for m in caplog.messages if "producer listener: Redis unavailable" in m]
        assert 1 <= len(listener) <= restarts
    finally:
        server.close()


# -- connections killed -----------------------------------------------------------------
def test_client_kill_of_every_kind_of_connection(redis_server, queue, start_consumer,
                                                 tmp_path):
    """CLIENT KILL of the producers' listener (BLMPOP), idle consumers (BZPOPMIN) and every
    other connection, in turns, while requests flow: all recover, nothing is lost."""
    n, rate = (5_000, 400) if FULL else (1_000, 300)
    url, admin = redis_server.url, redis_server.client()
    for i in range(2):
        start(start_consumer, url, queue, "Echo", *(["--strategy", "dynamic",
              "--max-batch-size", "16", "--max-queue-delay-ms", "10"] if i == 0 else []),
              log=tmp_path, sleep_ms=10)
    me = admin.client_id()
    stop, killed = threading.Event(), {"blmpop": 0, "bzpopmin": 0, "any": 0}

    def killer() -> None:
        kinds = list(killed)
        turn = 0
        while not stop.wait(0.25):
            kind = kinds[turn % len(kinds)]
            turn += 1
            for client in admin.client_list():
                if int(client["id"]) != me and kind in ("any", client["cmd"]):
                    try:
                        admin.client_kill_filter(_id=int(client["id"]))
                        killed[kind] += 1
                    except redis.ResponseError:
                        pass  # already gone

    thread = threading.Thread(target=killer, daemon=True)
    with CountingProducer(url, queue) as p:
        thread.start()
        try:
            handles = submit_paced(p, n, rate, idempotent=True)
        finally:
            stop.set()
            thread.join()
        check_exactly_once(p, handles, n, timeout=60, inbox_may_lose=True)
    s = queue_stats(admin, queue)
    print(f"\nclient kill: {n} requests; connections killed {killed}; processed "
          f"{s.processed}, requeued {s.requeued}")
    assert all(count > 0 for count in killed.values()), killed
    assert (s.processed, s.failed) == (n, 0)


def test_ambiguous_enqueue_is_safe_with_an_idempotency_key(shared_redis, queue,
                                                           start_consumer, tmp_path,
                                                           monkeypatch):
    """The enqueue reached Redis but its reply was lost: resubmitting with the same
    idempotency key returns the first request; without a key it would run twice."""
    start(start_consumer, shared_redis.url, queue, "Echo", "--strategy", "fifo", log=tmp_path)
    with CountingProducer(shared_redis.url, queue) as p:
        real = p._scripts.enqueue

        class LostReply:
            sha = real.sha

            def __call__(self, *args, **kwargs):
                real(*args, **kwargs)  # it landed ...
                p._scripts.enqueue = real
                raise redis.ConnectionError("reply lost")  # ... but the answer did not

        for key in ("order-17", None):
            monkeypatch.setattr(p._scripts, "enqueue", LostReply())
            with pytest.raises(redis.ConnectionError):
                p.submit({"i": key or "no-key"}, idempotency_key=key)
            retried = p.submit({"i": key or "no-key"}, idempotency_key=key)
            assert retried.result(timeout=15)["echo"]["i"] == (key or "no-key")
        wait_for(lambda: executions(tmp_path).get("no-key") == 2, 15, "the duplicate")
        assert executions(tmp_path)["order-17"] == 1  # the key made the resend safe
        again = p.submit({"i": "order-17"}, idempotency_key="order-17")  # within its TTL
        assert again.result(timeout=15)["echo"]["i"] == "order-17"
    assert executions(tmp_path)["order-17"] == 1


def test_resent_enqueue_of_the_same_id_is_not_added_twice(shared_redis, queue):
    """What redis-py's automatic retry relies on when it resends an enqueue whose reply
    was lost: the same request id is not queued twice."""
    r, keys = shared_redis.client(), QueueKeys(queue)
    scripts = Scripts(r)
    request = NewRequest("abc123", 1, 0, encode_request({"x": 1}))
    for expected_added in (1, 0, 0):
        script_keys, args = enqueue_call(keys, "prod", [request], 60)
        reply = scripts.enqueue(keys=script_keys, args=args)
        assert int(reply[1]) == expected_added
        assert enqueue_reply(keys, reply) == ["abc123"]
    assert r.zcard(keys.pending(1)) == 1 and r.hlen(keys.jobs) == 1


def test_results_computed_during_an_outage_are_delivered_not_re_run(queue, start_consumer,
                                                                    tmp_path):
    """Redis goes away while the model runs and stays away past redis-py's own retries:
    the consumer keeps its computed results and delivers them when Redis is back."""
    server = RedisServer("--appendonly", "yes", "--appendfsync", "always")
    try:
        consumer = start(start_consumer, server.url, queue, "Echo", "--strategy", "dynamic",
                         "--max-batch-size", "4", log=tmp_path, sleep_ms=1000)
        with CountingProducer(server.url, queue) as p:
            handles = p.submit_many([{"i": i} for i in range(4)])
            wait_for(lambda: len(executions(tmp_path)) == 4, 15, "the batch to start")
            server.kill()
            time.sleep(LONG_OUTAGE_S + 1)  # the model finishes meanwhile
            server.start()
            assert [h.result(timeout=20)["echo"]["i"] for h in handles] == [0, 1, 2, 3]
        assert executions(tmp_path) == {str(i): 1 for i in range(4)}
        s = queue_stats(server.client(), queue)
        assert (s.processed, s.requeued) == (4, 0)
        # Lost once, back once: the second line is logged after the completion landed,
        # so it may trail the result the producer already has.
        wait_for(lambda: consumer.output().count("(completing batch") == 2, 10,
                 "the consumer to log that Redis is back")
    finally:
        server.close()
