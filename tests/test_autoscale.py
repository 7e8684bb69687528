"""The autoscaling signal: the measured arrival rate, and `recommended_consumers` in
`stats --json` and in the exporter's metrics."""

from __future__ import annotations

import json
import subprocess
import urllib.request

import pytest
from click.testing import CliRunner
from helpers.processes import BATCHGATE, free_port
from helpers.support import wait_for

from batchgate.cli import main
from scheduler_core.admin import store_policy
from scheduler_core.cost_model import CostModel, write_cost_model
from scheduler_core.keys import QueueKeys
from scheduler_core.load import arrival_rate
from scheduler_core.ops.planner import Costs, Load, Target, consumers_for
from scheduler_core.ops.simulation import ModelTime
from scheduler_core.policy import Policy, Strategy

POLICY = Policy(strategy=Strategy.DYNAMIC, max_batch_size=32, max_queue_delay_ms=10)


def set_rate(client, queue: str, per_second: int, ahead_s: int = 0) -> None:
    """Arrival counters as enqueue.lua keeps them: `per_second` in each of the last 12 s
    (and the next `ahead_s`, so that the rate holds while a test runs)."""
    now_s, _ = client.time()
    counts = {str(now_s - k): per_second for k in range(-ahead_s, 13)}
    client.delete(QueueKeys(queue).arrivals)
    client.hset(QueueKeys(queue).arrivals, mapping=counts)


def test_arrival_rate_counts_the_last_whole_seconds(shared_redis, queue):
    client, keys = shared_redis.client(), QueueKeys(queue)
    assert arrival_rate(client, keys) == 0
    now_s, _ = client.time()
    client.hset(keys.arrivals, mapping={
        **{str(now_s - k): 30 for k in range(1, 11)},
        str(now_s - 30): 5000,  # too old
        "junk": 7})
    # The second under way is still counting; leave it out (unless the clock turned).
    rate = arrival_rate(client, keys, window_s=10)
    assert rate in (30.0, 27.0)


def stats(url: str, queue: str, *args: str) -> dict:
    result = CliRunner().invoke(main, ["stats", "--redis-url", url, "--queue", queue,
                                       "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_stats_recommends_the_consumers_the_planner_finds(shared_redis, queue):
    client, keys = shared_redis.client(), QueueKeys(queue)
    store_policy(client, queue, POLICY, replace=True)
    out = stats(shared_redis.url, queue, "--slo-p99-ms", "60")
    assert out["recommended_consumers"] is None  # no cost model yet
    write_cost_model(client, keys, CostModel(5000, 500, source="live"))
    assert stats(shared_redis.url, queue, "--slo-p99-ms", "60")["recommended_consumers"] == 0

    counts = {}
    for rate in (100, 2000, 4000):
        set_rate(client, queue, rate, ahead_s=5)
        out = stats(shared_redis.url, queue, "--slo-p99-ms", "60")
        assert out["arrival_rate_rps"] == rate and out["slo_p99_ms"] == 60
        assert out["cost_model"]["cost_ms"] == "5+0.5*b"
        counts[rate] = out["recommended_consumers"]
    # One consumer serves at most 32 / 21.1 ms = 1,513 req/s with this policy.
    assert counts[100] == 1
    assert 2 <= counts[2000] <= counts[4000]
    assert counts[4000] >= 3
    # The count meets the target when simulated on other arrivals, one fewer does not
    # carry the load or misses it.
    costs, target = Costs(ModelTime(5, 0.5)), Target(60)
    n = counts[2000]
    check = consumers_for(POLICY, Load(2000, requests=5000, seed=9), target, costs)
    assert check.feasible and abs(check.best.consumers - n) <= 1


def test_stats_reads_the_target_from_the_policy(shared_redis, queue):
    client, keys = shared_redis.client(), QueueKeys(queue)
    store_policy(client, queue, POLICY, replace=True)
    write_cost_model(client, keys, CostModel(5000, 500, source="profile"))
    set_rate(client, queue, 2000, ahead_s=5)
    assert stats(shared_redis.url, queue)["recommended_consumers"] is None  # no target
    client.hset(keys.policy, "slo_p99_ms", "60")  # the field `policy set` stores
    out = stats(shared_redis.url, queue)
    assert out["slo_p99_ms"] == 60 and out["recommended_consumers"] >= 2


def test_stats_refuses_a_bad_target(shared_redis, queue):
    result = CliRunner().invoke(main, ["stats", "--redis-url", shared_redis.url, "--queue",
                                       queue, "--slo-p99-ms", "0"])
    assert result.exit_code == 2 and "--slo-p99-ms" in result.output


def test_the_exporter_serves_recommended_consumers(shared_redis, queue):
    """Queue-wide figures come from `batchgate exporter`, once per queue, with no consumer."""
    parser = pytest.importorskip("prometheus_client.parser")
    client, keys = shared_redis.client(), QueueKeys(queue)
    client.hset(keys.policy, mapping=Policy.build("dynamic", max_batch_size=32,
                                                  max_queue_delay_ms=10).to_redis())
    port = free_port()
    exporter = subprocess.Popen([BATCHGATE, "exporter", "--redis-url", shared_redis.url,
                                 "--queue", queue, "--host", "127.0.0.1", "--port", str(port)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def scrape() -> dict[str, float]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                text = r.read().decode()
        except OSError:
            return {}
        return {s.name: s.value for family in parser.text_string_to_metric_families(text)
                for s in family.samples if s.labels.get("queue") == queue}

    try:
        first = wait_for(lambda: scrape() or None, what="the exporter to answer")
        assert "batchgate_recommended_consumers" not in first  # no target, no cost model
        client.hset(keys.policy, "slo_p99_ms", "60")
        write_cost_model(client, keys, CostModel(5000, 500, source="profile"))
        set_rate(client, queue, 2000, ahead_s=30)
        expected = stats(shared_redis.url, queue)["recommended_consumers"]
        assert expected >= 2
        metrics = wait_for(lambda: (m := scrape()).get("batchgate_queue_arrival_rate") == 2000
                           and m, what="the arrival rate in the metrics")
        assert metrics["batchgate_recommended_consumers"] == expected
    finally:
        exporter.kill()
        exporter.wait()
