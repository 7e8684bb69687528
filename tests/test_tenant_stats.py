"""Seeing tenants (docs/tenants.md#seeing-it) against a real redis-server: `batchgate
stats` (table and --json), the exporter's scrape and the dashboard's API show each
tenant's waiting, in flight, served, rejected and share of the weighted service, Jain's
index over the backlogged tenants, with bounded labels and bounded reads."""

from __future__ import annotations

import math

import orjson
import pytest
from helpers.cli import batchgate
from helpers.support import configure, wait_for

from producer import Producer, TenantLimit
from scheduler_core.keys import QueueKeys
from scheduler_core.ops import reading
from scheduler_core.ops.stats import queue_stats

# The known state of known_state(): weighted service (cost / weight) of the backlogged
# tenants gold (40 / 2), silver (10 / 1) and bronze (0); idle served 5 but waits for
# nothing, the default tenant's service is not counted.
SERVICE = {"gold": 20.0, "silver": 10.0, "bronze": 0.0}
SHARES = {t: x / sum(SERVICE.values()) for t, x in SERVICE.items()}
JAIN = sum(SERVICE.values()) ** 2 / (len(SERVICE) * sum(x * x for x in SERVICE.values()))


def known_state(url: str, queue: str, inprocess_consumer) -> None:
    """Served (by a consumer, then stopped): gold 4 × cost 10, silver 1 × 10, idle 1 × 5;
    then waiting: gold 2, silver 1, bronze 1, the default tenant 1."""
    configure(url, queue, strategy="fifo", fairness="cost", tenant_quotas="gold:weight=2")
    consumer = inprocess_consumer(lambda payloads: payloads, redis_url=url, queue=queue)
    with Producer(url, queue=queue) as p:
        handles = [*p.submit_many([1, 2, 3, 4], tenant="gold", cost=10),
                   p.submit(5, tenant="silver", cost=10), p.submit(6, tenant="idle", cost=5)]
        for handle in handles:
            handle.result(timeout=30)
        consumer.stop()
        p.submit_many([7, 8], tenant="gold", cost=3)
        p.submit(9, tenant="silver", cost=3)
        p.submit(10, tenant="bronze", cost=3)
        p.submit(11)


def test_stats_shows_each_backlogged_tenants_share_and_jains_index(shared_redis, queue,
                                                                   inprocess_consumer):
    known_state(shared_redis.url, queue, inprocess_consumer)
    # A tenant's served counters are written when its results are: wait for the last.
    wait_for(lambda: queue_stats(shared_redis.client(), queue).tenants["idle"]["served"] == 1)
    ran = batchgate("stats", "--redis-url", shared_redis.url, "--queue", queue, "--json")
    assert ran.returncode == 0, ran.stderr
    stats = orjson.loads(ran.stdout)
    tenants = stats["tenants"]
    assert tenants["gold"] == {"waiting": 2, "in_flight": 0, "accepted": 6, "served": 4,
                               "served_cost": 40, "rejected": 0, "share": SHARES["gold"]}
    assert {t: tenants[t]["share"] for t in SHARES} == pytest.approx(SHARES)
    assert tenants["idle"]["share"] is None and tenants["default"]["share"] is None
    assert stats["tenant_fairness"] == {"unit": "cost", "backlogged": 3,
                                        "jain_index": pytest.approx(JAIN)}
    assert math.isclose(JAIN, 0.6)
    assert stats["tenant_counters"]["read"] is True
    ran = batchgate("stats", "--redis-url", shared_redis.url, "--queue", queue)
    assert ran.returncode == 0, ran.stderr
    assert "5, 3 backlogged, Jain's index 0.600 (by cost)" in ran.stdout
    assert "served 4 (cost 40), rejected 0, share 66.7%" in ran.stdout


def test_under_fairness_requests_a_share_counts_requests_over_weight(shared_redis, queue):
    # Nothing served yet: the backlogged share equally, Jain's index is 1.
    configure(shared_redis.url, queue, strategy="fifo", fairness="requests")
    with Producer(shared_redis.url, queue=queue) as p:
        p.submit_many([1, 2, 3], tenant="a", cost=50)
        p.submit(4, tenant="b")
    stats = queue_stats(shared_redis.client(), queue)
    assert {t: row["share"] for t, row in stats.tenants.items()} == {"a": 0.5, "b": 0.5}
    assert stats.tenant_fairness == {"unit": "requests", "backlogged": 2, "jain_index": 1.0}


