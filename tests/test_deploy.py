"""deploy/keda.yaml and deploy/grafana-dashboard.json checked against what the exporter and
a consumer really serve (Kubernetes and Grafana cannot run here)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import redis
from helpers.metrics import names, scrape
from helpers.processes import free_port

from batchgate.cli import main as batchgate_main
from producer import Producer
from scheduler_core.registry import register_queue

yaml = pytest.importorskip("yaml")
pytest.importorskip("prometheus_client")

ROOT = Path(__file__).resolve().parent.parent
METRIC = re.compile(r"\bbatchgate_[a-z_]+\b")


@pytest.fixture
def served(redis_server, queue, start_consumer) -> set[str]:
    """Every sample name the exporter and a consumer serve once a request went through."""
    from prometheus_client import generate_latest, parser

    from batchgate.exporter import ExporterConfig, build_registry

    client = redis.Redis.from_url(redis_server.url)
    register_queue(client, queue)
    port = free_port()
    start_consumer(redis_server.url, queue, "--model", "consumer.models:noop",
                   "--metrics-port", str(port))
    with Producer(redis_server.url, queue) as producer:
        producer.submit({"x": 1}).result(timeout=30)
    text = generate_latest(build_registry(client, ExporterConfig())).decode()
    exported = {s.name for family in parser.text_string_to_metric_families(text)
                for s in family.samples}
    return exported | names(scrape(port))


def test_grafana_dashboard_queries_served_metrics(served):
    dashboard = json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())
    exprs = {panel["title"]: [t["expr"] for t in panel["targets"]]
             for panel in dashboard["panels"]}
    used = {name for queries in exprs.values() for q in queries for name in METRIC.findall(q)}
    assert used and used <= served, sorted(used - served)
    titles = " | ".join(exprs).lower()
    for topic in ("depth", "per second", "p99", "consumer"):
        assert topic in titles, topic
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert set(METRIC.findall(variables["queue"]["definition"])) <= served


def test_keda_scales_consumers_from_zero_on_the_exporter(served, monkeypatch):
    deployment, service, scaled = yaml.safe_load_all((ROOT / "deploy" / "keda.yaml").read_text())
    assert (deployment["kind"], service["kind"], scaled["kind"]) == \
        ("Deployment", "Service", "ScaledObject")
    assert scaled["spec"]["minReplicaCount"] == 0
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    query = trigger["metadata"]["query"]
    assert "batchgate_queue_depth" in query and set(METRIC.findall(query)) <= served
    assert trigger["metadata"]["activationThreshold"] == "0"

    # the exporter's command line parses, and its port is the one scraped and served
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    argv = container["command"]
    assert argv[:2] == ["batchgate", "exporter"]
    for env in container["env"]:
        monkeypatch.setenv(env["name"], env["value"])
    command = batchgate_main.get_command(None, "exporter")  # type: ignore[arg-type]
    with command.make_context("batchgate exporter", argv[2:]) as ctx:
        params = ctx.params
    assert params["redis_url"] == "redis://redis:6379/0"
    (port,) = container["ports"]
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert params["port"] == port["containerPort"] == int(annotations["prometheus.io/port"])
    assert service["spec"]["ports"][0]["targetPort"] == port["name"]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
