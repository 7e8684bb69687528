"""max_queue_delay_ms=auto: the delay derived from the arrival rate and the cost model.

Every consumer of a queue whose policy says `delay_mode=auto` calls `derive_delay_ms`
about once a second with the rate measured in Redis (scheduler_core/load.py), the cost
model t(b) = a + b·size and the number of live consumers, and passes the result to
pop_batch.lua (ARGV[4]). docs/scheduling.md ("max_queue_delay_ms=auto") explains the
reasoning; in short, for a delay D:

- a window of D collects b_w = 1 + λ·D requests (at most max_batch_size, which fills in
  (B - 1)/λ: no delay beyond that changes anything);
- while the consumers are busy, batches grow by themselves to b_s = λ·t(b_s)/n, i.e.
  b_s = λ·a / (n - λ·b) (unbounded when the consumers cannot keep up);
- the batch is b = min(B, max(b_w, b_s)); batches leave every I = max(D, t(b)/n);
- a request waits at most about I for its batch, then t(b) for the model, and
  TRANSPORT_MS outside both: predicted P99(D) = I + t(b) + TRANSPORT_MS.

P99(D) grows with D, so the largest D whose P99(D) stays within HEADROOM × slo_p99_ms is
found by bisection: the largest batches the target allows. Near saturation (the consumers
busy BUSY or more of the time at that D) the wait behind busy consumers, which the
prediction leaves out, grows fastest, so the headroom is traded for capacity: the largest
D whose P99(D) stays within slo_p99_ms itself, and up to FULL_MARGIN times the mean fill
time, so that nearly every batch leaves full. If the window would collect fewer than
MIN_GAIN more requests on average (λ·D < MIN_GAIN), it waits for batches that will not
come, and the delay is 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from scheduler_core.policy import LIMITS

# Share of the SLO the prediction may use: the rest covers what it leaves out (per-request
# decode/encode and delivery, Poisson bursts within a window, CPU contention).
HEADROOM = 0.75
TRANSPORT_MS = 1.5  # submit -> enqueue and model end -> result seen, per request
MIN_SAMPLES = 5  # model-time samples before a fit of the consumer's own is trusted
# Requests a window must collect on average besides the one that opened it: one more
# halves the model calls at best, and at low rates a 2-second count is noisy enough to
# cross that line by chance (20/s measures 27/s or more one time in 50).
MIN_GAIN = 2.0
BUSY = 0.75  # utilisation from which full batches matter more than headroom
# Then the window may last this many times the mean time B requests take to arrive: the
# arrivals' spread (sd √(B-1)/λ, 4.6 ms at B = 32 and 1,200/s) fills nearly every batch.
FULL_MARGIN = 1.5


@dataclass(frozen=True)
class Cost:
    """t(b) = a_ms + b_ms · b, in milliseconds; `source`: where it came from."""

    a_ms: float
    b_ms: float
    source: str = "profile"

    def t(self, size: float) -> float:
        return self.a_ms + self.b_ms * size


def read_cost_model(raw: Mapping[Any, Any]) -> Cost | None:
    """The stored cost model `{bg:q}:cost_model` (fields a_us, b_us, source, ...), or None
    when absent or unreadable."""
    data = {(k.decode() if isinstance(k, bytes) else str(k)):
            (v.decode() if isinstance(v, bytes) else str(v)) for k, v in raw.items()}
    try:
        a_us, b_us = float(data["a_us"]), float(data["b_us"])
    except (KeyError, ValueError):
        return None
    if not (math.isfinite(a_us) and math.isfinite(b_us)) or a_us < 0 or b_us < 0:
        return None
    return Cost(a_us / 1000, b_us / 1000, data.get("source", "profile"))


def fit_samples(samples: Iterable[tuple[int, float]]) -> Cost | None:
    """Least-squares t(b) = a + b·size from (batch size, model ms) samples; None with fewer
    than MIN_SAMPLES. With one batch size only, half the time is taken as fixed and half
    as per request (neither free batching nor no gain from it is assumed)."""
    points = list(samples)
    if len(points) < MIN_SAMPLES:
        return None
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    if sxx == 0:
        return Cost(mean_y / 2, mean_y / (2 * mean_x), "live")
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx
    slope = max(0.0, slope)
    return Cost(max(0.0, mean_y - slope * mean_x), slope, "live")


def predicted_p99_ms(delay_ms: float, rate_per_ms: float, cost: Cost, max_batch_size: int,
                     consumers: int) -> float:
    """The P99 latency the model above predicts for a delay (ms; rate in requests/ms)."""
    size, n = max_batch_size, max(1, consumers)
    fill = (size - 1) / rate_per_ms if rate_per_ms > 0 else math.inf
    window = min(delay_ms, fill)
    b_window = min(size, 1 + rate_per_ms * window)
    spare = n - rate_per_ms * cost.b_ms
    b_busy = rate_per_ms * cost.a_ms / spare if spare > 0 else math.inf
    b = min(size, max(b_window, b_busy))
    interval = max(window, cost.t(b) / n)
    return interval + cost.t(b) + TRANSPORT_MS


def derive_delay_ms(rate_rps: float, cost: Cost | None, slo_p99_ms: int, max_batch_size: int,
                    consumers: int = 1) -> int:
    """The delay (whole ms) for max_queue_delay_ms=auto: the largest whose predicted P99
    stays within HEADROOM × slo_p99_ms (within slo_p99_ms once the consumers are BUSY),
    or 0 when nothing is known yet (no rate, no cost model), when even no delay meets the
    target, or when the window would collect fewer than MIN_GAIN more requests on
    average. Bounded by LIMITS, by the SLO and by the time a full batch takes to fill."""
    if rate_rps <= 0 or cost is None or slo_p99_ms <= 0:
        return 0
    rate = rate_rps / 1000
    budget = HEADROOM * slo_p99_ms
    high = min(LIMITS["max_queue_delay_ms"][1], slo_p99_ms,
               math.ceil((max_batch_size - 1) / rate))
    delay = _largest_within(budget, high, rate, cost, max_batch_size, consumers)
    if delay is None:
        return 0
    if utilisation(delay, rate, cost, max_batch_size, consumers) >= BUSY:
        # up to FULL_MARGIN x the mean fill time, so that nearly every batch fills
        full = min(LIMITS["max_queue_delay_ms"][1], slo_p99_ms,
                   math.ceil(FULL_MARGIN * (max_batch_size - 1) / rate))
        delay = _largest_within(slo_p99_ms, full, rate, cost, max_batch_size,
                                consumers) or delay
    return delay if rate * delay >= MIN_GAIN else 0


def _largest_within(budget: float, high: int, rate: float, cost: Cost, max_batch_size: int,
                    consumers: int) -> int | None:
    """The largest D in [0, high] with predicted P99(D) <= budget (bisection; P99 grows
    with D), None when not even D = 0 is."""
    if predicted_p99_ms(0, rate, cost, max_batch_size, consumers) > budget:
        return None
    low = 0
    while low < high:
        mid = (low + high + 1) // 2
        if predicted_p99_ms(mid, rate, cost, max_batch_size, consumers) <= budget:
            low = mid
        else:
            high = mid - 1
    return low


def utilisation(delay_ms: float, rate_per_ms: float, cost: Cost, max_batch_size: int,
                consumers: int) -> float:
    """The share of time each consumer is busy with the batches a delay forms."""
    size, n = max_batch_size, max(1, consumers)
    window = min(delay_ms, (size - 1) / rate_per_ms) if rate_per_ms > 0 else delay_ms
    spare = n - rate_per_ms * cost.b_ms
    b_busy = rate_per_ms * cost.a_ms / spare if spare > 0 else math.inf
    b = min(size, max(1 + rate_per_ms * window, b_busy))
    return rate_per_ms * cost.t(b) / (n * b)


@dataclass(frozen=True)
class Derived:
    """One derivation, as a consumer publishes it."""

    delay_ms: int
    rate_rps: float
    cost: Cost | None
    consumers: int


# Fields a consumer writes into `{bg:q}:stats` (integers, as the rest of that hash).
STATS_DELAY_US = "auto_delay_us"
STATS_RATE_MRPS = "auto_rate_mrps"
STATS_AT_US = "auto_at_us"
