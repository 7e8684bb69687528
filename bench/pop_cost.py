"""What cost buckets add to a pop: pop_batch.lua's time inside Redis, with and without.

    python -m bench.pop_cost [--pops 40] [--kind fifo] [--kb 1] [--batch 64]
                             [--redis-server redis-server]

Starts a private `redis-server` on a free port. For each queue kind, shape (max_batch_size
64 with 4 cost buckets, 256 with 5) and payload size (1 KB, 20 KB, 50 KB) it fills two
queues with the same requests, whose costs cycle through every bucket: one whose policy
names no cost buckets, one that names them. The kinds:

  fifo    fifo, every request NORMAL (one level waits)
  mixed   fifo, priorities cycling HIGH, NORMAL, LOW (the pop merges three levels)
  aging   priority with aging on, priorities cycling: the pop takes HIGH while NORMAL
          and LOW wait (aging_ms is 10 minutes, so that both queues meet the same levels:
          the pop looks for requests to promote and finds none)

Then it pops --pops batches of each, in turns (the order alternating), so that both meet
the same load on the host. Each pop is measured twice: the CPU time Redis' main thread
spent on it (INFO cpu, used_cpu_user_main_thread + used_cpu_sys_main_thread, read just
before and just after; sending the reply is in it), which time slices lost to other
processes on a busy host do not inflate, and the duration of its EVALSHA from SLOWLOG
(slowlog-log-slower-than 0: the client and the network are not in it), which they do.
After each pop the queue is topped up again with as many new requests (costs cycling on,
each at the level of a popped one) and the popped ones are deleted (not timed), so every
pop meets the same depth, max_batch_size x (buckets + 1) + max_batch_size waiting, and
the same mix of levels (aging: 3 x that depth, a third of it HIGH). Prints, per point,
the least and the median CPU time of each side and their ratios (with / without), then
the SLOWLOG ratios, and checks that both CPU ratios are within --target (1.2).
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
from dataclasses import dataclass

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
AGING_MS = 600_000


@dataclass(frozen=True)
class Kind:
    """A queue shape: its strategy, aging, and the priorities its requests cycle through."""

    strategy: Strategy
    priorities: tuple[int, ...]
    aging_ms: int = 0
    # Depth in units of max_batch_size x (buckets + 2): the level the pop takes from holds
    # at least that many, so that each bucket makes a full batch on both sides.
    depth: int = 1


KINDS = {"fifo": Kind(Strategy.FIFO, (1,)),
         "mixed": Kind(Strategy.FIFO, (0, 1, 2)),
         "aging": Kind(Strategy.PRIORITY, (0, 1, 2), AGING_MS, depth=3)}


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


def main_thread_cpu_ms(client: redis.Redis) -> float:
    """CPU time Redis' main thread has used (ms): user + system."""
    cpu = client.info("cpu")
    return (cpu["used_cpu_user_main_thread"] + cpu["used_cpu_sys_main_thread"]) * 1000


def forget(client: redis.Redis, keys: QueueKeys, reply: list) -> list[int]:
    """Delete a popped batch (it is never run): the next pop meets what the last one did.
    Returns the levels its requests were popped from."""
    ids = [reply[i] for i in range(4, len(reply), 5)]
    pipe = client.pipeline(transaction=False)
    pipe.hdel(keys.jobs, *ids)
    pipe.hdel(keys.owner, *ids)
    pipe.zrem(keys.inflight, reply[0])
    pipe.hdel(keys.batches, reply[0])
    pipe.execute()
    return [int(reply[i]) for i in range(8, len(reply), 5)]


