"""The simulator's `--batching continuous` (scheduler_core/ops/simulation.py calls it when
SimConfig.batching says so): consumers whose requests join and leave a running batch at
every step, as consumer/continuous.py runs them.

A request of cost c runs c steps (without costs: one), its first in the step it joins.
A step of a consumer with n sequences decoding and j joining takes
step(n, j) = base_ms + per_seq_ms × (n + j) + prefill_ms × j (StepTime), plus
`step_overhead_ms` (the loop's own time per step), plus finish(k) when k sequences
finished in it (their complete.lua call is made before the next step). Each finished
request is seen finish(k) + transport after its step ends.

Between steps, as the real loop: waiting members join while slots are free
(max_batch_size) and the running costs stay within max_batch_cost (a request alone may
exceed it); then, while a slot is free and no popped member waits, the consumer pops
(`scheduler_core.rules.decide`, pop_batch.lua's twin), the pop being read after the step
it was sent with, so its requests join at the next step. A consumer with nothing running
pops as soon as work is due and starts fetch(b) later. Preemption, deadlines and
failures are not modelled.
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import MutableSequence
from dataclasses import dataclass
from typing import Any

from scheduler_core.errors import InvalidRequest
from scheduler_core.rules import Batch, Request, Wait, apply, decide

# The loop's own time per step besides the model (pop read, answers' bookkeeping, the
# step's Python), fitted to an in-process continuous consumer on a step-wise model that
# only sleeps (tests/test_simulate_continuous.py).
DEFAULT_STEP_OVERHEAD_MS = 1.0
_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)"
_STEP = re.compile(rf"^(?:{_NUMBER}(?:\+|$))?(?:{_NUMBER}\*?n)?$")


@dataclass(frozen=True)
class StepTime:
    """One step: base_ms + per_seq_ms × sequences + prefill_ms × those joining."""

    base_ms: float = 0.0
    per_seq_ms: float = 0.0
    prefill_ms: float = 0.0

    def __post_init__(self) -> None:
        for name in ("base_ms", "per_seq_ms", "prefill_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0 <= value <= 3_600_000:
                raise InvalidRequest("step_ms", f"{name} must be within [0, 3600000] ms, "
                                                f"got {value!r}")

    @classmethod
    def from_model(cls, model: Any) -> StepTime:
        """The step that makes a request alone take what the batch model says: per unit
        of cost (A + B·c), A is its prefill and each of its c steps B; per request
        (A + B·b), a request is one step of A + B per sequence."""
        if model.per_cost_ms:
            return cls(0.0, model.per_cost_ms, model.base_ms)
        return cls(model.base_ms, model.per_item_ms, 0.0)

    def us(self, running: int, joining: int) -> int:
        return round((self.base_ms + self.per_seq_ms * running + self.prefill_ms * joining)
                     * 1000)

    @classmethod
    def parse(cls, text: str, prefill_ms: float = 0.0) -> StepTime:
        """"A+B*n" ms ("0.5+1.3*n", "1.3*n", "2"; spaces ignored) for a step of n
        sequences, with `prefill_ms` per sequence joining."""
        m = _STEP.match(text.replace(" ", ""))
        if not m or not any(m.groups()):
            raise InvalidRequest("step_ms", f"{text!r} is not A+B*n (e.g. 0.5+1.3*n, 1.3*n; "
                                            "ms for a step of n sequences)")
        base, per = m.groups()
        return cls(float(base or 0), float(per or 0), prefill_ms)

    def __str__(self) -> str:
        return f"{self.base_ms:g}+{self.per_seq_ms:g}*n ms, prefill {self.prefill_ms:g} ms"


class _Consumer:
    __slots__ = ("index", "running", "here", "at", "cost")

    def __init__(self, index: int):
        self.index = index
        self.running: list[list[int]] = []  # [request index, steps left, cost]
        self.here: deque[Request] = deque()  # popped, not yet joined
        self.at = math.inf  # its next step boundary (inf: idle)
        self.cost = 0  # the running sequences' costs


def simulate_continuous(config: Any, levels: list[MutableSequence[Request]],
                        arrival: list[int], prios: list[int], stored: list[int] | None
                        ) -> tuple[list[int], list[int], int]:
    """Each request's result time (µs), the histogram of sequences per step and the model
    µs, for a scheduler_core.ops.simulation.SimConfig whose batching is "continuous"
    (`levels`: empty pending levels; `stored`: the costs as enqueued, 0 = refused)."""
    policy = config.policy
    step = config.step or StepTime.from_model(config.cost)
    slots, budget = policy.max_batch_size, policy.max_batch_cost
    overhead = round(config.step_overhead_ms * 1000)
    transport = round(config.transport_ms * 1000)
    fetch = [config.fetch.us(b) for b in range(slots + 1)]
    finish = [config.finish.us(b) for b in range(slots + 1)]
    prefer = config.prefer_buckets or (0,) * config.consumers
    only = config.only_buckets or (0,) * config.consumers
    n = len(arrival)
    done = [0] * n
    histogram = [0] * (slots + 1)
    consumers = [_Consumer(c) for c in range(config.consumers)]
    waiting, model_us, timer = 0, 0, math.inf
    i, next_arrival = 0, (arrival[0] if n else math.inf)

    def pop(c: _Consumer, now: int) -> int:
        """Pop for c at `now`; the batch waits in c.here. Returns its size (0: none)."""
        nonlocal waiting, timer
        decision = decide(levels, now, policy, prefer_bucket=prefer[c.index],
                          first_deadline_us=0, only_bucket=only[c.index])
        apply(levels, decision)
        if type(decision) is Batch:
            c.here.extend(p.request for p in decision.picked)
            waiting -= len(decision.picked)
            return len(decision.picked)
        if type(decision) is Wait and not c.running:
            timer = min(timer, now + max(decision.wait_us, 100))
        return 0

    def run_step(c: _Consumer, now: int) -> None:
        """Admit, pop for the next step, run one step from `now`."""
        nonlocal model_us
        joining = 0
        while c.here and len(c.running) < slots:
            r = c.here[0]
            if budget and c.running and c.cost + r.cost > budget:
                break
            c.here.popleft()
            c.running.append([r.id, r.cost, r.cost])  # type: ignore[list-item]
            c.cost += r.cost
            joining += 1
        if not c.running:
            c.at = math.inf
            return
        if waiting and not c.here and len(c.running) < slots:
            pop(c, now)  # sent with this step, read after it: joins at the next one
        model = step.us(len(c.running), joining)
        end = now + model + overhead
        finished = [s for s in c.running if s[1] == 1]
        histogram[len(c.running)] += 1
        if finished:
            seen = end + finish[len(finished)] + transport
            for s in finished:
                done[s[0]] = seen
                c.cost -= s[2]
            end += finish[len(finished)]
            c.running = [s for s in c.running if s[1] > 1]
        for s in c.running:
            s[1] -= 1
        model_us += model
        c.at = end

    while True:
        idle = any(c.at == math.inf for c in consumers)
        now = min(next_arrival, min(c.at for c in consumers),
                  timer if idle and waiting else math.inf)
        if now == math.inf:
            break
        if next_arrival == now:
            cost = 1 if stored is None else stored[i]
            if cost:  # 0: refused at enqueue (over max_cost)
                levels[prios[i]].append(Request(now, i, prios[i], cost=cost))
                waiting += 1
            i += 1
            next_arrival = arrival[i] if i < n else math.inf
        if timer <= now:
            timer = math.inf
        for c in consumers:
            if c.at == now:
                run_step(c, now)
        for c in consumers:  # idle ones pop what is due, lowest first
            if c.at == math.inf and waiting:
                size = pop(c, now)
                if size:
                    c.at = now + fetch[size]
    return done, histogram, model_us
