"""scheduler_core.rules.decide is pop_batch.lua's twin: on thousands of random queue states
and policies (every strategy, aging, deadlines, re-delivered requests, max_attempts,
per-level default timeouts, requests delayed past their deadline, costs, cost buckets, a
preferred bucket, a consumer dedicated to one bucket) the function and the script, run on
a real Redis (a third of them with
the delay passed in ARGV[4], as a consumer under max_queue_delay_ms=auto does), make the
same decision: the same batch (ids, levels, states, costs, what remains), the same wait,
the same aging moves, the same "expire first" ({-4}).

The script reads the clock itself (Redis TIME) and notes it as the consumer's heartbeat;
the function decides at exactly that time. Each case is built relative to a TIME read just
before the script runs, many requests within NEAR_US of a threshold (the delay, aging,
2 x aging, a deadline), where the µs that pass until the script runs decide the outcome.
"""

from __future__ import annotations

import random
import time
import uuid
from dataclasses import dataclass, replace

import pytest

from scheduler_core.keys import QueueKeys
from scheduler_core.policy import Policy, Strategy
from scheduler_core.rules import (
    DELAYED,
    EXHAUSTED,
    RUN,
    Batch,
    Expire,
    Nothing,
    Promotion,
    Request,
    Wait,
    apply,
    decide,
)
from scheduler_core.scripts import Scripts, pop_keys
from scheduler_core.wire import cost_record, delivered_job

CASES = 4000
NEAR_US = 2000  # a pipelined script call takes ~0.1-1 ms after the TIME read
DELAYS_MS = (0, 300, 1000, 2500)
AGINGS_MS = (0, 400, 1000, 1500)
SIZES = (1, 2, 3, 4, 8, 32)
TIMEOUTS_MS = (0, 0, 250, 1000, 3000)  # per-level default timeouts drawn for a policy
# A case's deadlines: none; all in the future; some within NEAR_US of now; some past.
DEADLINE_MIXES = ("none", "future", "future", "near", "past")
# Cost settings (a third of the cases): budgets, modes, buckets, and the costs drawn.
BUDGETS = (0, 0, 4, 20, 64, 300)
BUCKETS = ("", "", "4", "3,16", "2,8,32", "1,2,3,100")
COSTS = (1, 1, 2, 3, 4, 5, 8, 16, 17, 33, 64, 200, 500)


@dataclass
class Case:
    policy: Policy  # the rules decide() applies
    levels: list[list[Request]]  # HIGH, NORMAL, LOW, DELAYED
    stored: Policy  # the policy hash; differs from `policy` when delay_ms overrides it
    # The consumer's cost bucket (ARGV[3]), 1-based: N it prefers bucket N, -N it serves
    # bucket N only; 0 = none.
    prefer: int = 0
    delay_ms: int | None = None  # pop_batch's ARGV[4] (a consumer's auto delay)


