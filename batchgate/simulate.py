"""`batchgate simulate`: a queue's latency and throughput predicted before deploying it.

A discrete-event simulation of N consumers on one queue. Requests arrive (Poisson,
bursty, or from a trace file); whenever a consumer is free it pops at once, and the
batch is whatever `scheduler_core.rules.decide` (pop_batch.lua's twin: the same rules,
no copy of them here) says. A popped batch of b occupies its consumer for the per-batch
overhead plus the cost model t(b) = A + B·b; its requests' results are seen a transport
time later (submit to queue and result back to the producer, which occupies no
consumer). While every consumer is busy, requests queue. A consumer told "nothing due
for W µs" sleeps until then or until something changes (an arrival, another consumer
finishing), as a real one sleeps until its due timer or a wake-up.

Not modelled: deadlines, failures and retries, max_queue_size.

    from batchgate.simulate import CostModel, SimConfig, poisson_arrivals, simulate
    result = simulate(SimConfig(Policy(), CostModel(5, 0.5), consumers=2),
                      *poisson_arrivals(rate=1000, duration_s=10))
"""

from __future__ import annotations

import heapq
import itertools
import math
import re
import time
from collections.abc import Iterator, MutableSequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import orjson

from batchgate.workload import MIX, PRIORITIES, Workload
from scheduler_core.errors import InvalidRequest
from scheduler_core.options import POLICY_KNOBS
from scheduler_core.policy import Policy, Priority
from scheduler_core.rules import Batch, Request, Wait, apply, decide

# The gap between two batches of one consumer at saturation, p50 (docs/benchmarks.md,
# "Saturation: the scheduler's cost between batches").
DEFAULT_OVERHEAD_MS = 0.14
# submit -> enqueue (0.65 ms) plus model end -> result seen (0.57 ms), p50 at light load
# (docs/benchmarks.md, "Light load: the latency floor").
DEFAULT_TRANSPORT_MS = 1.22
# A wait of 0 that is not a batch (pop_batch.lua gives one while a promotion is pending):
# a consumer pops again after a round trip; never less than this.
MIN_REPOLL_US = 100
MAX_REQUESTS = 20_000_000  # about 2 GB of Python objects at the peak
PERCENTILES = (50, 95, 99)
_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)"
_COST = re.compile(rf"^(?:{_NUMBER}(?:\+{_NUMBER}\*?b)?|{_NUMBER}\*?b)$")

Arrivals = tuple[list[float], list[int]]  # (offsets in s, sorted; priorities 0-2)


@dataclass(frozen=True)
class CostModel:
    """t(b) = base_ms + per_item_ms × b, a model call on a batch of b."""

    base_ms: float
    per_item_ms: float = 0.0

    def __post_init__(self) -> None:
        for name in ("base_ms", "per_item_ms"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value <= 3_600_000):
                raise InvalidRequest("cost_ms", f"{name} must be within [0, 3600000] ms, "
                                                f"got {value!r}")

    @classmethod
    def parse(cls, text: str) -> CostModel:
        """"A+B*b" ("5+0.5*b", "5", "0.5*b"; spaces ignored), in ms."""
        m = _COST.match(text.replace(" ", ""))
        if not m:
            raise InvalidRequest("cost_ms", f"{text!r} is not A+B*b (e.g. 5+0.5*b, 5, 0.5*b; "
                                            "ms for a batch of b)")
        base, per, per_alone = m.groups()
        return cls(float(base or 0), float(per or per_alone or 0))

    def us(self, batch: int) -> int:
        return round((self.base_ms + self.per_item_ms * batch) * 1000)

    def __str__(self) -> str:
        return f"{self.base_ms:g}+{self.per_item_ms:g}*b ms"


@dataclass(frozen=True)
class SimConfig:
    policy: Policy = field(default_factory=Policy)
    cost: CostModel = field(default_factory=lambda: CostModel(5.0, 0.5))
    consumers: int = 2
    overhead_ms: float = DEFAULT_OVERHEAD_MS  # per batch, besides the model
    transport_ms: float = DEFAULT_TRANSPORT_MS  # per request: to the queue and back

    def __post_init__(self) -> None:
        if isinstance(self.consumers, bool) or not isinstance(self.consumers, int) or \
                not 1 <= self.consumers <= 4096:
            raise InvalidRequest("consumers", f"must be an integer in [1, 4096], got "
                                              f"{self.consumers!r}")
        for name in ("overhead_ms", "transport_ms"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value <= 60_000):
                raise InvalidRequest(name, f"must be within [0, 60000] ms, got {value!r}")


