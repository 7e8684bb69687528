"""Deadlines the server enforces (issue 15, section 1): a request leaves the queue at its
deadline whether or not anyone waits on its handle, even while every consumer is busy;
an expired request never fills a batch nor holds a place under max_queue_size; per-level
default timeouts, with and without override; on_timeout = delay; each expiry answered
exactly once.

Consumers run in the test process (the public Consumer API, as `batchgate consumer` runs
one); the CLI through click's CliRunner. Bounds come from the configured deadlines with
generous slack (the machine is loaded); the lateness measured is printed (run with -s)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

import pytest
from helpers.cli import batchgate
from helpers.support import RecordingModel, configure, wait_for

from producer import AsyncProducer, DeadlineExceeded, Priority, Producer
from scheduler_core.admin import request_state
from scheduler_core.deadlines import expire_due
from scheduler_core.errors import InvalidPolicy
from scheduler_core.keys import QueueKeys
from scheduler_core.ops.stats import queue_stats
from scheduler_core.policy import Policy
from scheduler_core.scripts import NewRequest, Scripts, enqueue_call, enqueue_reply
from scheduler_core.wire import DEADLINE, encode_request

SLACK_S = 1.0  # a loaded machine; the timers themselves fire within milliseconds


def _wait_done(handle, limit_s: float) -> float:
    """When (time.monotonic()) `handle` was seen done, without calling result() (nobody
    waits on it)."""
    wait_for(handle.done, timeout=limit_s, what=f"{handle.id} to end", interval=0.005)
    return time.monotonic()


def _enqueue_raw(client, queue: str, deadline_ms: int, priority: int = 1) -> str:
    """A request enqueued as a producer would, by a producer that is gone at once: no
    producer-side timer knows its deadline, only the server's set does."""
    keys = QueueKeys(queue)
    rid = f"raw{time.monotonic_ns()}"
    script_keys, args = enqueue_call(keys, "gone0producer", [NewRequest(
        rid, priority, deadline_ms, encode_request({"raw": rid}), store_result=True)], 3600)
    assert enqueue_reply(keys, Scripts(client).enqueue(keys=script_keys, args=args)) == [rid]
    return rid


# -- scenario A: nobody waits, every consumer busy --------------------------------------


def test_a_request_ends_at_its_deadline_while_nobody_waits_and_the_model_is_busy(
        shared_redis, queue, inprocess_consumer, tmp_path):
    model = RecordingModel(tmp_path)
    model.serve(inprocess_consumer, shared_redis.url, queue, strategy="fifo")
    with Producer(shared_redis.url, queue) as p:
        blocker = p.submit({"sleep_ms": 2500})  # past the bound below
        wait_for(model.batches, what="the blocker to start")
        submitted = time.monotonic()
        a = p.submit({"a": 1}, deadline_ms=500, store_result=True)
        took = _wait_done(a, 0.5 + SLACK_S + 2) - submitted
        print(f"\nscenario A: done {took * 1000:.0f} ms after submit (deadline 500 ms)")
        assert 0.5 <= took < 0.5 + SLACK_S
        assert not blocker.done()  # the model is still busy with the blocker
        with pytest.raises(DeadlineExceeded):
            a.result(timeout=0)
        stored = p.fetch(a.id)
        assert stored is not None and stored.error_type == DEADLINE
        found = request_state(shared_redis.client(), queue, a.id)
        assert found is not None and found.status == "expired"
        # `batchgate result` says so too (exit status 1: expired).
        shown = batchgate("result", "--redis-url", shared_redis.url, "--queue", queue,
                          "--json", a.id)
        assert shown.returncode == 1 and '"expired"' in shown.stdout, shown
        assert blocker.result(timeout=15) == {"sleep_ms": 2500}
    assert {"a": 1} not in model.payloads()


