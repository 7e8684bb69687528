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

import pytest
import test_rules
from helpers.support import configure
from test_rules import Case, random_case

from producer import DeadlineExceeded, Producer
from scheduler_core.keys import QueueKeys
from scheduler_core.ops.simulation import ModelTime, SimConfig, simulate
from scheduler_core.policy import Policy, Strategy
from scheduler_core.rules import DELAYED, Batch, Expire, Fair, Nothing, Request, Wait, apply, decide
from scheduler_core.scripts import (
    Scripts,
    complete_keys,
    dead_letter_keys,
    pop_keys,
    requeue_keys,
)
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


def head_cache(requests: list[Request], complete: bool) -> str:
    """lua/_fair.lua's head cache of a tenant's first requests at a level, oldest first."""
    return ("=" if complete else "+") + "c" + "".join(
        f"{r.arrival_us:017d}|{r.cost}|{r.id}," for r in requests)


def split_who(who: dict[str, str], members: list[list[str]], cost_of: dict[str, int]
              ) -> dict[str, str]:
    """fair:who's id -> tenant fields; checks that each head cache in it (field
    "<level>|<tenant>") lists the first of that tenant's members at the level (`members`:
    each level's set, in its order), all of them where it says so, with their units."""
    ids = {k: v for k, v in who.items() if "|" not in k}
    for field, value in who.items():
        if "|" not in field:
            continue
        level, tenant = field.split("|", 1)
        mine = [m.split("|") for m in members[int(level)] if m.split("|")[0] == tenant]
        flag, letter, entries = value[0], value[1], value[2:].split(",")
        assert entries.pop() == "" and mine and flag in "=+" and letter == "c", (field, value)
        assert len(entries) <= len(mine) and (flag == "+" or len(entries) == len(mine)), \
            (field, value, mine)
        for entry, (_, arrival, rid) in zip(entries, mine, strict=False):
            a, unit, i = entry.split("|")
            assert (a, i) == (arrival, rid), (field, value, mine)
            assert int(unit) == cost_of.get(rid, 1), (field, value)
    return ids


def write_state(pipe, keys: QueueKeys, case: Case, fair: Fair,
                rng: random.Random | None = None) -> None:
    """The keys as enqueue.lua and the fair index leave them (with `rng`, a head cache
    for some of the tenants, as pops leave them)."""
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
            for tenant in sorted({r.tenant for r in requests}):
                if rng is None or rng.random() < 0.5:
                    continue
                mine = sorted((r for r in requests if r.tenant == tenant),
                              key=lambda r: (r.arrival_us, r.id))
                k = rng.randint(1, len(mine))
                complete = k == len(mine) and rng.random() < 0.7
                pipe.hset(keys.fair_who, f"{level}|{tenant}",
                          head_cache(mine[:k], complete))
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
    for i in range(1200):
        sec, usec = client.time()
        t0 = sec * 1_000_000 + usec
        case, fair = fair_case(rng, t0)
        keys = QueueKeys(f"fair-{uuid.uuid4().hex[:12]}")
        pipe = client.pipeline(transaction=False)
        write_state(pipe, keys, case, fair, rng)
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
        members_after = [[m.decode() for m in replies[-7 + 2 * level]] for level in range(3)]
        sets_after = [set(level) for level in members_after]
        cost_of = {r.id: r.cost for level in case.levels for r in level}
        who_after = split_who({k.decode(): v.decode() for k, v in replies[-2].items()},
                              members_after, cost_of)
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


def _queue_with(shared_redis, queue: str, **policy) -> tuple:
    configure(shared_redis.url, queue, **policy)
    client = shared_redis.client()
    return client, Scripts(client), QueueKeys(queue)


def _tenant_of(handles: dict[str, list]) -> dict[str, str]:
    return {h.id: tenant for tenant, hs in handles.items() for h in hs}