@dataclass(frozen=True)
class SimResult:
    requests: int
    batches: int
    span_s: float  # first arrival to last result
    throughput_rps: float
    mean_batch: float
    utilisation: float  # share of the consumers' time spent in the model
    latency_ms: dict[str, dict[str, float | None]]  # all/high/normal/low -> p50..max
    counts: dict[str, int]  # requests per priority
    batch_histogram: dict[int, int]  # batch size -> batches
    wall_s: float  # how long the simulation took

    def to_dict(self) -> dict[str, Any]:
        return {"throughput_rps": self.throughput_rps, "mean_batch": self.mean_batch,
                "utilisation": self.utilisation, "latency_ms": self.latency_ms,
                "requests": self.requests, "counts": self.counts, "batches": self.batches,
                "span_s": self.span_s,
                "batch_histogram": {str(k): v for k, v in self.batch_histogram.items()},
                "wall_s": self.wall_s}


def simulate(config: SimConfig, times: list[float], prios: list[int]) -> SimResult:
    """Run the queue on these arrivals (offsets in s, sorted; priorities 0-2)."""
    started = time.perf_counter()
    n = len(times)
    if n != len(prios):
        raise InvalidRequest("arrivals", f"{n} times but {len(prios)} priorities")
    if n > MAX_REQUESTS:
        raise InvalidRequest("arrivals", f"{n} requests; at most {MAX_REQUESTS:,}")
    arrival = _arrival_scores(times)
    policy = config.policy
    cost = [config.cost.us(b) for b in range(policy.max_batch_size + 1)]
    overhead = round(config.overhead_ms * 1000)
    transport = round(config.transport_ms * 1000)
    repoll = max(overhead, MIN_REPOLL_US)
    levels = [_Level(), _Level(), _Level()]
    done = [0] * n  # when each request's result is seen (µs)
    histogram = [0] * (policy.max_batch_size + 1)
    free_at: list[int] = []  # heap: when each busy consumer finishes
    idle, timer, model_us, waiting = config.consumers, math.inf, 0, 0
    i, next_arrival = 0, (arrival[0] if n else math.inf)
    push, pop = heapq.heappush, heapq.heappop
    while True:
        now = min(next_arrival, free_at[0] if free_at else math.inf,
                  timer if idle else math.inf)
        if now == math.inf:
            break
        while free_at and free_at[0] == now:
            pop(free_at)
            idle += 1
        if next_arrival == now:  # scores are unique, as Redis' arrival clock makes them
            prio = prios[i]
            levels[prio].append(Request(now, i, prio))
            waiting += 1
            i += 1
            next_arrival = arrival[i] if i < n else math.inf
        if not idle:
            continue  # every consumer busy: the request waits
        timer = math.inf
        # Pop at once while consumers are free and batches due (with nothing waiting,
        # decide would say Nothing).
        while idle and waiting:
            decision = decide(levels, now, policy, first_deadline_us=0)  # none has one
            apply(levels, decision)
            if type(decision) is Batch:
                size = len(decision.picked)
                end = now + overhead + cost[size]
                seen = end + transport
                for p in decision.picked:
                    done[p.request.id] = seen  # type: ignore[index]
                push(free_at, end)
                idle -= 1
                waiting -= size
                histogram[size] += 1
                model_us += cost[size]
            else:
                if type(decision) is Wait:
                    timer = now + (decision.wait_us or repoll)
                break
    return _result(config, arrival, prios, done, histogram, model_us,
                   time.perf_counter() - started)


