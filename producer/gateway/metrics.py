"""Prometheus metrics of the HTTP gateway, served at `/metrics`.

- `batchgate_gateway_requests_total{endpoint,method,status}`: HTTP requests answered;
  `endpoint` is the route template (e.g. `/v1/requests/{request_id}`), `unmatched` otherwise;
  `method` one of METHODS, `other` otherwise; `status` the HTTP status code. Every label
  comes from a fixed set, whatever clients send: the exposition cannot grow without bound.
- `batchgate_gateway_request_seconds{endpoint,method}`: time to answer, all endpoints.
- `batchgate_gateway_submit_seconds{wait,status}`: `POST /v1/requests`, from receipt to
  answer (with wait=true this includes queueing and the model).
- `batchgate_gateway_waiting_requests`: submits now waiting for their result.
- `batchgate_gateway_open_streams`: `"stream": true` answers now open, each holding one
  reader of its request's partial results; one whose client hung up is closed as soon
  as the gateway reads the hang-up (hotpath.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0, 120.0, 300.0)
SUBMIT_PATH = "/v1/requests"
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class GatewayMetrics:
    """One registry per app, so that several apps in one process do not collide."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self.requests = Counter(
            "batchgate_gateway_requests", "HTTP requests answered by the gateway.",
            ["endpoint", "method", "status"], registry=self.registry)
        self.request_seconds = Histogram(
            "batchgate_gateway_request_seconds", "Time to answer an HTTP request.",
            ["endpoint", "method"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.submit_seconds = Histogram(
            "batchgate_gateway_submit_seconds",
            "POST /v1/requests: time from receipt to answer (wait=true includes the model).",
            ["wait", "status"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.waiting = Gauge(
            "batchgate_gateway_waiting_requests", "Submits now waiting for their result.",
            registry=self.registry)
        self.streams = Gauge(
            "batchgate_gateway_open_streams",
            "Streaming answers (server-sent events) now open.", registry=self.registry)

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class MetricsMiddleware:
    """Pure ASGI middleware: counts and times every HTTP request by route template."""

    def __init__(self, app: Any, metrics: GatewayMetrics, routes: Callable[[], Iterable[Any]]):
        self.app = app
        self.metrics = metrics
        self.routes = routes  # the app's, for requests answered before routing (guard.py)
        # The labelled children, looked up once each: labels() costs more than the count.
        # Bounded: every label comes from a fixed set.
        self._children: dict[tuple[str, str, int], tuple[Any, Any]] = {}
        self._submit_children: dict[tuple[bool, int], Any] = {}

    def endpoint(self, scope: dict[str, Any]) -> str:
        """The route template of the request's path, or "unmatched"."""
        path = getattr(scope.get("route"), "path", None)
        if path:
            return path
        return next((route.path for route in self.routes()
                     if route.path_regex.match(scope["path"])), "unmatched")

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        start = time.perf_counter()

        async def send_status(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            elapsed = time.perf_counter() - start
            endpoint = self.endpoint(scope)
            method = scope["method"] if scope["method"] in METHODS else "other"
            key = (endpoint, method, status)
            children = self._children.get(key)
            if children is None:
                children = self._children[key] = (
                    self.metrics.requests.labels(endpoint, method, str(status)),
                    self.metrics.request_seconds.labels(endpoint, method))
            children[0].inc()
            children[1].observe(elapsed)
            if endpoint == SUBMIT_PATH and method == "POST":
                submit_key = (bool(scope.get("batchgate.wait", False)), status)
                child = self._submit_children.get(submit_key)
                if child is None:
                    child = self._submit_children[submit_key] = \
                        self.metrics.submit_seconds.labels(
                            "true" if submit_key[0] else "false", str(status))
                child.observe(elapsed)
