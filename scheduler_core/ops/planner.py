"""The planner: which policy and how many consumers meet a latency target (P99) at a load.

`batchgate plan` searches strategy × max_batch_size × max_queue_delay_ms × consumers
(for `--batching continuous` consumers, strategy × max_batch_size × consumers; with
`compare`, both, naming the better: `better`);
`recommended_consumers` (stats, the exporter) asks only how many consumers the
queue's current policy needs. Both answer with the simulator (scheduler_core.ops.simulation)
on a short Poisson workload, the same for every candidate (common random numbers, so
candidates are compared on the same requests).

A configuration is tried only if its consumers can carry the load running full batches
at most MAX_BUSY of the time (a backlog makes every pop a full batch, so below that the
queue keeps up; a queue run at its limit has no margin for a burst, and a short
simulation of an overloaded queue can still show a tolerable p99). It meets the target
when, simulated, the p99 latency of all requests is at most `slo_p99_ms`, and that of
HIGH at most `slo_high_p99_ms` if given.

The cheapest is the one with the fewest consumers, then the most headroom (1 − the
largest ratio of predicted p99 to its target). Consumers are tried from the fewest whose
capacity can carry the load upwards; a candidate is dropped once more consumers stop
helping it (its p99 improves by less than 5%, or its consumers are busy less than a
quarter of the time: its latency is its own floor, D + t(b), not queueing).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from typing import Any

from scheduler_core.errors import InvalidRequest
from scheduler_core.ops.continuous_sim import StepTime
from scheduler_core.ops.simulation import (
    BATCHING,
    DEFAULT_OVERHEAD_MS,
    DEFAULT_TRANSPORT_MS,
    MIX,
    ModelTime,
    SimConfig,
    SimResult,
    draw_costs,
    poisson,
    simulate,
)
from scheduler_core.policy import LIMITS, Policy, Strategy

MAX_BUSY = 0.95
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DELAYS_MS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
DEFAULT_REQUESTS = 1_000  # simulated per candidate
VERIFY_FACTOR = 5  # the answer is simulated again on this many times the requests
MAX_CONSUMERS = 4096  # SimConfig's limit
VERIFIED = 4  # the answer and its runners-up
IMPROVES = 0.95  # more consumers must cut p99 below this share of the last one
IDLE = 0.25  # a candidate missing its target this idle is at its floor: dropped
CONTINUOUS_SLOTS = 64  # the most running sequences a continuous candidate gets


@dataclass(frozen=True)
class Target:
    slo_p99_ms: float
    slo_high_p99_ms: float | None = None

    def __post_init__(self) -> None:
        for name in ("slo_p99_ms", "slo_high_p99_ms"):
            value = getattr(self, name)
            if value is None and name == "slo_high_p99_ms":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0 < value <= 86_400_000:
                raise InvalidRequest(name, f"must be within (0, 86400000] ms, got {value!r}")

    def ratio(self, result: SimResult) -> float:
        """The largest predicted p99 / target (at most 1: met)."""
        worst = (result.latency_ms["all"]["p99"] or 0.0) / self.slo_p99_ms
        high = result.latency_ms["high"]["p99"]
        if self.slo_high_p99_ms is not None and high is not None:
            worst = max(worst, high / self.slo_high_p99_ms)
        return worst


@dataclass(frozen=True)
class Load:
    rate: float  # requests/s
    mix: tuple[float, float, float] = MIX
    requests: int = DEFAULT_REQUESTS
    seed: int = 1
    # Request costs, (cost, weight) pairs drawn per request; () = every request costs 1.
    cost_mix: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.rate, bool) or not isinstance(self.rate, (int, float)) \
                or not 0 < self.rate <= 10_000_000:
            raise InvalidRequest("rate", f"must be within (0, 10000000] requests/s, got "
                                         f"{self.rate!r}")
        if isinstance(self.requests, bool) or not isinstance(self.requests, int) \
                or not 100 <= self.requests <= 1_000_000:
            raise InvalidRequest("requests", f"must be an integer in [100, 1000000], got "
                                             f"{self.requests!r}")

    @functools.cached_property
    def arrivals(self) -> tuple[list[float], list[int], list[int] | None]:
        return self._draw(self.requests, self.seed)

    @functools.cached_property
    def long_arrivals(self) -> tuple[list[float], list[int], list[int] | None]:
        return self._draw(self.requests * VERIFY_FACTOR, self.seed + 1)

    def _draw(self, n: int, seed: int) -> tuple[list[float], list[int], list[int] | None]:
        times, prios = poisson(self.rate, n, self.mix, seed)
        return times, prios, draw_costs(n, self.cost_mix, seed) if self.cost_mix else None


@dataclass(frozen=True)
class Costs:
    model: ModelTime
    overhead_ms: float = DEFAULT_OVERHEAD_MS
    transport_ms: float = DEFAULT_TRANSPORT_MS
    # A request's expected cost (simulation.mean_cost), for a model timed per unit of
    # cost: batch_ms then counts b x it, a lower bound of what a padded batch costs, so
    # that the search starts no higher than it must.
    mean_cost: float = 1.0

    def batch_ms(self, b: int) -> float:
        return (self.model.base_ms + self.model.per_item_ms * b
                + self.model.per_cost_ms * b * self.mean_cost + self.overhead_ms)


@dataclass(frozen=True)
class Option:
    """One configuration and what the simulator predicts for it."""

    policy: Policy
    consumers: int
    result: SimResult
    ratio: float  # largest predicted p99 / its target
    busy: float  # share of the consumers' time in model and overhead

    @property
    def meets(self) -> bool:
        return self.ratio <= 1.0

    @property
    def headroom(self) -> float:
        return round(1.0 - self.ratio, 4)

    def to_dict(self) -> dict[str, Any]:
        p = self.policy
        return {"consumers": self.consumers,
                "policy": {"strategy": p.strategy.value, "max_batch_size": p.max_batch_size,
                           "max_queue_delay_ms": p.max_queue_delay_ms},
                "headroom": self.headroom, "busy": round(self.busy, 4),
                "predicted": self.result.to_dict()}


@dataclass
class Plan:
    feasible: bool
    best: Option | None
    runners_up: list[Option] = field(default_factory=list)
    closest_slo_p99_ms: float | None = None  # infeasible: the target best reachable
    closest_slo_high_p99_ms: float | None = None
    simulations: int = 0
    batching: str = "static"  # the consumers' --batching the plan is for

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"feasible": self.feasible, "batching": self.batching}
        if self.best is not None:
            out.update(self.best.to_dict())
        else:
            out.update({"consumers": None, "policy": None, "predicted": None})
        if not self.feasible:
            out["closest_slo_p99_ms"] = self.closest_slo_p99_ms
            out["closest_slo_high_p99_ms"] = self.closest_slo_high_p99_ms
        out["runners_up"] = [o.to_dict() for o in self.runners_up]
        out["simulations"] = self.simulations
        return out


class _Search:
    def __init__(self, load: Load, target: Target, costs: Costs, max_consumers: int,
                 verify: bool = True, batching: str = "static", step: StepTime | None = None):
        if isinstance(max_consumers, bool) or not isinstance(max_consumers, int) \
                or not 1 <= max_consumers <= MAX_CONSUMERS:
            raise InvalidRequest("max_consumers", f"must be an integer in [1, "
                                                  f"{MAX_CONSUMERS}], got {max_consumers!r}")
        self.load, self.target, self.costs, self.max = load, target, costs, max_consumers
        self.verify, self.batching, self.step = verify, batching, step
        self.simulations = 0

    def fewest(self, policy: Policy) -> int:
        """The fewest consumers whose capacity (full batches, at MAX_BUSY) carries the
        load."""
        b = policy.max_batch_size
        return max(1, math.ceil(self.load.rate * self.costs.batch_ms(b) / 1000 / b / MAX_BUSY))

    def run(self, policy: Policy, consumers: int, verify: bool = False) -> Option:
        config = SimConfig(policy, self.costs.model, consumers, self.costs.overhead_ms,
                           self.costs.transport_ms, batching=self.batching, step=self.step)
        arrivals = self.load.long_arrivals if verify else self.load.arrivals
        result = simulate(config, *arrivals)
        self.simulations += 1
        busy = result.utilisation
        if result.span_s:
            busy += result.batches * self.costs.overhead_ms / 1000 / (consumers * result.span_s)
        return Option(policy, consumers, result, self.target.ratio(result), busy)

    def search(self, candidates: list[Policy]) -> Plan:
        """Consumers from the fewest up; at the first count where any candidate meets the
        target (and still does on the longer verification run), the best of them."""
        alive = {i: p for i, p in enumerate(candidates)}
        last: dict[int, Option] = {}  # each candidate's last simulated option
        tried: list[Option] = []
        n = min(min(self.fewest(p) for p in candidates), self.max)
        while alive and n <= self.max:
            meeting: list[tuple[int, Option]] = []
            for i, policy in list(alive.items()):
                if self.fewest(policy) > n:
                    continue
                option = self.run(policy, n)
                tried.append(option)
                if option.meets:
                    meeting.append((i, option))
                elif self._stalled(option, last.get(i)):
                    del alive[i]
                last[i] = option
            meeting.sort(key=lambda io: (-io[1].headroom, io[0]))
            # The leaders are simulated again on a longer run, and ranked by that.
            verified: list[tuple[int, Option]] = []
            for i, option in _leaders(meeting, VERIFIED):
                checked = self.run(option.policy, n, verify=True) if self.verify else option
                if checked.meets:
                    verified.append((i, checked))
                else:
                    del alive[i]  # met on the short run only: not robust
            if verified:
                verified.sort(key=lambda io: (-io[1].headroom, io[0]))
                best, *rest = [o for _, o in verified]
                return Plan(True, best, rest, simulations=self.simulations,
                            batching=self.batching)
            n = n + 1 if alive else n
            if alive:
                n = max(n, min(self.fewest(p) for p in alive.values()))
        return self._closest(candidates, tried)

    @staticmethod
    def _stalled(option: Option, previous: Option | None) -> bool:
        if option.busy < IDLE:
            return True  # mostly idle: its latency is its floor, not queueing
        return previous is not None and option.ratio > previous.ratio * IMPROVES

    def _closest(self, candidates: list[Policy], tried: list[Option]) -> Plan:
        """Nothing meets the target within max_consumers: the lowest target reachable,
        and the fewest consumers that reach it."""
        if not tried:  # not even carried: the consumers the best capacity would take
            policy = min(candidates, key=lambda p: (self.fewest(p), candidates.index(p)))
            n = min(self.fewest(policy), MAX_CONSUMERS)
            option = self.run(policy, n, verify=self.verify)
            return Plan(False, option, [], _ceil(option.result.latency_ms["all"]["p99"]),
                        _ceil(option.result.latency_ms["high"]["p99"])
                        if self.target.slo_high_p99_ms is not None else None,
                        simulations=self.simulations, batching=self.batching)
        best_ratio = min(o.ratio for o in tried)
        # Within 5% of the best reachable, the fewest consumers, then the lowest ratio.
        near = [o for o in tried if o.ratio <= best_ratio * 1.05]
        pick = min(near, key=lambda o: (o.consumers, o.ratio))
        option = self.run(pick.policy, pick.consumers, verify=True) if self.verify else pick
        high = option.result.latency_ms["high"]["p99"]
        return Plan(False, option, [], _ceil(option.result.latency_ms["all"]["p99"]),
                    _ceil(high) if self.target.slo_high_p99_ms is not None else None,
                    simulations=self.simulations, batching=self.batching)


def _ceil(ms: float | None) -> float | None:
    return None if ms is None else math.ceil(ms * 10) / 10


def _leaders(ranked: list[tuple[int, Option]], count: int) -> list[tuple[int, Option]]:
    """The best, then the best of each other strategy, then the next best: `count`."""
    distinct: list[tuple[int, Option]] = []  # one of each set that behaved the same
    for item in ranked:
        r = item[1].result
        if not any(o.result.latency_ms == r.latency_ms
                   and o.result.batch_histogram == r.batch_histogram for _, o in distinct):
            distinct.append(item)
    picked = distinct[:1]
    seen = {o.policy.strategy for _, o in picked}
    for item in distinct[1:]:
        if item[1].policy.strategy not in seen:
            picked.append(item)
            seen.add(item[1].policy.strategy)
    picked += [item for item in distinct if item not in picked]
    return picked[:count]


def candidates(target: Target, costs: Costs, mix: tuple[float, float, float],
               base: Policy) -> list[Policy]:
    """The grid searched: strategy × max_batch_size (powers of two whose full batch fits
    the target) × max_queue_delay_ms (those under the target). fifo waits for nothing;
    priority is left out when only one priority arrives (it then equals dynamic or
    fifo)."""
    slo = target.slo_p99_ms
    floor = costs.transport_ms + costs.batch_ms(1)
    sizes = [b for b in BATCH_SIZES if b <= LIMITS["max_batch_size"][1]
             and costs.transport_ms + costs.batch_ms(b) <= slo] or [1]
    delays = [d for d in DELAYS_MS if d + floor <= slo] or [DELAYS_MS[0]]
    out = [replace(base, strategy=Strategy.FIFO, max_batch_size=b) for b in sizes]
    out += [replace(base, strategy=Strategy.DYNAMIC, max_batch_size=b, max_queue_delay_ms=d)
            for b in sizes if b > 1 for d in delays]
    if sum(1 for w in mix if w > 0) > 1:
        out.append(replace(base, strategy=Strategy.PRIORITY, max_batch_size=1))
        # Without NORMAL requests the delay plays no part (HIGH and LOW never wait).
        waits = delays if mix[1] > 0 else delays[:1]
        out += [replace(base, strategy=Strategy.PRIORITY, max_batch_size=b,
                        max_queue_delay_ms=d) for b in sizes if b > 1 for d in waits]
    return out


def continuous_candidates(mix: tuple[float, float, float], base: Policy) -> list[Policy]:
    """The grid searched for continuous consumers: fifo and (with more than one priority)
    priority × max_batch_size, the running sequences' slots; a pop never waits for a
    batch to form there, so no delay is searched."""
    sizes = [b for b in BATCH_SIZES if b <= min(CONTINUOUS_SLOTS, LIMITS["max_batch_size"][1])]
    out = [replace(base, strategy=Strategy.FIFO, max_batch_size=b) for b in sizes]
    if sum(1 for w in mix if w > 0) > 1:
        out += [replace(base, strategy=Strategy.PRIORITY, max_batch_size=b,
                        max_queue_delay_ms=DELAYS_MS[0]) for b in sizes]
    return out


def plan(load: Load, target: Target, costs: Costs, max_consumers: int = 64,
         base: Policy | None = None, batching: str = "static",
         step: StepTime | None = None) -> Plan:
    """The cheapest configuration meeting `target` at `load` (see the module's doc), for
    consumers of that `batching` (step: a continuous step's time, None: from the cost
    model)."""
    if batching not in BATCHING:
        raise InvalidRequest("batching", f"{batching!r} is not one of {', '.join(BATCHING)}")
    search = _Search(load, target, costs, max_consumers, batching=batching, step=step)
    grid = candidates(target, costs, load.mix, base or Policy()) if batching == "static" \
        else continuous_candidates(load.mix, base or Policy())
    return search.search(grid)


def better(plans: dict[str, Plan]) -> str:
    """Of plans per batching mode, the better: one that meets the target, then the fewest
    consumers, then the most headroom; where none meets it, the lowest reachable p99."""
    def rank(mode: str) -> tuple[Any, ...]:
        p = plans[mode]
        if p.best is None:
            return (2, 0, 0.0, mode != "static")
        if p.feasible:
            return (0, p.best.consumers, -p.best.headroom, mode != "static")
        return (1, p.closest_slo_p99_ms or math.inf, p.best.consumers, mode != "static")
    return min(plans, key=rank)


def consumers_for(policy: Policy, load: Load, target: Target, costs: Costs,
                  max_consumers: int = 256, verify: bool = True) -> Plan:
    """How many consumers `policy` needs to meet `target` at `load` (the planner's answer
    for one policy; infeasible: those that reach the closest target)."""
    return _Search(load, target, costs, max_consumers, verify).search([policy])


RATE_STEP = 1.05  # recommended_consumers caches answers per 5% band of arrival rate


@functools.lru_cache(maxsize=256)
def _recommended(rate_band: int, policy: Policy, target: Target, costs: Costs) -> int:
    rate = min(RATE_STEP ** rate_band, 10_000_000.0)
    answer = consumers_for(policy, Load(rate), target, costs, verify=False)
    assert answer.best is not None  # a single policy is always simulated
    return answer.best.consumers


def recommended_consumers(rate: float, policy: Policy, target: Target, costs: Costs,
                          waiting: int = 0) -> int:
    """The consumers `policy` needs at `rate` requests/s to meet `target` (where no count
    does: those that come closest). Without arrivals: 1 while requests wait or run, else
    0. Rates are rounded up to a 5% band, and answers cached per band, policy, target and
    cost, so that stats and metric scrapes stay cheap (one search: a few simulations of
    DEFAULT_REQUESTS requests)."""
    if rate <= 0:
        return 1 if waiting > 0 else 0
    band = math.ceil(math.log(rate) / math.log(RATE_STEP) - 1e-9)
    return _recommended(band, policy, target, costs)
