"""The raw 4-hop path's consumer for `python -m bench.latency`: BLPOP a request, LPUSH
its reply to the list the request names. No Lua, no envelope, no model.

A request is b"<reply list>"; its reply is b"<popped at>:<replied at>" (time.time()).
"""

from __future__ import annotations

import argparse
import time

import redis

from bench.workers.gate import guard_parent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--queue", required=True)
    args = parser.parse_args()
    guard_parent()
    client = redis.Redis.from_url(args.redis_url)
    client.ping()
    print("ready", flush=True)
    while True:
        popped = client.blpop([args.queue], timeout=1)
        if popped is None:
            continue
        at = time.time()
        client.lpush(popped[1], b"%.6f:%.6f" % (at, time.time()))


if __name__ == "__main__":
    main()
