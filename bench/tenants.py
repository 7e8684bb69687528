"""Tenant quotas (docs/tenants.md), measured against one private redis-server:

    python -m bench.tenants                       # 3 producers, 30 s
    python -m bench.tenants --producers 3 --seconds 30 --rate 200 --burst 20

1. What a tenant costs the scripts: Redis' own time (INFO commandstats) per enqueue of 32
   requests, per pop of a 32-request batch and per completion of it, without a tenant
   and with one (its counters kept), side by side.
2. Fair share (docs/tenants.md, "Fair share"), driving pop_batch.lua directly:
   weights 2:1 with both tenants backlogged (service ratio, Jain's index over weighted
   service); costs 16 and 256 (weights 1, 2) under fairness=cost, the largest gap in
   weighted cost served after any pop against the bound D = 128; 1,000 backlogged
   tenants: Redis' time per pop under fairness=cost against fairness=none on the same
   backlog, and Redis' memory once drained against before.
3. A rate quota across processes: `--producers` processes of one tenant, each submitting
   one request after another as fast as the quota lets it (sleeping retry_after_s when
   refused), over the same `--seconds`; accepted in all against the bound burst + rate x
   seconds.
Ends with `summary: N of M checks met`.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from batchgate.embedded import EmbeddedRedis
from bench.common import worker_env

CALLS = 300  # of each script, per variant
BATCH = 32

DRIVER = """
import sys, time
from producer import Producer, TenantLimit
url, queue, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
accepted = 0
with Producer(url, queue=queue) as p:
    p.connect()
    print("ready", flush=True)
    start = float(sys.stdin.readline())
    time.sleep(max(0.0, start - time.time()))
    while time.time() < start + seconds:
        try:
            p.submit(0, tenant="acme")
            accepted += 1
        except TenantLimit as exc:
            time.sleep(min(exc.retry_after_s or 0.01, max(0.0, start + seconds - time.time())))
print(accepted)
"""


def script_cost(url: str, tenant: str | None) -> dict[str, float]:
    """Redis µs per call of enqueue, pop_batch and complete, BATCH requests each."""
    import redis

    from scheduler_core.admin import store_policy
    from scheduler_core.keys import QueueKeys
    from scheduler_core.policy import Policy
    from scheduler_core.scripts import (
        NewRequest,
        Scripts,
        complete_keys,
        enqueue_call,
        pop_keys,
    )
    from scheduler_core.wire import encode_request

    client = redis.Redis.from_url(url)
    queue = f"cost-{tenant or 'none'}"
    keys, scripts = QueueKeys(queue), Scripts(client)
    store_policy(client, queue, Policy(strategy="fifo", max_batch_size=BATCH), replace=True)
    envelope = encode_request({"x": 1}, tenant=tenant)
    spent = {"enqueue": 0, "pop_batch": 0, "complete": 0}

    def timed(name: str, script_keys: list[str], args: list) -> list:
        client.config_resetstat()
        reply = getattr(scripts, name)(keys=script_keys, args=args)
        spent[name] += client.info("commandstats")["cmdstat_evalsha"]["usec"]
        return reply

    for n in range(CALLS):
        requests = [NewRequest(f"r{n}x{i}", 1, 0, envelope) for i in range(BATCH)]
        timed("enqueue", *enqueue_call(keys, "p", requests, 60))
    for _ in range(CALLS):
        reply = timed("pop_batch", pop_keys(keys), ["c1", 60_000])
        ids = [item.decode() for item in reply[4::5]]
        args = [reply[0], 60, len(ids)]
        for rid in ids:
            args += [rid, "ok", b'{"v":1,"id":"x","ok":true,"value":1}']
        timed("complete", complete_keys(keys, [(rid, "p") for rid in ids]), args)
    client.close()
    return {name: total / CALLS for name, total in spent.items()}


def _fair_queue(url: str, queue: str, **policy):
    import redis

    from scheduler_core.admin import store_policy
    from scheduler_core.keys import QueueKeys
    from scheduler_core.policy import Policy
    from scheduler_core.scripts import Scripts

    client = redis.Redis.from_url(url)
    store_policy(client, queue, Policy(strategy="fifo", **policy), replace=True)
    return client, Scripts(client), QueueKeys(queue)


def _fill(url: str, queue: str, groups: list[tuple[str, int, int]]) -> dict[str, str]:
    """Enqueue (tenant, count, cost) groups, interleaved in chunks; id -> tenant."""
    from producer import Producer

    who: dict[str, str] = {}
    with Producer(url, queue=queue) as p:
        left = {t: n for t, n, _ in groups}
        while any(left.values()):
            for tenant, _, cost in groups:
                k = min(100, left[tenant])
                if k:
                    for h in p.submit_many([0] * k, tenant=tenant, cost=cost):
                        who[h.id] = tenant
                    left[tenant] -= k
    return who


def _pop(client, scripts, keys) -> list[str]:
    from scheduler_core.scripts import pop_keys

    reply = scripts.pop_batch(keys=pop_keys(keys), args=["c1", 600_000])
    return [x.decode() for x in reply[4::5]] if int(reply[0]) > 0 else []


def jain(values: list[float]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values)) if values else 1.0


def weights_run(url: str) -> tuple[float, float]:
    """Weights 2:1, both backlogged, fairness=requests, batches of 32: the service ratio
    and Jain's index over weighted service, over 40 pops."""
    client, scripts, keys = _fair_queue(url, "fair-w", max_batch_size=32, fairness="requests",
                                        tenant_quotas="gold:weight=2")
    who = _fill(url, "fair-w", [("gold", 2000, 1), ("base", 2000, 1)])
    served = {"gold": 0, "base": 0}
    for _ in range(40):
        for rid in _pop(client, scripts, keys):
            served[who[rid]] += 1
    client.close()
    return served["gold"] / served["base"], jain([served["gold"] / 2, served["base"] / 1])