def random_case(rng: random.Random, t0: int) -> Case:
    # A third of the cases are partial batches, mostly young and without HIGH: waits.
    partial = rng.random() < 0.35
    strategy = rng.choice([Strategy.DYNAMIC, Strategy.PRIORITY] if partial else list(Strategy))
    size = rng.choice(SIZES[3:] if partial else SIZES)
    costed = rng.random() < 0.35
    policy = Policy(strategy=strategy, max_batch_size=size,
                    max_queue_delay_ms=rng.choice(DELAYS_MS[1:] if partial else DELAYS_MS),
                    aging_ms=rng.choice(AGINGS_MS), max_attempts=rng.randint(1, 4),
                    timeout_high_ms=rng.choice(TIMEOUTS_MS),
                    timeout_normal_ms=rng.choice(TIMEOUTS_MS),
                    timeout_low_ms=rng.choice(TIMEOUTS_MS),
                    allow_timeout_override=rng.randint(0, 1),
                    max_batch_cost=rng.choice(BUDGETS) if costed else 0,
                    cost_mode=rng.choice(("sum", "padded")),
                    cost_buckets=rng.choice(BUCKETS) if costed else "")
    mix = rng.choice(DEADLINE_MIXES)
    cost_mix = rng.sample(COSTS, rng.randint(1, 4))
    thresholds = [t for t in (policy.max_queue_delay_ms, policy.aging_ms,
                              2 * policy.aging_ms) if t > 0]
    n = rng.randint(1, size - 1) if partial else rng.choice((0, 1, 2, 3, 5, 10, 20, 40, 80))
    weights = (0, 6, 3) if partial else (1, 6, 3)
    span_ms = (1.2 * policy.max_queue_delay_ms if partial
               else rng.choice((0.5, 1, 2, 4)) * max(thresholds, default=1000))  # of the ages
    levels: list[list[Request]] = [[], [], [], []]
    taken: set[int] = set()
    for _ in range(n):
        prio = rng.choices((0, 1, 2), weights=weights)[0]
        level = prio if rng.random() < 0.8 else rng.randint(0, prio)  # aged before
        arrival = t0 - age_us(rng, thresholds, span_ms)
        while arrival in taken:  # Redis' arrival clock makes scores unique per queue
            arrival = t0 - age_us(rng, thresholds, span_ms)
        taken.add(arrival)
        deadline = deadline_us(rng, policy, mix, prio, arrival, t0, n)
        attempts = 0 if rng.random() < 0.75 else rng.randint(1, policy.max_attempts + 1)
        cost = rng.choice(cost_mix) if costed else 1
        levels[level].append(Request(arrival, uuid.UUID(int=rng.getrandbits(128)).hex[:12],
                                     prio, deadline, attempts, cost))
    # Requests expire_due.lua delayed (on_timeout = delay): past their deadline, which
    # their meta no longer carries; they run only when the three levels are empty.
    if rng.random() < 0.3:
        for _ in range(rng.choice((1, 2, 5, 40))):
            arrival = t0 - rng.randint(1, 10_000_000)
            while arrival in taken:
                arrival = t0 - rng.randint(1, 10_000_000)
            taken.add(arrival)
            attempts = 0 if rng.random() < 0.8 else rng.randint(1, policy.max_attempts + 1)
            cost = rng.choice(cost_mix) if costed else 1
            levels[DELAYED].append(Request(arrival, uuid.UUID(int=rng.getrandbits(128)).hex[:12],
                                           rng.randint(0, 2), 0, attempts, cost))
    for level in levels:
        level.sort()
    prefer = rng.choice((0, 0, 1, 2, 3, -1, -2, -3)) if costed else \
        rng.choice((0,) * 8 + (-1, -2))  # without buckets every request is in bucket 1
    if rng.random() < 0.3:  # delay_mode=auto: the consumer passes the delay it derived
        stored = replace(policy, max_queue_delay_ms=rng.choice(DELAYS_MS), delay_mode="auto",
                         slo_p99_ms=60)
        return Case(policy, levels, stored, prefer, policy.max_queue_delay_ms)
    return Case(policy, levels, policy, prefer)


def deadline_us(rng: random.Random, policy: Policy, mix: str, prio: int, arrival: int,
                t0: int, n: int) -> int:
    """A deadline as enqueue.lua gives it: the request's own deadline_ms, or its level's
    default timeout (Policy.deadline_ms), counted from its enqueue; then placed per mix
    (about one request of the case near or past it)."""
    own_ms = rng.choice((0, 0, 100, 2000))
    ms = policy.deadline_ms(prio, own_ms)
    if not ms or mix == "none":
        return 0
    odds = min(0.5, 1.5 / n)
    if mix == "near" and rng.random() < odds:
        return t0 + rng.randint(-NEAR_US, NEAR_US)
    if mix == "past" and rng.random() < odds:
        return t0 - rng.randint(1, 5_000_000)
    # Not yet due: one that would be (its age is random) is moved ahead, near enough to
    # end a wait now and then.
    return max(arrival + ms * 1000, t0 + rng.randint(NEAR_US, 1_000_000))


def age_us(rng: random.Random, thresholds: list[int], span_ms: float) -> int:
    """An age in µs up to span_ms, a fifth of them within NEAR_US of a threshold."""
    if thresholds and rng.random() < 0.2:
        return max(0, rng.choice(thresholds) * 1000 + rng.randint(-NEAR_US, NEAR_US))
    return rng.randint(0, int(span_ms * 1000))


