"""Tenant quotas (docs/tenants.md), measured against one private redis-server:

    python -m bench.tenants                       # 3 producers, 30 s
    python -m bench.tenants --producers 3 --seconds 30 --rate 200 --burst 20

1. What a tenant costs the scripts: Redis' own time (INFO commandstats) per enqueue of 32
   requests, per pop of a 32-request batch and per completion of it, without a tenant
   and with one (its counters kept), side by side.
2. A rate quota across processes: `--producers` processes of one tenant, each submitting
   one request after another as fast as the quota lets it (sleeping retry_after_s when
   refused), over the same `--seconds`; accepted in all against the bound burst + rate x
   seconds.
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
        counts = rate_across(url, args.producers, args.seconds, args.rate, args.burst)
        bound = args.burst + args.rate * args.seconds
        total = sum(counts)
        print(f"\nrps={args.rate} burst={args.burst}, {args.producers} producer processes "
              f"over {args.seconds:g} s: {counts} = {total} accepted; bound {bound:g} "
              f"({(total - bound) / bound * 100:+.1f}%), "
              f"{total / args.seconds:.1f} req/s sustained")
    finally:
        server.close()


if __name__ == "__main__":
    main()
