"""What finding queues costs (scheduler_core/registry.py): one SCAN pass for the queues'
marks over a keyspace of other keys, and one dashboard refresh with many idle queues:

    python -m bench.queue_scan                       # 1,000,000 other keys
    python -m bench.queue_scan --keys 100000 --idle 2100

Fills one private `redis-server` (DEBUG POPULATE) with --keys keys of one queue, marks
--queues queues and --idle more, then times `known_queues` (wall time, and SCAN's calls and
time in Redis from INFO commandstats) and one dashboard refresh (`Feed`, its bytes).
"""

from __future__ import annotations

import argparse
import time

from batchgate.embedded import EmbeddedRedis


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=1_000_000, help="other keys")
    parser.add_argument("--queues", type=int, default=100, help="marked queues")
    parser.add_argument("--idle", type=int, default=0, help="more marked idle queues")
    args = parser.parse_args()
    import redis

    from scheduler_core.keys import QueueKeys
    from scheduler_core.registry import known_queues

    server = EmbeddedRedis("--enable-debug-command", "yes")
    try:
        client = redis.Redis.from_url(server.url)
        client.execute_command("DEBUG", "POPULATE", args.keys, "{bg:filler}:request")
        now = int(time.time() * 1000)
        pipe = client.pipeline(transaction=False)
        for i in range(args.queues + args.idle):
            pipe.set(QueueKeys(f"q-{i:05d}").seen, now)
        pipe.execute()
        client.config_resetstat()
        started = time.perf_counter()
        found = known_queues(client)
        took = time.perf_counter() - started
        scan = client.info("commandstats").get("cmdstat_scan", {"calls": 0, "usec": 0})
        print(f"{args.keys:,} other keys, {len(found):,} queues found: {took:.3f} s wall, "
              f"{scan['calls']:,} SCAN calls, {scan['usec'] / 1000:.0f} ms in Redis "
              f"({scan['usec'] / max(1, scan['calls']):.0f} us per call)")
        try:
            from batchgate.dashboard.app import Feed
        except ImportError:
            return
        started = time.perf_counter()
        body = Feed(client, 0.5, None)._read()
        print(f"one dashboard refresh: {time.perf_counter() - started:.3f} s, "
              f"{len(body):,} bytes")
    finally:
        server.close()


if __name__ == "__main__":
    main()
