"""The raw-Redis ceiling's consumer: the fewest Redis operations a request needs, with no
Lua, no leases, no envelopes and no model.

Per request there are four operations, as in batchgate: enqueue (the producer's RPUSH),
pop (LPOP/BLMPOP of up to --batch requests at once), complete (one RPUSH of the result to
the producer's inbox, pipelined with the next pop: one round trip per batch, as the
batchgate consumer does) and deliver (the producer's BLMPOP of its inbox).

A request is the bytes b"<index>"; its result is b"<index>:<pop time us>:<batch>:<pid>".
"""

from __future__ import annotations

import argparse
import os
import time

import redis

from bench.workers.gate import guard_parent, ready_then_wait


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--queue", required=True)
    parser.add_argument("--inbox", required=True)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--go", required=True, help="start-gate list key")
    args = parser.parse_args()
    guard_parent()
    client = redis.Redis.from_url(args.redis_url)
    client.ping()
    pid = os.getpid()
    ready_then_wait(args.redis_url, args.go)
    items: list[bytes] | None = None
    while True:
        if not items:
            popped = client.blmpop(1, 1, args.queue, direction="LEFT", count=args.batch)
            if not popped:
                continue
            items = popped[1]
        stamp = b":%d:%d:%d" % (int(time.time() * 1e6), len(items), pid)
        pipe = client.pipeline(transaction=False)
        for item in items:
            pipe.rpush(args.inbox, item + stamp)
        pipe.lpop(args.queue, args.batch)
        items = pipe.execute()[-1]


if __name__ == "__main__":
    main()
