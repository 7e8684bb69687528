"""A queue's stored cost model: `batchgate profile --queue` stores it, running consumers
refit it from their live model times, and a live fit replaces a profile only once it
rests on enough samples."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from helpers.support import wait_for

from batchgate.cli import main
from producer import Priority, Producer
from scheduler_core.cost_model import (
    LIVE_MIN_PER_SIZE,
    LIVE_MIN_SAMPLES,
    CostModel,
    fit_samples,
    read_cost_model,
    refit_live,
    write_cost_model,
)
from scheduler_core.keys import QueueKeys


def test_profile_queue_stores_the_fit_for_that_queue(shared_redis, queue):
    result = CliRunner().invoke(main, [
        "profile", "--model", "consumer.models:synthetic", "--model-arg", "base_ms=4",
        "--model-arg", "per_item_ms=5", "--batch-sizes", "1,8,16", "--warmup", "1",
        "--repeat", "3", "--queue", queue, "--redis-url", shared_redis.url, "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    client = shared_redis.client()
    raw = {k.decode(): v.decode() for k, v in client.hgetall(QueueKeys(queue).cost_model)
           .items()}
    assert set(raw) == {"a_us", "b_us", "r2", "samples", "source", "updated_us"}
    assert raw["source"] == "profile" and raw["samples"] == "9"  # 3 sizes x 3 runs
    assert float(raw["a_us"]) == pytest.approx(out["fit"]["base_ms"] * 1000, abs=1)
    assert float(raw["b_us"]) == pytest.approx(out["fit"]["per_item_ms"] * 1000, abs=1)
    # A sleep of 4 + 5·b ms: a loaded host oversleeps by a few ms, which tilts the line
    # by a few tenths of a ms per request at most.
    assert 3500 <= float(raw["b_us"]) <= 7500
    now_s, _ = client.time()
    assert abs(int(raw["updated_us"]) / 1e6 - now_s) < 60
    assert out["stored"]["queue"] == queue


def test_profile_refuses_a_bad_queue_name_before_timing():
    result = CliRunner().invoke(main, ["profile", "--queue", "no spaces"])
    assert result.exit_code == 2 and "queue" in result.output


def test_a_live_fit_needs_two_batch_sizes_with_enough_calls_each():
    one_size = [(8, 9000)] * 100
    assert fit_samples(one_size) is None
    few = [(1, 3000)] * LIVE_MIN_PER_SIZE + [(8, 10000)] * LIVE_MIN_PER_SIZE
    assert len(few) < LIVE_MIN_SAMPLES and fit_samples(few) is None
    # A size seen too rarely is left out rather than let one odd call tilt the line.
    enough = [(1, 3000)] * 30 + [(8, 10000)] * 30 + [(32, 99_000)] * (LIVE_MIN_PER_SIZE - 1)
    model = fit_samples(enough)
    assert model is not None and model.source == "live" and model.samples == 60
    assert (model.a_us, model.b_us) == pytest.approx((2000, 1000))


def test_refit_replaces_a_profile_only_with_enough_samples(shared_redis, queue):
    client, keys = shared_redis.client(), QueueKeys(queue)
    write_cost_model(client, keys, CostModel(50_000, 0, source="profile"))
    client.lpush(keys.model_samples, *["1:3000"] * 20, *["4:6000"] * 20)
    assert refit_live(client, keys) is None  # 40 calls: the profile stays
    assert read_cost_model(client, keys).source == "profile"
    client.lpush(keys.model_samples, *["4:6000"] * 20, "junk", "0:5")
    stored = refit_live(client, keys)
    assert stored is not None and read_cost_model(client, keys) == stored
    assert (stored.source, stored.samples) == ("live", 60)
    assert (stored.a_us, stored.b_us) == pytest.approx((2000, 1000))


def test_a_running_consumer_keeps_the_stored_fit_current(shared_redis, queue,
                                                         start_consumer):
    client, keys = shared_redis.client(), QueueKeys(queue)
    write_cost_model(client, keys, CostModel(50_000, 0, source="profile"))  # stale
    start_consumer(shared_redis.url, queue, "--model", "consumer.models:synthetic",
                   "--model-arg", "base_ms=2", "--model-arg", "per_item_ms=1",
                   "--strategy", "fifo", "--max-batch-size", "16", "--cost-refit-s", "0.5")
    with Producer(shared_redis.url, queue) as producer:
        for _ in range(50):  # one at a time: batches of 1
            producer.submit({"x": 1}, priority=Priority.NORMAL).result(timeout=15)
        for _ in range(8):  # 16 at once (one enqueue call): batches of 16, or split
            handles = producer.submit_many([{"x": i} for i in range(16)])
            for handle in handles:
                handle.result(timeout=15)

    def live() -> CostModel | None:
        model = read_cost_model(client, keys)
        return model if model is not None and model.source == "live" else None

    model = wait_for(live, timeout=10, what="a live refit")
    assert model.samples >= LIVE_MIN_SAMPLES
    # The sleep model takes 2 + 1·b ms; sleeps overrun by a fraction of a ms.
    assert model.b_us == pytest.approx(1000, abs=250)
    assert model.a_us == pytest.approx(2000, abs=1500)


def test_a_bad_refit_interval_is_refused_naming_it():
    result = CliRunner().invoke(main, ["consumer", "--redis-url", "redis://127.0.0.1:1/0",
                                       "--cost-refit-s", "0.05"])
    assert result.exit_code == 2 and "cost_refit_s" in result.output, result.output