def meta(r: Request) -> str:
    # as enqueue.lua writes it: the cost only when not 1 (both costs when it was capped)
    base = f"{r.priority}:{r.arrival_us}:{r.deadline_us}:{r.attempts}:0:prod"
    if r.cost != 1:
        base += f":{r.cost}" if r.cost % 2 else f":{r.cost}:{r.cost * 3}"
    return base + '|{"v":1}'


def run_case(client, scripts: Scripts, rng: random.Random) -> tuple[
        Case, list, int, int, list[list[str]], set[str], set[str]]:
    """Build the case's state through the real keys (as enqueue.lua writes them, aged and
    re-delivered ones as aging and requeue_expired.lua leave them, delayed ones as
    expire_due.lua does), run pop_batch.lua; (case, reply, TIME before, TIME after,
    pending ids per level and delayed ids after, the deadlines zset's ids after, the ids
    in the cost bucket sets after)."""
    sec, usec = client.time()
    t0 = sec * 1_000_000 + usec
    case = random_case(rng, t0)
    keys = QueueKeys(f"rules-{uuid.uuid4().hex[:12]}")
    pipe = client.pipeline(transaction=False)
    pipe.hset(keys.policy, mapping=case.stored.to_redis())
    for level, requests in enumerate(case.levels):
        if requests:
            pipe.zadd(keys.pending(level) if level != DELAYED else keys.delayed,
                      {r.id: r.arrival_us for r in requests})
            pipe.hset(keys.jobs, mapping={r.id: meta(r) for r in requests})
            with_deadline = {r.id: r.deadline_us for r in requests if r.deadline_us}
            if with_deadline:  # as enqueue.lua lists them
                pipe.zadd(keys.deadlines, with_deadline)
            listed = {r.id: case.stored.bucket_of(r.cost) + 1 if case.stored.bucket_bounds
                      else 0 for r in requests}
            for r in requests:
                if listed[r.id]:  # as enqueue.lua (requeue, retry) list them
                    pipe.zadd(keys.bucket_set(listed[r.id]), {r.id: r.arrival_us})
            # Their costs entries, as enqueue.lua writes them; every third has one without
            # the priority and every third none, as if listed by older versions (the pop
            # reads what is missing from its jobs value).
            pipe.hset(keys.costs, mapping={r.id: cost_record(r.cost, listed[r.id], r.priority)
                                           for r in requests[::3]})
            if requests[1::3]:
                pipe.hset(keys.costs, mapping={r.id: cost_record(r.cost, listed[r.id])
                                               for r in requests[1::3]})
    # ARGV[3] (prefer) and ARGV[4] (delay) are absent, as consumers without them send.
    optional = [case.prefer] if case.prefer or case.delay_ms is not None else []
    if case.delay_ms is not None:
        optional.append(case.delay_ms)
    pipe.evalsha(scripts.pop_batch.sha, len(keys.shared), *pop_keys(keys), "c1", 60_000,
                 *optional)
    pipe.zscore(keys.consumers, "c1")  # the script's clock: it notes the consumer's pop
    for level in range(3):
        pipe.zrange(keys.pending(level), 0, -1)
    pipe.zrange(keys.delayed, 0, -1)
    pipe.zrange(keys.deadlines, 0, -1)
    for b in range(1, 6):
        pipe.zrange(keys.bucket_set(b), 0, -1)
    pipe.delete(*keys.shared)
    replies = pipe.execute()
    reply, now = replies[-13], int(replies[-12])
    after = [[x.decode() for x in ids] for ids in replies[-11:-7]]
    deadlines_after = {x.decode() for x in replies[-7]}
    sets_after = {x.decode() for ids in replies[-6:-1] for x in ids}
    return case, reply, t0, now, after, deadlines_after, sets_after


def listed_left(case: Case, decision) -> set[str]:
    """The ids in the cost bucket sets after the pop: a popped request leaves its set."""
    if not case.stored.bucket_bounds:
        return set()
    gone = set(decision.ids) if isinstance(decision, Batch) else set()
    return {r.id for level in case.levels for r in level} - gone


