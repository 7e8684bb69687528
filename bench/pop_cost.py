"""What cost buckets add to a pop: pop_batch.lua's time inside Redis, with and without.

    python -m bench.pop_cost [--pops 20] [--redis-server redis-server]

Starts a private `redis-server` on a free port. For each shape (max_batch_size 64 with 4
cost buckets, 256 with 5) and payload size (1 KB, 20 KB, 50 KB) it fills two fifo queues
with the same requests, whose costs cycle through every bucket: one whose policy names no
cost buckets, one that names them. Then it pops --pops batches of each, in turns (the
order alternating), so that both meet the same load on the host. Each pop's time is the
Redis-side duration of its EVALSHA, from SLOWLOG (slowlog-log-slower-than 0): the client
and the network are not in it. After each pop the queue is topped up again and the
popped requests are deleted (not timed), so every pop meets the same depth:
max_batch_size x (buckets + 1) + max_batch_size waiting. Prints, per point, the least and
the median time of each side and their ratio (with / without).
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator

import orjson
import redis

from scheduler_core.admin import store_policy
from scheduler_core.keys import QueueKeys
from scheduler_core.policy import Policy, Strategy
from scheduler_core.scripts import NewRequest, Scripts, enqueue_call, pop_keys

PAYLOAD_KB = (1, 20, 50)
# (max_batch_size, cost_buckets): 4 and 5 buckets.
SHAPES = ((64, "10,100,1000"), (256, "10,100,1000,10000"))
LEASE_MS = 600_000


@contextlib.contextmanager
def private_redis(server: str) -> Iterator[redis.Redis]:
    """A throw-away redis-server on a free loopback port, no persistence."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as workdir:
        proc = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1",
                                 "--save", "", "--appendonly", "no", "--dir", workdir],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=port)
        try:
            for _ in range(200):
                with contextlib.suppress(redis.ConnectionError):
                    if client.ping():
                        break
                time.sleep(0.05)
            yield client
        finally:
            client.close()
            proc.terminate()
            proc.wait(10)


def bucket_costs(buckets: str) -> list[int]:
    """One cost per bucket: each boundary, and one past the last."""
    bounds = [int(b) for b in buckets.split(",")]
    return [*bounds, bounds[-1] + 1]


def fill(client: redis.Redis, scripts: Scripts, keys: QueueKeys, n: int, envelope: bytes,
         costs: list[int], start: int) -> None:
    requests = [NewRequest(id=uuid.uuid4().hex, priority=1, deadline_ms=0, envelope=envelope,
                           idempotency_key=None, cost=costs[(start + i) % len(costs)],
                           store_result=False) for i in range(n)]
    for first in range(0, n, 1000):
        script_keys, args = enqueue_call(keys, "", requests[first:first + 1000], 60)
        assert int(scripts.enqueue(keys=script_keys, args=args)[0]) == 1


def forget(client: redis.Redis, keys: QueueKeys, reply: list) -> int:
    """Delete a popped batch (it is never run): the next pop meets what the last one did."""
    ids = [reply[i] for i in range(4, len(reply), 5)]
    pipe = client.pipeline(transaction=False)
    pipe.hdel(keys.jobs, *ids)
    pipe.hdel(keys.owner, *ids)
    pipe.zrem(keys.inflight, reply[0])
    pipe.hdel(keys.batches, reply[0])
    pipe.execute()
    return len(ids)


class Side:
    """One queue of a point: its policy (with or without cost buckets), kept at its depth."""

    def __init__(self, client: redis.Redis, batch: int, buckets: str, envelope: bytes,
                 costed: bool) -> None:
        self.client, self.scripts = client, Scripts(client)
        self.keys = QueueKeys(f"popcost-{uuid.uuid4().hex[:8]}")
        self.costs, self.envelope = bucket_costs(buckets), envelope
        store_policy(client, self.keys.queue,
                     Policy(strategy=Strategy.FIFO, max_batch_size=batch, max_queue_size=0,
                            cost_buckets=buckets if costed else ""), replace=True)
        self.added = batch * (len(self.costs) + 1) + batch
        fill(client, self.scripts, self.keys, self.added, envelope, self.costs, 0)
        self.pop = f"evalsha {self.scripts.pop_batch.sha} ".encode()
        self.times: list[float] = []

    def pop_once(self) -> None:
        """One pop, timed by SLOWLOG; then the queue is topped up again (not timed)."""
        self.client.slowlog_reset()
        reply = self.scripts.pop_batch(keys=pop_keys(self.keys), args=["bench", LEASE_MS])
        assert int(reply[0]) > 0, reply[:2]
        took = [e["duration"] for e in self.client.slowlog_get(8)
                if e["command"].lower().startswith(self.pop)]
        assert took, "SLOWLOG holds no pop"
        self.times.append(took[0] / 1000)
        popped = forget(self.client, self.keys, reply)
        fill(self.client, self.scripts, self.keys, popped, self.envelope, self.costs,
             self.added)
        self.added += popped


def pop_times(client: redis.Redis, batch: int, buckets: str, payload_kb: int,
              pops: int) -> tuple[list[float], list[float]]:
    """The Redis-side ms of `pops` pops without cost buckets and `pops` with them, taken
    in turns (the order alternating), so that both meet the same load on the host."""
    envelope = orjson.dumps({"v": 1, "payload": "x" * (payload_kb * 1024)})
    sides = [Side(client, batch, buckets, envelope, costed) for costed in (False, True)]
    client.config_set("slowlog-log-slower-than", 0)
    client.config_set("slowlog-max-len", 128)
    try:
        for i in range(pops):
            for side in (sides if i % 2 else sides[::-1]):
                side.pop_once()
    finally:
        client.config_set("slowlog-log-slower-than", 10000)
        for side in sides:
            client.delete(*side.keys.shared)
    return sides[0].times, sides[1].times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pops", type=int, default=20, help="pops timed per point")
    parser.add_argument("--redis-server", default="redis-server")
    args = parser.parse_args(argv)
    ratios: dict[str, list[float]] = {"min": [], "median": []}
    with private_redis(args.redis_server) as client:
        print(f"redis {client.info('server')['redis_version']}; {args.pops} pops per point; "
              "Redis-side ms per pop (SLOWLOG), min and median")
        print(f"{'batch':>5} {'buckets':>7} {'payload':>7} | {'min without':>11} "
              f"{'with':>7} {'ratio':>5} | {'median without':>14} {'with':>7} {'ratio':>5}")
        for batch, buckets in SHAPES:
            for kb in PAYLOAD_KB:
                without, with_ = pop_times(client, batch, buckets, kb, args.pops)
                lo = min(with_) / min(without)
                mid = statistics.median(with_) / statistics.median(without)
                ratios["min"].append(lo)
                ratios["median"].append(mid)
                print(f"{batch:>5} {len(bucket_costs(buckets)):>7} {kb:>5}KB | "
                      f"{min(without):>11.3f} {min(with_):>7.3f} {lo:>5.2f} | "
                      f"{statistics.median(without):>14.3f} "
                      f"{statistics.median(with_):>7.3f} {mid:>5.2f}", flush=True)
    print(f"worst ratio: {max(ratios['min']):.2f} by the min, {max(ratios['median']):.2f} "
          "by the median (target <= 1.2)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
