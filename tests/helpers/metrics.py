"""Scraping a Prometheus /metrics endpoint over HTTP, parsed by prometheus_client."""

from __future__ import annotations

import urllib.request

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int, host: str = "127.0.0.1") -> Samples:
    """Every sample served at http://host:port/metrics, by (name, sorted labels)."""
    from prometheus_client import parser

    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    samples = {}
    for family in parser.text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples: Samples, name: str, default: float = 0.0, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), default)


def names(samples: Samples) -> set[str]:
    return {name for name, _ in samples}
