"""A backward step of Redis' clock (an NTP step, failover to a host whose clock lags):
the queue's clock (lua/_common.lua, queue_now) never goes back, so a batch waits no
longer than max_queue_delay_ms, leases and deadlines keep their length, and waits are
measured from where the clock was.

The step is simulated by the state it leaves behind: the queue's last arrival score (the
`{bg:q}:clock` key, and the latest time the queue showed) ahead of the server's TIME. A
real step of a private redis-server's clock under libfaketime was tried: Debian's
libfaketime 0.9.10 aborts redis-server at start (recursive clock_gettime from jemalloc)."""

from __future__ import annotations

import random
import time

from helpers.support import configure

from producer import Producer
from scheduler_core.keys import CLOCK_OFFSET, CLOCK_SEEN, QueueKeys
from scheduler_core.rules import queue_clock
from scheduler_core.scripts import Scripts, pop_keys

STEP_US = 20_000_000  # the 20 s backward step
SLACK_S = 1.0  # a loaded machine


def server_us(client) -> int:
    sec, usec = client.time()
    return sec * 1_000_000 + usec


def step_back(client, keys: QueueKeys, step_us: int = STEP_US) -> None:
    """What a backward step of `step_us` leaves: the last arrival issued that far ahead
    of TIME."""
    client.set(keys.clock, server_us(client) + step_us)


def test_after_a_backward_step_a_lone_request_waits_only_the_delay(shared_redis, queue):
    configure(shared_redis.url, queue, strategy="dynamic", max_batch_size=8,
              max_queue_delay_ms=20)
    client, keys = shared_redis.client(), QueueKeys(queue)
    scripts = Scripts(client)
    step_back(client, keys)
    with Producer(shared_redis.url, queue) as p:
        handle = p.submit({"lone": 1}, deadline_ms=2000)
        sent = time.monotonic()
        # Popped as an idle consumer does: each "not yet" names a due time within the
        # delay (it named the step + the delay, cut to the deadline, before the fix).
        while int((reply := scripts.pop_batch(keys=pop_keys(keys),
                                              args=["c1", 60_000]))[0]) == 0:
            assert 0 <= int(reply[1]) <= 20_000, reply
            time.sleep(int(reply[1]) / 1e6)
        assert time.monotonic() - sent < 0.02 + SLACK_S  # the batch, within its deadline
        now, lease_deadline = int(reply[1]), int(reply[2])
        assert lease_deadline - now == 60_000_000  # the lease keeps its length
        assert [(reply[4].decode(), reply[7].decode())] == [(handle.id, "run")]
        wait_us = int(client.lindex(keys.wait_samples, 0))
        assert 20_000 <= wait_us <= 20_000 + SLACK_S * 1e6  # the delay, not the step


def test_after_a_backward_step_a_consumer_answers_within_the_delay(shared_redis, queue,
                                                                   start_consumer):
    """The issue's case: dynamic, 20 ms delay, an idle consumer; after the step a lone
    request took 19.8 s and one with deadline_ms=2000 expired without running."""
    client, keys = shared_redis.client(), QueueKeys(queue)
    start_consumer(shared_redis.url, queue, "--model", "consumer.models:noop",
                   "--strategy", "dynamic", "--max-batch-size", "8",
                   "--max-queue-delay-ms", "20")
    with Producer(shared_redis.url, queue) as p:
        assert p.submit({"before": 1}).result(timeout=15)
        step_back(client, keys)
        sent = time.monotonic()
        assert p.submit({"after": 1}, deadline_ms=2000).result(timeout=30) == {"after": 1}
        took = time.monotonic() - sent
    print(f"\nafter a {STEP_US / 1e6:.0f} s backward step: answered in {took * 1000:.0f} ms")
    assert took < 0.02 + SLACK_S


def test_the_queue_clock_matches_its_python_twin(shared_redis, queue):
    """rules.queue_clock against the scripts' queue_now on random stored states: the pop's
    now (its heartbeat score) and the offset it leaves."""
    client, keys = shared_redis.client(), QueueKeys(queue)
    configure(shared_redis.url, queue, strategy="dynamic")
    scripts, rng = Scripts(client), random.Random(7)
    for _ in range(200):
        t = server_us(client)
        offset = rng.choice([0, 0, rng.randint(1, 5 * STEP_US)])
        seen = rng.choice([0, t + offset - rng.randint(0, STEP_US),
                           t + offset + rng.randint(1, STEP_US)])
        last = rng.choice([0, t + rng.randint(-STEP_US, STEP_US)])
        client.hset(keys.stats, mapping={CLOCK_OFFSET: offset, CLOCK_SEEN: seen})
        client.set(keys.clock, last)
        t0 = server_us(client)
        scripts.pop_batch(keys=pop_keys(keys), args=["c1", 1000])
        t1 = server_us(client)
        now = int(client.zscore(keys.consumers, "c1"))
        stored = int(client.hget(keys.stats, CLOCK_OFFSET) or 0)
        low, high = queue_clock(t0, offset, seen, last), queue_clock(t1, offset, seen, last)
        assert low[0] <= now <= high[0], (offset, seen, last)
        assert queue_clock(now - stored, offset, seen, last) == (now, stored)
        assert int(client.hget(keys.stats, CLOCK_SEEN)) == now


def test_a_clock_written_by_hand_is_read_as_none(shared_redis, queue):
    """Hand-written clock values (not numbers, nan, negative, huge) never fail a script:
    read as 0, so the queue's clock is TIME again."""
    client, keys = shared_redis.client(), QueueKeys(queue)
    configure(shared_redis.url, queue, strategy="fifo")
    scripts = Scripts(client)
    with Producer(shared_redis.url, queue) as p:
        for bad in ("abc", "nan", "-5", "1e300", "inf"):
            client.hset(keys.stats, mapping={CLOCK_OFFSET: bad, CLOCK_SEEN: bad})
            client.set(keys.clock, bad)
            handle = p.submit({"bad": bad})
            t0 = server_us(client)
            reply = scripts.pop_batch(keys=pop_keys(keys), args=["c1", 60_000])
            assert reply[4].decode() == handle.id, (bad, reply)
            assert t0 - 1_000_000 <= int(reply[1]) <= server_us(client), bad
