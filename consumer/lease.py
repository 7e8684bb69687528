"""The consumer's lease thread: heartbeat, and renew the lease of every batch it holds.

It runs beside the consumer loop, not in it, so that a long (CPU-bound) batch keeps its
lease while the model runs. A batch the model has run for longer than max_batch_ms is
deemed hung: its lease is no longer renewed, so the sweep re-queues it elsewhere.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from consumer.batch import Batch
from scheduler_core.keys import QueueKeys
from scheduler_core.scripts import ScriptPipeline, Scripts, extend_lease_keys

log = logging.getLogger("batchgate.consumer")


class LeaseKeeper:
    """Renews, every lease_ms / 3 (at most 1 s), the batch the model runs (`running()`)
    and those held beside it (`aside()`: fetched ahead, still completing)."""

    def __init__(self, client: redis.Redis, scripts: Scripts, keys: QueueKeys, consumer: str,
                 lease_ms: int, max_batch_ms: int, running: Callable[[], Batch | None],
                 aside: Callable[[], list[Batch]]):
        self._redis, self._scripts, self._keys = client, scripts, keys
        self._consumer, self._lease_ms, self._max_batch_ms = consumer, lease_ms, max_batch_ms
        self._running, self._aside = running, aside
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="batchgate-lease", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        interval = min(self._lease_ms / 3000, 1.0)
        held: Batch | None = None
        since, lost = 0.0, False  # when `held` started; its lease lost (or given up)
        while not self._stop.wait(interval):
            batch = self._running()
            if batch is not held:
                held, since, lost = batch, time.monotonic(), False
            if batch is not None and self._max_batch_ms and \
                    time.monotonic() - since > self._max_batch_ms / 1000:
                if not lost:
                    lost = True
                    log.error("batch %s: the model has run for over max_batch_ms=%d; treating "
                              "it as hung: lease not renewed, the batch will be re-queued",
                              batch.id, self._max_batch_ms)
                batch = None  # heartbeat only: the lease lapses, the sweep re-queues it
            others = [b for b in self._aside() if b is not batch]
            try:
                renewed = self._renew([batch, *others])
            except redis.RedisError as exc:
                log.debug("lease renewal failed: %s", exc)
                continue
            # Only a batch still running has lost its lease: one completed while the
            # renewal was in flight is simply no longer in the in-flight set.
            if batch is not None and not renewed and self._running() is batch and not lost:
                lost = True
                log.warning("batch %s: lease lost; its results will be refused", batch.id)

    def _renew(self, batches: list[Batch | None]) -> bool:
        """Heartbeat and extend each lease in one round trip (None: heartbeat only);
        whether the first batch's lease was extended."""
        pipe = ScriptPipeline(self._redis)
        keys = extend_lease_keys(self._keys)
        for batch in batches:
            args: list[Any] = [self._consumer, batch.id if batch else "", self._lease_ms]
            pipe.script(self._scripts.extend_lease, keys, args)
        return int(pipe.execute()[0]) != 0