def ids_after(case: Case, decision) -> list[list[str]]:
    levels = [list(level) for level in case.levels]
    apply(levels, decision)
    return [[r.id for r in level] for level in levels]


def deadlines_left(case: Case, decision) -> set[str]:
    """The deadlines zset after the pop: a popped request leaves it."""
    gone = set(decision.ids) if isinstance(decision, Batch) else set()
    return {r.id for level in case.levels for r in level if r.deadline_us} - gone


def test_decide_makes_the_decisions_of_pop_batch_lua(shared_redis):
    client = shared_redis.client()
    scripts = Scripts(client)
    scripts.pop_batch(keys=pop_keys(QueueKeys("rules-load")), args=["c", 60_000])  # load it
    rng = random.Random(20261130)
    seen = {"batch": 0, "wait": 0, "aging wait": 0, "deadline wait": 0, "nothing": 0,
            "expire first": 0, "delayed batch": 0, EXHAUSTED: 0, "promoted": 0,
            "isolated": 0, "borderline": 0, "costed batch": 0, "costed wait": 0,
            "budget cut": 0, "bucket cut": 0, "preferred": 0, "delay override wait": 0,
            "dedicated batch": 0, "dedicated, none in view": 0}
    started = time.monotonic()
    for i in range(CASES):
        case, reply, t0, now, after, deadlines_after, sets_after = run_case(client, scripts,
                                                                            rng)
        where = f"case {i}: {case.policy}, prefer {case.prefer}, levels {case.levels}, " \
                f"reply {reply}"
        assert t0 <= now, where
        expected = decide_as(case, now)
        # Cases the µs between the TIME read and the script decided.
        seen["borderline"] += expected != decide_as(case, t0)
        if int(reply[0]) == -4:
            assert isinstance(expected, Expire), where
            seen["expire first"] += 1
        elif int(reply[0]) == 0:
            wait = int(reply[1])
            if wait == -1:
                assert isinstance(expected, Nothing), where
                seen["nothing"] += 1
                seen["dedicated, none in view"] += case.prefer < 0 and any(case.levels)
            else:
                assert isinstance(expected, Wait) and expected.wait_us == wait, where
                seen["wait"] += 1
                seen["deadline wait"] += wait == min(
                    r.deadline_us for level in case.levels for r in level if r.deadline_us
                ) - now if any(r.deadline_us for level in case.levels for r in level) else 0
                seen["delay override wait"] += case.delay_ms is not None
                seen["aging wait"] += case.policy.strategy is Strategy.PRIORITY and \
                    case.policy.aging_ms > 0
                seen["costed wait"] += costed(case.policy)
        else:
            assert int(reply[1]) == now, where
            assert isinstance(expected, Batch), where
            # per request: id, jobs value, attempt, state, level
            items = [reply[k:k + 5] for k in range(4, len(reply), 5)]
            jobs = [delivered_job(x[1]) for x in items]  # arrival, producer, cost, requested
            got = [(x[0].decode(), x[3].decode(), int(x[4]), job[2])
                   for x, job in zip(items, jobs, strict=True)]
            assert got == [(p.request.id, p.state, p.level, p.request.cost)
                           for p in expected.picked], where
            assert [job[3] for job in jobs] == [
                r.cost if r.cost % 2 else r.cost * 3 for r in (p.request for p in
                                                             expected.picked)], where
            assert int(reply[3]) == expected.remaining, where
            assert [int(x[2]) for x in items] == [p.request.attempts + 1
                                                  for p in expected.picked], where
            seen["batch"] += 1
            seen["dedicated batch"] += case.prefer < 0 and any(
                r not in expected.run for level in case.levels for r in level)
            seen["delayed batch"] += any(p.level == DELAYED for p in expected.picked)
            assert not expected.expired, where  # an expired request never joins a batch
            seen[EXHAUSTED] += len(expected.dead_lettered)
            seen["isolated"] += any(p.request.attempts for p in expected.picked)
            if costed(case.policy):
                seen["costed batch"] += 1
                seen["preferred"] += case.prefer > 0 and case.policy.bucket_of(
                    expected.picked[0].request.cost) == case.prefer - 1 and \
                    expected.picked[0].request != min(r for level in case.levels
                                                      for r in level)
                cut_budget, cut_bucket = cuts(case, expected)
                seen["budget cut"] += cut_budget
                seen["bucket cut"] += cut_bucket
        assert after == ids_after(case, expected), where  # the aging moves and the pops
        assert deadlines_after == deadlines_left(case, expected), where
        # A batch leaves its bucket sets (by one range removal where it is a run of one).
        assert sets_after == listed_left(case, expected), where
        seen["promoted"] += len(expected.promoted)
    took = time.monotonic() - started
    # Every outcome is exercised, many times over.
    print(seen, f"{took:.1f} s")
    assert min(seen.values()) >= 50, seen
    assert took < 60, took