def gap_run(url: str) -> tuple[float, float]:
    """Costs 16 (weight 1) and 256 (weight 2), fairness=cost, max_batch_cost 1024: the
    largest gap in weighted cost served after any pop while both are backlogged, and the
    bound D."""
    client, scripts, keys = _fair_queue(url, "fair-g", max_batch_size=32, fairness="cost",
                                        max_batch_cost=1024, tenant_quotas="heavy:weight=2")
    who = _fill(url, "fair-g", [("light", 3000, 16), ("heavy", 300, 256)])
    unit = {"light": 16 / 1, "heavy": 256 / 2}
    served, worst = {"light": 0.0, "heavy": 0.0}, 0.0
    while client.zcard(keys.fair_counters(1)) == 2:
        for rid in _pop(client, scripts, keys):
            served[who[rid]] += unit[who[rid]]
        worst = max(worst, abs(served["light"] - served["heavy"]))
    client.close()
    return worst, max(unit.values())


def many_tenants(url: str, fairness: str, tenants: int = 1000, each: int = 20
                 ) -> tuple[float, int, int]:
    """Redis µs per pop of 32 from `tenants` backlogged tenants (`each` requests each),
    Redis' memory after draining (and completing) them minus before, and the keys of the
    fair index left."""
    from scheduler_core.scripts import complete_keys

    queue = f"fair-many-{fairness}"
    client, scripts, keys = _fair_queue(url, queue, max_batch_size=32, fairness=fairness)
    client.memory_purge() if hasattr(client, "memory_purge") else None
    before = client.info("memory")["used_memory"]
    _fill(url, queue, [(f"t{i:04d}", each, 1 + i % 7) for i in range(tenants)])
    spent = pops = 0
    while True:
        client.config_resetstat()
        ids = _pop(client, scripts, keys)
        if not ids:
            break
        if pops < 200:
            spent += client.info("commandstats")["cmdstat_evalsha"]["usec"]
        pops += 1
        batch = client.zrange(keys.inflight, 0, 0)[0]
        args = [batch, 60, len(ids)]
        for rid in ids:
            args += [rid, "ok", b'{"v":1,"id":"x","ok":true,"value":1}']
        scripts.complete(keys=complete_keys(keys, [(rid, "p") for rid in ids]), args=args)
    for key in (keys.tenants, keys.arrivals, keys.samples if hasattr(keys, "samples") else None,
                keys.wait_samples, keys.e2e_samples, keys.stats, keys.consumers):
        if key:
            client.delete(key)  # counters and samples kept by design, not the index
    after = client.info("memory")["used_memory"]
    left = sum(client.exists(k) for k in keys.shared[36:43])
    client.close()
    return spent / min(pops, 200), after - before, left