def test_with_its_producer_gone_a_busy_consumer_expires_it(shared_redis, queue,
                                                           inprocess_consumer, tmp_path):
    """No producer timer knows the deadline: the busy consumer's lease thread, armed at
    the earliest deadline it read, takes it out (it reads the deadlines at each renewal,
    at most 1 s apart)."""
    model = RecordingModel(tmp_path)
    model.serve(inprocess_consumer, shared_redis.url, queue, strategy="fifo")
    client = shared_redis.client()
    with Producer(shared_redis.url, queue) as p:
        blocker = p.submit({"sleep_ms": int((0.7 + 1.0 + SLACK_S) * 1000) + 1000})
        wait_for(model.batches, what="the blocker to start")
        started = time.monotonic()
        rid = _enqueue_raw(client, queue, 700)
        wait_for(lambda: p.fetch(rid), timeout=0.7 + 1.0 + SLACK_S + 2, interval=0.005,
                 what="the expiry")
        took = time.monotonic() - started
        print(f"\nbusy consumer, producer gone: expired {took * 1000:.0f} ms after enqueue "
              "(deadline 700 ms)")
        assert 0.7 <= took < 0.7 + 1.0 + SLACK_S
        assert p.fetch(rid).error_type == DEADLINE and not blocker.done()
    assert queue_stats(client, queue).expired == 1


def test_with_its_producer_gone_an_idle_consumer_expires_it(shared_redis, queue,
                                                            inprocess_consumer, tmp_path):
    """The idle consumer's due timer is armed at the earliest deadline (enqueue wakes it
    when a deadline is the earliest), not at the end of a 5 s batch window."""
    model = RecordingModel(tmp_path)
    model.serve(inprocess_consumer, shared_redis.url, queue, strategy="dynamic",
                max_batch_size=8, max_queue_delay_ms=5000)
    client = shared_redis.client()
    started = time.monotonic()
    rid = _enqueue_raw(client, queue, 400)
    found = wait_for(lambda: request_state(client, queue, rid).status == "expired",
                     timeout=0.4 + SLACK_S + 2, interval=0.005, what="the expiry")
    took = time.monotonic() - started
    print(f"\nidle consumer, producer gone: expired {took * 1000:.0f} ms after enqueue "
          "(deadline 400 ms)")
    assert found and 0.4 <= took < 0.4 + SLACK_S
    assert model.payloads() == []


def test_an_async_producer_times_its_deadlines_too(shared_redis, queue):
    """AsyncProducer: an event-loop timer at the earliest deadline, moved earlier when a
    shorter deadline arrives (no consumer runs; nobody awaits the handles)."""
    configure(shared_redis.url, queue, timeout_high_ms=250)

    async def main() -> tuple[float, float]:
        async with AsyncProducer(shared_redis.url, queue) as p:
            started = time.monotonic()
            slow = await p.submit({"slow": 1}, deadline_ms=900)
            fast = await p.submit({"fast": 1}, priority=Priority.HIGH)  # the default: 250
            while not fast.done():
                await asyncio.sleep(0.005)
            fast_at = time.monotonic() - started
            assert not slow.done()
            while not slow.done():
                await asyncio.sleep(0.005)
            with pytest.raises(DeadlineExceeded):
                await slow.result(timeout=0)
            return fast_at, time.monotonic() - started

    fast_at, slow_at = asyncio.run(main())
    print(f"\nasync: done {fast_at * 1000:.0f} ms (250 ms) and {slow_at * 1000:.0f} ms "
          "(900 ms) after submit")
    assert 0.25 <= fast_at < 0.25 + SLACK_S and 0.9 <= slow_at < 0.9 + SLACK_S


def test_a_request_popped_in_time_runs_though_its_deadline_passes_while_it_runs(
        shared_redis, queue, inprocess_consumer, tmp_path):
    model = RecordingModel(tmp_path)
    model.serve(inprocess_consumer, shared_redis.url, queue, strategy="fifo")
    with Producer(shared_redis.url, queue) as p:
        handle = p.submit({"sleep_ms": 900}, deadline_ms=300)
        assert handle.result(timeout=15) == {"sleep_ms": 900}
    assert queue_stats(shared_redis.client(), queue).expired == 0


# -- scenario B: an expired request never fills a batch ----------------------------------


