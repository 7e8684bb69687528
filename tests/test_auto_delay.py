"""max_queue_delay_ms=auto: the policy setting, the arrival counts enqueue.lua keeps, the
delay derived from them, and real consumers applying it."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
from click.testing import CliRunner
from helpers.processes import free_port
from helpers.support import configure, queue_pattern, snapshot, wait_for, wait_samples_ms

from batchgate.cli import main as cli
from consumer.auto_delay import DelayKeeper
from consumer.batch import Batch, Item
from producer import Priority, Producer
from scheduler_core.admin import read_policy
from scheduler_core.auto_delay import (
    BUSY,
    HEADROOM,
    MIN_GAIN,
    Cost,
    derive_delay_ms,
    fit_samples,
    predicted_p99_ms,
    read_cost_model,
    utilisation,
)
from scheduler_core.errors import InvalidPolicy
from scheduler_core.keys import QueueKeys
from scheduler_core.load import DEFAULT_WINDOW_S, arrival_rate, rate_from
from scheduler_core.ops.options import DelayType
from scheduler_core.ops.stats import queue_stats
from scheduler_core.policy import AUTO, Policy
from scheduler_core.scripts import Scripts, configure_keys
from scheduler_core.wire import Outcome


# -- the policy setting -----------------------------------------------------------------
def test_auto_needs_a_p99_target_named_with_its_limit():
    with pytest.raises(InvalidPolicy) as info:
        Policy.build("dynamic", max_queue_delay_ms="auto")
    assert info.value.field == "slo_p99_ms" and "1-600000" in str(info.value)
    policy = Policy.build("dynamic", max_queue_delay_ms="auto", slo_p99_ms=60)
    assert (policy.delay_mode, policy.slo_p99_ms, policy.auto_delay) == ("auto", 60, True)
    assert Policy.from_redis(policy.to_redis()) == policy
    with pytest.raises(InvalidPolicy) as info:
        Policy(delay_mode="sometimes")
    assert info.value.field == "delay_mode" and "fixed or auto" in str(info.value)


@pytest.mark.parametrize("spelled", ["auto", " AUTO ", "Auto"])
def test_every_reader_takes_auto_the_same_way(spelled):
    """The flag, Policy.build, Policy.differences and `simulate` read "auto" alike."""
    assert DelayType().convert(spelled, None, None) == AUTO
    policy = Policy.build("dynamic", max_queue_delay_ms=spelled, slo_p99_ms=60)
    assert (policy.delay_mode, policy.max_queue_delay_ms) == ("auto", 50)  # fixed one kept
    assert policy.differences({"max_queue_delay_ms": spelled}) == {}
    assert policy.differences({"max_queue_delay_ms": 50}) == {"max_queue_delay_ms":
                                                                 ("auto", 50)}
    assert Policy.build(**policy.to_dict()) == policy  # a stored delay_mode stays
    fixed = Policy.build("dynamic", max_queue_delay_ms=20)
    assert (fixed.delay_mode, fixed.max_queue_delay_ms) == ("fixed", 20)
    assert fixed.differences({"max_queue_delay_ms": spelled}) == {"max_queue_delay_ms":
                                                                    ("fixed", "auto")}
    done = CliRunner().invoke(cli, ["simulate", "--max-queue-delay-ms", spelled])
    assert done.exit_code == 2 and "auto is not simulated" in done.output, done.output


def test_policy_set_auto_and_back_writes_nothing_on_bad_input(shared_redis, queue):
    runner, client = CliRunner(), shared_redis.client()
    configure(shared_redis.url, queue, strategy="dynamic", max_queue_delay_ms=40)
    base = ["policy", "set", "--redis-url", shared_redis.url, "--queue", queue]
    before = snapshot(client, queue_pattern(queue))
    for bad, expected in [(["--max-queue-delay-ms", "auto"], "slo_p99_ms"),
                          (["--max-queue-delay-ms", "auto", "--slo-p99-ms", "600001"],
                           "slo_p99_ms: 600001 is outside [0, 600000]"),
                          (["--max-queue-delay-ms", "soon"], "--max-queue-delay-ms")]:
        done = runner.invoke(cli, [*base, *bad])
        assert done.exit_code == 2 and expected in done.output, (bad, done.output)
        assert snapshot(client, queue_pattern(queue)) == before  # nothing written

    done = runner.invoke(cli, [*base, "--max-queue-delay-ms", "auto", "--slo-p99-ms", "60"])
    assert done.exit_code == 0, done.output
    shown = json.loads(done.output)
    assert (shown["delay_mode"], shown["slo_p99_ms"], shown["max_queue_delay_ms"]) == \
        ("auto", 60, 40)  # the fixed delay is kept for a switch back
    done = runner.invoke(cli, [*base, "--max-queue-delay-ms", "20"])
    assert done.exit_code == 0, done.output
    stored = read_policy(client, queue)
    assert (stored.delay_mode, stored.max_queue_delay_ms, stored.slo_p99_ms) == ("fixed", 20, 60)


def test_configure_lua_refuses_an_unknown_delay_mode(shared_redis, queue):
    client = shared_redis.client()
    args = ["replace"]
    for field, value in {**Policy().to_redis(), "delay_mode": "sometimes"}.items():
        args += [field, value]
    reply = Scripts(client).configure(keys=configure_keys(QueueKeys(queue)), args=args)
    assert [int(reply[0]), reply[1]] == [-3, b"delay_mode"]
    assert not client.exists(QueueKeys(queue).policy)


# -- the arrival counts -----------------------------------------------------------------
def next_second(client) -> int:
    """Sleep into the next second of Redis' clock; return it."""
    sec, usec = client.time()
    time.sleep((1_000_000 - usec) / 1e6 + 0.01)
    return sec + 1


