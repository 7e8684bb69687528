"""Fair share between tenants (docs/tenants.md, "Fair share"): pop_batch.lua under the
policy's fairness = requests | cost against its twin, scheduler_core.rules.decide, on random
queue states with tenants, weights, max_in_flight, priorities, aging, deadlines, costs and
cost buckets: the same batch, wait or nothing, and the same fair index after (each level's
virtual counters, its tenant-ordered set). Then the rule by example, driven through the
script: who goes in which batch, the bound it keeps, max_in_flight."""

from __future__ import annotations

import random
import time
import uuid
from dataclasses import replace

import test_rules
from test_rules import Case, random_case

from scheduler_core.keys import QueueKeys
from scheduler_core.policy import Policy, Strategy
from scheduler_core.rules import DELAYED, Batch, Expire, Fair, Nothing, Request, Wait, apply, decide
from scheduler_core.scripts import Scripts, pop_keys
from scheduler_core.wire import DEFAULT_TENANT, cost_record, fair_member

TENANTS = ("acme", "b-team", "c.org", "d:x", DEFAULT_TENANT)
COUNTERS = (0.0, 0.0, 0.5, 1.0, 2.25, 7.0)


def meta(r: Request) -> str:
    envelope = '{"v":1}' if r.tenant == DEFAULT_TENANT else f'{{"v":1,"tenant":"{r.tenant}"}}'
    return test_rules.meta(r).rsplit("|", 1)[0] + "|" + envelope


def fair_case(rng: random.Random, t0: int) -> tuple[Case, Fair]:
    case = random_case(rng, t0)
    tenants = rng.sample(TENANTS, rng.randint(1, len(TENANTS)))
    mode = rng.choice(("requests", "cost"))
    quotas = {}
    for t in tenants:
        if t != DEFAULT_TENANT and rng.random() < 0.6:
            quotas[t] = {"weight": rng.choice((0, 1, 2, 3, 7))}
            if rng.random() < 0.3:
                quotas[t]["max_in_flight"] = rng.randint(1, 4)
    if rng.random() < 0.3:
        quotas["*"] = {"weight": rng.choice((1, 2))}
    costed = bool(case.policy.max_batch_cost or case.policy.cost_buckets)
    levels = [[r._replace(tenant=rng.choice(tenants),
                          cost=r.cost if costed or mode == "requests" else rng.choice((1, 3, 16)))
               for r in level] for level in case.levels]
    policy = replace(case.policy, fairness=mode, tenant_quotas=quotas)
    stored = replace(case.stored, fairness=mode, tenant_quotas=quotas)
    fair = Fair(in_flight={t: rng.randint(0, 3) for t in tenants if t != DEFAULT_TENANT})
    for level in range(3):
        for r in levels[level]:
            if r.tenant not in fair.counters[level]:
                fair.counters[level][r.tenant] = rng.choice(COUNTERS)
    return Case(policy, levels, stored, case.prefer, case.delay_ms), fair


def write_state(pipe, keys: QueueKeys, case: Case, fair: Fair) -> None:
    """The keys as enqueue.lua and the fair index leave them."""
    pipe.hset(keys.policy, mapping=case.stored.to_redis())
    for level, requests in enumerate(case.levels):
        if not requests:
            continue
        pipe.zadd(keys.pending(level) if level != DELAYED else keys.delayed,
                  {r.id: r.arrival_us for r in requests})
        pipe.hset(keys.jobs, mapping={r.id: meta(r) for r in requests})
        with_deadline = {r.id: r.deadline_us for r in requests if r.deadline_us}
        if with_deadline:
            pipe.zadd(keys.deadlines, with_deadline)
        listed = {r.id: case.stored.bucket_of(r.cost) + 1 if case.stored.bucket_bounds
                  else 0 for r in requests}
        for r in requests:
            if listed[r.id]:
                pipe.zadd(keys.bucket_set(listed[r.id]), {r.id: r.arrival_us})
        pipe.hset(keys.costs, mapping={r.id: cost_record(r.cost, listed[r.id])
                                       for r in requests})
        if level < 3:
            pipe.zadd(keys.fair_set(level), {fair_member(r.tenant, r.arrival_us, r.id): 0
                                             for r in requests})
            pipe.hset(keys.fair_who, mapping={r.id: r.tenant for r in requests})
            pipe.zadd(keys.fair_counters(level), fair.counters[level])
    flying = {f"f:{t}": n for t, n in fair.in_flight.items() if n}
    if flying:
        pipe.hset(keys.tenants, mapping=flying)