def decide_as(case: Case, now: int):
    """decide() for the case's consumer (ARGV[3]: prefer N, or dedicated to -N)."""
    return decide(case.levels, now, case.policy, prefer_bucket=max(case.prefer, 0),
                  only_bucket=max(-case.prefer, 0))


def costed(policy: Policy) -> bool:
    return bool(policy.max_batch_cost or policy.cost_buckets)


def cuts(case: Case, batch: Batch) -> tuple[bool, bool]:
    """Whether the batch was cut short by the budget, by its bucket: a same-level request
    younger than the batch's newest (left waiting) that the budget or its bucket kept out."""
    policy = case.policy
    if len(batch.picked) >= policy.max_batch_size or any(p.request.attempts
                                                         for p in batch.picked):
        return False, False
    level = batch.picked[0].level
    bucket = policy.bucket_of(batch.picked[0].request.cost)
    left = [r for r in case.levels[level] if r.id not in set(batch.ids)]
    other = any(policy.bucket_of(r.cost) != bucket for r in left)
    same = any(policy.bucket_of(r.cost) == bucket for r in left)
    return same and policy.max_batch_cost > 0, other


# -- the rules by example ---------------------------------------------------------------
def req(ms: int, rid: str, prio: int = 1, **kw: int) -> Request:
    return Request(ms * 1000, rid, prio, **kw)


def test_a_redelivered_request_runs_alone_and_ends_the_batch_before_it():
    policy = Policy(strategy=Strategy.FIFO, max_batch_size=8)
    levels = [[], [req(1, "a"), req(2, "b"), req(3, "c", attempts=1), req(4, "d")], []]
    first = decide(levels, 10_000, policy)
    assert isinstance(first, Batch) and first.ids == ["a", "b"] and first.remaining == 2
    apply(levels, first)
    second = decide(levels, 10_000, policy)
    assert isinstance(second, Batch) and second.ids == ["c"]


def test_expired_requests_leave_first_and_exhausted_ones_are_answered_not_run():
    """A request past its deadline is never batched: the pop says "expire first"; once it
    has left, the other is due only when its own window ends."""
    policy = Policy(strategy=Strategy.DYNAMIC, max_batch_size=2, max_attempts=2,
                    max_queue_delay_ms=100)
    levels = [[], [req(1, "late", deadline_us=5_000), req(2, "ok", deadline_us=500_000)], []]
    assert isinstance(decide(levels, 10_000, policy), Expire)  # not a "full" batch of 2
    del levels[1][0]  # expire_due.lua took it out
    wait = decide(levels, 10_000, policy)
    assert isinstance(wait, Wait) and wait.wait_us == 92_000  # 2 ms + 100 ms - 10 ms
    dead = decide([[req(1, "x", attempts=2)], [], []], 200_000, policy)  # its window is over
    assert isinstance(dead, Batch) and [r.id for r in dead.dead_lettered] == ["x"]
    assert [p.state for p in dead.picked] == [EXHAUSTED]


def test_a_wait_ends_at_the_earliest_deadline():
    policy = Policy(strategy=Strategy.PRIORITY, max_batch_size=4, max_queue_delay_ms=500)
    levels = [[], [req(0, "n", deadline_us=200_000)], []]
    wait = decide(levels, 50_000, policy)
    assert isinstance(wait, Wait) and wait.wait_us == 150_000  # not 450 ms


