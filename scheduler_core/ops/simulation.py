"""The simulator behind `batchgate simulate` and `batchgate plan`: a queue's latency and
throughput predicted before deploying it; the planner (scheduler_core/ops/planner.py)
answers `recommended_consumers` with it too.

A discrete-event simulation of N consumers on one queue. Requests arrive (offsets and
priorities given); whenever a consumer is free it pops at once, and the batch is whatever
`scheduler_core.rules.decide` (pop_batch.lua's twin: the same rules, no copy of them
here) says. A popped batch of b runs the model for t(b) = A + B·b (or, with request
costs, A + B·Σcost under cost_mode sum, A + B·b·max cost under padded), each batch's time
optionally multiplied by a ratio drawn (seeded) from measured samples: `jitter`. Around
the model, the distributed path as consumer/overlap.py runs it:

- fetch(b): pop → model start (the pop's round trip, decoding the payloads), on the
  consumer. Hidden behind the previous batch when that one was popped with requests left
  waiting (the consumer fetched ahead): then the gap is only `overhead_ms`. Such a
  consumer decides its next batch `lead_ms` before its model ends, as the real one pops
  it (by default twice fetch(b) plus 0.5 ms), and starts it when the model is free: a
  decision made a little early sees the queue as it was then (a level just emptied by
  another consumer's batch, say).
- finish(b): model end → result seen (encoding, complete.lua, delivery). On the result's
  path always; on the consumer only when the batch was popped with nothing left waiting
  (no overlap: the consumer completes it before it pops again).
- transport: submit → enqueue, per request, on no consumer.

These are constants; `path_spread` adds the path's measured spread: each result is seen
later or earlier by an offset drawn from measured path times (path_offsets).

While every consumer is busy, requests queue. A consumer told "nothing due for W µs" sleeps
until then or until something changes (an arrival, another consumer finishing), as a
real one sleeps until its due timer or a wake-up. When a consumer's pop leaves work
waiting, the next idle consumer decides `react_ms` later, not at the same instant: a real
one is woken by that pop and pops itself a moment after, by when a new request may have
arrived (under priority, a NORMAL arrival in that moment holds LOW back for another round).

Requests may carry costs; the policy's cost settings then apply as pop_batch.lua applies
them, requests above max_cost are refused (counted, not run) or capped
(over_cost=truncate), and the result reports latency per cost and the padding waste
Σ(max − cost) / Σ max over the batches.

Not modelled: deadlines, failures and retries, max_queue_size.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import random
import re
import time
from collections.abc import Iterator, MutableSequence, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from scheduler_core.cost_model import fit
from scheduler_core.errors import InvalidRequest
from scheduler_core.ops.continuous_sim import (
    DEFAULT_STEP_OVERHEAD_MS,
    StepTime,
    simulate_continuous,
)
from scheduler_core.policy import MAX_COST_BUCKETS, Policy
from scheduler_core.rules import Batch, Fair, Request, Wait, apply, decide
from scheduler_core.wire import DEFAULT_TENANT

PRIORITIES = ("high", "normal", "low")
BATCHING = ("static", "continuous")
MIX = (0.1, 0.6, 0.3)  # share of HIGH, NORMAL, LOW requests
# The gap between two batches of one consumer at saturation, p50 (docs/benchmarks.md,
# "Saturation: the scheduler's cost between batches").
DEFAULT_OVERHEAD_MS = 0.14
# The distributed path, fitted to the stage p50s measured on the benchmark grid and
# checked against its latencies (docs/benchmarks.md, "The simulator against the real
# system"): submit -> enqueue, per request; DEFAULT_FETCH (pop -> model start) and
# DEFAULT_FINISH (model end -> result seen), per batch, below PathTime.
DEFAULT_TRANSPORT_MS = 0.5
# A wait of 0 that is not a batch (pop_batch.lua gives one while a promotion is pending):
# a consumer pops again after a round trip; never less than this.
MIN_REPOLL_US = 100
# A consumer fetching ahead pops its next batch twice its recent fetch time plus this
# margin before its model is expected to end (consumer/overlap.py, FETCH_MARGIN_S).
PREFETCH_MARGIN_US = 500
AUTO_LEAD = -1.0  # SimConfig.lead_ms: derived from the fetch time, as the consumer does
# From one consumer's pop that leaves work waiting to the next idle consumer's decision
# (docs/benchmarks.md, "The moment between two consumers' pops").
DEFAULT_REACT_MS = 0.2
MAX_REQUESTS = 20_000_000  # about 2 GB of Python objects at the peak
PERCENTILES = (50, 95, 99)
_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)"
_COST = re.compile(rf"^(?:{_NUMBER}(?:\+{_NUMBER}\*?([bc]))?|{_NUMBER}\*?([bc]))$")

@dataclass(frozen=True)
class ModelTime:
    """t(b) = base_ms + per_item_ms × b, a model call on a batch of b; or, per unit of
    request cost, base_ms + per_cost_ms × c where c is the batch's Σcost (cost_mode sum)
    or b × its largest cost (padded: what a padded tensor computes)."""

    base_ms: float
    per_item_ms: float = 0.0
    per_cost_ms: float = 0.0

    def __post_init__(self) -> None:
        for name in ("base_ms", "per_item_ms", "per_cost_ms"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value <= 3_600_000):
                raise InvalidRequest("cost_ms", f"{name} must be within [0, 3600000] ms, "
                                                f"got {value!r}")

    @classmethod
    def parse(cls, text: str) -> ModelTime:
        """"A+B*b" ("5+0.5*b", "5", "0.5*b"; spaces ignored), in ms; "A+B*c" per unit of
        cost (c: Σcost, or b × max cost under cost_mode padded)."""
        m = _COST.match(text.replace(" ", ""))
        if not m:
            raise InvalidRequest("cost_ms", f"{text!r} is not A+B*b or A+B*c (e.g. 5+0.5*b, "
                                            "5, 0.5*b, 2+0.01*c; ms for a batch of b)")
        base, per, var, per_alone, var_alone = m.groups()
        slope = float(per or per_alone or 0)
        if (var or var_alone) == "c":
            return cls(float(base or 0), 0.0, slope)
        return cls(float(base or 0), slope)

    def us(self, batch: int, cost_units: int = 0) -> int:
        """µs for a batch of `batch` requests whose cost is `cost_units` (Σcost or b × max
        cost, as the policy's cost_mode counts)."""
        return round((self.base_ms + self.per_item_ms * batch + self.per_cost_ms * cost_units)
                     * 1000)

    def __str__(self) -> str:
        if self.per_cost_ms:
            return f"{self.base_ms:g}+{self.per_cost_ms:g}*c ms"
        return f"{self.base_ms:g}+{self.per_item_ms:g}*b ms"


@dataclass(frozen=True)
class PathTime:
    """A + B·b ms for a batch of b: one stage of the path around the model."""

    base_ms: float
    per_item_ms: float = 0.0
    name: str = "path_ms"  # the option it came from, for errors

    def __post_init__(self) -> None:
        for part in (self.base_ms, self.per_item_ms):
            if isinstance(part, bool) or not isinstance(part, (int, float)) \
                    or not 0 <= part <= 60_000:
                raise InvalidRequest(self.name, f"each term must be within [0, 60000] ms, got "
                                                f"{part!r}")

    @classmethod
    def parse(cls, text: str, name: str) -> PathTime:
        """"A+B*b" ("0.4+0.06*b", "1.5", "0.1*b"; spaces ignored), ms."""
        m = _COST.match(text.replace(" ", ""))
        if not m or "c" in (m.group(3), m.group(5)):
            raise InvalidRequest(name, f"{text!r} is not A+B*b (e.g. 0.4+0.06*b, 1.5; ms for "
                                       "a batch of b)")
        base, per, _, per_alone, _ = m.groups()
        return cls(float(base or 0), float(per or per_alone or 0), name)

    def us(self, batch: int) -> int:
        return round((self.base_ms + self.per_item_ms * batch) * 1000)

    def __str__(self) -> str:
        return f"{self.base_ms:g}+{self.per_item_ms:g}*b ms"


DEFAULT_FETCH = PathTime(0.45, 0.05, "fetch_ms")
DEFAULT_FINISH = PathTime(1.2, 0.06, "finish_ms")


def path_offsets(samples: Sequence[float]) -> tuple[float, ...]:
    """Measured path times, ms (per request: intended arrival -> enqueue plus model end ->
    result seen), as offsets from their mean: SimConfig.path_spread."""
    if len(samples) < 2:
        raise InvalidRequest("path_spread", f"{len(samples)} path samples; at least 2 needed")
    mean = sum(samples) / len(samples)
    return tuple(round(s - mean, 3) for s in samples)


def jitter_ratios(samples: Sequence[tuple[int, float]]) -> tuple[float, ...]:
    """Each measured model call's time over the least-squares line A + B·b through all of
    them (the fit the consumers' live refit makes): (batch size, ms) pairs in, ratios out.
    With one batch size only, over their mean."""
    points = [(int(b), float(ms)) for b, ms in samples if ms > 0]
    if len(points) < 2:
        raise InvalidRequest("cost_jitter", f"{len(points)} usable model-time samples; "
                                            "need at least 2")
    if len({b for b, _ in points}) >= 2:
        line = fit(points)  # negative terms clamped to 0, as the live refit stores them
        base, per = max(0.0, line.base_ms), max(0.0, line.per_item_ms)
        expected = [base + per * b for b, _ in points]
    else:
        mean = sum(ms for _, ms in points) / len(points)
        expected = [mean] * len(points)
    ratios = tuple(ms / e for (_, ms), e in zip(points, expected, strict=True) if e > 0)
    if not ratios:
        raise InvalidRequest("cost_jitter", "the samples' fit is not positive anywhere")
    return ratios


@dataclass(frozen=True)
class SimConfig:
    policy: Policy = field(default_factory=Policy)
    cost: ModelTime = field(default_factory=lambda: ModelTime(5.0, 0.5))
    consumers: int = 2
    overhead_ms: float = DEFAULT_OVERHEAD_MS  # per batch, besides the model
    transport_ms: float = DEFAULT_TRANSPORT_MS  # per request: submit -> enqueue
    # Each consumer's --prefer-bucket (1-based, 0 = none), one per consumer; () = none.
    # Idle consumers pop lowest first.
    prefer_buckets: tuple[int, ...] = ()
    fetch: PathTime = DEFAULT_FETCH  # pop -> model start, per batch of b
    finish: PathTime = DEFAULT_FINISH  # model end -> result seen, per batch of b
    # Ratios actual / fitted model time (jitter_ratios); each batch's model time is
    # multiplied by one drawn with jitter_seed. () = the model time exactly.
    jitter: tuple[float, ...] = ()
    jitter_seed: int = 1
    # Each consumer's --only-bucket (1-based, 0 = every bucket), one per consumer; () = none.
    only_buckets: tuple[int, ...] = ()
    # How long before its model ends a consumer that fetches ahead pops its next batch, ms
    # (consumer/overlap.py arms the pop twice a fetch plus 0.5 ms early). AUTO_LEAD: twice
    # fetch(b) of the running batch plus 0.5 ms; 0: at the end (an in-process batcher).
    lead_ms: float = AUTO_LEAD
    # How long after another consumer's pop that left work waiting an idle consumer
    # decides, ms (0: at the same instant).
    react_ms: float = DEFAULT_REACT_MS
    # Offsets from the path's mean, ms (path_offsets): each request's result is seen one
    # of them (drawn with jitter_seed) later or earlier than the constant path gives. The
    # path's spread (a host's stalls), which its means alone leave out. () = none.
    path_spread: tuple[float, ...] = ()
    # "static": a popped batch runs to its end; "continuous": requests join and leave a
    # running batch at every step (scheduler_core/ops/continuous_sim.py), each step
    # `step` (None: StepTime.from_model(cost)) plus step_overhead_ms.
    batching: str = "static"
    step: StepTime | None = None
    step_overhead_ms: float = DEFAULT_STEP_OVERHEAD_MS

    def __post_init__(self) -> None:
        if self.batching not in BATCHING:
            raise InvalidRequest("batching", f"{self.batching!r} is not one of "
                                             f"{', '.join(BATCHING)}")
        if self.step is not None and not isinstance(self.step, StepTime):
            raise InvalidRequest("step_ms", f"must be a StepTime, got {self.step!r}")
        if isinstance(self.consumers, bool) or not isinstance(self.consumers, int) or \
                not 1 <= self.consumers <= 4096:
            raise InvalidRequest("consumers", f"must be an integer in [1, 4096], got "
                                              f"{self.consumers!r}")
        if not (isinstance(self.lead_ms, (int, float)) and
                (self.lead_ms == AUTO_LEAD or 0 <= self.lead_ms <= 60_000)):
            raise InvalidRequest("lead_ms", f"must be within [0, 60000] ms or {AUTO_LEAD} "
                                            f"(twice the fetch plus 0.5 ms), got "
                                            f"{self.lead_ms!r}")
        for name in ("overhead_ms", "transport_ms", "react_ms", "step_overhead_ms"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value <= 60_000):
                raise InvalidRequest(name, f"must be within [0, 60000] ms, got {value!r}")
        if not all(isinstance(r, (int, float)) and 0 < r <= 1000 for r in self.jitter):
            raise InvalidRequest("cost_jitter", "every ratio must be within (0, 1000]")
        if not all(isinstance(d, (int, float)) and abs(d) <= 60_000 for d in self.path_spread):
            raise InvalidRequest("path_spread", "every offset must be within [-60000, 60000] "
                                                "ms")
        for name in ("fetch", "finish"):
            if not isinstance(getattr(self, name), PathTime):
                raise InvalidRequest(name, f"must be a PathTime, got {getattr(self, name)!r}")
        for knob in ("prefer_buckets", "only_buckets"):
            buckets = getattr(self, knob)
            if buckets and (len(buckets) != self.consumers or not all(
                    type(b) is int and 0 <= b <= MAX_COST_BUCKETS + 1 for b in buckets)):
                raise InvalidRequest(knob, f"{buckets!r}: one bucket per consumer, each "
                                           f"0-{MAX_COST_BUCKETS + 1} (0 = none)")
        if any(p and o for p, o in zip(self.prefer_buckets, self.only_buckets, strict=False)):
            raise InvalidRequest("only_buckets", "a consumer dedicated to a bucket prefers "
                                                 "no other: give one of the two per consumer")


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
    # With request costs: latency per cost (as submitted), the padding waste
    # Σ(max - cost) / Σ max over the batches, requests refused over max_cost, and those
    # whose cost max_cost capped.
    latency_by_cost: dict[int, dict[str, float | None]] = field(default_factory=dict)
    padding_waste: float = 0.0
    rejected: int = 0
    truncated: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"throughput_rps": self.throughput_rps, "mean_batch": self.mean_batch,
                "utilisation": self.utilisation, "latency_ms": self.latency_ms,
                "requests": self.requests, "counts": self.counts, "batches": self.batches,
                "span_s": self.span_s,
                "batch_histogram": {str(k): v for k, v in self.batch_histogram.items()},
                "latency_by_cost_ms": {str(k): v for k, v in self.latency_by_cost.items()},
                "padding_waste": self.padding_waste, "rejected": self.rejected,
                "truncated": self.truncated, "wall_s": self.wall_s}


