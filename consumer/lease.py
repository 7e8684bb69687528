"""The consumer's lease thread: heartbeat, renew the lease of every batch it holds, and
watch the queue's stored policy.

It runs beside the consumer loop, not in it, so that a long (CPU-bound) batch keeps its
lease while the model runs. A model that has run one batch for longer than max_batch_ms
is deemed hung, and the consumer lets go of everything it holds: that batch's lease is
no longer renewed, the batch fetched ahead is given back to the queue at once, and once
the hung batch's lease has lapsed (max_batch_ms + lease_ms) the process is told to exit:
Python cannot interrupt a thread stuck in a model, so only a fresh process recovers.

While the consumer holds a batch (its loop cannot), the thread also keeps the queue's
deadlines: each renewal reads the earliest deadline still waiting, and the thread wakes at
that moment to take the requests past their deadline out of the queue (expire_due), then
re-arms itself at the next one. An idle consumer's own due timer covers them otherwise.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
import redis

from consumer.batch import Batch
from scheduler_core.deadlines import expire_due
from scheduler_core.keys import QueueKeys, queue_clock_us
from scheduler_core.registry import REGISTER_EVERY_S, register_queue
from scheduler_core.scripts import ScriptPipeline, Scripts, extend_lease_keys, requeue_keys

log = logging.getLogger("batchgate.consumer")

EXIT_MODEL_HUNG = 3  # exit status of a consumer whose model hung past max_batch_ms
RELEASE_LEASE_MS = 100  # extend_lease's shortest lease: a batch let go lapses this soon


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class Held:
    """Where the lease thread finds what the consumer holds."""
    current: Callable[[], Batch | None]  # the batch in hand (model, or its completion)
    in_model: Callable[[], Batch | None]  # the batch the model runs right now
    fetched: Callable[[], Batch | None] = _nothing  # fetched ahead, waiting for the model
    completing: Callable[[], list[Batch]] = list  # results on their way to Redis


INFO_TTL_S = 30  # `{bg:q}:consumer:<name>` outlives the last heartbeat this long
FAILURES_KEPT = 100  # `{bg:q}:failures` keeps the newest this many


@dataclass(frozen=True)
class Report:
    """What the lease thread publishes with each heartbeat, for dashboards."""
    about: Callable[[], dict[str, str]]  # host, pid, device, batches, current batch...
    failures: deque[dict[str, Any]]  # failed requests not yet written (drained here)


@dataclass(frozen=True)
class LeaseTimes:
    lease_ms: int
    max_batch_ms: int  # 0: never deem the model hung

    @property
    def interval_s(self) -> float:
        return min(self.lease_ms / 3000, 1.0)


class LeaseKeeper:
    """Every lease_ms / 3 (at most 1 s): heartbeat, renew the leases of what `held`
    reports, and pass the queue's stored policy (raw hash) to `on_policy`. When the model
    hangs, `on_hung` is called once the hung batch's lease has lapsed; it should exit."""

    def __init__(self, client: redis.Redis, scripts: Scripts, keys: QueueKeys, consumer: str,
                 times: LeaseTimes, held: Held, on_policy: Callable[[dict[bytes, bytes]], None],
                 on_hung: Callable[[], None], report: Report | None = None,
                 result_ttl_s: Callable[[], int] = lambda: 600):
        self._redis, self._scripts, self._keys = client, scripts, keys
        self._consumer, self._times, self._held = consumer, times, held
        self._on_policy, self._on_hung = on_policy, on_hung
        self._report = report
        self._registered_at = float("-inf")  # last mark of the queue as seen (registry.py)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="batchgate-lease", daemon=True)
        self._watched: Batch | None = None  # the batch in the model when last looked
        self._since = 0.0  # when `_watched` was first seen in the model
        self._hung = False  # `_watched` ran past max_batch_ms
        self._warned: Batch | None = None  # the batch whose lost lease was reported
        self._released: set[str] = set()  # ids of fetched-ahead batches given back
        self._result_ttl_s = result_ttl_s  # the policy's, for a queue that lost its own
        self._deadline_at: float | None = None  # monotonic: the earliest deadline known

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        next_tick = time.monotonic() + self._times.interval_s
        while True:
            wake = next_tick if self._deadline_at is None else min(next_tick, self._deadline_at)
            if self._stop.wait(max(0.0, wake - time.monotonic())):
                return
            now = time.monotonic()
            try:
                if self._deadline_at is not None and now >= self._deadline_at:
                    self._deadline_at = None
                    self._expire(now)
                if now >= next_tick:
                    next_tick = now + self._times.interval_s
                    self._tick()
            except redis.RedisError as exc:
                log.debug("lease renewal failed: %s", exc)
            except Exception:  # a dead lease thread would lose every batch: carry on
                log.exception("lease thread: unexpected error")

    def _expire(self, now: float) -> None:
        """The earliest deadline has come: expire what is due while the consumer holds a
        batch (an idle consumer's pop does it), and arm for the next deadline."""
        if self._held.current() is None and self._held.in_model() is None:
            return  # idle: its due timer and pop_batch's {-4} take care of it
        sweep = expire_due(self._scripts, self._keys, self._result_ttl_s())
        if sweep.more:
            self._deadline_at = now
        elif sweep.next_in_s is not None:
            self._deadline_at = now + sweep.next_in_s

    def _arm(self, first: list[Any], now_us: int) -> None:
        """Arm for the earliest deadline read with a renewal (zrange with scores), at the
        queue's clock `now_us`."""
        if not first:
            return
        at = time.monotonic() + max(0.0, (first[0][1] - now_us) / 1e6)
        if self._deadline_at is None or at < self._deadline_at:
            self._deadline_at = at

    def _tick(self) -> None:
        now = time.monotonic()
        self._watch_model(now)
        current = self._held.current()
        if self._hung and current is self._watched:
            current = None  # heartbeat only: the hung batch's lease lapses
        completing = self._held.completing()
        others = [b for b in completing if b is not current]
        release: list[Batch] = []
        fetched = self._held.fetched()
        if fetched is not None and fetched is not current:
            if not self._hung:
                others.append(fetched)
            elif fetched.id not in self._released:
                release.append(fetched)  # the model will not get to it: give it back
        exit_at = self._since + (self._times.max_batch_ms + self._times.lease_ms) / 1000
        # Once exiting, results still being written get one more lease to land.
        exiting = self._hung and now >= exit_at and (
            not completing or now >= exit_at + self._times.lease_ms / 1000)
        try:
            self._renew_and_report(current, others, release)
        finally:
            if exiting:  # even with Redis away: the model is stuck either way
                self._on_hung()
        if self._report is not None:
            self._publish()
        if now - self._registered_at >= REGISTER_EVERY_S:
            self._registered_at = now
            try:
                register_queue(self._redis, self._keys.queue)
            except redis.RedisError as exc:  # e.g. an ACL limited to the queue's keys
                log.debug("queue registry not updated: %s", exc)

    def _renew_and_report(self, current: Batch | None, others: list[Batch],
                          release: list[Batch]) -> None:
        renewed, policy = self._renew(current, others, release, sweep=self._hung)
        if release:
            self._released.update(b.id for b in release)
            log.warning("batch %s (fetched ahead) given back to the queue: the model is hung",
                        ", ".join(b.id for b in release))
            # Re-queue it as soon as its shortened lease lapses, not at the next sweep.
            self._stop.wait(2 * RELEASE_LEASE_MS / 1000)
            self._scripts.requeue_expired(keys=requeue_keys(self._keys), args=[100])
        # Only a batch still in hand has lost its lease: one completed while the renewal
        # was in flight is simply no longer in the in-flight set.
        if current is not None and not renewed and self._held.current() is current \
                and self._warned is not current:
            self._warned = current
            log.warning("batch %s: lease lost; its results will be refused", current.id)
        try:
            self._on_policy(policy)
        except (redis.RedisError, ValueError) as exc:
            log.warning("could not check the queue's policy: %s", exc)

    def _publish(self) -> None:
        """This consumer's info hash, and the failed requests seen since the last tick
        (pushed onto the queue's failures list), for dashboards: a round trip of its own,
        so that a refusal (an ACL without these commands) never touches the lease."""
        assert self._report is not None
        info = self._keys.consumer_info(self._consumer)
        failed: list[dict[str, Any]] = []
        while self._report.failures:
            failed.append(self._report.failures.popleft())
        pipe = self._redis.pipeline(transaction=False)
        pipe.hset(info, mapping=self._report.about())
        pipe.expire(info, INFO_TTL_S)
        if failed:
            pipe.lpush(self._keys.failures, *(orjson.dumps(f) for f in failed))
            pipe.ltrim(self._keys.failures, 0, FAILURES_KEPT - 1)
        try:
            pipe.execute()
        except redis.RedisError as exc:
            log.debug("consumer info not published: %s", exc)

    def _watch_model(self, now: float) -> None:
        """Start the hang clock for a new batch in the model; deem it hung past
        max_batch_ms (a model that returns after all resets the clock)."""
        batch = self._held.in_model()
        if batch is not self._watched:
            self._watched, self._since, self._hung = batch, now, False
        limit = self._times.max_batch_ms
        if batch is not None and limit and not self._hung and now - self._since > limit / 1000:
            self._hung = True
            log.error("batch %s: the model has run for over max_batch_ms=%d; treating it as "
                      "hung: lease not renewed, the batch fetched ahead given back, and the "
                      "process exits (status %d) in lease_ms=%d unless the model returns",
                      batch.id, limit, EXIT_MODEL_HUNG, self._times.lease_ms)

    def _renew(self, current: Batch | None, others: list[Batch], release: list[Batch],
               sweep: bool) -> tuple[bool, dict[bytes, bytes]]:
        """One round trip: heartbeat and extend each lease (`current` None: heartbeat
        only), shorten the leases of `release`, sweep lapsed leases (while hung the loop
        cannot), and read the policy. Whether `current`'s lease was extended, and the
        stored policy."""
        pipe = ScriptPipeline(self._redis, pinned=True)  # TIME: the queue's own server
        lease = self._times.lease_ms
        calls: list[tuple[Batch | None, int]] = [(current, lease), *((b, lease) for b in others),
                                                  *((b, RELEASE_LEASE_MS) for b in release)]
        keys = extend_lease_keys(self._keys)
        for batch, ms in calls:
            args: list[Any] = [self._consumer, batch.id if batch else "", ms]
            pipe.script(self._scripts.extend_lease, keys, args)
        if sweep:
            pipe.script(self._scripts.requeue_expired, requeue_keys(self._keys), [100])
        pipe.command("hgetall", self._keys.policy)
        pipe.command("zrange", self._keys.deadlines, 0, 0, False, True)  # with scores
        pipe.command("time")
        pipe.command("get", self._keys.clock)
        replies = pipe.execute()
        self._arm(replies[-3], queue_clock_us(replies[-2], replies[-1]))
        return int(replies[0]) != 0, replies[-4]