def test_delayed_requests_run_only_when_nothing_else_waits():
    """on_timeout = delay: past their deadline, they run once the three levels are empty,
    even behind a partial NORMAL batch that is not due yet."""
    policy = Policy(strategy=Strategy.PRIORITY, max_batch_size=4, max_queue_delay_ms=500)
    late = req(0, "late", prio=0)
    levels = [[], [req(10, "n")], [], [late]]
    assert isinstance(decide(levels, 20_000, policy), Wait)
    levels[1].clear()
    batch = decide(levels, 20_000, policy)
    assert isinstance(batch, Batch) and batch.ids == ["late"] and batch.picked[0].level == DELAYED
    assert batch.picked[0].state == RUN and batch.remaining == 0


def test_normal_waits_for_its_window_or_its_promotion():
    policy = Policy(strategy=Strategy.PRIORITY, max_batch_size=4, max_queue_delay_ms=50,
                    aging_ms=30)
    levels = [[], [req(100, "n")], [req(105, "l", prio=2)]]
    wait = decide(levels, 110_000, policy)  # n is promoted at 130 ms, before its window ends
    assert isinstance(wait, Wait) and wait.wait_us == 20_000
    moved = decide(levels, 130_000, policy)
    assert isinstance(moved, Batch) and moved.ids == ["n"] and moved.picked[0].level == 0
    assert moved.promoted == (Promotion(levels[1][0], 1, 0),)


def test_thresholds_are_reached_at_equality():
    """A window of exactly max_queue_delay_ms is due, a wait of exactly aging_ms promotes,
    a deadline equal to now has passed (the script compares with < and <=, so)."""
    policy = Policy(strategy=Strategy.PRIORITY, max_batch_size=4, max_queue_delay_ms=50,
                    aging_ms=100)
    assert isinstance(decide([[], [req(0, "n")], []], 49_999, policy), Wait)
    assert isinstance(decide([[], [req(0, "n")], []], 50_000, policy), Batch)
    aged = decide([[], [], [req(0, "l", prio=2)]], 100_000, policy)
    assert isinstance(aged, Batch) and aged.picked[0].level == 1
    assert isinstance(decide([[req(0, "h", prio=0, deadline_us=7_000)], [], []], 7_000,
                             policy), Expire)
    assert isinstance(decide([[req(0, "h", prio=0, deadline_us=7_000)], [], []], 6_999,
                             policy), Batch)


def test_per_level_default_timeouts_and_their_override():
    policy = Policy(timeout_high_ms=100, timeout_normal_ms=0, timeout_low_ms=5000)
    assert policy.deadline_ms(0, 0) == 100  # the level's default
    assert policy.deadline_ms(0, 30) == 30  # its own replaces it (override allowed)
    assert policy.deadline_ms(1, 0) == 0 and policy.deadline_ms(1, 70) == 70  # no default
    strict = Policy(timeout_low_ms=5000, allow_timeout_override=0)
    assert strict.deadline_ms(2, 60_000) == 5000 and strict.deadline_ms(1, 60_000) == 60_000


@pytest.mark.parametrize("strategy", list(Strategy))
def test_an_empty_queue_is_nothing(strategy):
    assert isinstance(decide([[], [], []], 0, Policy(strategy=strategy)), Nothing)


def test_a_request_aged_from_low_waits_for_its_next_promotion_not_zero():
    """A LOW request promoted to NORMAL moves up again at 2 x aging_ms: until then the
    consumer sleeps (it used to be told "due in 0" and poll without pause)."""
    policy = Policy(strategy=Strategy.PRIORITY, max_batch_size=4, max_queue_delay_ms=5000,
                    aging_ms=1000)
    levels = [[], [req(0, "l", prio=2)], []]  # in NORMAL since 1,000 ms
    wait = decide(levels, 1_200_000, policy)
    assert isinstance(wait, Wait) and wait.wait_us == 800_000
    levels[1].append(req(500, "n"))  # submitted NORMAL: moves up at 1,500 ms
    wait = decide(levels, 1_200_000, policy)
    assert isinstance(wait, Wait) and wait.wait_us == 300_000