def simulate(config: SimConfig, times: list[float], prios: list[int],
             costs: list[int] | None = None, tenants: list[str] | None = None) -> SimResult:
    """Run the queue on these arrivals (offsets in s, sorted; priorities 0-2; costs, each
    >= 1, as submitted: None for all 1; tenants: None for the default one). Under the
    policy's fairness each level is shared as pop_batch.lua shares it (rules.Fair);
    max_in_flight is not simulated."""
    started = time.perf_counter()
    n = len(times)
    if n != len(prios):
        raise InvalidRequest("arrivals", f"{n} times but {len(prios)} priorities")
    if costs is not None and len(costs) != n:
        raise InvalidRequest("costs", f"{n} times but {len(costs)} costs")
    if n > MAX_REQUESTS:
        raise InvalidRequest("arrivals", f"{n} requests; at most {MAX_REQUESTS:,}")
    if tenants is not None and len(tenants) != n:
        raise InvalidRequest("tenants", f"{n} times but {len(tenants)} tenants")
    arrival = _arrival_scores(times)
    policy = config.policy
    if config.batching == "continuous":
        return _continuous(config, arrival, prios, costs, started)
    fair = Fair() if policy.fairness != "none" else None
    # Without costs every request costs 1: a batch of b costs b units in either cost_mode.
    cost = [config.cost.us(b, b) for b in range(policy.max_batch_size + 1)]
    # Costs as enqueue.lua stores them: capped (truncate) or refused (reject) over max_cost.
    stored, refused, capped = _stored_costs(policy, costs, n)
    per_cost = config.cost.per_cost_ms > 0
    pad_total = pad_waste = 0
    overhead = round(config.overhead_ms * 1000)
    transport = round(config.transport_ms * 1000)
    fetch = [config.fetch.us(b) for b in range(policy.max_batch_size + 1)]
    finish = [config.finish.us(b) for b in range(policy.max_batch_size + 1)]
    jitter = config.jitter
    draw = random.Random(f"jitter-{config.jitter_seed}").choice if jitter else None
    spread = [round(d * 1000) for d in config.path_spread]
    offset = random.Random(f"path-{config.jitter_seed}").choice if spread else None
    # A consumer that popped its running batch with requests left waiting fetches the next
    # one ahead (consumer/overlap.py): free at `ahead[c]`, it pops without a fetch.
    ahead = [-1] * config.consumers
    busy_until = [0] * config.consumers  # when its running model ends (a fetch ahead waits)
    # Before its first batch has run a consumer knows no model time, and fetches ahead as
    # the model starts (consumer/overlap.py); later, lead before the model's end.
    knows_model = [False] * config.consumers
    lead = [round(2 * f + PREFETCH_MARGIN_US) if config.lead_ms == AUTO_LEAD
            else round(config.lead_ms * 1000) for f in fetch]
    repoll = max(overhead, MIN_REPOLL_US)
    react = round(config.react_ms * 1000)
    levels = [_Level(), _Level(), _Level()]
    done = [0] * n  # when each request's result is seen (µs)
    histogram = [0] * (policy.max_batch_size + 1)
    free_at: list[tuple[int, int]] = []  # heap: (when a busy consumer finishes, which)
    idle = list(range(config.consumers))  # the idle consumers, lowest first
    prefer = config.prefer_buckets or (0,) * config.consumers
    only = config.only_buckets or (0,) * config.consumers
    # With dedicated consumers one idle consumer's Wait is not another's: each decides.
    dedicated = any(only)
    timer, model_us, waiting = math.inf, 0, 0
    i, next_arrival = 0, (arrival[0] if n else math.inf)
    push, pop = heapq.heappush, heapq.heappop
    while True:
        now = min(next_arrival, free_at[0][0] if free_at else math.inf,
                  timer if idle else math.inf)
        if now == math.inf:
            break
        while free_at and free_at[0][0] == now:
            bisect.insort(idle, pop(free_at)[1])
        if next_arrival == now:  # scores are unique, as Redis' arrival clock makes them
            prio = prios[i]
            tenant = tenants[i] if tenants is not None else DEFAULT_TENANT
            if stored is None or stored[i]:  # 0: refused at enqueue (over max_cost)
                levels[prio].append(Request(now, i, prio, cost=stored[i] if stored else 1,
                                            tenant=tenant))
                waiting += 1
                if fair is not None:
                    fair.join(prio, tenant)
            i += 1
            next_arrival = arrival[i] if i < n else math.inf
        if not idle:
            continue  # every consumer busy: the request waits
        timer = math.inf
        # Pop at once while consumers are free and batches due (with nothing waiting,
        # decide would say Nothing).
        while idle and waiting:
            for consumer in idle if dedicated else idle[:1]:
                decision = decide(levels, now, policy, prefer_bucket=prefer[consumer],
                                  first_deadline_us=0,  # no simulated request has one
                                  only_bucket=only[consumer], fair=fair)
                apply(levels, decision, fair)
                if fair is not None:
                    fair.in_flight.clear()  # max_in_flight is not simulated
                if type(decision) is Batch:
                    break
                if type(decision) is Wait:
                    timer = min(timer, now + (decision.wait_us or repoll))
            if type(decision) is Batch:
                size = len(decision.picked)
                model = cost[size]
                if stored is not None:
                    batch_costs = [p.request.cost for p in decision.picked]
                    top = max(batch_costs)
                    pad_total += size * top
                    pad_waste += size * top - sum(batch_costs)
                    if per_cost:
                        model = config.cost.us(size, policy.batch_cost(batch_costs))
                if draw is not None:
                    model = round(model * draw(jitter))
                idle.remove(consumer)
                start = max(now, busy_until[consumer])
                end = start + (overhead if ahead[consumer] == now else fetch[size]) + model
                seen = end + finish[size] + transport
                for p in decision.picked:
                    done[p.request.id] = (  # type: ignore[index]
                        seen if offset is None else max(end, seen + offset(spread)))
                waiting -= size
                if waiting:  # overlapped: fetches its next batch ahead, completes beside it
                    fetch_at = max(now, end - (lead[size] if knows_model[consumer] else model))
                    ahead[consumer], busy_until[consumer] = fetch_at, end
                    push(free_at, (fetch_at, consumer))
                else:  # completed on the consumer before it pops again
                    busy_until[consumer] = end + finish[size]
                    push(free_at, (end + finish[size], consumer))
                knows_model[consumer] = True
                histogram[size] += 1
                model_us += model
                if react and idle and waiting:  # the others look a moment later
                    timer = min(timer, now + react)
                    break
            else:
                break
    result = _result(config, arrival, prios, done, histogram, model_us,
                     time.perf_counter() - started, costs, stored if refused else None)
    if costs is None:
        return result
    return replace(result, padding_waste=round(pad_waste / pad_total, 4) if pad_total else 0.0,
                   rejected=refused, truncated=capped)