def test_an_expired_request_does_not_count_toward_a_full_batch(shared_redis, queue,
                                                               inprocess_consumer, tmp_path):
    model = RecordingModel(tmp_path)
    model.serve(inprocess_consumer, shared_redis.url, queue, strategy="dynamic",
                max_batch_size=3, max_queue_delay_ms=2000)
    with Producer(shared_redis.url, queue) as p:
        blockers = p.submit_many([{"sleep_ms": 1200}, {"b": 0}, {"b": 1}])  # a full batch
        wait_for(model.batches, what="the blockers to start")
        a2 = p.submit({"a2": 1}, deadline_ms=300)
        b, c = p.submit({"B": 1}), p.submit({"C": 1})
        _wait_done(a2, 0.3 + SLACK_S + 2)
        d_sent = time.monotonic()
        d = p.submit({"D": 1})
        assert d.result(timeout=10) == {"D": 1}
        took = time.monotonic() - d_sent
        print(f"\nscenario B: D answered {took * 1000:.0f} ms after its submit "
              "(the delay is 2000 ms; the blocker ends ~1200 ms after it started)")
        # B, C, D made a full batch as the blocker ended (~0.9 s on): no 2 s window.
        assert took < 2.0 - 0.3
        assert [h.result(timeout=10) for h in (b, c)] == [{"B": 1}, {"C": 1}]
        assert all(h.done() for h in blockers)
    assert model.batches()[1]["payloads"] == [{"B": 1}, {"C": 1}, {"D": 1}]
    with pytest.raises(DeadlineExceeded):
        a2.result(timeout=0)


def test_a_pop_expires_first_so_an_expired_request_never_joins_a_batch(shared_redis, queue):
    """pop_batch answers {-4} while a waiting request is past its deadline; after
    expire_due the batch holds only live requests and counts only them toward full."""
    client = shared_redis.client()
    configure(shared_redis.url, queue, strategy="dynamic", max_batch_size=3,
              max_queue_delay_ms=60_000)
    scripts, keys = Scripts(client), QueueKeys(queue)
    late = _enqueue_raw(client, queue, 1)
    live = [_enqueue_raw(client, queue, 0) for _ in range(2)]
    time.sleep(0.01)
    assert scripts.pop_batch(keys=keys.shared, args=["c", 10_000]) == [-4]
    sweep = expire_due(scripts, keys)
    assert (sweep.expired, sweep.delayed, sweep.more) == (1, 0, False)
    reply = scripts.pop_batch(keys=keys.shared, args=["c", 10_000])
    assert reply[0] == 0 and reply[1] > 50_000_000  # 2 of 3: the window, not a full batch
    third = _enqueue_raw(client, queue, 0)
    reply = scripts.pop_batch(keys=keys.shared, args=["c", 10_000])
    assert [x.decode() for x in reply[4::5]] == [*live, third]
    assert request_state(client, queue, late).status == "expired"


# -- max_queue_size ----------------------------------------------------------------------


def test_expired_requests_hold_no_place_under_max_queue_size(shared_redis, queue):
    client = shared_redis.client()
    configure(shared_redis.url, queue, max_queue_size=2)
    _enqueue_raw(client, queue, 50)  # expires, and nobody takes it out: no consumer
    _enqueue_raw(client, queue, 0)
    wait_for(lambda: queue_stats(client, queue).past_deadline == 1, 10,
             "the first request to pass its 50 ms deadline")
    with Producer(shared_redis.url, queue) as p:
        p.submit({"fits": 1})  # 1 live + 1 new <= 2: accepted
        with pytest.raises(Exception) as full:
            p.submit({"over": 1})
        assert type(full.value).__name__ == "QueueFull"
        assert full.value.depth == 2  # the live ones: the expired one is not counted


# -- per-level default timeouts ----------------------------------------------------------