def test_a_light_tenant_is_not_queued_behind_a_flood(shared_redis, queue):
    client, scripts, keys = _queue_with(shared_redis, queue, strategy="fifo",
                                        max_batch_size=4, fairness="requests")
    with Producer(shared_redis.url, queue=queue) as p:
        handles = {"flood": _enqueue(p, "flood", 200), "light": _enqueue(p, "light", 2)}
    who = _tenant_of(handles)
    first = _pop(client, scripts, keys)
    assert [who[i] for i, _ in first] == ["flood", "light", "flood", "light"]
    # Without fairness (the default) the same backlog runs in arrival order.
    configure(shared_redis.url, queue + "-none", strategy="fifo", max_batch_size=4)
    with Producer(shared_redis.url, queue=queue + "-none") as p:
        flood, light = _enqueue(p, "flood", 200), _enqueue(p, "light", 2)
    none = _pop(client, scripts, QueueKeys(queue + "-none"))
    assert [i for i, _ in none] == [h.id for h in flood[:4]]
    assert not set(h.id for h in light) & {i for i, _ in none}
    # fairness=none writes no key of the fair index.
    assert not any(client.exists(k) for k in QueueKeys(queue + "-none").shared[36:43])


def test_strict_priority_holds_and_fairness_applies_inside_each_level(shared_redis, queue):
    client, scripts, keys = _queue_with(shared_redis, queue, strategy="priority",
                                        max_batch_size=4, fairness="requests", aging_ms=0)
    with Producer(shared_redis.url, queue=queue) as p:
        handles = {"a": _enqueue(p, "a", 6, "low"), "b": _enqueue(p, "b", 6, "high"),
                   "c": _enqueue(p, "c", 2, "high")}
    who = _tenant_of(handles)
    assert [(who[i], level) for i, level in _pop(client, scripts, keys)] == [
        ("b", 0), ("c", 0), ("b", 0), ("c", 0)]
    assert [who[i] for i, _ in _pop(client, scripts, keys)] == ["b"] * 4
    assert [who[i] for i, _ in _pop(client, scripts, keys)] == ["a"] * 4  # LOW: none above


def test_weights_share_a_level_in_proportion(shared_redis, queue):
    client, scripts, keys = _queue_with(shared_redis, queue, strategy="fifo",
                                        max_batch_size=6, fairness="requests",
                                        tenant_quotas="big:weight=2")
    with Producer(shared_redis.url, queue=queue) as p:
        handles = {"big": _enqueue(p, "big", 60), "small": _enqueue(p, "small", 60)}
    who = _tenant_of(handles)
    served = [who[i] for _ in range(5) for i, _ in _pop(client, scripts, keys)]
    assert served.count("big") == 20 and served.count("small") == 10


def test_the_service_gap_stays_within_the_documented_bound(shared_redis, queue):
    """docs/tenants.md, "The bound": two tenants backlogged at a level, costs 16 and 256,
    weights 1 and 2, under fairness=cost with a cost budget per batch: after every pop the
    gap between their weighted cost served (counted from the batches) stays within
    D = max(cost / weight) = 128, and so does their virtual counters' gap."""
    client, scripts, keys = _queue_with(shared_redis, queue, strategy="fifo",
                                        max_batch_size=8, fairness="cost", max_batch_cost=1024,
                                        tenant_quotas="heavy:weight=2")
    with Producer(shared_redis.url, queue=queue) as p:
        handles = {"light": _enqueue(p, "light", 400, cost=16),
                   "heavy": _enqueue(p, "heavy", 40, cost=256)}
    who, cost, weight = _tenant_of(handles), {"light": 16, "heavy": 256}, {"light": 1, "heavy": 2}
    service = {"light": 0.0, "heavy": 0.0}
    bound, worst, pops = 128, 0.0, 0
    while True:
        counters = dict(client.zrange(keys.fair_counters(1), 0, -1, withscores=True))
        if len(counters) < 2:
            break  # one ran out: no longer both backlogged
        assert abs(counters[b"light"] - counters[b"heavy"]) <= bound
        for i, _ in _pop(client, scripts, keys):
            service[who[i]] += cost[who[i]] / weight[who[i]]
        pops += 1
        worst = max(worst, abs(service["light"] - service["heavy"]))
        assert worst <= bound, (pops, service)
    assert pops > 20 and worst > 0
    print(f"{pops} pops, largest gap {worst} (bound {bound})")


