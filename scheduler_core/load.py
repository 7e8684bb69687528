"""A queue's measured arrival rate, from the per-second counters enqueue.lua keeps in
`{bg:q}:arrivals` (hash: epoch second as a decimal string -> requests enqueued in that
second; old fields removed)."""

from __future__ import annotations

import redis

from scheduler_core.keys import QueueKeys

DEFAULT_WINDOW_S = 10


def arrival_rate(client: redis.Redis, keys: QueueKeys, window_s: int = DEFAULT_WINDOW_S) -> float:
    """Requests per second enqueued over the last `window_s` whole seconds (by Redis'
    clock; the second under way is left out, it is still counting)."""
    now_s, _ = client.time()
    seconds = [str(int(now_s) - k) for k in range(1, window_s + 1)]
    counts = client.hmget(keys.arrivals, seconds)
    total = 0
    for value in counts:
        try:
            total += int(value) if value is not None else 0
        except ValueError:
            continue  # not a counter: not ours to read
    return total / window_s
