"""A sharded queue from 1 to 3 shards on a real Redis Cluster: what each shard costs
Redis, which is what scales when every primary has a core of its own.

    python -m bench.shard_scaling [--shards 1,2,3] [--per-shard 30000]

A 3-primary cluster (no replicas) on free ports; for S shards, a queue whose S shards
fall on S different primaries (dynamic, batches of up to 32, no queue delay), the no-op
model. A `ShardedProducer` (round robin) enqueues `--per-shard` × S requests while no
consumer runs, then S `batchgate consumer` processes (each serving every shard, as the
CLI starts them) drain the backlog. Reported per S: requests/s from the consumers' start
to the last result seen by the producer (every process here shares this machine's cores,
so this does not scale on 2 cores), each primary's Redis CPU per request of its shard
(`INFO cpu` over enqueue and drain), and the consumers' and the producer's CPU per
request. `--json` writes the rows too.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from batchgate.processes import ChildProcess, batchgate_argv, wait_all_ready
from bench.common import CHUNK, redis_cpu_s
from bench.topology import EmbeddedCluster
from producer import ShardedProducer
from scheduler_core.admin import ensure_policy
from scheduler_core.connection import connect
from scheduler_core.keys import QueueKeys
from scheduler_core.shards import shard_names

POLICY = {"strategy": "dynamic", "max_batch_size": 32, "max_queue_delay_ms": 0}


def spread_queue(cluster: EmbeddedCluster, shards: int) -> str:
    """A queue name whose `shards` shards are served by `shards` different primaries."""
    for n in itertools.count():
        name = f"scale{shards}-{n}"
        owners = [cluster.primary_of(QueueKeys(s).policy) for s in shard_names(name, shards)]
        if len(set(owners)) == shards:
            return name
    raise AssertionError("unreachable")


def measure(cluster: EmbeddedCluster, shards: int, per_shard: int,
            work: Path) -> dict[str, Any]:
    queue = spread_queue(cluster, shards)
    client = connect(cluster.url)
    try:
        ensure_policy(client, queue, {**POLICY, "shards": shards})
    finally:
        client.close()
    owners = {s: cluster.primary_of(QueueKeys(s).policy) for s in shard_names(queue, shards)}
    primaries = {port: cluster.client(port) for port in owners.values()}
    before = {port: redis_cpu_s(c) for port, c in primaries.items()}
    total = per_shard * shards
    seen: list[float] = []  # when each result reached the producer
    all_seen = threading.Event()
    lock = threading.Lock()

    def count(_result: Any) -> None:
        with lock:
            seen.append(time.perf_counter())
            if len(seen) == total:
                all_seen.set()

    producer_cpu0 = time.process_time()
    with ShardedProducer(cluster.url, queue, on_result=count) as producer:
        for first in range(0, total, CHUNK):
            producer.submit_many([{"i": i} for i in range(first, min(total, first + CHUNK))])
        consumers = [ChildProcess([*batchgate_argv(), "--log-level", "WARNING", "consumer",
                                   "--redis-url", cluster.url, "--queue", queue, "--model",
                                   "consumer.models:noop", "--name", f"{queue}-c{i}"],
                                  work / f"{queue}-{i}.log", b"ready on queue")
                     for i in range(shards)]
        try:
            wait_all_ready(consumers, 90)
            start_up_cpu = sum(c.cpu_s() for c in consumers)  # imports, model load
            if not all_seen.wait(600):
                raise RuntimeError(f"{len(seen)} of {total} results after 600 s")
            drained_s = seen[-1] - seen[0]  # first result to last: the start-up left out
            consumer_cpu = sum(c.cpu_s() for c in consumers) - start_up_cpu
        finally:
            for child in consumers:
                child.kill()
    producer_cpu = time.process_time() - producer_cpu0
    redis_us = {port: (redis_cpu_s(c) - before[port]) / per_shard * 1e6
                for port, c in primaries.items()}
    for c in primaries.values():
        c.close()
    return {"shards": shards, "requests": total,
            "req_per_s": round((total - 1) / drained_s),
            "redis_cpu_us_per_request": {str(p): round(v, 1) for p, v in redis_us.items()},
            "redis_cpu_us_mean": round(sum(redis_us.values()) / shards, 1),
            "consumer_cpu_us_per_request": round(consumer_cpu / total * 1e6, 1),
            "producer_cpu_us_per_request": round(producer_cpu / total * 1e6, 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", default="1,2,3", help="comma-separated shard counts (≤ 3)")
    parser.add_argument("--per-shard", type=int, default=30_000, help="requests per shard")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    counts = [int(x) for x in args.shards.split(",")]
    if any(not 1 <= s <= 3 for s in counts):
        parser.error("--shards: each count must be within 1-3 (the cluster has 3 primaries)")
    if args.per_shard < 1:
        parser.error("--per-shard must be at least 1")
    work = Path(tempfile.mkdtemp(prefix="batchgate-shards-"))
    rows = []
    try:
        with EmbeddedCluster(primaries=3, replicas=0) as cluster:
            for shards in counts:
                row = measure(cluster, shards, args.per_shard, work)
                print(json.dumps(row), file=sys.stderr, flush=True)
                rows.append(row)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("| shards | requests | req/s (all on this host) | Redis CPU µs/req, each primary | "
          "mean | consumers µs/req | producer µs/req |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        each = " · ".join(f"{v:g}" for v in row["redis_cpu_us_per_request"].values())
        print(f"| {row['shards']} | {row['requests']:,} | {row['req_per_s']:,} | {each} | "
              f"{row['redis_cpu_us_mean']:g} | {row['consumer_cpu_us_per_request']:g} | "
              f"{row['producer_cpu_us_per_request']:g} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
