"""Scrape time of `batchgate exporter` by number of queues and --samples:

    python -m bench.exporter_scrape                    # 100 queues
    python -m bench.exporter_scrape --queues 10,100 --samples 100,1000,10000

Fills one private `redis-server` with N registered queues, each with a policy, 50 waiting
requests and full latency lists (10,000 samples each, as a busy queue keeps), starts a
real `batchgate exporter` per --samples value and times whole HTTP scrapes of /metrics.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request

from batchgate.embedded import EmbeddedRedis, free_port
from scheduler_core.lifetime import spawn


def fill(url: str, queues: int) -> None:
    import redis

    from scheduler_core.admin import store_policy
    from scheduler_core.keys import QueueKeys
    from scheduler_core.policy import Policy
    from scheduler_core.registry import register_queue

    client = redis.Redis.from_url(url)
    for i in range(queues):
        name = f"scrape-{i:05d}"
        register_queue(client, name)
        store_policy(client, name, Policy(), replace=True)
        keys = QueueKeys(name)
        pipe = client.pipeline(transaction=False)
        pipe.lpush(keys.wait_samples, *range(1000, 11000))
        pipe.lpush(keys.e2e_samples, *range(2000, 12000))
        pipe.lpush(keys.model_samples, *[f"8:{n}" for n in range(500, 10500)])
        pipe.zadd(keys.pending(1), {f"r{n}": n for n in range(50)})
        pipe.execute()


def get(port: int) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=120) as reply:
        return reply.read()


def scrape_times(url: str, queues: int, samples: int, scrapes: int) -> tuple[list[float], int]:
    command = shutil.which("batchgate", path=os.path.dirname(sys.executable)) or "batchgate"
    port = free_port()
    proc = spawn([command, "exporter", "--redis-url", url, "--host", "127.0.0.1",
                  "--port", str(port), "--samples", str(samples),
                  "--max-queues", str(queues)], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                get(port)  # warm-up, and the exporter is up
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        times, size = [], 0
        for _ in range(scrapes):
            started = time.perf_counter()
            size = len(get(port))
            times.append(time.perf_counter() - started)
        return times, size
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--queues", default="100", help="comma-separated queue counts")
    parser.add_argument("--samples", default="100,1000,10000",
                        help="comma-separated --samples values")
    parser.add_argument("--scrapes", type=int, default=5, help="timed scrapes per row")
    args = parser.parse_args()
    print(f"{'queues':>7} {'samples':>8} {'median ms':>10} {'min ms':>8} {'max ms':>8} "
          f"{'bytes':>8}")
    for queues in (int(q) for q in args.queues.split(",")):
        server = EmbeddedRedis()
        try:
            fill(server.url, queues)
            for samples in (int(s) for s in args.samples.split(",")):
                times, size = scrape_times(server.url, queues, samples, args.scrapes)
                print(f"{queues:>7} {samples:>8} {statistics.median(times) * 1000:>10.0f} "
                      f"{min(times) * 1000:>8.0f} {max(times) * 1000:>8.0f} {size:>8}",
                      flush=True)
        finally:
            server.close()


if __name__ == "__main__":
    main()