def test_pop_batch_and_decide_share_a_level_fairly_alike(shared_redis):
    client = shared_redis.client()
    scripts = Scripts(client)
    scripts.pop_batch(keys=pop_keys(QueueKeys("fair-load")), args=["c", 60_000])
    rng = random.Random(35)
    seen = {"batch": 0, "several tenants": 0, "not arrival order": 0, "wait": 0,
            "nothing": 0, "blocked": 0, "expire": 0, "promoted": 0}
    started = time.monotonic()
    for i in range(1500):
        sec, usec = client.time()
        t0 = sec * 1_000_000 + usec
        case, fair = fair_case(rng, t0)
        keys = QueueKeys(f"fair-{uuid.uuid4().hex[:12]}")
        pipe = client.pipeline(transaction=False)
        write_state(pipe, keys, case, fair)
        optional = [case.prefer] if case.prefer or case.delay_ms is not None else []
        if case.delay_ms is not None:
            optional.append(case.delay_ms)
        pipe.evalsha(scripts.pop_batch.sha, len(keys.shared), *pop_keys(keys), "c1", 60_000,
                     *optional)
        pipe.zscore(keys.consumers, "c1")
        for level in range(3):
            pipe.zrange(keys.fair_counters(level), 0, -1, withscores=True)
            pipe.zrange(keys.fair_set(level), 0, -1)
        pipe.hgetall(keys.fair_who)
        pipe.delete(*keys.shared)
        replies = pipe.execute()
        reply, now = replies[-10], int(replies[-9])
        counters_after = [{k.decode(): v for k, v in replies[-8 + 2 * level]}
                          for level in range(3)]
        sets_after = [{m.decode() for m in replies[-7 + 2 * level]} for level in range(3)]
        who_after = {k.decode(): v.decode() for k, v in replies[-2].items()}
        expected = decide(case.levels, now, case.policy, prefer_bucket=max(case.prefer, 0),
                          only_bucket=max(-case.prefer, 0), fair=fair)
        where = f"case {i}: {case.policy} prefer {case.prefer} levels {case.levels} " \
                f"fair {fair} reply {reply}"
        if int(reply[0]) == -4:
            assert isinstance(expected, Expire), where
            seen["expire"] += 1
            continue
        if int(reply[0]) == 0:
            if int(reply[1]) == -1:
                assert isinstance(expected, Nothing), where
                seen["nothing"] += 1
            else:
                assert isinstance(expected, Wait) and expected.wait_us == int(reply[1]), where
                seen["wait"] += 1
            seen["blocked"] += isinstance(expected, (Nothing, Wait)) and any(case.levels[:3])\
                and int(reply[1]) < 0
        else:
            assert isinstance(expected, Batch), where
            items = [reply[k:k + 5] for k in range(4, len(reply), 5)]
            got = [(x[0].decode(), x[3].decode(), int(x[4])) for x in items]
            assert got == [(p.request.id, p.state, p.level) for p in expected.picked], where
            assert int(reply[3]) == expected.remaining, where
            seen["batch"] += 1
            seen["several tenants"] += len({p.request.tenant for p in expected.picked}) > 1
            seen["not arrival order"] += [p.request for p in expected.picked] != sorted(
                p.request for p in expected.picked)
        seen["promoted"] += len(expected.promoted)
        levels = [list(level) for level in case.levels]
        apply(levels, expected, fair)
        assert counters_after == fair.counters, where
        assert sets_after == [{fair_member(r.tenant, r.arrival_us, r.id) for r in level}
                              for level in levels[:3]], where
        assert who_after == {r.id: r.tenant for level in levels[:3] for r in level}, where
    took = time.monotonic() - started
    print(seen, f"{took:.1f} s")
    assert min(seen.values()) >= 10, seen


# -- the rule by example, through the script -------------------------------------------
def _pop(client, scripts: Scripts, keys: QueueKeys) -> list[tuple[str, int]]:
    reply = scripts.pop_batch(keys=pop_keys(keys), args=["c1", 60_000])
    return [(reply[k].decode(), int(reply[k + 4])) for k in range(4, len(reply), 5)]


def _enqueue(producer, tenant: str, n: int, priority: str = "normal", cost: int = 1) -> list:
    return producer.submit_many([{"t": tenant, "k": k} for k in range(n)], tenant=tenant,
                                priority=priority, cost=cost)


def test_decide_alone_interleaves_a_flood_and_a_light_tenant():
    policy = Policy(strategy=Strategy.FIFO, max_batch_size=4, fairness="requests")
    flood = [Request(t, f"f{t}", 1, tenant="flood") for t in range(1, 101)]
    light = [Request(1000, "l1", 1, tenant="light"), Request(1001, "l2", 1, tenant="light")]
    levels: list[list[Request]] = [[], sorted(flood + light), []]
    fair = Fair()
    for r in levels[1]:
        fair.join(1, r.tenant)
    batch = decide(levels, 10**7, policy, fair=fair)
    assert isinstance(batch, Batch)
    assert batch.ids == ["f1", "l1", "f2", "l2"]  # the flood's backlog is not ahead of it