def _continuous(config: SimConfig, arrival: list[int], prios: list[int],
                costs: list[int] | None, started: float) -> SimResult:
    """simulate() under continuous batching: `batches` counts steps, mean_batch and the
    histogram the sequences a step ran."""
    stored, refused, capped = _stored_costs(config.policy, costs, len(arrival))
    done, histogram, model_us = simulate_continuous(
        config, [_Level(), _Level(), _Level()], arrival, prios, stored)
    result = _result(config, arrival, prios, done, histogram, model_us,
                     time.perf_counter() - started, costs, stored if refused else None)
    steps = sum(histogram)
    mean = round(sum(k * v for k, v in enumerate(histogram)) / steps, 2) if steps else 0.0
    return replace(result, mean_batch=mean, rejected=refused, truncated=capped)


def _stored_costs(policy: Policy, costs: list[int] | None, n: int
                  ) -> tuple[list[int] | None, int, int]:
    """Each request's cost as stored (0: refused over max_cost), refused, capped."""
    if costs is None:
        return None, 0, 0
    cap = policy.max_cost
    if not cap:
        return list(costs), 0, 0
    if policy.over_cost == "truncate":
        return [min(c, cap) for c in costs], 0, sum(c > cap for c in costs)
    return [c if c <= cap else 0 for c in costs], sum(c > cap for c in costs), 0


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
            histogram: list[int], model_us: int, wall_s: float,
            costs: list[int] | None = None, stored: list[int] | None = None) -> SimResult:
    ran = [k for k, c in enumerate(stored) if c] if stored is not None else None
    if ran is not None:  # the refused never ran: latency and throughput are of the rest
        arrival, prios, done = ([v[k] for k in ran] for v in (arrival, prios, done))
        costs = [costs[k] for k in ran] if costs is not None else None
    n = len(arrival)
    latency = [d - a for d, a in zip(done, arrival, strict=True)]
    by_prio: list[list[int]] = [[], [], []]
    for lat, prio in zip(latency, prios, strict=True):
        by_prio[prio].append(lat)
    by_cost: dict[int, list[int]] = {}
    for lat, c in zip(latency, costs or (), strict=False):
        by_cost.setdefault(c, []).append(lat)
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
        wall_s=round(wall_s, 3),
        latency_by_cost={c: _summary(by_cost[c]) for c in sorted(by_cost)})


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


