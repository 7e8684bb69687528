"""Tenant quotas (docs/tenants.md), measured against one private redis-server:

    python -m bench.tenants                       # 3 producers, 30 s
    python -m bench.tenants --producers 3 --seconds 30 --rate 200 --burst 20
    python -m bench.tenants --seconds 0           # without the rate quota's run

1. What a tenant costs the scripts: Redis' own time (INFO commandstats) per enqueue of 32
   requests, per pop of a 32-request batch and per completion of it, without a tenant
   and with one (its counters kept), side by side.
2. Fair share (docs/tenants.md, "Fair share"), driving pop_batch.lua directly:
   weights 2:1 with both tenants backlogged (service ratio, Jain's index over weighted
   service); costs 16 and 256 (weights 1, 2) under fairness=cost, the largest gap in
   weighted cost served after any pop against the bound D = 128; 1,000 backlogged
   tenants: Redis' time per pop under fairness=cost against fairness=none on the same
   backlog, and what a drain leaves: the keys (with MEMORY USAGE each) and used_memory
   once they are deleted, against before.
3. A flood, through a real `batchgate consumer` (flood_run): a light tenant at 10% of the
   consumer's capacity alone, then beside a tenant at 5x under fairness=none and =cost
   (`--flood-seconds` each): the light tenant's p99 and the requests served per second.
4. A rate quota across processes: `--producers` processes of one tenant, each submitting
   one request after another as fast as the quota lets it (sleeping retry_after_s when
   refused), over the same `--seconds`; accepted in all against the bound burst + rate x
   seconds.
Ends with `summary: N of M checks met`.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from batchgate.embedded import EmbeddedRedis
from batchgate.processes import ChildProcess, wait_all_ready
from bench.common import redis_cpu_s, worker_env

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
                 ) -> tuple[float, dict[str, int], int]:
    """The median of Redis' µs per pop of 32 from `tenants` backlogged tenants (`each`
    requests each), over the whole drain (each batch completed); the keys the drain leaves
    (name after the queue's prefix -> MEMORY USAGE); and Redis' used_memory once those are
    deleted (after MEMORY PURGE), minus before the fill."""
    from scheduler_core.scripts import complete_keys

    queue = f"fair-many-{fairness}-{tenants}"
    client, scripts, keys = _fair_queue(url, queue, max_batch_size=32, fairness=fairness)
    prefix = f"{{bg:{queue}}}"
    existing = set(client.scan_iter(match=prefix + "*"))
    client.memory_purge()
    before = client.info("memory")["used_memory"]
    _fill(url, queue, [(f"t{i:04d}", each, 1 + i % 7) for i in range(tenants)])
    spent = []
    while True:
        client.config_resetstat()
        ids = _pop(client, scripts, keys)
        if not ids:
            break
        spent.append(client.info("commandstats")["cmdstat_evalsha"]["usec"])
        batch = client.zrange(keys.inflight, 0, 0)[0]
        args = [batch, 60, len(ids)]
        for rid in ids:
            args += [rid, "ok", b'{"v":1,"id":"x","ok":true,"value":1}']
        scripts.complete(keys=complete_keys(keys, [(rid, "p") for rid in ids]), args=args)
    left = {k.decode()[len(prefix):]: client.memory_usage(k, samples=0)
            for k in set(client.scan_iter(match=prefix + "*")) - existing}
    client.delete(*[prefix + k for k in left])
    client.memory_purge()
    after = client.info("memory")["used_memory"]
    client.close()
    return statistics.median(spent), left, after - before


# The flood section: one `batchgate consumer` process on the synthetic model t(b) = BASE_MS
# + PER_ITEM_MS x b, batches of FLOOD_BATCH on NORMAL (strategy priority) released when full
# or after FLOOD_DELAY_MS; its capacity is FLOOD_BATCH / t(FLOOD_BATCH).
FLOOD_BATCH, FLOOD_DELAY_MS, BASE_MS, PER_ITEM_MS = 16, 30, 5.0, 0.5
CAPACITY = FLOOD_BATCH / (BASE_MS + PER_ITEM_MS * FLOOD_BATCH) * 1000  # requests/s


def flood_run(url: str, fairness: str, seconds: float, flood_x: float, light_x: float,
              out: Path) -> dict[str, float]:
    """Tenant `flood` at flood_x x CAPACITY and tenant `light` at light_x x CAPACITY, both
    NORMAL, evenly spaced, for `seconds`, on a queue of its own: the light tenant's p50 and
    p99 (ms; a request still waiting 2 s after the end counts as waited until then, so a
    p99 so marked is a lower bound) and the requests served per second while both send."""
    import redis

    from producer import Producer
    from scheduler_core.admin import store_policy
    from scheduler_core.policy import Policy

    queue = f"flood-{fairness}-{flood_x:g}"
    client = redis.Redis.from_url(url)
    store_policy(client, queue, Policy(strategy="priority", max_batch_size=FLOOD_BATCH,
                                       max_queue_delay_ms=FLOOD_DELAY_MS, fairness=fairness),
                 replace=True)
    consumer = ChildProcess(
        [sys.executable, "-m", "batchgate.cli", "consumer", "--redis-url", url, "--queue",
         queue, "--model", "consumer.models:synthetic", "--model-arg", f"base_ms={BASE_MS}",
         "--model-arg", f"per_item_ms={PER_ITEM_MS}"], out / f"consumer-{queue}.log",
        b"ready on queue", env=worker_env())
    wait_all_ready([consumer], 60)
    done: dict[str, float] = {}
    lock = threading.Lock()

    def on_result(result) -> None:
        with lock:
            done[result.id] = time.perf_counter()

    light_sent: dict[str, float] = {}
    producer = Producer(url, queue=queue, on_result=on_result).connect()
    gaps = {"flood": 1 / (flood_x * CAPACITY) if flood_x else None,
            "light": 1 / (light_x * CAPACITY)}
    start, cpu = time.perf_counter(), redis_cpu_s(client)
    sent = {"flood": 0, "light": 0}
    try:
        while (now := time.perf_counter() - start) < seconds:
            for tenant, gap in gaps.items():
                due = int(now / gap) + 1 - sent[tenant] if gap else 0
                if due > 0:
                    at = time.perf_counter()
                    handles = producer.submit_many([0] * due, tenant=tenant)
                    sent[tenant] += due
                    if tenant == "light":
                        for h in handles:
                            light_sent[h.id] = at
            time.sleep(0.001)
        end = time.perf_counter()
        limit = end + 2.0
        while time.perf_counter() < limit and not all(i in done for i in light_sent):
            time.sleep(0.02)
        stop, cpu = time.perf_counter(), redis_cpu_s(client) - cpu
    finally:
        producer.close()
        consumer.terminate()
        consumer.reap()
        for key in client.scan_iter(match=f"{{bg:{queue}}}*", count=1000):
            client.delete(key)
        client.close()
    waits = sorted((done.get(i, stop) - at) * 1000 for i, at in light_sent.items())
    served = sum(1 for t in done.values() if start + 0.5 <= t <= end)
    return {"p50": statistics.median(waits), "p99": waits[int(0.99 * (len(waits) - 1))],
            "censored": sum(1 for i in light_sent if i not in done),
            "rate": served / (end - start - 0.5), "light": len(light_sent),
            "redis_us": cpu * 1e6 / max(1, len(done))}


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


def report(checks: list[tuple[str, bool]]) -> None:
    for name, ok in checks:
        print(f"  {'met' if ok else 'NOT met'}: {name}")
    print(f"summary: {sum(ok for _, ok in checks)} of {len(checks)} checks met")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--producers", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=30.0,
                        help="the rate quota's run (0: skip it)")
    parser.add_argument("--flood-seconds", type=float, default=4.0,
                        help="each of the flood section's three runs")
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
        many_tenants(url, "cost", tenants=50, each=2)  # scripts loaded, buffers grown
        none_us, none_left, none_mem = many_tenants(url, "none")
        cost_us, cost_left, cost_mem = many_tenants(url, "cost")
        print(f"1,000 backlogged tenants, pop of 32 (median over the drain): {none_us:.0f} µs "
              f"(none) vs {cost_us:.0f} µs (cost) = {cost_us / none_us:.2f}x")
        print(f"  drained: keys left {sorted(cost_left)} (cost), the same as none: "
              f"{sorted(cost_left) == sorted(none_left)}; their MEMORY USAGE "
              f"{sum(cost_left.values()):,} (cost) / {sum(none_left.values()):,} (none) bytes; "
              f"used_memory once they are deleted {cost_mem:+,} (cost) / {none_mem:+,} (none)")
        checks += [("1,000 tenants pop cost <= 1.5x none", cost_us <= 1.5 * none_us),
                   ("drained: the keys (and bytes, +-1%) none leaves, no fair index",
                    sorted(cost_left) == sorted(none_left)
                    and abs(sum(cost_left.values()) - sum(none_left.values()))
                    <= 0.01 * sum(none_left.values())),
                   ("drained: used_memory at most 64 KiB above before", cost_mem <= 64 * 1024)]
        with tempfile.TemporaryDirectory() as tmp:
            light = {}
            for label, fairness, flood_x in (("alone", "cost", 0.0), ("none", "none", 5.0),
                                             ("cost", "cost", 5.0)):
                light[label] = flood_run(url, fairness, args.flood_seconds, flood_x, 0.1,
                                         Path(tmp))
        print(f"\nlight tenant at 10% of capacity ({CAPACITY:.0f} req/s: batches of "
              f"{FLOOD_BATCH}, t(b) = {BASE_MS:g} + {PER_ITEM_MS:g}·b ms, delay "
              f"{FLOOD_DELAY_MS} ms), flood at 5x, NORMAL, {args.flood_seconds:g} s each:")
        for label, r in light.items():
            bound = " (lower bound: some never ran)" if r["censored"] else ""
            print(f"  {label:>5}: light p50 {r['p50']:.1f} ms, p99 {r['p99']:.1f} ms{bound}; "
                  f"served {r['rate']:.0f} req/s; Redis CPU {r['redis_us']:.0f} µs per request")
        alone, none, cost = light["alone"], light["none"], light["cost"]
        print(f"  light p99: cost/alone {cost['p99'] / alone['p99']:.2f}x, none/alone "
              f"{none['p99'] / alone['p99']:.2f}x; throughput cost/none "
              f"{cost['rate'] / none['rate']:.3f}")
        checks += [("flood: light p99 under cost <= 1.5x alone", cost["p99"] <= 1.5 * alone["p99"]),
                   ("flood: light p99 under none > 1.5x alone (grows with the flood)",
                    none["p99"] > 1.5 * alone["p99"]),
                   ("flood: throughput cost >= 0.97x none", cost["rate"] >= 0.97 * none["rate"])]
        if args.seconds <= 0:
            return report(checks)
        counts = rate_across(url, args.producers, args.seconds, args.rate, args.burst)
        bound = args.burst + args.rate * args.seconds
        total = sum(counts)
        print(f"\nrps={args.rate} burst={args.burst}, {args.producers} producer processes "
              f"over {args.seconds:g} s: {counts} = {total} accepted; bound {bound:g} "
              f"({(total - bound) / bound * 100:+.1f}%), "
              f"{total / args.seconds:.1f} req/s sustained")
        checks.append(("rate limit sustained +-5%", abs(total - bound) <= 0.05 * bound))
        report(checks)
    finally:
        server.close()


if __name__ == "__main__":
    main()
