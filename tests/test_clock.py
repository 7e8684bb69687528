"""A backward step of Redis' clock (an NTP step, failover to a host whose clock lags):
the queue's clock (lua/_common.lua, queue_now) never goes back, so a batch waits no
longer than max_queue_delay_ms, leases and deadlines keep their length, and waits are
measured from where the clock was.

A real step: a private redis-server whose wall clock a small LD_PRELOAD shim shifts
(helpers/clockstep.c, built with the system's C compiler; libfaketime aborts
redis-server at start), stepped back 20 s while a consumer serves it. The same step is
also simulated by the state it leaves behind (the queue's last arrival score, the
`{bg:q}:clock` key, ahead of the server's TIME) for the scripts alone and the Python twin."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from helpers.processes import RedisServer
from helpers.support import configure

from producer import Producer
from scheduler_core.keys import QueueKeys, clock_offset_us
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
        # The clock key's latest time: shown by a call, or issued as an arrival score.
        latest = rng.choice([0, t + offset - rng.randint(0, STEP_US),
                             t + offset + rng.randint(1, STEP_US),
                             t + rng.randint(-STEP_US, STEP_US)])
        client.set(keys.clock, f"{latest}:{offset}" if offset else latest)
        t0 = server_us(client)
        scripts.pop_batch(keys=pop_keys(keys), args=["c1", 1000])
        t1 = server_us(client)
        now = int(client.zscore(keys.consumers, "c1"))
        stored = clock_offset_us(client.get(keys.clock))
        low, high = queue_clock(t0, offset, latest, latest), queue_clock(t1, offset, latest,
                                                                            latest)
        assert low[0] <= now <= high[0], (offset, latest)
        assert queue_clock(now - stored, offset, latest, latest) == (now, stored)
        assert int(client.get(keys.clock).split(b":")[0]) == now


def test_a_clock_written_by_hand_is_read_as_none(shared_redis, queue):
    """Hand-written clock values (not numbers, nan, negative, huge) never fail a script:
    read as 0, so the queue's clock is TIME again."""
    client, keys = shared_redis.client(), QueueKeys(queue)
    configure(shared_redis.url, queue, strategy="fifo")
    scripts = Scripts(client)
    with Producer(shared_redis.url, queue) as p:
        for bad in ("abc", "nan", "-5", "1e300", "inf", "5:abc", "nan:1e300", ":"):
            client.set(keys.clock, bad)
            handle = p.submit({"bad": bad})
            t0 = server_us(client)
            reply = scripts.pop_batch(keys=pop_keys(keys), args=["c1", 60_000])
            assert reply[4].decode() == handle.id, (bad, reply)
            assert t0 - 1_000_000 <= int(reply[1]) <= server_us(client), bad


@pytest.fixture
def stepped_redis(tmp_path, monkeypatch):
    """(server, step): a private redis-server whose wall clock `step(us)` shifts by us."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build helpers/clockstep.c")
    shim, offset = tmp_path / "clockstep.so", tmp_path / "offset_us"
    subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(shim),
                    str(Path(__file__).parent / "helpers" / "clockstep.c")], check=True)
    offset.write_text("0")
    with monkeypatch.context() as env:  # for the server only, not the consumers
        env.setenv("LD_PRELOAD", str(shim))
        env.setenv("CLOCKSTEP_FILE", str(offset))
        server = RedisServer()
    assert "LD_PRELOAD" not in os.environ or os.environ["LD_PRELOAD"] != str(shim)
    def step(us: int) -> None:  # whole: a torn read (an empty file) would be no step at all
        part = offset.with_suffix(".part")
        part.write_text(str(us))
        part.replace(offset)

    yield server, step
    server.close()


def test_a_real_backward_step_of_the_server_clock(stepped_redis, queue, start_consumer):
    server, step = stepped_redis
    client = server.client()
    start_consumer(server.url, queue, "--model", "consumer.models:noop", "--strategy",
                   "dynamic", "--max-batch-size", "8", "--max-queue-delay-ms", "20")
    with Producer(server.url, queue) as p:
        assert p.submit({"before": 1}).result(timeout=15)
        before = server_us(client)
        step(-STEP_US)
        assert server_us(client) < before - STEP_US / 2  # the server's clock went back
        took = []
        for i in range(3):
            sent = time.monotonic()
            assert p.submit({"after": i}, deadline_ms=2000).result(timeout=30) == {"after": i}
            took.append(time.monotonic() - sent)
    print(f"\nafter a real {STEP_US / 1e6:.0f} s backward step: answered in "
          f"{', '.join(f'{t * 1000:.0f}' for t in took)} ms")
    assert max(took) < 0.02 + SLACK_S
    offset = clock_offset_us(client.get(QueueKeys(queue).clock))
    assert STEP_US * 0.9 <= offset <= STEP_US  # what the queue's clock absorbed