class _Level(MutableSequence[Request]):
    """A pending level whose head leaves in O(1) and where requests near the head are
    inserted and removed in O(distance from it), as in a zset. On a plain list each pop
    would move the whole backlog: quadratic once a simulated queue is overloaded."""

    __slots__ = ("items", "start")

    def __init__(self) -> None:
        self.items: list[Any] = []  # items[:start] are gone (None)
        self.start = 0

    def __len__(self) -> int:
        return len(self.items) - self.start

    def __iter__(self) -> Iterator[Request]:
        return itertools.islice(self.items, self.start, None)

    def __getitem__(self, k: Any) -> Any:
        if type(k) is slice:
            if k.start is None and k.step is None and k.stop is not None and k.stop >= 0:
                return self.items[self.start:self.start + k.stop]  # level[:n], the usual
            lo, hi, step = k.indices(len(self))
            return self.items[self.start + lo:self.start + hi:step]
        return self.items[self.start + (k if k >= 0 else len(self) + k)]

    def __setitem__(self, k: Any, value: Any) -> None:
        raise NotImplementedError  # decide and apply never replace in place

    def __delitem__(self, k: Any) -> None:
        items, start = self.items, self.start
        if isinstance(k, slice):  # apply: the batch leaves the head
            lo, hi, _ = k.indices(len(self))
            if lo != 0:
                raise NotImplementedError
            items[start:start + hi] = [None] * hi
            self.start = start + hi
            if self.start > 4096 and self.start > len(items) // 2:
                del items[:self.start]
                self.start = 0
        elif k < len(self) // 2:  # near the head: shift the requests before it
            items[start + 1:start + k + 1] = items[start:start + k]
            items[start] = None
            self.start = start + 1
        else:
            del items[start + k]

    def insert(self, k: int, value: Request) -> None:
        start = self.start
        if start and k < len(self) // 2:  # room before the head: shift the requests before
            self.items[start - 1:start + k - 1] = self.items[start:start + k]
            self.items[start + k - 1] = value
            self.start = start - 1
        else:
            self.items.insert(start + k, value)

    def append(self, value: Request) -> None:
        self.items.append(value)


def _arrival_scores(times: list[float]) -> list[int]:
    """Arrival times in µs, strictly increasing as Redis' arrival clock issues them."""
    scores, last = [0] * len(times), -1
    for k, t in enumerate(times):
        last = max(round(t * 1e6), last + 1)
        scores[k] = last
    return scores


def _result(config: SimConfig, arrival: list[int], prios: list[int], done: list[int],
            histogram: list[int], model_us: int, wall_s: float) -> SimResult:
    n = len(arrival)
    latency = [d - a for d, a in zip(done, arrival, strict=True)]
    by_prio: list[list[int]] = [[], [], []]
    for lat, prio in zip(latency, prios, strict=True):
        by_prio[prio].append(lat)
    span_us = (max(done) - arrival[0]) if n else 0
    batches = sum(histogram)
    return SimResult(
        requests=n, batches=batches, span_s=span_us / 1e6,
        throughput_rps=round(n / (span_us / 1e6), 1) if span_us else 0.0,
        mean_batch=round(n / batches, 2) if batches else 0.0,
        utilisation=round(model_us / (config.consumers * span_us), 4) if span_us else 0.0,
        latency_ms={"all": _summary(latency),
                    **{PRIORITIES[p]: _summary(by_prio[p]) for p in range(3)}},
        counts={PRIORITIES[p]: len(by_prio[p]) for p in range(3)},
        batch_histogram={b: k for b, k in enumerate(histogram) if k},
        wall_s=round(wall_s, 3))


def _summary(latency_us: list[int]) -> dict[str, float | None]:
    """p50/p95/p99 (nearest rank) and max, in ms; None where no request."""
    if not latency_us:
        return {**{f"p{q}": None for q in PERCENTILES}, "max": None}
    ordered = sorted(latency_us)
    n = len(ordered)
    out: dict[str, float | None] = {
        f"p{q}": ordered[max(0, math.ceil(q / 100 * n) - 1)] / 1000 for q in PERCENTILES}
    out["max"] = ordered[-1] / 1000
    return out