def test_enqueue_counts_arrivals_per_second_and_drops_old_ones(shared_redis, queue):
    client, keys = shared_redis.client(), QueueKeys(queue)
    configure(shared_redis.url, queue, strategy="dynamic")  # no consumer: they stay queued
    now = client.time()[0]
    stale = {str(now - 121): 7, str(now - 400): 3, **{f"junk{i}": 1 for i in range(140)}}
    client.hset(keys.arrivals, mapping=stale)
    second = next_second(client)
    with Producer(shared_redis.url, queue) as producer:
        producer.submit_many([{"i": i} for i in range(25)])
        producer.submit({"one": 1}, priority=Priority.HIGH)
    counts = {k.decode(): int(v) for k, v in client.hgetall(keys.arrivals).items()}
    assert sum(counts.values()) == 26 and set(counts) <= {str(second), str(second + 1)}, counts
    next_second(client)
    assert arrival_rate(client, keys, window_s=4) == 26 / 4
    # the second in progress (still counting) is left out
    assert rate_from({str(second + 1): 99, str(second): 10, str(second - 1): 4},
                     second + 1, 2) == 7.0


# -- the derivation ---------------------------------------------------------------------
def test_the_delay_is_zero_at_light_load_and_fills_batches_within_the_target_under_load():
    cost, slo = Cost(5, 0.5), 60
    assert derive_delay_ms(20, cost, slo, 32) == 0  # a window would catch < 2 more requests
    assert derive_delay_ms(0, cost, slo, 32) == derive_delay_ms(300, None, slo, 32) == 0
    delay = derive_delay_ms(300, cost, slo, 32)  # the largest within the headroom
    assert 300 * delay / 1000 >= MIN_GAIN
    assert predicted_p99_ms(delay, 0.3, cost, 32, 1) <= HEADROOM * slo
    assert predicted_p99_ms(delay + 1, 0.3, cost, 32, 1) > HEADROOM * slo
    # near saturation: full batches (31 more arrive in 25.8 ms) within the SLO itself
    assert utilisation(21, 1.2, cost, 32, 1) >= BUSY
    assert derive_delay_ms(1200, cost, slo, 32) == 39  # 1.5 x the 25.8 ms mean fill time
    assert predicted_p99_ms(39, 1.2, cost, 32, 1) <= slo
    assert derive_delay_ms(300, cost, slo, 32, consumers=4) >= derive_delay_ms(300, cost, slo, 32)
    assert derive_delay_ms(300, cost, 600_000, 32) <= 31 / 0.3 + 1  # no wait past a full batch


