"""The arrival rate of a queue, measured in Redis.

enqueue.lua counts the requests it adds per second in `{bg:q}:arrivals` (hash: epoch
second as a decimal string -> requests enqueued in that second, by Redis' clock; about
the last 120 s are kept). Every consumer and `batchgate stats` read the same counts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from scheduler_core.connection import slot_owner
from scheduler_core.keys import QueueKeys

DEFAULT_WINDOW_S = 10


def rate_from(counts: Mapping[Any, Any], now_s: int, window_s: int = DEFAULT_WINDOW_S) -> float:
    """Requests/s over the `window_s` complete seconds before `now_s` (the second in
    progress is left out: it is still counting)."""
    if window_s < 1:
        raise ValueError(f"window_s must be at least 1, got {window_s!r}")
    wanted = {str(now_s - age) for age in range(1, window_s + 1)}
    total = 0
    for field, value in counts.items():
        name = field.decode() if isinstance(field, bytes) else str(field)
        text = value.decode() if isinstance(value, bytes) else str(value)
        if name in wanted and text.isdigit():  # anything else is not ours to read
            total += int(text)
    return total / window_s


def arrival_rate(client: Any, keys: QueueKeys, window_s: int = DEFAULT_WINDOW_S) -> float:
    """Requests/s enqueued on the queue over the last `window_s` complete seconds (Redis'
    clock; one round trip)."""
    # TIME has no key: on a cluster the MULTI goes to the primary serving the queue's slot.
    pipe = slot_owner(client, keys.arrivals).pipeline(transaction=True)
    pipe.time()
    pipe.hgetall(keys.arrivals)
    (now_s, _), counts = pipe.execute()
    return rate_from(counts, int(now_s), window_s)