def poisson(rate: float, requests: int, mix: Sequence[float] = MIX,
            seed: int = 1) -> tuple[list[float], list[int]]:
    """`requests` Poisson arrivals at `rate` per s (offsets in s) and their priorities,
    drawn with `mix` as the weights of HIGH, NORMAL, LOW."""
    rng = random.Random(seed)
    times, at = [0.0] * requests, 0.0
    for k in range(requests):
        at += rng.expovariate(rate)
        times[k] = at
    return times, rng.choices((0, 1, 2), weights=mix, k=requests)


def draw_costs(n: int, mix: Sequence[tuple[int, float]], seed: int = 1) -> list[int]:
    """n costs drawn from the mix, (cost, weight) pairs, seeded (a stream of their own:
    the arrivals of a seed stay those of batchgate bench)."""
    rng = random.Random(f"costs-{seed}")
    values, weights = zip(*mix, strict=True)
    return rng.choices(values, weights=weights, k=n)


def mean_cost(mix: Sequence[tuple[int, float]], policy: Policy) -> float:
    """A request's expected cost as the queue runs it: capped at max_cost under
    over_cost=truncate, 0 when refused (reject)."""
    total = sum(w for _, w in mix)
    cap = policy.max_cost
    if not cap:
        return sum(c * w for c, w in mix) / total
    if policy.over_cost == "truncate":
        return sum(min(c, cap) * w for c, w in mix) / total
    return sum(c * w for c, w in mix if c <= cap) / total