def test_max_in_flight_passes_over_a_tenant_until_a_slot_frees(shared_redis, queue):
    client, scripts, keys = _queue_with(shared_redis, queue, strategy="fifo",
                                        max_batch_size=4, fairness="requests",
                                        tenant_quotas="capped:max_in_flight=2")
    with Producer(shared_redis.url, queue=queue) as p:
        handles = {"capped": _enqueue(p, "capped", 6), "free": _enqueue(p, "free", 3)}
    who = _tenant_of(handles)
    first = _pop(client, scripts, keys)
    assert sorted(who[i] for i, _ in first) == ["capped", "capped", "free", "free"]
    assert [who[i] for i, _ in _pop(client, scripts, keys)] == ["free"]
    # Only the capped tenant waits, at its limit: nothing until a slot frees (not a spin).
    assert [int(x) for x in scripts.pop_batch(keys=pop_keys(keys), args=["c1", 60_000])] \
        == [0, -1]
    # A finished request frees its slot (and wakes the consumers).
    batch_id = client.zrange(keys.inflight, 0, 0)[0].decode()
    done = next(i for i, _ in first if who[i] == "capped")
    client.delete(keys.marker)
    scripts.complete(keys=complete_keys(keys, [(done, "")]),
                     args=[batch_id, 60, 1, done, "ok", '{"v":1,"ok":true}'])
    assert client.exists(keys.marker)
    assert [who[i] for i, _ in _pop(client, scripts, keys)] == ["capped"]
    # A crashed consumer's lease running out frees them too (re-queued, waiting again).
    for _ in range(10):
        if client.zcard(keys.inflight) == 0:
            break
        client.zadd(keys.inflight, {b: 0 for b in client.zrange(keys.inflight, 0, -1)})
        scripts.requeue_expired(keys=requeue_keys(keys), args=[10])
    assert client.hget(keys.tenants, "f:capped") is None
    # (a re-delivered request runs alone)
    assert [who[i] for i, _ in _pop(client, scripts, keys)] == ["capped"]


def test_every_path_keeps_the_fair_index_exact(shared_redis, queue):
    """cancel, deadline expiry (reject and delay), lease re-queue, preempt, dead-letter
    retry, aging: the fair index lists exactly the requests waiting at each level, and
    the counters exactly the tenants there; drained, the queue holds none of its keys."""
    client, scripts, keys = _queue_with(shared_redis, queue, strategy="priority",
                                        max_batch_size=3, fairness="cost", aging_ms=200,
                                        max_queue_delay_ms=0)

    def exact() -> None:
        for level in range(3):
            ids = {i.decode() for i in client.zrange(keys.pending(level), 0, -1)}
            members = [m.decode().split("|") for m in client.zrange(keys.fair_set(level), 0, -1)]
            assert {m[2] for m in members} == ids
            assert {m[0] for m in members} == {
                t.decode() for t in client.zrange(keys.fair_counters(level), 0, -1)}
        listed = {i.decode() for level in range(3) for i in client.zrange(keys.pending(level),
                                                                           0, -1)}
        who = {k.decode(): v.decode() for k, v in client.hgetall(keys.fair_who).items()}
        members = [[m.decode() for m in client.zrange(keys.fair_set(level), 0, -1)]
                   for level in range(3)]
        cost_of = {k.decode(): int(v.split(b":")[0]) for k, v in client.hgetall(keys.costs).items()}
        assert set(split_who(who, members, cost_of)) == listed

    with Producer(shared_redis.url, queue=queue) as p:
        a = _enqueue(p, "a", 4, "low", cost=3)
        b = _enqueue(p, "b", 3, "normal")
        c = p.submit({"x": 1}, priority="high", deadline_ms=30)  # the default tenant
        exact()
        assert b[0].cancel() == "cancelled"
        exact()
        time.sleep(0.05)
        scripts.expire_due(keys=list(keys.shared), args=["list", 10])
        with pytest.raises(DeadlineExceeded):
            c.result(timeout=10)
        exact()
        popped = _pop(client, scripts, keys)  # NORMAL, due at once
        exact()
        batch_id = client.zrange(keys.inflight, 0, 0)[0].decode()
        scripts.preempt(keys=list(keys.shared), args=[batch_id, 1, popped[0][0]])
        exact()
        client.zadd(keys.inflight, {batch_id: 0})
        scripts.requeue_expired(keys=requeue_keys(keys), args=[10])
        exact()
        time.sleep(0.45)  # LOW ages past 2 x aging_ms: moves up
        while client.zcard(keys.pending(0)) + client.zcard(keys.pending(1)) + \
                client.zcard(keys.pending(2)):
            _pop(client, scripts, keys)
            exact()
    # Dead-lettered, then retried: waiting again, listed again.
    client.zadd(keys.dead, {a[0].id: 1})
    client.hset(keys.jobs, a[0].id, "2:1:0:0:1:|{\"v\":1,\"tenant\":\"a\"}")
    scripts.dead_letter(keys=dead_letter_keys(keys, [a[0].id]), args=["retry", 1, a[0].id])
    exact()
    assert client.zrange(keys.fair_counters(2), 0, -1) == [b"a"]
    _pop(client, scripts, keys)
    exact()
    for k in (*(keys.fair_set(level) for level in range(3)),
              *(keys.fair_counters(level) for level in range(3)), keys.fair_who):
        assert not client.exists(k), k