class Side:
    """One queue of a point: its policy (with or without cost buckets), kept at its depth."""

    def __init__(self, client: redis.Redis, kind: Kind, batch: int, buckets: str,
                 envelope: bytes, costed: bool) -> None:
        self.client, self.scripts, self.kind = client, Scripts(client), kind
        self.keys = QueueKeys(f"popcost-{uuid.uuid4().hex[:8]}")
        self.costs, self.envelope = bucket_costs(buckets), envelope
        store_policy(client, self.keys.queue,
                     Policy(strategy=kind.strategy, max_batch_size=batch, max_queue_size=0,
                            aging_ms=kind.aging_ms, cost_buckets=buckets if costed else ""),
                     replace=True)
        self.added = 0
        self.fill(kind.depth * batch * (len(self.costs) + 2))
        self.pop = f"evalsha {self.scripts.pop_batch.sha} ".encode()
        self.cpu: list[float] = []  # ms of Redis' main thread per pop
        self.times: list[float] = []  # ms per pop by SLOWLOG

    def fill(self, n: int, levels: list[int] | None = None) -> None:
        """n new requests, their costs cycling on from the last one's; their priorities
        `levels`, or cycling."""
        prios, costs = self.kind.priorities, self.costs
        if levels is None:
            levels = [prios[i % len(prios)] for i in range(n)]
        requests = [NewRequest(id=uuid.uuid4().hex, priority=levels[k], deadline_ms=0,
                               envelope=self.envelope, idempotency_key=None,
                               cost=costs[(self.added + k) % len(costs)], store_result=False)
                    for k in range(n)]
        for first in range(0, n, 1000):
            script_keys, args = enqueue_call(self.keys, "", requests[first:first + 1000], 60)
            assert int(self.scripts.enqueue(keys=script_keys, args=args)[0]) == 1
        self.added += n

    def pop_once(self) -> None:
        """One pop, timed by INFO cpu and SLOWLOG; then the queue is topped up again (not
        timed)."""
        self.client.slowlog_reset()
        before = main_thread_cpu_ms(self.client)
        reply = self.scripts.pop_batch(keys=pop_keys(self.keys), args=["bench", LEASE_MS])
        self.cpu.append(main_thread_cpu_ms(self.client) - before)
        assert int(reply[0]) > 0, reply[:2]
        took = [e["duration"] for e in self.client.slowlog_get(8)
                if e["command"].lower().startswith(self.pop)]
        assert took, "SLOWLOG holds no pop"
        self.times.append(took[0] / 1000)
        levels = forget(self.client, self.keys, reply)
        self.fill(len(levels), levels)


def pop_times(client: redis.Redis, kind: Kind, batch: int, buckets: str, payload_kb: int,
              pops: int) -> tuple[Side, Side]:
    """`pops` pops without cost buckets and `pops` with them, taken in turns (the order
    alternating), so that both meet the same load on the host: the two sides, timed."""
    envelope = orjson.dumps({"v": 1, "payload": "x" * (payload_kb * 1024)})
    sides = [Side(client, kind, batch, buckets, envelope, costed) for costed in (False, True)]
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
    return sides[0], sides[1]


def ratios(without: list[float], with_: list[float]) -> tuple[float, float]:
    """with / without, by the least and by the median."""
    return (min(with_) / min(without),
            statistics.median(with_) / statistics.median(without))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pops", type=int, default=40, help="pops timed per point and side")
    parser.add_argument("--kind", choices=sorted(KINDS), action="append",
                        help="queue kinds (repeatable; default: all)")
    parser.add_argument("--kb", type=int, choices=PAYLOAD_KB, action="append",
                        help="payload sizes in KB (repeatable; default: all)")
    parser.add_argument("--batch", type=int, choices=[b for b, _ in SHAPES], action="append",
                        help="shapes by max_batch_size (repeatable; default: all)")
    parser.add_argument("--target", type=float, default=1.2, help="ratio checked per point")
    parser.add_argument("--redis-server", default="redis-server")
    args = parser.parse_args(argv)
    kinds, sizes = args.kind or list(KINDS), args.kb or list(PAYLOAD_KB)
    shapes = [s for s in SHAPES if not args.batch or s[0] in args.batch]
    met = checks = 0
    with private_redis(args.redis_server) as client:
        print(f"redis {client.info('server')['redis_version']}; {args.pops} pops per point "
              "and side, in turns; ms per pop: Redis' main thread CPU (least, median), "
              "then the ratios by SLOWLOG")
        print(f"{'kind':>5} {'batch':>5} {'buckets':>7} {'payload':>7} | "
              f"{'least without':>13} {'with':>7} {'ratio':>5} | "
              f"{'median without':>14} {'with':>7} {'ratio':>5} | "
              f"{'slowlog least':>13} {'median':>6} | check")
        for name in kinds:
            for batch, buckets in shapes:
                for kb in sizes:
                    without, with_ = pop_times(client, KINDS[name], batch, buckets, kb,
                                               args.pops)
                    lo, mid = ratios(without.cpu, with_.cpu)
                    wall_lo, wall_mid = ratios(without.times, with_.times)
                    ok = max(lo, mid) <= args.target
                    checks, met = checks + 1, met + ok
                    print(f"{name:>5} {batch:>5} {len(bucket_costs(buckets)):>7} {kb:>5}KB | "
                          f"{min(without.cpu):>13.3f} {min(with_.cpu):>7.3f} {lo:>5.2f} | "
                          f"{statistics.median(without.cpu):>14.3f} "
                          f"{statistics.median(with_.cpu):>7.3f} {mid:>5.2f} | "
                          f"{wall_lo:>13.2f} {wall_mid:>6.2f} | "
                          f"{'ok' if ok else 'OVER'} (<= {args.target})", flush=True)
    print(f"summary: {met} of {checks} checks met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