# -- arrivals -----------------------------------------------------------------------------
def poisson_arrivals(rate: float, duration_s: float, mix: tuple[float, ...] = MIX,
                     seed: int = 1, bursty: bool = False) -> Arrivals:
    """batchgate bench's workload generator (same seed, same requests): Poisson at `rate`
    for `duration_s`; bursty adds 50 requests within 100 ms every 2 s."""
    if not (isinstance(rate, (int, float)) and 0 < rate <= 10_000_000):
        raise InvalidRequest("rate", f"must be within (0, 10000000] requests/s, got {rate!r}")
    if not (isinstance(duration_s, (int, float)) and 0 < duration_s <= 1_000_000):
        raise InvalidRequest("duration_s", f"must be within (0, 1000000] s, got "
                                           f"{duration_s!r}")
    if rate * duration_s > MAX_REQUESTS:
        raise InvalidRequest("rate", f"rate x duration_s = {rate * duration_s:,.0f} requests; "
                                     f"at most {MAX_REQUESTS:,}")
    kind = "bursty" if bursty else "poisson"
    return Workload(kind, rate=rate, duration_s=duration_s, seed=seed).schedule(mix)


def parse_mix(text: str) -> tuple[float, float, float]:
    """"high=10,normal=60,low=30" -> weights (HIGH, NORMAL, LOW); unnamed ones are 0."""
    weights = dict.fromkeys(PRIORITIES, 0.0)
    for part in text.split(","):
        name, _, value = part.partition("=")
        name = name.strip().lower()
        try:
            weight = float(value)
        except ValueError:
            weight = -1.0
        if name not in weights or not 0 <= weight < math.inf:
            raise InvalidRequest("mix", f"{part.strip()!r}: use high=W,normal=W,low=W with "
                                        "weights >= 0")
        weights[name] = weight
    if sum(weights.values()) <= 0:
        raise InvalidRequest("mix", "the weights add up to 0")
    high, normal, low = (weights[p] for p in PRIORITIES)
    return high, normal, low