def _policy_set(url: str, queue: str, *flags: str) -> str:
    done = batchgate("policy", "set", "--redis-url", url, "--queue", queue, *flags)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_per_level_default_timeouts_with_and_without_override(shared_redis, queue):
    shown = _policy_set(shared_redis.url, queue, "--timeout-low-ms", "300",
                        "--timeout-high-ms", "0")
    assert '"timeout_low_ms": 300' in shown and '"allow_timeout_override": 1' in shown
    with Producer(shared_redis.url, queue) as p:
        started = time.monotonic()
        low = p.submit({"low": 1}, priority=Priority.LOW)  # the LOW default: 300 ms
        own = p.submit({"own": 1}, priority=Priority.LOW, deadline_ms=60_000)  # overrides
        normal = p.submit({"normal": 1})  # no default for NORMAL
        took = _wait_done(low, 0.3 + SLACK_S + 2) - started
        print(f"\ndefault timeout: LOW done {took * 1000:.0f} ms after submit (300 ms)")
        assert 0.3 <= took < 0.3 + SLACK_S
        with pytest.raises(DeadlineExceeded):
            low.result(timeout=0)
        time.sleep(0.5)
        assert not own.done() and not normal.done()

        _policy_set(shared_redis.url, queue, "--allow-timeout-override", "0")
        forced = p.submit({"forced": 1}, priority=Priority.LOW, deadline_ms=60_000)
        _wait_done(forced, 0.3 + SLACK_S + 2)  # the default applies, its own is ignored
        with pytest.raises(DeadlineExceeded):
            forced.result(timeout=0)
        # Where the level has no default, a request's own deadline still applies.
        short = p.submit({"short": 1}, deadline_ms=200)
        _wait_done(short, 0.2 + SLACK_S + 2)
        assert not own.done() and not normal.done()


def test_timeouts_are_validated_naming_the_field_and_limit(shared_redis, queue):
    for flags, says in ((["--timeout-normal-ms", "86400001"],
                         "timeout_normal_ms: 86400001 is outside [0, 86400000]"),
                        (["--timeout-high-ms", "-1"], "timeout_high_ms: -1 is outside [0, "),
                        (["--allow-timeout-override", "2"],
                         "allow_timeout_override: 2 is outside [0, 1]"),
                        (["--on-timeout", "drop"], "'--on-timeout'")):  # click: the choices
        done = batchgate("policy", "set", "--redis-url", shared_redis.url, "--queue", queue,
                         *flags)
        assert done.returncode == 2 and says in done.stderr, (flags, done.stderr)
    with pytest.raises(InvalidPolicy) as info:
        Policy(on_timeout="drop")  # type: ignore[arg-type]
    assert info.value.field == "on_timeout" and "reject or delay" in str(info.value)
    assert not shared_redis.client().exists(QueueKeys(queue).policy)  # nothing written


# -- on_timeout = delay ------------------------------------------------------------------


def test_on_timeout_delay_runs_the_request_only_when_nothing_else_waits(
        shared_redis, queue, inprocess_consumer, tmp_path):
    model = RecordingModel(tmp_path)
    model.serve(inprocess_consumer, shared_redis.url, queue, strategy="priority",
                max_queue_delay_ms=0, on_timeout="delay")
    client = shared_redis.client()
    with Producer(shared_redis.url, queue) as p:
        blocker = p.submit({"sleep_ms": 1500}, priority=Priority.HIGH)
        wait_for(model.batches, what="the blocker to start")
        late = p.submit({"late": 1}, priority=Priority.HIGH, deadline_ms=200)
        wait_for(lambda: queue_stats(client, queue).delayed == 1, timeout=0.2 + SLACK_S + 2,
                 what="the late request to be delayed", interval=0.01)
        others = [p.submit({"n": i}) for i in range(3)]
        assert not late.done()  # delayed, not rejected
        assert request_state(client, queue, late.id).status == "queued"
        assert late.result(timeout=15) == {"late": 1}
        assert [h.result(timeout=15) for h in others] == [{"n": i} for i in range(3)]
        assert blocker.done()
    batches = [b["payloads"] for b in model.batches()]
    # The NORMAL ones (submitted after it expired, but live) ran first, then the late one.
    assert batches[1:] == [[{"n": 0}, {"n": 1}, {"n": 2}], [{"late": 1}]], batches
    assert queue_stats(client, queue).expired == 0


