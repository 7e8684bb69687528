"""The consumer's cost-model thread: every few seconds, refit the queue's stored model
time t(b) = A + B·b from the live samples the queue's batches leave (every consumer's,
newest first) and store it (scheduler_core.cost_model.refit_live). Off the batch path: a
refit reads up to 2,000 samples and writes one hash."""

from __future__ import annotations

import logging
import threading

import redis

from scheduler_core.cost_model import refit_live
from scheduler_core.keys import QueueKeys

log = logging.getLogger("batchgate.consumer")


class CostRefit:
    def __init__(self, client: redis.Redis, keys: QueueKeys, interval_s: float):
        self._redis, self._keys, self._interval = client, keys, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="batchgate-cost-refit",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                stored = refit_live(self._redis, self._keys)
            except redis.RedisError as exc:  # the loop itself reports Redis being away
                log.debug("cost model refit skipped: %s", exc)
                continue
            except Exception:  # never take the consumer down over a statistic
                log.exception("cost model refit failed")
                continue
            if stored is not None:
                log.debug("cost model refitted: %s (%d samples, R² %.3f)", stored.cost_ms,
                          stored.samples, stored.r2)
