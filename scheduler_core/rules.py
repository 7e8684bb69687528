"""The batch decision of `lua/pop_batch.lua` as a pure function: `decide(levels, now_us,
policy)`.

Given the requests waiting at each level (HIGH, NORMAL, LOW), the time and the queue's
policy, it says what one `pop_batch.lua` call would do: a Batch (which requests, from
which level, which of them are run, answered as expired or dead-lettered), Wait (nothing
due for `wait_us`) or Nothing (no request waits), together with the aging promotions
the call makes on the way, or Expire (a waiting request is past its deadline: it must
leave through expire_due.lua first, so that it never fills or joins a batch). It is the
script's twin, step by step (past_deadline, promote_aged, choose or take_delayed,
isolate_retried, commit's states); tests/test_rules.py holds the two together on random
queue states against a real Redis. `batchgate simulate` and the benchmark's in-process
baseline decide with it, so the rules have one Python copy. With a policy's cost settings
(max_batch_cost, cost_buckets) a batch is fitted to the budget from one bucket
(_CostRules: the script's read_cost_rules, fit and pick_costed, whose pick_from_sets
reads the same batch from the bucket sets, passing over the ids of other levels); a
request's cost is `Request.cost`; `decide(..., prefer_bucket=N)` is a consumer's
ARGV[3] = N and `decide(..., only_bucket=N)` one dedicated to bucket N (ARGV[3] = -N:
the rules applied to that bucket's oldest requests wherever they wait, the script's
read_views of the bucket's set). Under the policy's fairness (requests or cost: lua/_fair.lua,
docs/tenants.md) `decide(..., fair=Fair(...))` takes the state the fair index keeps (each
level's backlogged tenants' virtual counters, the tenants' requests in flight): wherever
the rules take requests of a level they take them in fair order (fair_order), and the
decision carries the counters after the call (`counters`), which `apply` stores.

Out of scope, as they come only from hand-written keys: members whose id no producer
makes (the script dead-letters them) and members without meta.

A level is a sequence of Request sorted as Redis keeps a pending zset: by arrival, then
id. An optional fourth level (DELAYED) holds the requests past their deadline under
on_timeout = delay, as the `{bg:q}:delayed` zset does; they run only when the three
levels are empty. `decide` reads O(max_batch_size) of each level (times the buckets with
costs on; plus a bisection when aging is on) and never modifies them; `apply` makes the
decision's writes on lists.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections import Counter
from collections.abc import Iterator, MutableSequence, Sequence
from dataclasses import dataclass, field
from operator import attrgetter, itemgetter
from typing import NamedTuple

from scheduler_core.policy import Policy, Strategy
from scheduler_core.wire import DEFAULT_TENANT

RUN, EXPIRED, EXHAUSTED = "run", "expired", "exhausted"  # the script's item states
DELAYED = 3  # the level of the delayed set (past their deadline, on_timeout = delay)
_arrival = attrgetter("arrival_us")


class Request(NamedTuple):
    """A waiting request as pop_batch.lua sees it: its pending score and its meta.
    Fields in sort order: tuples compare by arrival, then id, as a zset orders members."""

    arrival_us: int  # the pending score (Redis time at enqueue, µs)
    id: str | int
    priority: int  # as submitted (meta); its level may be higher after aging
    deadline_us: int = 0  # 0: none
    attempts: int = 0  # deliveries so far; > 0 means re-delivered after a crash or hang
    cost: int = 1  # as enqueued (capped under over_cost=truncate)
    tenant: str = DEFAULT_TENANT  # who it is for (docs/tenants.md)


class Picked(NamedTuple):
    request: Request
    level: int  # the level it was taken from
    state: str  # RUN, EXPIRED (past its deadline) or EXHAUSTED (dead-lettered)


class Promotion(NamedTuple):
    request: Request
    source: int  # level before the call
    target: int  # level after it


# Per level (HIGH, NORMAL, LOW): each backlogged tenant's virtual counter (lua/_fair.lua).
Counters = tuple[dict[str, float], ...]


class Batch(NamedTuple):
    picked: tuple[Picked, ...]
    remaining: int  # requests still waiting after this batch, all levels
    promoted: tuple[Promotion, ...] = ()
    counters: Counters | None = None  # under fairness: the counters after the call

    @property
    def ids(self) -> list[str | int]:
        return [p.request.id for p in self.picked]

    @property
    def run(self) -> list[Request]:
        return [p.request for p in self.picked if p.state == RUN]

    @property
    def expired(self) -> list[Request]:
        return [p.request for p in self.picked if p.state == EXPIRED]

    @property
    def dead_lettered(self) -> list[Request]:
        return [p.request for p in self.picked if p.state == EXHAUSTED]


class Wait(NamedTuple):
    """Nothing is due for `wait_us` µs (0: already due once a promotion limit lets it)."""

    wait_us: int
    promoted: tuple[Promotion, ...] = ()
    counters: Counters | None = None


class Nothing(NamedTuple):
    """No request waits at any level (or, under max_in_flight, every tenant that waits
    is at its limit)."""

    promoted: tuple[Promotion, ...] = ()
    counters: Counters | None = None


class Expire(NamedTuple):
    """A waiting request is past its deadline: expire the due ones, then decide again
    (pop_batch.lua's {-4}). Nothing moved."""

    promoted: tuple[Promotion, ...] = ()


Decision = Batch | Wait | Nothing | Expire
Levels = Sequence[Sequence[Request]]
NOTHING = Nothing()
EXPIRE = Expire()


def first_deadline(levels: Levels) -> int:
    """The earliest deadline of the requests waiting in the three levels (0: none), as
    the `{bg:q}:deadlines` zset holds them. O(waiting requests)."""
    return min((r.deadline_us for level in levels[:3] for r in level if r.deadline_us),
               default=0)


# Tenants read past the lowest counters, at most, when tenants at their max_in_flight are
# passed over (lua/_fair.lua's FAIR_SKIP).
FAIR_SKIP = 1024


@dataclass
class Fair:
    """What the fair index (lua/_fair.lua) keeps beside the levels: per level the virtual
    counter of each tenant with requests waiting there (exactly those), and each named
    tenant's requests in flight ({bg:q}:tenants f:<tenant>)."""

    counters: list[dict[str, float]] = field(default_factory=lambda: [{}, {}, {}])
    in_flight: dict[str, int] = field(default_factory=dict)

    def join(self, level: int, tenant: str) -> None:
        """A request of `tenant` starts waiting at `level` (enqueue, re-queue): if the
        tenant had none there, its counter is lifted to the smallest backlogged one."""
        if level <= 2:
            _join(self.counters[level], tenant)


def _join(counters: dict[str, float], tenant: str) -> None:
    if tenant not in counters:
        counters[tenant] = min(counters.values(), default=0.0)


def tenant_share(policy: Policy, tenant: str) -> tuple[int, int]:
    """A tenant's weight and max_in_flight (0: none) as the fair index reads them from
    tenant_quotas: its own entry, else '*'; the default tenant: weight 1, no limit."""
    if tenant == DEFAULT_TENANT:
        return 1, 0
    quotas = policy.quotas
    q = quotas[tenant] if tenant in quotas else quotas.get("*", {})
    return q.get("weight", 0) or 1, q.get("max_in_flight", 0)


def fair_order(waiting: dict[str, list[Request]], counters: dict[str, float], n: int,
               policy: Policy, in_flight: dict[str, int]) -> tuple[list[Request], bool]:
    """lua/_fair.lua's fair_order: a level's first n requests in fair order (each next is
    the oldest of the tenant whose counter, with what this order gave it, is lowest), from
    the first n tenants by counter below their max_in_flight; and whether a tenant was
    passed over at its limit. `waiting`: each tenant's requests at the level, oldest first."""
    found: list[list] = []  # [counter, rank, tenant, weight, room, next index]
    blocked = False
    for rank, (tenant, counter) in enumerate(sorted(counters.items(),
                                                    key=lambda tc: (tc[1], tc[0]))):
        if len(found) >= n or rank >= n + FAIR_SKIP:
            break
        weight, limit = tenant_share(policy, tenant)
        room = limit - in_flight.get(tenant, 0) if limit else math.inf
        if room > 0:
            found.append([counter, rank, tenant, weight, room, 0])
        else:
            blocked = True
    heap = [(e[0], e[1], k) for k, e in enumerate(found)]  # sorted already: a heap
    out: list[Request] = []
    cost_mode = policy.fairness == "cost"
    while len(out) < n and heap:
        _, _, k = heap[0]
        e = found[k]
        mine = waiting.get(e[2], ())
        if e[5] >= len(mine):
            heapq.heappop(heap)
            continue
        r = mine[e[5]]
        out.append(r)
        e[0] = e[0] + (r.cost if cost_mode else 1) / e[3]
        e[5] += 1
        e[4] -= 1
        if e[4] <= 0 or e[5] >= len(mine):
            heapq.heappop(heap)
        else:
            heapq.heapreplace(heap, (e[0], e[1], k))
    return out, blocked


def _by_tenant(level: Sequence[Request]) -> dict[str, list[Request]]:
    out: dict[str, list[Request]] = {}
    for r in level:
        out.setdefault(r.tenant, []).append(r)
    return out


def _merge(lists: list[tuple[int, list[Request]]], n: int) -> list[tuple[Request, int]]:
    """pop_batch's take(): the lists merged by taking, each time, the list whose next
    request arrived first (a tie to the earlier list), up to n."""
    at = [0] * len(lists)
    out: list[tuple[Request, int]] = []
    while len(out) < n:
        best = None
        for k, (_, items) in enumerate(lists):
            if at[k] < len(items) and (best is None or items[at[k]].arrival_us
                                       < lists[best][1][at[best]].arrival_us):
                best = k
        if best is None:
            break
        out.append((lists[best][1][at[best]], lists[best][0]))
        at[best] += 1
    return out


def decide(levels: Levels, now_us: int, policy: Policy, prefer_bucket: int = 0,
           first_deadline_us: int | None = None, only_bucket: int = 0,
           fair: Fair | None = None) -> Decision:
    """What pop_batch.lua does with this queue state at `now_us` under `policy`, for a
    consumer that prefers cost bucket `prefer_bucket` (1-based; 0 = none), or that serves
    bucket `only_bucket` only (0 = every bucket).

    `first_deadline_us`: the earliest deadline among the waiting requests (0: none) where
    the caller keeps it, as Redis keeps the deadlines zset; None: found by a scan.
    `fair`: the fair index's state under fairness requests | cost (None: every tenant at
    counter 0, none in flight)."""
    deadline = first_deadline(levels) if first_deadline_us is None else first_deadline_us
    if deadline and deadline <= now_us:  # past_deadline
        return EXPIRE
    if policy.fairness != "none" and fair is None:
        fair = Fair()
        for level, requests in enumerate(levels[:3]):
            for r in requests:
                fair.join(level, r.tenant)
    decision = _decide(levels, now_us, policy, prefer_bucket, only_bucket,
                       fair if policy.fairness != "none" else None)
    if deadline and type(decision) is Wait:  # a wait ends by the earliest deadline
        return Wait(min(decision.wait_us, deadline - now_us), decision.promoted,
                    decision.counters)
    if deadline and type(decision) is Nothing:  # dedicated, none of its bucket in view
        return Wait(deadline - now_us, decision.promoted, decision.counters)
    return decision


def _decide(levels: Levels, now_us: int, policy: Policy, prefer_bucket: int,
            only_bucket: int, fair: Fair | None) -> Decision:
    size, delay = policy.max_batch_size, policy.max_queue_delay_ms * 1000
    aging = policy.aging_ms * 1000 if policy.strategy is Strategy.PRIORITY else 0
    costs = _CostRules.of(policy, prefer_bucket)
    window = costs.window if costs else size  # requests read per level
    promoted: tuple[Promotion, ...] = ()
    if aging:
        heads, counts, promoted = _promote(levels[:3], now_us, aging, size, window)
    else:
        heads = [level[:window] for level in levels[:3]]
        counts = [len(level) for level in levels[:3]]
    total = counts[0] + counts[1] + counts[2]  # waiting at the three levels
    delayed = levels[DELAYED] if len(levels) > DELAYED else ()
    if total == 0 and not delayed:
        return NOTHING if fair is None else Nothing((), _copy(fair.counters))
    # Under fairness: the levels after the aging moves, by tenant, and the counters the
    # moves leave (lua/_fair.lua's fair_move, in the script's order of moves).
    counters: Counters | None = None
    waiting: list[dict[str, list[Request]]] = []
    blocked = False
    if fair is not None:
        after = _after_moves(levels[:3], promoted)
        waiting = [_by_tenant(level) for level in after]
        counters = _copy(fair.counters)
        _fair_moves(counters, levels[:3], promoted)
    queue_heads = heads  # the aging due time reads the whole level, dedicated or not
    delayed_view = delayed[:window]
    if only_bucket == 1 and not policy.bucket_bounds:
        only_bucket = 0  # without cost buckets bucket 1 is every request
    if only_bucket:  # read_views: the rules see this bucket's requests only
        *heads, delayed_view = _bucket_view(levels, promoted, policy.bucket_bounds,
                                            only_bucket, window)
        counts = [len(head) for head in heads]
        if not (any(counts) if total else delayed_view):
            return Nothing(promoted, counters)  # until a wake-up (or the next deadline)
    strategy = policy.strategy

    def take(levels: tuple[int, ...], n: int) -> list[tuple[Request, int]]:
        nonlocal blocked
        if fair is None or only_bucket:  # a dedicated consumer's view: arrival order
            return _take(heads, levels, n)
        lists = []
        for level in levels:
            if level == DELAYED or not counts[level]:
                lists.append((level, list(heads[level][:n])))
                continue
            order, passed = fair_order(waiting[level], counters[level], n, policy,
                                       fair.in_flight)
            blocked = blocked or passed
            lists.append((level, order))
        return _merge(lists, n)

    def pick(levels: tuple[int, ...]) -> list[tuple[Request, int]]:
        if costs:
            return costs.pick(take(levels, window), now_us, delay, False) or []
        return take(levels, size)

    due: list[tuple[Request, int]] | None
    if total == 0:  # take_delayed: only when no level waits
        heads.append(delayed_view)
        chosen = pick((DELAYED,))
    elif strategy is Strategy.FIFO:
        chosen = pick((0, 1, 2))
    elif strategy is Strategy.DYNAMIC:  # all levels as one: full, or the oldest is due
        first = min(head[0].arrival_us for head in heads if head)
        if costs:
            due = costs.pick(take((0, 1, 2), window), now_us, delay, True)
            if due is None:
                return Wait(max(0, first + delay - now_us), promoted, counters)
            chosen = due
        elif sum(counts) < size and now_us - first < delay:
            return Wait(max(0, first + delay - now_us), promoted, counters)
        else:
            chosen = take((0, 1, 2), size)
    elif counts[0]:  # priority: HIGH at once
        chosen = pick((0,))
    elif counts[1]:  # NORMAL by the dynamic rule; LOW waits behind it
        first = heads[1][0].arrival_us
        due = costs.pick(take((1,), window), now_us, delay, True) if costs else None
        if due is not None:
            chosen = due
        elif costs or (counts[1] < size and now_us - first < delay):
            due_us = first + delay
            if aging:  # or until the next promotion (see pop_batch.lua)
                due_us = min(due_us, first + 2 * aging)
                cut = now_us - aging
                younger = next((r.arrival_us for r in queue_heads[1] if r.arrival_us > cut),
                               None)
                if younger is not None:
                    due_us = min(due_us, younger + aging)
                if counts[2]:
                    due_us = min(due_us, heads[2][0].arrival_us + aging)
            return Wait(max(0, due_us - now_us), promoted, counters)
        else:
            chosen = take((1,), size)
    else:  # LOW when nothing else waits
        chosen = pick((2,))
    # isolate_retried: a re-delivered request runs alone, the batch ends before it;
    # commit: each request's state.
    picked = []
    for r, level in chosen:
        if r.attempts and picked:
            break
        state = EXHAUSTED if r.attempts >= policy.max_attempts else \
            EXPIRED if 0 < r.deadline_us <= now_us else RUN
        picked.append(Picked(r, level, state))
        if r.attempts:
            break
    if not picked and blocked:  # every tenant that waits is at its max_in_flight
        return Nothing(promoted, counters)
    if counters is not None:
        _fair_commit(counters, waiting, picked, policy)
    return Batch(tuple(picked), total + len(delayed) - len(picked), promoted, counters)


class _CostRules(NamedTuple):
    """pop_batch.lua's cost rules (read_cost_rules, fit, pick_costed): on when the policy
    has a max_batch_cost or cost_buckets."""

    size: int
    budget: int  # max_batch_cost; 0 = none
    padded: bool  # cost_mode padded: batch size x largest cost, else the sum
    bounds: tuple[int, ...]  # cost_buckets
    prefer: int  # the consumer's preferred bucket, 0-based; -1 = none

    @classmethod
    def of(cls, policy: Policy, prefer_bucket: int = 0) -> _CostRules | None:
        if not policy.max_batch_cost and not policy.cost_buckets:
            return None
        return cls(policy.max_batch_size, policy.max_batch_cost,
                   policy.cost_mode == "padded", policy.bucket_bounds, prefer_bucket - 1)

    @property
    def window(self) -> int:
        """Requests read per level: one max_batch_size per bucket."""
        return self.size * (len(self.bounds) + 1)

    def fit(self, group: list[tuple[Request, int]]) -> tuple[list[tuple[Request, int]], bool]:
        """The batch a bucket's requests make within max_batch_size and the budget, and
        whether it is full (the first request always fits: alone if above the budget)."""
        chosen: list[tuple[Request, int]] = []
        total = top = 0
        for c in group:
            if len(chosen) == self.size:
                return chosen, True
            cost = c[0].cost
            s, t = total + cost, max(top, cost)
            if self.budget and chosen and ((len(chosen) + 1) * t if self.padded
                                           else s) > self.budget:
                return chosen, True
            chosen.append(c)
            total, top = s, t
        return chosen, len(chosen) == self.size

    def pick(self, cands: list[tuple[Request, int]], now_us: int, delay: int,
             due_only: bool) -> list[tuple[Request, int]] | None:
        """Group the candidates (oldest first) by bucket; the preferred bucket's group if
        it is due (full, or its oldest waited `delay`; with due_only False, if it has
        any), else the first due group in the order of their oldest requests; None if
        none is due."""
        groups: dict[int, list[tuple[Request, int]]] = {}
        for c in cands:
            groups.setdefault(bisect.bisect_left(self.bounds, c[0].cost), []).append(c)
        preferred = groups.get(self.prefer)
        order = groups.values() if preferred is None else (preferred, *groups.values())
        for group in order:  # dicts keep insertion order: oldest head first
            chosen, full = self.fit(group)
            # The group's oldest: its first, except in a fair order.
            if not due_only or full or now_us - min(c[0].arrival_us for c in group) >= delay:
                return chosen
        return None


def _copy(counters: Sequence[dict[str, float]]) -> Counters:
    return tuple(dict(c) for c in counters)


def _after_moves(levels: Levels, promoted: tuple[Promotion, ...]) -> list[list[Request]]:
    """The three levels once the aging moves are made."""
    if not promoted:
        return [list(level) for level in levels]
    moved = {p.request: p.target for p in promoted}
    out: list[list[Request]] = [[], [], []]
    for index, level in enumerate(levels):
        for r in level:
            out[moved.get(r, index)].append(r)
    for level in out:
        level.sort()
    return out


def _fair_moves(counters: Counters, levels: Levels, promoted: tuple[Promotion, ...]) -> None:
    """The counters after promote_aged's moves, one by one in its order (LOW -> NORMAL,
    then NORMAL -> HIGH, each oldest first): a tenant leaves a level with its last request
    there and joins one at the smallest counter there."""
    if not promoted:
        return
    count = [Counter(r.tenant for r in level) for level in levels]
    up1 = sorted(p.request for p in promoted if p.source == 2)
    up0 = sorted(p.request for p in promoted if p.target == 0)
    for r, source, target in [*((r, 2, 1) for r in up1), *((r, 1, 0) for r in up0)]:
        count[source][r.tenant] -= 1
        if not count[source][r.tenant]:
            counters[source].pop(r.tenant, None)
        count[target][r.tenant] += 1
        _join(counters[target], r.tenant)


def _fair_commit(counters: Counters, waiting: list[dict[str, list[Request]]],
                 picked: list[Picked], policy: Policy) -> None:
    """lua/_fair.lua's fair_commit: each request's tenant's counter grows by its unit /
    weight, in batch order; a tenant with none left at the level leaves its counters."""
    taken: Counter[tuple[int, str]] = Counter()
    for p in picked:
        level, tenant = p.level, p.request.tenant
        if level > 2 or tenant not in counters[level]:
            continue
        unit = p.request.cost if policy.fairness == "cost" else 1
        counters[level][tenant] = counters[level][tenant] + unit / tenant_share(policy, tenant)[0]
        taken[level, tenant] += 1
    for (level, tenant), n in taken.items():
        if len(waiting[level].get(tenant, ())) <= n:
            del counters[level][tenant]


def _bucket_view(levels: Levels, promoted: tuple[Promotion, ...], bounds: tuple[int, ...],
                 bucket: int, n: int) -> list[list[Request]]:
    """read_views: the oldest n requests of cost bucket `bucket` (1-based) wherever they
    wait, as its set orders them (by arrival, then id), per level after the aging moves
    (HIGH, NORMAL, LOW, DELAYED). O(the requests ahead of them)."""
    moved = {p.request: p.target for p in promoted}

    def listed(index: int, level: Sequence[Request]) -> Iterator[tuple[Request, int]]:
        for r in level:
            if bisect.bisect_left(bounds, r.cost) + 1 == bucket:
                yield r, moved.get(r, index)

    view: list[list[Request]] = [[], [], [], []]
    merged = heapq.merge(*(listed(i, level) for i, level in enumerate(levels)),
                         key=itemgetter(0))
    for r, level in itertools.islice(merged, n):
        view[level].append(r)
    return view


def _take(heads: list[Sequence[Request]], levels: tuple[int, ...],
          n: int) -> list[tuple[Request, int]]:
    """The n oldest of the given levels' heads, merged by arrival (a tie goes to the lower
    level, as the script's merge)."""
    waiting = [level for level in levels if heads[level]]
    if len(waiting) <= 1:
        return [(r, level) for level in waiting for r in heads[level][:n]]
    merged = sorted(((r, level) for level in waiting for r in heads[level]),
                    key=lambda c: (c[0].arrival_us, c[1]))  # stable: keeps a level's order
    return merged[:n]


def _promote(levels: Levels, now: int, aging: int, size: int, n: int
             ) -> tuple[list[Sequence[Request]], list[int], tuple[Promotion, ...]]:
    """promote_aged: the first `size` requests and the count of each level once aged
    requests have moved up, and the moves. Each query takes at most 2 x size, in the
    script's order: LOW -> NORMAL; then NORMAL (the moved LOW included) that waited
    2 x aging -> HIGH; then NORMAL that waited aging -> HIGH if submitted NORMAL or HIGH
    (those submitted LOW count against the limit but stay). The heads hold `window`
    requests of each level (`n`: size, or more with costs on)."""
    high, normal, low = levels
    limit = 2 * size
    cut1, cut2 = now - aging, now - 2 * aging
    k2 = min(limit, bisect.bisect_right(low, cut1, key=_arrival))
    i1 = bisect.bisect_right(normal, cut1, key=_arrival)
    if not k2 and not i1:  # nothing has waited aging_ms (the common case)
        return [level[:n] for level in levels], [len(level) for level in levels], ()
    up1 = list(low[:k2])  # LOW -> NORMAL
    i2 = bisect.bisect_right(normal, cut2, key=_arrival)
    twice = sorted([*normal[:min(i2, limit)], *(r for r in up1 if r.arrival_us <= cut2)])
    del twice[limit:]
    window = sorted([*normal[i2:min(i1, i2 + limit)], *(r for r in up1 if r.arrival_us > cut2)])
    once = [r for r in window[:limit] if r.priority <= 1]
    up0 = sorted(twice + once)  # -> HIGH
    gone = set(up0)
    from_low = {r.id for r in up1}
    rest_normal = itertools.islice((r for r in normal if r not in gone), n)
    heads = [sorted([*high[:n], *up0])[:n],
             sorted([*rest_normal, *(r for r in up1 if r not in gone)])[:n],
             low[k2:k2 + n]]
    counts = [len(high) + len(up0), len(normal) + k2 - len(up0), len(low) - k2]
    promoted = tuple(
        [Promotion(r, 2, 1) for r in up1 if r not in gone]
        + [Promotion(r, 2 if r.id in from_low else 1, 0) for r in up0])
    return heads, counts, promoted


def apply(levels: Sequence[MutableSequence[Request]], decision: Decision,
          fair: Fair | None = None) -> None:
    """Make the decision's writes on the levels (lists, or any mutable sequence sorted as
    decide expects): the aging moves, then the batch leaves the head of its levels; and on
    `fair` (under fairness): the counters after the call, the batch's named tenants' in
    flight counts up."""
    if fair is not None and getattr(decision, "counters", None) is not None:
        fair.counters = [dict(c) for c in decision.counters]  # type: ignore[union-attr]
        if isinstance(decision, Batch):
            for p in decision.picked:
                if p.request.tenant != DEFAULT_TENANT:
                    fair.in_flight[p.request.tenant] = fair.in_flight.get(p.request.tenant,
                                                                          0) + 1
    for request, source, target in decision.promoted:
        level = levels[source]
        del level[bisect.bisect_left(level, request)]
        bisect.insort(levels[target], request)
    if isinstance(decision, Batch):
        taken: list[list[Request]] = [[], [], [], []]
        for p in decision.picked:
            taken[p.level].append(p.request)
        for level, requests in enumerate(taken):
            n = len(requests)
            if not n:
                continue
            requests.sort()  # a fair order is not in arrival order
            if levels[level][n - 1] == requests[-1]:  # the head of the level, as usual
                del levels[level][:n]
            else:  # costs on: a bucket's requests, others left between them
                for request in reversed(requests):
                    del levels[level][bisect.bisect_left(levels[level], request)]


def queue_clock(time_us: int, offset_us: int, seen_us: int, last_arrival_us: int
                ) -> tuple[int, int]:
    """The `now_us` every script of a queue works with (lua/_common.lua's queue_now), and
    the offset it leaves stored: Redis' TIME plus the queue's offset, raised so that the
    clock never runs behind the latest time it showed nor the last arrival score issued
    (a backward step of TIME is absorbed; the clock runs on from where it was), and
    repaid at 1% of the time passed."""
    passed = time_us + offset_us - seen_us
    if offset_us > 0 and passed > 0:
        offset_us = max(0, offset_us - passed // 100)
    now = time_us + offset_us
    latest = max(seen_us, last_arrival_us)
    if now < latest:
        return latest, latest - time_us
    return now, offset_us
