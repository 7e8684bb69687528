"""The consumer's side of max_queue_delay_ms=auto: derive the delay about once a second.

The lease thread calls `update` (every lease_ms / 3, at most 1 s); the loop reads
`delay_ms` for each pop (pop_batch.lua's ARGV[3]) and records its model times. Inputs: the
queue's arrival rate over the last RATE_WINDOW_S complete seconds (scheduler_core/load.py),
the stored cost model `{bg:q}:cost_model` or, while there is none, a fit of this
consumer's own recent model times, and the consumers alive. The result is also written
into `{bg:q}:stats` for `batchgate stats`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

from scheduler_core.admin import CONSUMER_ALIVE_S
from scheduler_core.auto_delay import (
    STATS_AT_US,
    STATS_DELAY_US,
    STATS_RATE_MRPS,
    Derived,
    derive_delay_ms,
    fit_samples,
    read_inputs,
)
from scheduler_core.keys import QueueKeys
from scheduler_core.load import arrival_rate
from scheduler_core.policy import Policy

log = logging.getLogger("batchgate.consumer")

RECOMPUTE_S = 1.0  # derive again after this long (not per batch)
RATE_WINDOW_S = 2  # short enough to follow a load step within a few seconds
SAMPLES_KEPT = 256  # this consumer's newest (batch size, model ms)


class DelayKeeper:
    def __init__(self, client: Any, keys: QueueKeys):
        self._redis, self._keys = client, keys
        self._samples: deque[tuple[int, float]] = deque(maxlen=SAMPLES_KEPT)
        self._next = 0.0
        self._lock = threading.Lock()  # update may run from the loop (start) and the lease
        self.derived: Derived | None = None  # the latest derivation; None: fixed delay

    @property
    def delay_ms(self) -> int | None:
        """The delay to pass to pop_batch, None under a fixed delay."""
        derived = self.derived
        return None if derived is None else derived.delay_ms

    def record(self, size: int, model_s: float) -> None:
        if size > 0:
            self._samples.append((size, model_s * 1000))

    def update(self, policy: Policy | None, force: bool = False) -> None:
        """Derive the delay again if the policy says auto and RECOMPUTE_S has passed."""
        if policy is None or not policy.auto_delay:
            self.derived = None
            return
        now = time.monotonic()
        with self._lock:
            if not force and now < self._next:
                return
            self._next = now + RECOMPUTE_S
            rate = arrival_rate(self._redis, self._keys, RATE_WINDOW_S)
            cost, consumers, now_us = read_inputs(self._redis, self._keys, CONSUMER_ALIVE_S)
            if cost is None:
                cost = fit_samples(list(self._samples))
            delay = derive_delay_ms(rate, cost, policy.slo_p99_ms, policy.max_batch_size,
                                    consumers)
            old = self.derived
            self.derived = Derived(delay, rate, cost, consumers)
            if old is None or old.delay_ms != delay:
                log.debug("auto delay %d ms (rate %.1f/s, %s, %d consumers)", delay, rate,
                          cost, consumers)
            self._redis.hset(self._keys.stats, mapping={
                STATS_DELAY_US: delay * 1000, STATS_RATE_MRPS: int(rate * 1000),
                STATS_AT_US: now_us})