def rate_across(url: str, producers: int, seconds: float, rate: int, burst: int,
                queue: str = "rated") -> list[int]:
    """Requests each of `producers` processes of tenant acme got into `queue` over the
    same span of `seconds` (the queue's policy set to that rate quota)."""
    import redis

    from scheduler_core.admin import change_policy

    client = redis.Redis.from_url(url)
    change_policy(client, queue, {"strategy": "fifo",
                                  "tenant_quotas": f"acme:rps={rate},burst={burst}"})
    client.close()
    procs = [subprocess.Popen([sys.executable, "-c", DRIVER, url, queue, str(seconds)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=worker_env()) for _ in range(producers)]
    for proc in procs:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    start = f"{time.time() + 0.5}\n"
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write(start)
        proc.stdin.flush()
    return [int(proc.communicate(timeout=seconds + 60)[0]) for proc in procs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--producers", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--rate", type=int, default=200, help="the tenant's rps")
    parser.add_argument("--burst", type=int, default=20)
    args = parser.parse_args()
    server = EmbeddedRedis()
    try:
        url = server.url
        print(f"script time in Redis per call, {BATCH} requests (µs), {CALLS} calls each")
        print(f"{'':>14}{'enqueue':>10}{'pop_batch':>11}{'complete':>10}")
        for label, tenant in (("no tenant", None), ("tenant acme", "acme")):
            cost = script_cost(url, tenant)
            print(f"{label:>14}{cost['enqueue']:>10.1f}{cost['pop_batch']:>11.1f}"
                  f"{cost['complete']:>10.1f}")
        checks: list[tuple[str, bool]] = []
        ratio, index = weights_run(url)
        print(f"\nweights 2:1, both backlogged, 40 pops of 32: service ratio {ratio:.3f}, "
              f"Jain's index {index:.4f}")
        checks += [("weights 2:1 -> ratio 2.0 +-5%", abs(ratio - 2) <= 0.1),
                   ("Jain >= 0.99", index >= 0.99)]
        worst, bound_d = gap_run(url)
        print(f"costs 16/256, weights 1/2, fairness=cost: largest weighted gap {worst:g} "
              f"(bound {bound_d:g})")
        checks.append(("mixed costs gap <= bound", worst <= bound_d))
        none_us, none_mem, _ = many_tenants(url, "none")
        cost_us, cost_mem, left = many_tenants(url, "cost")
        print(f"1,000 backlogged tenants, pop of 32: {none_us:.1f} µs (none) vs "
              f"{cost_us:.1f} µs (cost) = {cost_us / none_us:.2f}x; used_memory after drain "
              f"{none_mem:+,} (none) / {cost_mem:+,} (cost) bytes vs before; fair index keys "
              f"left: {left}")
        checks += [("1,000 tenants pop cost <= 1.5x none", cost_us <= 1.5 * none_us),
                   ("drained: no fair index key, memory as none (+256 KiB)",
                    left == 0 and cost_mem <= none_mem + 256 * 1024)]
        counts = rate_across(url, args.producers, args.seconds, args.rate, args.burst)
        bound = args.burst + args.rate * args.seconds
        total = sum(counts)
        print(f"\nrps={args.rate} burst={args.burst}, {args.producers} producer processes "
              f"over {args.seconds:g} s: {counts} = {total} accepted; bound {bound:g} "
              f"({(total - bound) / bound * 100:+.1f}%), "
              f"{total / args.seconds:.1f} req/s sustained")
        checks.append(("rate limit sustained +-5%", abs(total - bound) <= 0.05 * bound))
        for name, ok in checks:
            print(f"  {'met' if ok else 'NOT met'}: {name}")
        print(f"summary: {sum(ok for _, ok in checks)} of {len(checks)} checks met")
    finally:
        server.close()


if __name__ == "__main__":
    main()
