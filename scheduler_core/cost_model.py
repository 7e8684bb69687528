"""A queue's model time per batch, t(b) = a + b_per_item·b, stored with the queue.

`batchgate profile --queue Q` stores a fit measured offline (source "profile"); every
consumer of the queue refits it every few seconds from the live samples its batches leave
in `{bg:q}:samples:model` ("size:model_us", newest first) and stores that (source "live").
The planner (`batchgate plan --queue`, `recommended_consumers`) and the adaptive delay
read it.

The hash `{bg:q}:cost_model` (KEYS[23]) holds, as decimal strings:

| field        | meaning                                                       |
|--------------|---------------------------------------------------------------|
| `a_us`       | fixed time of a model call, µs (may be decimal)               |
| `b_us`       | time per request in the batch, µs (may be decimal)            |
| `r2`         | R² of the fit                                                 |
| `samples`    | model calls the fit was made from                             |
| `source`     | `profile` or `live`                                           |
| `updated_us` | when it was written, Redis TIME in µs                         |

A live fit replaces whatever is stored (a profile included) only once it rests on enough
samples: at least LIVE_MIN_SAMPLES model calls spread over at least two batch sizes with
LIVE_MIN_PER_SIZE calls each. Until then a profile (or an older live fit) stays.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import redis

from scheduler_core.connection import slot_owner
from scheduler_core.errors import InvalidRequest
from scheduler_core.keys import QueueKeys

SOURCES = ("profile", "live")
LIVE_WINDOW = 2_000  # newest model samples a live refit reads (of the 10,000 kept)
LIVE_MIN_SAMPLES = 50
LIVE_MIN_PER_SIZE = 5
LIVE_MIN_SIZES = 2


@dataclass(frozen=True)
class Fit:
    """t(b) = base_ms + per_item_ms × b, least squares over (batch size, ms) points."""

    base_ms: float
    per_item_ms: float
    r2: float

    def ms(self, batch: int) -> float:
        return self.base_ms + self.per_item_ms * batch

    @property
    def cost_ms(self) -> str:
        """As `batchgate simulate --cost-ms` takes it (a negative term clamped to 0)."""
        return f"{max(0.0, self.base_ms):.4g}+{max(0.0, self.per_item_ms):.4g}*b"


def fit(points: list[tuple[int, float]]) -> Fit:
    """Least-squares line through (batch size, ms); needs two distinct sizes."""
    xs, ys = [float(b) for b, _ in points], [ms for _, ms in points]
    if len(set(xs)) < 2:
        raise InvalidRequest("batch_sizes", "need at least two distinct batch sizes to fit")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    base = my - slope * mx
    ss_res = sum((y - base - slope * x) ** 2 for x, y in zip(xs, ys, strict=True))
    ss_tot = sum((y - my) ** 2 for y in ys)
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
    return Fit(base, slope, r2)


@dataclass(frozen=True)
class CostModel:
    """The stored fit: t(b) = a_us + b_us × b microseconds."""

    a_us: float
    b_us: float
    r2: float = 1.0
    samples: int = 0
    source: str = "profile"
    updated_us: int = 0

    def __post_init__(self) -> None:
        for name in ("a_us", "b_us"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0 <= value <= 3.6e9:
                raise InvalidRequest(name, f"must be within [0, 3.6e9] µs, got {value!r}")
        if self.source not in SOURCES:
            raise InvalidRequest("source", f"must be one of {', '.join(SOURCES)}, got "
                                           f"{self.source!r}")

    @classmethod
    def from_fit(cls, line: Fit, samples: int, source: str) -> CostModel:
        """Negative terms (a noisy fit) are clamped to 0: a time is never negative."""
        return cls(max(0.0, line.base_ms * 1000), max(0.0, line.per_item_ms * 1000),
                   line.r2, samples, source)

    @property
    def base_ms(self) -> float:
        return self.a_us / 1000

    @property
    def per_item_ms(self) -> float:
        return self.b_us / 1000

    @property
    def cost_ms(self) -> str:
        """As `--cost-ms` takes it: "A+B*b" in ms."""
        return f"{self.base_ms:.6g}+{self.per_item_ms:.6g}*b"

    def to_redis(self) -> dict[str, str]:
        return {"a_us": f"{self.a_us:.3f}", "b_us": f"{self.b_us:.3f}",
                "r2": f"{self.r2:.5f}", "samples": str(self.samples), "source": self.source,
                "updated_us": str(self.updated_us)}

    def to_dict(self) -> dict[str, Any]:
        return {"a_us": round(self.a_us, 3), "b_us": round(self.b_us, 3),
                "r2": round(self.r2, 5), "samples": self.samples, "source": self.source,
                "updated_us": self.updated_us, "cost_ms": self.cost_ms}

    @classmethod
    def from_redis(cls, raw: dict[Any, Any]) -> CostModel | None:
        """The stored model, or None if there is none or it is unreadable."""
        data = {_text(k): _text(v) for k, v in raw.items()}
        try:
            return cls(float(data["a_us"]), float(data["b_us"]),
                       float(data.get("r2", "1")), int(float(data.get("samples", "0"))),
                       data.get("source", "profile"), int(float(data.get("updated_us", "0"))))
        except (KeyError, ValueError, InvalidRequest):
            return None


def read_cost_model(client: redis.Redis, keys: QueueKeys) -> CostModel | None:
    return CostModel.from_redis(client.hgetall(keys.cost_model))


def write_cost_model(client: redis.Redis, keys: QueueKeys, model: CostModel) -> CostModel:
    """Store `model` (all fields at once), stamped with Redis' clock; returns what was
    stored."""
    client = slot_owner(client, keys.cost_model)  # a cluster: the slot's primary, for TIME
    now_s, now_frac = client.time()
    stored = CostModel(model.a_us, model.b_us, model.r2, model.samples, model.source,
                       int(now_s) * 1_000_000 + int(now_frac))
    pipe = client.pipeline(transaction=True)
    pipe.delete(keys.cost_model)
    pipe.hset(keys.cost_model, mapping=stored.to_redis())
    pipe.execute()
    return stored


def parse_samples(raw: Iterable[bytes | str]) -> list[tuple[int, int]]:
    """"size:model_us" entries as (size, µs); unreadable ones are skipped."""
    out = []
    for entry in raw:
        size, _, us = _text(entry).partition(":")
        if size.isdigit() and us.isdigit() and int(size) > 0:
            out.append((int(size), int(us)))
    return out


def fit_samples(samples: list[tuple[int, int]]) -> CostModel | None:
    """A live fit from (size, µs) samples: the median of each batch size that has at
    least LIVE_MIN_PER_SIZE calls, fitted by least squares. None if the samples are too
    few (LIVE_MIN_SAMPLES) or cover fewer than LIVE_MIN_SIZES such sizes."""
    by_size: dict[int, list[int]] = defaultdict(list)
    for size, us in samples:
        by_size[size].append(us)
    used = {b: v for b, v in by_size.items() if len(v) >= LIVE_MIN_PER_SIZE}
    count = sum(len(v) for v in used.values())
    if len(used) < LIVE_MIN_SIZES or count < LIVE_MIN_SAMPLES:
        return None
    line = fit([(b, statistics.median(v) / 1000) for b, v in sorted(used.items())])
    return CostModel.from_fit(line, count, "live")


def refit_live(client: redis.Redis, keys: QueueKeys) -> CostModel | None:
    """A consumer's periodic refit: fit the newest LIVE_WINDOW model samples and store
    the fit if they suffice; returns what was stored (None: nothing written)."""
    model = fit_samples(parse_samples(client.lrange(keys.model_samples, 0, LIVE_WINDOW - 1)))
    if model is None:
        return None
    return write_cost_model(client, keys, model)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