def test_the_simulator_shares_a_level_as_the_script_does():
    """simulate() decides with rules.decide and its Fair state: a light tenant's requests
    (cost 2, to tell them apart) arriving behind a flood wait for the flood's backlog
    without fairness, and about one batch with it."""
    times = [i * 1e-6 for i in range(600)] + [0.01 + i * 0.05 for i in range(10)]
    prios = [1] * len(times)
    costs = [1] * 600 + [2] * 10
    tenants = ["flood"] * 600 + ["light"] * 10
    p99 = {}
    for fairness in ("none", "requests"):
        config = SimConfig(Policy(strategy=Strategy.FIFO, max_batch_size=8,
                                  fairness=fairness), ModelTime(5.0, 0.5), consumers=1)
        result = simulate(config, times, prios, costs, tenants)
        p99[fairness] = result.latency_by_cost[2]["p99"]
    assert p99["none"] > 200 and p99["requests"] < 30, p99


def _index_exact(client, keys: QueueKeys, all_listed: bool) -> None:
    """The fair index against the levels, read in one transaction (the producer's sweeper
    expires requests meanwhile): each level's set lists waiting requests only (all of them
    where `all_listed`), its counters hold exactly the tenants listed there, who maps each
    listed id to its tenant and each head cache is exact (split_who)."""
    pipe = client.pipeline(transaction=True)
    for level in range(3):
        pipe.zrange(keys.fair_set(level), 0, -1)
        pipe.zrange(keys.pending(level), 0, -1)
        pipe.zrange(keys.fair_counters(level), 0, -1)
    pipe.hgetall(keys.fair_who)
    pipe.hgetall(keys.costs)
    got = pipe.execute()
    members = [[m.decode() for m in got[3 * level]] for level in range(3)]
    for level in range(3):
        ids = {i.decode() for i in got[3 * level + 1]}
        listed = {m.split("|")[2] for m in members[level]}
        assert listed == ids if all_listed else listed <= ids, (level, listed ^ ids)
        assert {m.split("|")[0] for m in members[level]} == {
            t.decode() for t in got[3 * level + 2]}, level
    who = {k.decode(): v.decode() for k, v in got[9].items()}
    cost_of = {k.decode(): int(v.split(b":")[0]) for k, v in got[10].items() if b":" in v}
    ids = split_who(who, members, cost_of)
    expected = {m.split("|")[2]: m.split("|")[0] for level in members for m in level}
    assert ids == expected, sorted(set(ids.items()) ^ set(expected.items()))


