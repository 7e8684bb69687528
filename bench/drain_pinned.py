"""One shard's capacity with Redis on a core of its own: a no-op backlog drained by one
consumer, batchgate against the raw-Redis ceiling, side by side in one run.

    python -m bench.drain_pinned [--requests 30000] [--rounds 3] [--json FILE]

On a 2-core host the throughput section shares both cores between Redis, the consumer and
the producer, so its ratio says as much about the host as about the code. Here Redis is
pinned to CPU 0 and the consumer (and this process) to CPU 1, as on a host where Redis has
a core to itself, and nobody reads the results while the backlog drains (they stay in the
producer's inbox list). Each round drains `--requests` no-op requests (dynamic, batches of
32) with one `batchgate consumer` process, as the CLI starts it, then twice as many with
the raw ceiling's consumer (`workers/raw_consumer.py`: LPOP 32, RPUSH each result), on one
private redis-server. Reported per round: requests/s from the first request answered to
the last, Redis's CPU per request over the drain and how busy it was, and the ratio.
Needs Linux (sched_setaffinity) and two CPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from batchgate.embedded import embedded_redis
from batchgate.processes import ChildProcess, batchgate_argv, wait_all_ready
from bench.common import CHUNK, redis_cpu_s, worker_env
from bench.workers.gate import READY_LINE
from producer import Producer
from scheduler_core.admin import ensure_policy
from scheduler_core.keys import QueueKeys

REDIS_CPU, CLIENT_CPU = 0, 1
POLICY = {"strategy": "dynamic", "max_batch_size": 32, "max_queue_delay_ms": 0}


def drain(client: redis.Redis, done: Callable[[], int], total: int,
          timeout_s: float = 300) -> dict[str, float]:
    """Poll `done()` until it reaches `total`: the rate from the first answer to the last,
    and Redis's CPU over that span."""
    deadline = time.monotonic() + timeout_s
    first: tuple[float, int, float] | None = None
    while time.monotonic() < deadline:
        n = done()
        if n and first is None:
            first = (time.monotonic(), n, redis_cpu_s(client))
        if n >= total:
            break
        time.sleep(0.002)
    else:
        raise RuntimeError(f"{done()} of {total} answered after {timeout_s} s")
    assert first is not None
    span, count = time.monotonic() - first[0], total - first[1]
    redis_s = redis_cpu_s(client) - first[2]
    return {"req_per_s": round(count / span), "redis_cpu_us_per_request":
            round(redis_s / count * 1e6, 1), "redis_busy": round(redis_s / span, 2)}


def batchgate_round(url: str, client: redis.Redis, total: int, work: Path,
                    queue: str) -> dict[str, float]:
    ensure_policy(client, queue, POLICY)
    with Producer(url, queue) as producer:
        for first in range(0, total, CHUNK):
            producer.submit_many([{"i": i} for i in range(first, min(total, first + CHUNK))])
    consumer = ChildProcess([*batchgate_argv(), "--log-level", "WARNING", "consumer",
                             "--redis-url", url, "--queue", queue, "--model",
                             "consumer.models:noop"], work / f"{queue}.log", b"ready on queue",
                            env=worker_env())
    try:
        os.sched_setaffinity(consumer.proc.pid, {CLIENT_CPU})
        stats = QueueKeys(queue).stats
        return drain(client, lambda: int(client.hget(stats, "processed") or 0), total)
    finally:
        consumer.kill()


def raw_round(url: str, client: redis.Redis, total: int, work: Path,
              name: str) -> dict[str, float]:
    key, inbox, go = f"{name}:q", f"{name}:inbox", f"{name}:go"
    for first in range(0, total, CHUNK):
        client.rpush(key, *(b"%d" % i for i in range(first, min(total, first + CHUNK))))
    worker = ChildProcess([sys.executable, "-m", "bench.workers.raw_consumer",
                           "--redis-url", url, "--queue", key, "--inbox", inbox,
                           "--batch", "32", "--go", go], work / f"{name}.log", READY_LINE,
                          env=worker_env())
    try:
        os.sched_setaffinity(worker.proc.pid, {CLIENT_CPU})
        wait_all_ready([worker], 60)
        client.rpush(go, "go")
        return drain(client, lambda: client.llen(inbox), total)
    finally:
        worker.kill()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=30_000,
                        help="batchgate requests per round (the raw ceiling drains twice as many)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.rounds < 1:
        parser.error("--requests and --rounds must be at least 1")
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("drain_pinned needs two CPUs: Redis on one, the consumer on the other")
    os.sched_setaffinity(0, {CLIENT_CPU})  # the poller, and every child it starts
    rows: list[dict[str, Any]] = []
    with embedded_redis() as url, tempfile.TemporaryDirectory() as tmp:
        client = redis.Redis.from_url(url)
        pid = int(client.info("server")["process_id"])
        os.sched_setaffinity(pid, {REDIS_CPU})
        for n in range(1, args.rounds + 1):
            ours = batchgate_round(url, client, args.requests, Path(tmp), f"pinned{n}")
            raw = raw_round(url, client, 2 * args.requests, Path(tmp), f"raw{n}")
            rows.append({"round": n, "batchgate": ours, "raw": raw,
                         "ratio": round(ours["req_per_s"] / raw["req_per_s"], 3)})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        client.close()
    print("| round | batchgate req/s | Redis µs/req (busy) | raw req/s | Redis µs/req (busy) | "
          "ratio |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        b, r = row["batchgate"], row["raw"]
        print(f"| {row['round']} | {b['req_per_s']:,} | {b['redis_cpu_us_per_request']:g} "
              f"({b['redis_busy']:.0%}) | {r['req_per_s']:,} | "
              f"{r['redis_cpu_us_per_request']:g} ({r['redis_busy']:.0%}) | {row['ratio']} |")
    print(f"median ratio {statistics.median(row['ratio'] for row in rows)}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