def read_trace(path: Path) -> Arrivals:
    """A JSONL trace: one {"t": seconds since the start, "priority": "high"|"normal"|"low"
    or 0-2 (optional, default normal)} per line, in any order."""
    rows: list[tuple[float, int]] = []
    with path.open("rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise InvalidRequest("trace", f"{path}:{number}: not JSON ({exc})") from None
            t = row.get("t") if isinstance(row, dict) else None
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < 1e9:
                raise InvalidRequest("trace", f"{path}:{number}: \"t\" must be seconds in "
                                              f"[0, 1e9), got {t!r}")
            prio = Priority.parse(row.get("priority", "normal"), f"trace line {number}")
            rows.append((float(t), int(prio)))
            if len(rows) > MAX_REQUESTS:
                raise InvalidRequest("trace", f"more than {MAX_REQUESTS:,} requests")
    if not rows:
        raise InvalidRequest("trace", f"{path} has no requests")
    rows.sort(key=lambda r: r[0])
    return [t for t, _ in rows], [p for _, p in rows]


# -- the command --------------------------------------------------------------------------
def _policy_option(flag: str) -> Any:
    """The same option, help and limits as `batchgate policy set` has."""
    _, kwargs, text = next(k for k in POLICY_KNOBS if k[0] == flag)
    return click.option(flag, help=text, **kwargs)


def render(result: SimResult, config: SimConfig, workload: str) -> str:
    p = config.policy
    lines = [
        f"{result.requests:,} requests ({workload}), {config.consumers} consumer(s), "
        f"t(b) = {config.cost}, overhead {config.overhead_ms:g} ms per batch, transport "
        f"{config.transport_ms:g} ms per request",
        f"policy: {p.strategy}, max_batch_size {p.max_batch_size}, max_queue_delay_ms "
        f"{p.max_queue_delay_ms}, aging_ms {p.aging_ms}",
        "",
        f"throughput {result.throughput_rps:,.1f} req/s   mean batch {result.mean_batch}   "
        f"utilisation {result.utilisation:.1%}   ({result.batches:,} batches over "
        f"{result.span_s:,.2f} s)",
        "",
        f"{'latency ms':<10}{'p50':>10}{'p95':>10}{'p99':>10}{'max':>10}{'requests':>11}",
    ]
    for name, s in result.latency_ms.items():
        count = result.requests if name == "all" else result.counts[name]
        cells = "".join(f"{'-' if s[k] is None else f'{s[k]:.2f}':>10}"
                        for k in ("p50", "p95", "p99", "max"))
        lines.append(f"{name:<10}{cells}{count:>11,}")
    lines += ["", "batch size   batches   share"]
    lo = 1
    while lo <= p.max_batch_size:  # bins up to a power of two: 1, 2, 3-4, 5-8, ...
        hi = min(p.max_batch_size, 1 << (lo - 1).bit_length())
        k = sum(v for b, v in result.batch_histogram.items() if lo <= b <= hi)
        if k:
            label = str(lo) if lo == hi else f"{lo}-{hi}"
            lines.append(f"{label:>10}{k:>10,}{k / result.batches:>8.1%}")
        lo = hi + 1
    lines.append(f"\nsimulated in {result.wall_s:.2f} s")
    return "\n".join(lines)


@click.command("simulate")
@_policy_option("--strategy")
@_policy_option("--max-batch-size")
@_policy_option("--max-queue-delay-ms")
@_policy_option("--aging-ms")
@click.option("--arrivals", type=click.Choice(["poisson", "bursty"]), default="poisson",
              show_default=True, help="Poisson at --rate; bursty adds 50 requests within "
              "100 ms every 2 s.")
@click.option("--rate", type=float, default=1000.0, show_default=True,
              help="Mean arrival rate, requests/s, (0, 10000000].")
@click.option("--duration-s", type=float, default=10.0, show_default=True,
              help="Seconds of arrivals, (0, 1000000].")
@click.option("--mix", default="high=10,normal=60,low=30", show_default=True,
              help="Weights of the priorities among arrivals.")
@click.option("--trace", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help='Arrivals from a JSONL file of {"t": s, "priority": "high"|"normal"|"low"}'
                   " instead (--arrivals, --rate, --duration-s, --mix unused).")
@click.option("--consumers", type=int, default=2, show_default=True,
              help="Consumer processes, 1-4096.")
@click.option("--cost-ms", default="5+0.5*b", show_default=True,
              help="The model's time for a batch of b, A+B*b ms (batchgate profile fits it).")
@click.option("--overhead-ms", type=float, default=DEFAULT_OVERHEAD_MS, show_default=True,
              help="Scheduler time per batch besides the model, ms (default: the measured gap "
                   "between batches at saturation).")
@click.option("--transport-ms", type=float, default=DEFAULT_TRANSPORT_MS, show_default=True,
              help="Latency per request outside queue and model (submit to enqueue, model "
                   "end to result seen), ms; occupies no consumer (default: measured at light "
                   "load).")
@click.option("--seed", type=int, default=1, show_default=True,
              help="Random seed of the arrivals (that of batchgate bench gives its requests).")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def simulate_command(strategy: str | None, max_batch_size: int | None,
                     max_queue_delay_ms: int | None, aging_ms: int | None, arrivals: str,
                     rate: float, duration_s: float, mix: str, trace: Path | None,
                     consumers: int, cost_ms: str, overhead_ms: float, transport_ms: float,
                     seed: int, as_json: bool) -> None:
    """Predict latency per priority, throughput, batch sizes and utilisation of a queue
    policy on a workload, by a discrete-event simulation of the scheduling rules (no
    Redis, no model: about a million requests in seconds)."""
    policy = Policy.build(strategy, max_batch_size=max_batch_size,
                          max_queue_delay_ms=max_queue_delay_ms, aging_ms=aging_ms)
    config = SimConfig(policy, CostModel.parse(cost_ms), consumers, overhead_ms, transport_ms)
    if trace is not None:
        times, prios = read_trace(trace)
        workload = f"trace {trace.name}"
    else:
        weights = parse_mix(mix)
        times, prios = poisson_arrivals(rate, duration_s, weights, seed, arrivals == "bursty")
        workload = f"{arrivals} {rate:g}/s for {duration_s:g} s, mix {mix}, seed {seed}"
    if not times:
        raise click.UsageError("no requests arrive: raise --rate or --duration-s")
    result = simulate(config, times, prios)
    if as_json:
        click.echo(orjson.dumps(result.to_dict(), option=orjson.OPT_INDENT_2).decode())
    else:
        click.echo(render(result, config, workload))