def test_cost_model_from_the_stored_hash_or_the_consumers_own_samples():
    assert read_cost_model({b"a_us": b"5000", b"b_us": b"500", b"source": b"live"}) == \
        Cost(5, 0.5, "live")
    assert read_cost_model({}) is None and read_cost_model({"a_us": "x", "b_us": "1"}) is None
    fit = fit_samples([(b, 5 + 0.5 * b) for b in (1, 2, 4, 8, 16)])
    assert fit is not None and abs(fit.a_ms - 5) < 1e-9 and abs(fit.b_ms - 0.5) < 1e-9
    assert fit_samples([(1, 6.0)] * 3) is None  # too few
    assert fit_samples([(1, 6.0)] * 5).t(1) == 6.0  # one size only: t(1) is still right


# -- real consumers ---------------------------------------------------------------------
def test_auto_at_light_load_does_not_wait_the_stored_delay(shared_redis, queue,
                                                           inprocess_consumer):
    """The stored fixed delay is 3 s; under auto with a 100 ms target, single requests at
    ~5/s are answered in about t(1) = 2 ms, not after the window."""
    stored_ms = 3000
    runner = CliRunner()
    done = runner.invoke(cli, ["policy", "set", "--redis-url", shared_redis.url, "--queue",
                               queue, "--strategy", "dynamic", "--max-queue-delay-ms",
                               str(stored_ms)])
    assert done.exit_code == 0, done.output
    done = runner.invoke(cli, ["policy", "set", "--redis-url", shared_redis.url, "--queue",
                               queue, "--max-queue-delay-ms", "auto", "--slo-p99-ms", "100"])
    assert done.exit_code == 0, done.output
    port = free_port()
    inprocess_consumer("consumer.models:synthetic", redis_url=shared_redis.url, queue=queue,
                       model_args={"base_ms": 2, "per_item_ms": 0}, metrics_port=port)
    latencies = []
    with Producer(shared_redis.url, queue) as producer:
        for i in range(15):
            started = time.monotonic()
            producer.submit({"i": i}).result(timeout=10)
            latencies.append(time.monotonic() - started)
            time.sleep(0.2)
    # Not the stored window: each left the queue at once (Redis' clock, arrival to pop);
    # answered in t(1) = 2 ms plus what a loaded machine adds, far below the window.
    assert max(wait_samples_ms(shared_redis.client(), queue)) < stored_ms / 2
    assert max(latencies) < stored_ms / 1000 / 2, latencies
    stats = json.loads(runner.invoke(cli, ["stats", "--redis-url", shared_redis.url, "--queue",
                                           queue, "--json"]).output)
    assert stats["max_queue_delay_ms_in_use"] == 0
    assert stats["policy"]["delay_mode"] == "auto" and stats["arrival_rate_rps"] > 0
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        metrics = reply.read().decode()
    assert f'batchgate_consumer_max_queue_delay_seconds_in_use{{queue="{queue}"}} 0.0' \
        in metrics, metrics
    # Queue-wide figures are the exporter's: a consumer reports only its own.
    assert "batchgate_queue_arrival_rate" not in metrics


