"""The consumer's side of max_queue_delay_ms=auto: derive the delay about once a second.

A thread of its own derives the delay every RECOMPUTE_S, off the loop's path; the loop
reads `delay_ms` for each pop (pop_batch.lua's ARGV[4]) and records its model times.
Inputs, read in one round trip: the queue's arrival counts (scheduler_core/load.py), the
stored cost model `{bg:q}:cost_model` or, while there is none, a fit of this consumer's
own recent model times, and the consumers alive. The result is also written into
`{bg:q}:stats` for `batchgate stats`.

A load that falls is seen sooner, by the batches themselves (`observe`): a batch that
the delay released (its oldest request waited the whole delay, and it is not full) but
that holds far fewer requests than the rate predicts says the requests are no longer
coming. The delay is derived again at once from the rate that batch shows, and that rate
caps the measured one for the next RATE_WINDOW_S + 1 seconds (the window still holds the
old load). So after a drop one window, not the 2-second rate window, is waited in vain.
A rate that rises waits for the next derivation: until then the delay only holds batches
that fill sooner anyway.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

import redis

from consumer.batch import Batch
from scheduler_core.auto_delay import (
    MIN_GAIN,
    STATS_AT_US,
    STATS_DELAY_US,
    STATS_RATE_MRPS,
    Cost,
    Derived,
    derive_delay_ms,
    fit_samples,
    read_cost_model,
)
from scheduler_core.connection import slot_owner
from scheduler_core.keys import CONSUMER_ALIVE_S, QueueKeys, queue_clock_us
from scheduler_core.load import rate_from
from scheduler_core.policy import Policy, Strategy

log = logging.getLogger("batchgate.consumer")

RECOMPUTE_S = 1.0  # a derivation this often (not per batch)
RATE_WINDOW_S = 2  # complete seconds the rate is measured over
PARTIAL_MIN_S = 0.25  # the second in progress counts once this much of it has passed
SAMPLES_KEPT = 256  # this consumer's newest (batch size, model ms)


def partial_rate(counts: dict[Any, Any], now_s: int, now_us: int) -> float | None:
    """Requests/s so far in the second in progress, None early in it."""
    elapsed = now_us / 1e6
    if elapsed < PARTIAL_MIN_S:
        return None
    raw = counts.get(str(now_s).encode(), counts.get(str(now_s), 0))
    return int(raw) / elapsed


class DelayKeeper:
    def __init__(self, client: Any, keys: QueueKeys):
        self._redis, self._keys = client, keys
        self._samples: deque[tuple[int, float]] = deque(maxlen=SAMPLES_KEPT)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._next = 0.0
        self._inputs: tuple[Cost | None, int] = (None, 1)  # of the last derivation
        self._cap: tuple[float, float] | None = None  # (rate seen by a batch, until when)
        self.policy: Policy | None = None
        self.derived: Derived | None = None  # the latest derivation; None: fixed delay

    @property
    def delay_ms(self) -> int | None:
        """The delay to pass to pop_batch, None under a fixed delay."""
        derived = self.derived
        return None if derived is None else derived.delay_ms

    def record(self, size: int, model_s: float) -> None:
        if size > 0:
            self._samples.append((size, model_s * 1000))

    def follow(self, policy: Policy | None) -> None:
        """The queue's policy as last read (the delay applies from the next derivation)."""
        self.policy = policy
        if policy is None or not policy.auto_delay:
            self.derived = None

    # -- the thread ---------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="batchgate-auto-delay",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.wait(RECOMPUTE_S):
            try:
                self.step()
            except (redis.RedisError, ValueError) as exc:  # keep the last delay
                log.warning("could not derive the queue delay: %s", exc)

    def step(self, force: bool = False) -> None:
        """Derive the delay from the queue's inputs (when RECOMPUTE_S has passed, or
        `force`) and publish it in the queue's stats."""
        policy = self.policy
        if policy is None or not policy.auto_delay:
            self.derived = None
            return
        with self._lock:
            now = time.monotonic()
            if not force and now < self._next - 0.05:
                return
            self._next = now + RECOMPUTE_S
            # TIME has no key: on a cluster, the primary serving the queue's slot.
            pipe = slot_owner(self._redis, self._keys.arrivals).pipeline(transaction=True)
            pipe.time()
            pipe.hgetall(self._keys.arrivals)
            pipe.hgetall(self._keys.cost_model)
            pipe.zrange(self._keys.consumers, 0, -1, withscores=True)
            pipe.get(self._keys.clock)  # heartbeats are on the queue's clock
            (now_s, now_us), counts, raw_cost, beats, offset = pipe.execute()
            now_s, now_us = int(now_s), int(now_us)
            rate = rate_from(counts, now_s, RATE_WINDOW_S)
            partial = partial_rate(counts, now_s, now_us)
            if partial is not None:
                rate = min(rate, partial)
            cap = self._cap
            if cap is not None and now < cap[1]:
                rate = min(rate, max(cap[0], partial or 0.0))
            alive_after = queue_clock_us((now_s, now_us), offset) - CONSUMER_ALIVE_S * 1e6
            consumers = max(1, sum(1 for _, beat in beats if beat >= alive_after))
            cost = read_cost_model(raw_cost) or fit_samples(list(self._samples))
            self._inputs = (cost, consumers)
            self.derived = self._derive(policy, rate)
            self._publish(now_s * 1_000_000 + now_us)

    def _publish(self, now_us: int) -> None:
        derived = self.derived
        if derived is not None:
            self._redis.hset(self._keys.stats, mapping={
                STATS_DELAY_US: derived.delay_ms * 1000,
                STATS_RATE_MRPS: int(derived.rate_rps * 1000), STATS_AT_US: now_us})

    def observe(self, batch: Batch) -> None:
        """A popped batch (the loop's call, no Redis): if the delay released it with far
        fewer requests than the rate predicts, the load has fallen; derive the delay from
        the rate it shows. Only batches the window formed count: not HIGH or LOW under
        priority, not a re-delivered request (it runs alone)."""
        derived, policy = self.derived, self.policy
        if derived is None or policy is None or derived.delay_ms == 0 or not batch.items:
            return
        size = len(batch.items)
        if size >= policy.max_batch_size or any(
                item.attempts > 1 or (policy.strategy is Strategy.PRIORITY and item.level != 1)
                for item in batch.items):
            return
        oldest_wait_us = batch.popped_us - min(item.arrival_us for item in batch.items)
        if oldest_wait_us < derived.delay_ms * 1000:
            return
        expected = derived.rate_rps * derived.delay_ms / 1000  # arrivals within the window
        # A delay is derived only where the window collects MIN_GAIN more on average, so
        # any window may show the drop: under a quarter of them (none at all, below 4).
        if expected < MIN_GAIN or size - 1 >= expected / 4:
            return
        seen = (size - 1) / (oldest_wait_us / 1e6)
        self._cap = (seen, time.monotonic() + RATE_WINDOW_S + 1)
        self.derived = self._derive(policy, seen)
        try:  # rare (a load step down): one write, for `stats`
            self._publish(batch.popped_us)
        except redis.RedisError as exc:
            log.warning("could not publish the queue delay: %s", exc)
        log.debug("load fell: a window of %d ms held %d requests (%.1f expected)",
                  derived.delay_ms, size, expected + 1)

    def _derive(self, policy: Policy, rate: float) -> Derived:
        cost, consumers = self._inputs
        delay = derive_delay_ms(rate, cost, policy.slo_p99_ms, policy.max_batch_size,
                                consumers)
        return Derived(delay, rate, cost, consumers)