def test_random_operations_keep_the_fair_index_and_its_head_caches_exact(shared_redis, queue):
    """Enqueue (several tenants, levels, costs), cancel, pop, complete, a lapsed lease
    re-queued, preemption, deadline expiry, aging and fairness switched between requests,
    cost and none, in random order: after every step the index lists what waits, and the
    head caches a pop keeps are exact prefixes of their tenant's requests; no request ends
    twice."""
    from scheduler_core.admin import change_policy

    client, scripts, keys = _queue_with(shared_redis, queue, strategy="priority",
                                        max_batch_size=4, fairness="cost", aging_ms=150,
                                        max_queue_delay_ms=0)
    rng = random.Random(3535)
    tenants = ("a", "b", "c:x", "d.e", "f-g", None)
    handles: list = []
    mode, all_listed, steps, history = "cost", True, {}, []
    ended: set[str] = set()
    with Producer(shared_redis.url, queue=queue) as p:
        for _ in range(400):
            op = rng.choices(("submit", "cancel", "pop", "complete", "lapse", "preempt",
                              "expire", "switch"), (6, 2, 5, 3, 1, 1, 1, 1))[0]
            steps[op] = steps.get(op, 0) + 1
            history.append(op)
            inflight = [b.decode() for b in client.zrange(keys.inflight, 0, -1)]
            if op == "submit":
                tenant = rng.choice(tenants)
                kw = {"tenant": tenant} if tenant else {}
                if rng.random() < 0.2:
                    kw["deadline_ms"] = rng.choice((5, 60_000))
                new = p.submit_many([{"k": 1}] * rng.randint(1, 5), cost=rng.choice(
                    (1, 3, 16)), priority=rng.choice(("high", "normal", "low")), **kw)
                handles += new
                history.append(f"{[h.id[:6] for h in new]} {kw}")
            elif op == "cancel" and handles:
                h = rng.choice(handles)
                history.append(f"cancel {h.id[:6]}")
                if h.cancel() == "cancelled":
                    assert h.id not in ended
                    ended.add(h.id)
            elif op == "pop":
                reply = scripts.pop_batch(keys=pop_keys(keys), args=["c1", 60_000])
                if int(reply[0]) == -4:
                    scripts.expire_due(keys=list(keys.shared), args=["list", 100])
            elif op == "complete" and inflight:
                batch = rng.choice(inflight)
                ids = [rid for rid in client.hget(keys.batches, batch).decode().split(
                    "|", 1)[1].split(",") if client.hget(keys.owner, rid) == batch.encode()]
                args = [batch, 60, len(ids)]
                for rid in ids:
                    args += [rid, "ok", b'{"v":1,"id":"x","ok":true,"value":1}']
                scripts.complete(keys=complete_keys(keys, [(rid, "p") for rid in ids]),
                                 args=args)
                assert not ended & set(ids)
                ended |= set(ids)
            elif op == "lapse" and inflight:
                client.zadd(keys.inflight, {rng.choice(inflight): 0})
                scripts.requeue_expired(keys=requeue_keys(keys), args=[10])
            elif op == "preempt" and inflight:
                batch = rng.choice(inflight)
                ids = client.hget(keys.batches, batch).decode().split("|", 1)[1].split(",")
                scripts.preempt(keys=list(keys.shared), args=[batch, 1, rng.choice(ids)])
            elif op == "expire":
                time.sleep(0.01)
                scripts.expire_due(keys=list(keys.shared), args=["list", 100])
            elif op == "switch":
                mode = rng.choice(("requests", "cost", "none"))
                change_policy(client, queue, {"fairness": mode})
                all_listed = all_listed and mode != "none" or not any(
                    client.zcard(keys.pending(level)) for level in range(3))
            if mode != "none":
                try:
                    _index_exact(client, keys, all_listed)
                except AssertionError as exc:
                    raise AssertionError(f"after {history[-12:]} under {mode}") from exc
            else:
                assert not client.exists(keys.fair_who, *(keys.fair_set(i) for i in range(3)))
    print(steps)
    assert min(steps.values()) >= 5, steps