def test_a_flood_of_expiries_is_taken_in_bounded_chunks_and_all_of_them_end(shared_redis,
                                                                             queue):
    """More requests fall due at once than one sweep takes (200 per call, 10 calls): the
    producer's timer sweeps again until none is left; no consumer runs."""
    with Producer(shared_redis.url, queue) as p:
        handles = p.submit_many([{"i": i} for i in range(2500)], deadline_ms=300)
        started = time.monotonic()
        wait_for(lambda: all(h.done() for h in handles), timeout=0.3 + SLACK_S + 5,
                 what="every request to expire")
        print(f"\n2,500 expiries: all done {(time.monotonic() - started) * 1000:.0f} ms "
              "after the submit returned (deadline 300 ms)")
    stats = queue_stats(shared_redis.client(), queue)
    assert stats.expired == 2500 and stats.depth == {"high": 0, "normal": 0, "low": 0}


# -- exactly once ------------------------------------------------------------------------


def test_each_expiry_is_answered_exactly_once(shared_redis, queue, inprocess_consumer,
                                              tmp_path):
    """Many requests falling due together while the producer's timer, the busy consumer's
    lease thread and four more sweepers race to expire them: each result reaches the
    inbox once."""
    model = RecordingModel(tmp_path)
    model.serve(inprocess_consumer, shared_redis.url, queue, strategy="fifo")
    client = shared_redis.client()
    seen: Counter[str] = Counter()
    lock = threading.Lock()

    def count(result) -> None:
        with lock:
            seen[result.id] += 1

    with Producer(shared_redis.url, queue, on_result=count) as p:
        blocker = p.submit({"sleep_ms": 3000})
        wait_for(model.batches, what="the blocker to start")
        handles = p.submit_many([{"i": i} for i in range(300)], deadline_ms=400)
        stop = threading.Event()

        def sweep() -> None:
            scripts, keys = Scripts(shared_redis.client()), QueueKeys(queue)
            while not stop.is_set():
                expire_due(scripts, keys, chunk=50)

        sweepers = [threading.Thread(target=sweep) for _ in range(4)]
        for t in sweepers:
            t.start()
        try:
            wait_for(lambda: all(h.done() for h in handles), timeout=0.4 + SLACK_S + 5,
                     what="every request to expire")
        finally:
            stop.set()
            for t in sweepers:
                t.join()
        time.sleep(0.5)  # any second delivery would have arrived by now
        for h in handles:
            with pytest.raises(DeadlineExceeded):
                h.result(timeout=0)
        assert blocker.result(timeout=15) == {"sleep_ms": 3000}
    assert all(seen[h.id] == 1 for h in handles), Counter(seen[h.id] for h in handles)
    assert queue_stats(client, queue).expired == 300
    assert model.payloads() == [{"sleep_ms": 3000}]


def test_a_request_fetched_ahead_does_not_run_once_its_deadline_has_passed(
        shared_redis, queue, inprocess_consumer, tmp_path):
    """fifo, batch 1: W (50 ms) teaches the consumer a batch's time, so behind W and A
    (3 s) it fetches B (deadline 500 ms) ahead ~50 ms into A. B's deadline passes in the
    consumer's hands: it must not run, and is answered DeadlineExceeded, once."""
    model = RecordingModel(tmp_path)
    model.serve(inprocess_consumer, shared_redis.url, queue, strategy="fifo")
    client, keys = shared_redis.client(), QueueKeys(queue)
    with Producer(shared_redis.url, queue) as p:
        w = p.submit({"sleep_ms": 50})  # the consumer learns the shape's time
        a = p.submit({"sleep_ms": 3000})
        b = p.submit({"B": 1}, deadline_ms=500)
        # The precondition, made true rather than hoped for: B is popped (owned by a
        # batch, out of the deadlines set) while A still runs.
        wait_for(lambda: client.hexists(keys.owner, b.id), 2.5, "B to be fetched ahead")
        assert client.zscore(keys.deadlines, b.id) is None and not a.done()
        with pytest.raises(DeadlineExceeded):
            b.result(timeout=15)
        assert a.result(timeout=15) == {"sleep_ms": 3000} and w.result(timeout=1)
    assert {"B": 1} not in model.payloads()
    assert queue_stats(client, queue).expired == 1