def scrape(client, queue: str, **config) -> dict[str, dict[tuple, float]]:
    """The exporter's text for `queue`, parsed back: metric -> {labels: value}."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from batchgate.exporter import ExporterConfig, build_registry
    text = generate_latest(build_registry(client, ExporterConfig((queue,), **config)))
    found: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "queue"))
            found.setdefault(sample.name, {})[labels] = sample.value
    return found


def test_the_exporter_caps_tenant_labels_and_sums_the_rest_as_other(shared_redis, queue,
                                                                     inprocess_consumer):
    pytest.importorskip("prometheus_client")
    known_state(shared_redis.url, queue, inprocess_consumer)
    client = shared_redis.client()
    wait_for(lambda: queue_stats(client, queue).tenants["idle"]["served"] == 1)
    metrics = scrape(client, queue, tenant_labels=1)  # gold (most accepted) and other
    waiting = {dict(k)["tenant"]: v for k, v in metrics["batchgate_tenant_waiting"].items()}
    assert waiting == {"gold": 2, "other": 3}  # silver, bronze, default (idle: 0)
    served = metrics["batchgate_tenant_served_cost_total"]
    assert {dict(k)["tenant"]: v for k, v in served.items()} == {"gold": 40, "other": 15}
    share = {dict(k)["tenant"]: v for k, v in metrics["batchgate_tenant_share"].items()}
    assert share == pytest.approx({"gold": SHARES["gold"],
                                   "other": SHARES["silver"] + SHARES["bronze"]})
    assert metrics["batchgate_tenant_fairness_jain"] == {(("unit", "cost"),):
                                                         pytest.approx(JAIN)}
    assert metrics["batchgate_tenant_backlogged"] == {(): 3}
    # The default: every tenant of a few has its own label.
    labels = {dict(k)["tenant"] for k in scrape(client, queue)["batchgate_tenant_waiting"]}
    assert labels == {"gold", "silver", "bronze", "idle", "default"}


def test_labels_stay_bounded_with_many_tenants(shared_redis, queue):
    pytest.importorskip("prometheus_client")
    from batchgate.exporter import DEFAULT_TENANT_LABELS
    from batchgate.present import stats_table
    configure(shared_redis.url, queue, strategy="fifo", tenant_quotas="t00:max_waiting=1")
    n = DEFAULT_TENANT_LABELS + 5
    with Producer(shared_redis.url, queue=queue) as p:
        for i in range(n):
            p.submit_many(list(range(i + 1)), tenant=f"t{i:02d}")
        p.submit_many([0, 1, 2])  # the default tenant
        with pytest.raises(TenantLimit):
            p.submit(0, tenant="t00")
    client = shared_redis.client()
    tenants = queue_stats(client, queue).tenants
    assert len(tenants) == n + 1
    assert list(tenants)[0] == f"t{n - 1:02d}"  # the busiest first
    assert tenants["default"]["waiting"] == 3
    assert tenants["t00"] == {"waiting": 1, "in_flight": 0, "accepted": 1, "served": 0,
                              "served_cost": 0, "rejected": 1, "share": 1 / n}
    table = "\n".join(stats_table({**queue_stats(client, queue).to_dict(),
                                   "recommended_consumers": None}))
    assert f"tenants          {n + 1}, {n} backlogged" in table and "  other" in table
    metrics = scrape(client, queue)
    for name in ("batchgate_tenant_waiting", "batchgate_tenant_rejected_total",
                 "batchgate_tenant_share"):
        assert len(metrics[name]) == DEFAULT_TENANT_LABELS + 1  # the top N and "other"
    waiting = {dict(k)["tenant"]: v for k, v in metrics["batchgate_tenant_waiting"].items()}
    assert waiting["other"] == sum(tenants[name]["waiting"] for name in tenants
                                   if name not in waiting)
    assert sum(waiting.values()) == sum(t["waiting"] for t in tenants.values())
    share = metrics["batchgate_tenant_share"]
    assert math.isclose(sum(share.values()), 1.0)
    assert scrape(client, queue, tenant_labels=0)["batchgate_tenant_waiting"] == \
        {(("tenant", "other"),): sum(t["waiting"] for t in tenants.values())}


def test_past_the_read_cap_tenant_counters_are_not_read_and_that_is_said(
        shared_redis, queue, monkeypatch):
    pytest.importorskip("prometheus_client")
    # 70 tenants x 2 fields (w:, a:).
    with Producer(shared_redis.url, queue=queue) as p:
        for i in range(70):
            p.submit(i, tenant=f"t{i:02d}")
    client = shared_redis.client()
    assert client.hlen(QueueKeys(queue).tenants) == 140
    monkeypatch.setattr(reading, "TENANT_FIELDS_READ", 140)
    assert len(queue_stats(client, queue).tenants) == 70  # at the cap: read whole
    monkeypatch.setattr(reading, "TENANT_FIELDS_READ", 139)
    stats = queue_stats(client, queue)
    assert stats.tenants == {} and stats.tenant_fairness["jain_index"] is None
    assert stats.tenant_counters == {"fields": 140, "read_cap": 139, "read": False}
    ran = batchgate("stats", "--redis-url", shared_redis.url, "--queue", queue)
    assert "not read: 140 counters, over the 139 read (docs/tenants.md)" in ran.stdout
    metrics = scrape(client, queue)
    assert metrics["batchgate_tenant_counter_fields"] == {(): 140}
    assert "batchgate_tenant_waiting" not in metrics


def test_the_dashboard_api_has_shares_and_jains_index(shared_redis, queue,
                                                      inprocess_consumer):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from batchgate.dashboard.app import create_app
    known_state(shared_redis.url, queue, inprocess_consumer)
    client = shared_redis.client()
    wait_for(lambda: queue_stats(client, queue).tenants["idle"]["served"] == 1)
    with TestClient(create_app(client, only=[queue])) as http:
        snap, = http.get("/api/snapshot").json()["queues"]
    assert snap["tenant_count"] == 5
    assert {t: snap["tenants"][t]["share"] for t in SHARES} == pytest.approx(SHARES)
    assert snap["tenant_fairness"] == {"unit": "cost", "backlogged": 3,
                                       "jain_index": pytest.approx(JAIN)}


def test_the_page_shows_shares_and_jains_index(shared_redis, queue, inprocess_consumer):
    sync_api = pytest.importorskip("playwright.sync_api")
    import test_dashboard
    known_state(shared_redis.url, queue, inprocess_consumer)
    wait_for(lambda: queue_stats(shared_redis.client(), queue).tenants["idle"]["served"] == 1)
    with test_dashboard.queue_card(shared_redis.url, queue) as card:
        sync_api.expect(card.locator(".tenant-total")).to_have_text(
            "(5; 3 backlogged, Jain's index 0.600 by cost)")
        gold = card.locator(".tenants tbody tr", has_text="gold")
        sync_api.expect(gold.locator("td").last).to_have_text("66.7%")
        idle = card.locator(".tenants tbody tr", has_text="idle")
        sync_api.expect(idle.locator("td").last).to_have_text("–")
