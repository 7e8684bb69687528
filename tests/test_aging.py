"""Aging, the priority strategy's headline promise (docs/strategies.md, docs/scheduling.md
"The priority rules, exactly"), checked against pop_batch.lua on a real Redis with a real
Consumer (in the test process, as `batchgate consumer` runs one) while a producer keeps
HIGH requests waiting all the time:

- NORMAL waits at most about aging_ms, LOW about 2 x aging_ms, plus the batch in
  progress, and neither runs earlier (it is promoted, not let in by an idle gap);
- promotion goes one level per aging_ms (LOW to NORMAL, then to HIGH), and a promoted
  request keeps its arrival time: it is the oldest of its new level, served before every
  HIGH request that arrived after it;
- aging_ms = 0 turns aging off: LOW (and NORMAL) wait while the flood lasts.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from helpers.support import RecordingModel, configure, wait_for, wait_samples_ms

from producer import Producer
from scheduler_core.keys import QueueKeys
from scheduler_core.scripts import Scripts, pop_keys

BATCH = 4  # max_batch_size
MODEL_MS = 40  # the recording model's time per batch
AGING_MS = 600
# Kept waiting at HIGH: more than a batch (so HIGH never runs dry between top-ups), and
# drained in about 6 batches, well within aging_ms (so a promoted request is older than
# every HIGH request still waiting when it is promoted).
HIGH_DEPTH = 6 * BATCH
# One batch in progress when the request falls due, and the one fetched ahead of it
# (overlap); slack for a loaded 2-core machine.
SLACK_S = 0.5


def bound_s(levels: int) -> float:
    return levels * AGING_MS / 1000 + 2 * MODEL_MS / 1000 + SLACK_S


class HighFlood:
    """A thread topping the HIGH level up to HIGH_DEPTH waiting requests every few ms:
    as many HIGH requests arrive as the consumer serves, so HIGH is never empty."""

    def __init__(self, url: str, queue: str):
        self.producer = Producer(url, queue)
        self.client = self.producer._redis
        self.key = QueueKeys(queue).pending(0)
        self.lock = threading.Lock()  # held while submitting: `mark` orders arrivals
        self.seq = 0  # flood requests submitted so far; payload {"h": seq}
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HighFlood:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                missing = HIGH_DEPTH - self.client.zcard(self.key)
                if missing > 0:
                    with self.lock:
                        self.producer.submit_many(
                            [{"h": self.seq + i} for i in range(missing)], priority="high")
                        self.seq += missing
                time.sleep(0.003)
        except BaseException as exc:  # reported by the test
            self.errors.append(exc)

    def submit_marked(self, p: Producer, payload: Any, priority: str) -> tuple[Any, float, int]:
        """Submit between two flood top-ups: (handle, wall-clock time before the submit,
        the flood sequence number from which HIGH requests arrived after it)."""
        with self.lock:
            before = time.time()
            handle = p.submit(payload, priority=priority)
            return handle, before, self.seq

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self.producer.close()


def batch_of(model: RecordingModel, payload: Any) -> tuple[int, dict[str, Any]]:
    batches = model.batches()
    return next((i, b) for i, b in enumerate(batches) if payload in b["payloads"])


def check_promoted(model: RecordingModel, payload: Any, submitted_at: float, mark: int,
                   levels: int) -> float:
    """The request ran while HIGH waited, not before levels x aging_ms and within its
    bound, behind no HIGH request that arrived after it. Returns its wait in seconds."""
    _, batch = batch_of(model, payload)
    waited = batch["t"] - submitted_at
    # It ran in a HIGH batch: promoted, not let in because HIGH ran dry.
    assert any("h" in x for x in batch["payloads"]), batch
    assert waited >= levels * AGING_MS / 1000, (payload, waited)
    assert waited <= bound_s(levels), (payload, waited, bound_s(levels))
    ahead = batch["payloads"][:batch["payloads"].index(payload)]
    assert all(x["h"] < mark for x in ahead if "h" in x), (payload, mark, batch)
    return waited


def start_flooded(shared_redis, queue, inprocess_consumer, tmp_path, aging_ms: int):
    configure(shared_redis.url, queue, strategy="priority", max_batch_size=BATCH,
              max_queue_delay_ms=50, aging_ms=aging_ms)
    model = RecordingModel(tmp_path)
    model.serve(inprocess_consumer, shared_redis.url, queue, delay_ms=MODEL_MS)
    return model


def test_normal_and_low_are_promoted_within_aging_under_a_high_flood(
        shared_redis, queue, inprocess_consumer, tmp_path):
    model = start_flooded(shared_redis, queue, inprocess_consumer, tmp_path, AGING_MS)
    with Producer(shared_redis.url, queue) as p, HighFlood(shared_redis.url, queue) as flood:
        wait_for(lambda: len(model.batches()) >= 3, what="the flood to be served")
        normal, normal_at, normal_mark = flood.submit_marked(p, {"n": 0}, "normal")
        low, low_at, low_mark = flood.submit_marked(p, {"l": 0}, "low")
        assert low.result(timeout=10) == {"l": 0}
        assert normal.result(timeout=1) == {"n": 0}
        assert not flood.errors, flood.errors
        # The flood was still on when LOW ran: HIGH requests ran after it.
        wait_for(lambda: batch_of(model, {"l": 0})[0] < len(model.batches()) - 1,
                 what="a HIGH batch after the LOW request")
    waits = (check_promoted(model, {"n": 0}, normal_at, normal_mark, 1),
             check_promoted(model, {"l": 0}, low_at, low_mark, 2))
    print(f"\naging {AGING_MS} ms under a HIGH flood: NORMAL waited {waits[0]:.3f}s, "
          f"LOW {waits[1]:.3f}s")
    # NORMAL reached HIGH one aging_ms before LOW did.
    assert batch_of(model, {"n": 0})[0] < batch_of(model, {"l": 0})[0]


def test_aging_zero_turns_aging_off_so_low_starves_under_the_flood(
        shared_redis, queue, inprocess_consumer, tmp_path):
    model = start_flooded(shared_redis, queue, inprocess_consumer, tmp_path, 0)
    # Longer than LOW would wait with aging on (the test above): still not served.
    flood_s = bound_s(2) + 0.5
    with Producer(shared_redis.url, queue) as p:
        with HighFlood(shared_redis.url, queue) as flood:
            wait_for(lambda: len(model.batches()) >= 3, what="the flood to be served")
            normal = p.submit({"n": 0}, priority="normal")
            low = p.submit({"l": 0}, priority="low")
            ends, served_before = time.monotonic() + flood_s, len(model.batches())
            while time.monotonic() < ends:
                assert not normal.done() and not low.done()
                time.sleep(0.05)
            served_during_flood = len(model.batches())
            assert not flood.errors, flood.errors
        # Once HIGH drains, NORMAL and then LOW run: they were starved, not lost.
        assert normal.result(timeout=30) == {"n": 0}
        assert low.result(timeout=10) == {"l": 0}
    batches = model.batches()
    assert served_during_flood >= served_before + 5  # the consumer kept serving HIGH
    assert all(all("h" in x for x in b["payloads"]) for b in batches[:served_during_flood])
    assert batch_of(model, {"n": 0})[0] < batch_of(model, {"l": 0})[0]


def test_promoted_requests_keep_their_arrival_time(shared_redis, queue, inprocess_consumer,
                                                   tmp_path):
    """While a long HIGH batch runs, a LOW, a NORMAL and then two HIGH requests arrive.
    When the batch ends the LOW one has waited over 2 x aging_ms and the NORMAL one over
    aging_ms: both are HIGH now and, arrival kept, the oldest of it: the next batch is
    LOW, NORMAL, HIGH, HIGH in arrival order. A request that lost its arrival time at
    promotion would queue behind the two HIGH ones."""
    aging_ms = 300
    configure(shared_redis.url, queue, strategy="priority", max_batch_size=BATCH,
              max_queue_delay_ms=50, aging_ms=aging_ms)
    model = RecordingModel(tmp_path)
    model.serve(inprocess_consumer, shared_redis.url, queue)
    blocker = {"blocker": 1, "sleep_ms": 2 * aging_ms + 500}
    with Producer(shared_redis.url, queue) as p:
        handles = [p.submit(blocker, priority="high")]
        wait_for(lambda: model.batches(), what="the blocker to start")
        handles += [p.submit({"l": 0}, priority="low"), p.submit({"n": 0}, priority="normal")]
        handles += p.submit_many([{"h": 0}, {"h": 1}], priority="high")
        for h in handles:
            h.result(timeout=15)
    assert [b["payloads"] for b in model.batches()] == [
        [blocker], [{"l": 0}, {"n": 0}, {"h": 0}, {"h": 1}]]


def test_an_idle_consumer_wakes_up_when_a_request_would_age(shared_redis, queue,
                                                            inprocess_consumer):
    """A lone NORMAL request not due for a minute (max_queue_delay_ms): the consumer
    sleeps until it would age (docs/scheduling.md, rule 3), not until its own due time nor
    for its whole idle block (1 s), and serves it as HIGH after aging_ms."""
    aging_ms = 200
    configure(shared_redis.url, queue, strategy="priority", max_batch_size=BATCH,
              max_queue_delay_ms=60_000, aging_ms=aging_ms)
    inprocess_consumer("consumer.models:noop", redis_url=shared_redis.url, queue=queue)
    with Producer(shared_redis.url, queue) as p:
        assert p.submit({"n": 0}).result(timeout=10) == {"n": 0}
    (waited_ms,) = wait_samples_ms(shared_redis.client(), queue)  # by Redis' clock
    assert aging_ms <= waited_ms <= aging_ms + SLACK_S * 1000, waited_ms


def test_aging_learns_the_submitted_priority_without_reading_payloads(shared_redis, queue):
    """Between aging_ms and 2 x aging_ms a NORMAL request moves up to HIGH but one
    submitted LOW (already moved up to NORMAL) stays: the pop learns which from the
    request's costs entry (a few bytes), not from its jobs value, whose payload may be
    megabytes. Here each jobs value says the other priority (written by hand): the pop
    follows the costs entries."""
    aging_ms = 300
    configure(shared_redis.url, queue, strategy="priority", max_batch_size=BATCH,
              max_queue_delay_ms=60_000, aging_ms=aging_ms)
    client, keys = shared_redis.client(), QueueKeys(queue)
    with Producer(shared_redis.url, queue) as p:
        low = p.submit({"l": 0}, priority="low")
        normal = p.submit({"n": 0}, priority="normal")
    for handle, other in ((low, b"1"), (normal, b"2")):
        value = client.hget(keys.jobs, handle.id)
        client.hset(keys.jobs, handle.id, other + value[1:])  # the meta's priority
    time.sleep(1.3 * aging_ms / 1000)  # both waited past aging_ms, neither 2 x aging_ms
    scripts = Scripts(client)
    reply = scripts.pop_batch(keys=pop_keys(keys), args=["c", 60_000])
    assert [reply[i] for i in range(4, len(reply), 5)] == [normal.id.encode()]  # HIGH now
    assert client.zrange(keys.pending(1), 0, -1) == [low.id.encode()]  # NORMAL, not HIGH
