"""A consumer's settings: one field per flag of `batchgate consumer`, validated here for
the CLI and for `Consumer(...)` alike, before anything is written.

The queue's policy knobs (strategy, max_batch_size, ...) are settings too: `policy` holds
the ones given; `ConsumerConfig.build` takes them as plain keywords, as the CLI takes
them as flags.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field, fields, replace
from typing import Any
from urllib.parse import urlsplit

from scheduler_core.connection import DEFAULT_REDIS_URL
from scheduler_core.errors import InvalidRequest
from scheduler_core.keys import QueueKeys
from scheduler_core.policy import KNOBS, MAX_COST_BUCKETS, Policy
from scheduler_core.wire import DEFAULT_MAX_RESULT_BYTES

MAX_TORCH_THREADS = 1024
# [low, high] of each whole-number setting (None, where allowed, means "not set").
INT_RANGES: dict[str, tuple[int, int]] = {
    "lease_ms": (100, 86_400_000),
    "max_result_bytes": (16, 512 << 20),
    "wait_replicas": (0, 64),
    "wait_timeout_ms": (1, 60_000),
    "prefer_bucket": (0, MAX_COST_BUCKETS + 1),
    "only_bucket": (0, MAX_COST_BUCKETS + 1),
    "torch_threads": (1, MAX_TORCH_THREADS),
    "metrics_port": (1, 65_535),
}
# Settings that are 0 (off) or within [low, high].
OFF_OR_RANGES: dict[str, tuple[int | float, int, str]] = {  # (low, high, unit)
    "max_batch_ms": (100, 86_400_000, ""),
    "cost_refit_s": (0.1, 86_400, " s"),
}
FLOAT_RANGES: dict[str, tuple[int, int]] = {"stop_timeout": (0, 86_400)}
OPTIONAL = ("torch_threads", "metrics_port")
OTEL_EXPORTERS = ("none", "console", "otlp")
MAX_URL = 2048
BATCHING_MODES = ("static", "continuous")


@dataclass(frozen=True)
class ConsumerConfig:
    redis_url: str = DEFAULT_REDIS_URL
    queue: str = "default"
    lease_ms: int = 10_000  # a batch not renewed for this long is re-queued
    # A batch the model runs longer than this is deemed hung: its lease is no longer
    # renewed, the batch fetched ahead is given back, and lease_ms later, unless the model
    # returned, the process exits with EXIT_MODEL_HUNG (a stuck thread cannot be
    # interrupted; a supervisor starts a fresh process). 0 = never.
    max_batch_ms: int = 0
    max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES
    # While a backlog waits, fetch the next batch and write the last one's results beside
    # the model (consumer/overlap.py). Off: one batch at a time, nothing held ahead.
    overlap: bool = True
    # Every this many seconds, refit the queue's stored cost model from the live model
    # samples (consumer/refit.py). 0 = never.
    cost_refit_s: float = 5.0
    # Policy values given explicitly (None = adopt the queue's stored policy or default).
    policy: dict[str, Any] = field(default_factory=dict)
    name: str = ""
    # The cost bucket this consumer serves first when it is due (1-based; 0 = none):
    # docs/scheduling.md, "Requests of different cost".
    prefer_bucket: int = 0
    # The cost bucket this consumer serves alone (1-based; 0 = every bucket): a consumer
    # dedicated to it, which never takes another bucket's requests.
    only_bucket: int = 0
    # Acknowledge a completion only once this many replicas confirm it (WAIT); until
    # then it is offered again. wait_timeout_ms bounds each WAIT.
    wait_replicas: int = 0
    wait_timeout_ms: int = 1000
    # "static": the model runs one popped batch to its end. "continuous": a step-wise
    # model (consumer/stepwise.py) whose running batch requests join and leave at every
    # step (consumer/continuous.py).
    batching: str = "static"
    # Continuous batching only: when HIGH requests wait and every slot runs, give running
    # LOW sequences back to the queue (recomputed later) to make room for them.
    preempt: bool = False
    # -- around the loop (consumer/api.py) ------------------------------------------
    device: str | None = None  # given to a model factory as device=; shown in stats
    torch_threads: int | None = None  # cap torch's CPU threads (None: leave them be)
    otel_exporter: str = "none"  # "console": install a span printer (consumer/tracing.py)
    # --otel-exporter otlp: the collector's OTLP/HTTP URL (a bare http://host:port gets
    # /v1/traces); None: OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, else localhost:4318.
    otel_endpoint: str | None = None
    metrics_port: int | None = None  # serve Prometheus metrics on this port
    stop_timeout: float = 30.0  # s that stop() and leaving `with` wait for the loop

    @classmethod
    def build(cls, base: ConsumerConfig | None = None, **settings: Any) -> ConsumerConfig:
        """`base` (or the defaults) with `settings` applied: fields of ConsumerConfig, and
        policy knobs (strategy=, max_batch_size=, ...) merged into its `policy`. An
        unknown keyword is a TypeError naming it, as for any call."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(settings) - known - set(KNOBS))
        if unknown:
            raise TypeError(f"unknown consumer setting {', '.join(unknown)}; the settings "
                            f"are {', '.join(sorted(known | set(KNOBS)))}")
        base = base or cls()
        policy = {**base.policy, **(settings.pop("policy", None) or {}),
                  **{k: v for k, v in settings.items() if k in KNOBS and v is not None}}
        return replace(base, policy=policy, **{k: v for k, v in settings.items()
                                               if k in known})

    def __post_init__(self) -> None:
        QueueKeys(self.queue)
        for knob, (low, high) in INT_RANGES.items():
            value = getattr(self, knob)
            if value is None and knob in OPTIONAL:
                continue
            if isinstance(value, bool) or not isinstance(value, int) \
                    or not low <= value <= high:
                raise InvalidRequest(knob, f"{value!r} is outside [{low}, {high}]")
        for knob, (low, high, unit) in OFF_OR_RANGES.items():
            value = getattr(self, knob)
            if not _number(value, whole=knob.endswith("_ms")) \
                    or not (value == 0 or low <= value <= high):
                raise InvalidRequest(knob, f"{value!r}: use 0 (off) or [{low}, {high}]"
                                           f"{unit}")
        for knob, (low, high) in FLOAT_RANGES.items():
            value = getattr(self, knob)
            if not _number(value) or not low <= value <= high:
                raise InvalidRequest(knob, f"{value!r} is outside [{low}, {high}] s")
        if self.batching not in BATCHING_MODES:
            raise InvalidRequest("batching", f"{self.batching!r}: use "
                                             f"{' or '.join(BATCHING_MODES)}")
        if not isinstance(self.preempt, bool):
            raise InvalidRequest("preempt", f"{self.preempt!r} is not true or false")
        if self.preempt and self.batching != "continuous":
            raise InvalidRequest("preempt", "preemption evicts sequences of a running batch: "
                                            "it needs batching='continuous' "
                                            "(--batching continuous)")
        if not isinstance(self.overlap, bool):
            raise InvalidRequest("overlap", f"{self.overlap!r} is not true or false")
        if self.prefer_bucket and self.only_bucket:
            raise InvalidRequest("only_bucket", "a consumer dedicated to a bucket prefers no "
                                                "other: give prefer_bucket or only_bucket")
        if self.otel_exporter not in OTEL_EXPORTERS:
            raise InvalidRequest("otel_exporter", f"{self.otel_exporter!r}: use "
                                                  f"{' or '.join(OTEL_EXPORTERS)}")
        if self.otel_endpoint is not None:
            if self.otel_exporter != "otlp":
                raise InvalidRequest("otel_endpoint", "is for otel_exporter otlp, not "
                                                      f"{self.otel_exporter!r}")
            if not _http_url(self.otel_endpoint):
                raise InvalidRequest("otel_endpoint", f"{self.otel_endpoint!r} is not an "
                                     f"http:// or https:// URL with a host (at most "
                                     f"{MAX_URL} characters)")
        if self.device is not None and not isinstance(self.device, str):
            raise InvalidRequest("device", f"{self.device!r} is not a device name (cpu, "
                                           "cuda:0, ...)")
        # Checked here, so that a bad knob is refused before the policy is stored.
        Policy.build(**{k: v for k, v in self.policy.items() if v is not None})
        if not self.name:
            object.__setattr__(self, "name", f"{socket.gethostname()}:{os.getpid()}:"
                                             f"{uuid.uuid4().hex[:6]}")
        if "|" in self.name:
            raise InvalidRequest("name", "must not contain '|'")


def _http_url(value: Any) -> bool:
    if not isinstance(value, str) or len(value) > MAX_URL or any(c.isspace() for c in value):
        return False
    try:
        url = urlsplit(value)
        url.port  # noqa: B018 - raises ValueError for a port out of range
    except ValueError:
        return False
    return url.scheme in ("http", "https") and bool(url.hostname)


def _number(value: Any, whole: bool = False) -> bool:
    kinds = int if whole else (int, float)
    return not isinstance(value, bool) and isinstance(value, kinds)