def test_auto_under_load_waits_and_forms_batches(shared_redis, queue, inprocess_consumer):
    """~150 requests/s with a 400 ms target: the derived delay is above 0, batches hold
    several requests, and `stats --json` shows the delay in use and the rate."""
    client = shared_redis.client()
    done = CliRunner().invoke(cli, ["policy", "set", "--redis-url", shared_redis.url,
                                    "--queue", queue, "--strategy", "dynamic",
                                    "--max-queue-delay-ms", "auto", "--slo-p99-ms", "400"])
    assert done.exit_code == 0, done.output
    inprocess_consumer("consumer.models:synthetic", redis_url=shared_redis.url, queue=queue,
                       model_args={"base_ms": 5, "per_item_ms": 0.5}, lease_ms=3000)
    with Producer(shared_redis.url, queue) as producer:
        handles, seen = [], []
        end = time.monotonic() + 4
        while time.monotonic() < end:
            handles += producer.submit_many([{"i": i} for i in range(3)])
            time.sleep(0.02)
            stats = queue_stats(client, queue)
            if stats.max_queue_delay_ms_in_use:
                seen.append(stats)
        assert all(h.result(timeout=20) for h in handles)
    assert seen, "no consumer derived a delay above 0 under ~150 requests/s"
    assert 0 < seen[-1].max_queue_delay_ms_in_use <= 400
    # The rate shown: requests enqueued over the last DEFAULT_WINDOW_S complete seconds
    # (a loaded machine may submit fewer than ~150/s): some, and no more than were sent.
    assert 0 < seen[-1].arrival_rate_rps * DEFAULT_WINDOW_S <= len(handles), len(handles)
    final = wait_for(lambda: (s := queue_stats(client, queue)).processed == len(handles) and s,
                     what="all requests processed")
    assert final.mean_batch_size > 1.5, final


def test_a_window_that_stays_nearly_empty_drops_the_delay_at_once(shared_redis):
    """After a load step down, the first batch the delay releases with far fewer requests
    than the rate predicts sets the delay from the rate it shows (0 at light load),
    without waiting for the 2-second rate window to forget the old load; where the window
    predicts only 2-4 more, a window that collected none."""
    keys = QueueKeys(f"observe-{time.monotonic_ns()}")
    keeper = DelayKeeper(shared_redis.client(), keys)
    keeper.follow(Policy.build("dynamic", max_queue_delay_ms="auto", slo_p99_ms=60))
    keeper._inputs = (Cost(5, 0.5), 1)
    keeper.derived = keeper._derive(keeper.policy, 1200)
    delay = keeper.delay_ms
    assert delay and delay > 10

    def batch(size: int, waited_ms: float, attempts: int = 1) -> Batch:
        now = 10_000_000
        return Batch("b", now, [Item(f"r{i}", b"{}", now - int(waited_ms * 1000) + i, attempts,
                                     "p", Outcome.RUN, 1) for i in range(size)])

    keeper.observe(batch(size=1, waited_ms=delay / 2))  # not released by the delay
    keeper.observe(batch(size=20, waited_ms=delay))  # as many as the rate predicts
    keeper.observe(batch(size=1, waited_ms=delay, attempts=2))  # a re-delivery runs alone
    assert keeper.delay_ms == delay
    keeper.observe(batch(size=1, waited_ms=delay))
    assert keeper.delay_ms == 0
    stats = shared_redis.client().hgetall(keys.stats)  # published for `stats`
    assert stats[b"auto_delay_us"] == b"0" and stats[b"auto_at_us"] == b"10000000"
    # at a rate whose window predicts only 2-4 more requests, an empty window is the sign
    keeper.derived = keeper._derive(keeper.policy, 75)
    delay = keeper.delay_ms
    assert delay and 2 <= 75 * delay / 1000 < 4
    keeper.observe(batch(size=2, waited_ms=delay))  # one more came: no evidence
    assert keeper.delay_ms == delay
    keeper.observe(batch(size=1, waited_ms=delay))
    assert keeper.delay_ms == 0


def test_every_policy_change_applies_a_delay_the_same_way():
    # Policy.changed is what `policy set`, `plan --apply` and the dashboard all apply.
    auto = Policy.build("dynamic", max_queue_delay_ms="auto", slo_p99_ms=60)
    fixed = auto.changed(max_queue_delay_ms=5, max_batch_size=8)
    assert (fixed.delay_mode, fixed.max_queue_delay_ms, fixed.max_batch_size) == ("fixed", 5, 8)
    again = fixed.changed(max_queue_delay_ms="auto")
    assert (again.delay_mode, again.max_queue_delay_ms) == ("auto", 5)
    assert auto.changed(aging_ms=100).delay_mode == "auto"  # other knobs leave the mode
    assert fixed.changed(strategy="fifo").max_batch_size == 1  # the new strategy's default
