"""The consumer loop: pop a due batch atomically, run the model, complete it, repeat.

One process runs one loop (one model, one device). A lease thread renews the batch's lease
and heartbeats while the model runs; any consumer re-queues batches whose lease expired.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import redis

from consumer.loader import BatchModel
from scheduler_core.admin import ensure_policy
from scheduler_core.connection import DEFAULT_REDIS_URL, Backoff, connect
from scheduler_core.errors import InvalidRequest
from scheduler_core.keys import QueueKeys
from scheduler_core.policy import Policy
from scheduler_core.scripts import (
    ScriptPipeline,
    Scripts,
    complete_keys,
    pop_keys,
    requeue_keys,
)
from scheduler_core.wire import (
    DEADLINE,
    DEFAULT_MAX_RESULT_BYTES,
    decode_request,
    encode_error,
    encode_result,
)

log = logging.getLogger("batchgate.consumer")

IDLE_BLOCK_S = 1.0  # longest idle block: bounds heartbeat, sweep and shutdown latency
SAMPLES_KEPT = 10_000


@dataclass(frozen=True)
class ConsumerConfig:
    redis_url: str = DEFAULT_REDIS_URL
    queue: str = "default"
    lease_ms: int = 10_000  # a batch not renewed for this long is re-queued
    # A batch running longer than this is deemed hung: its lease is no longer renewed, so
    # another consumer re-runs it (and this one's late results are refused). 0 = never.
    max_batch_ms: int = 0
    max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES
    # Policy values given explicitly (None = adopt the queue's stored policy or default).
    policy: dict[str, Any] = field(default_factory=dict)
    name: str = ""

    def __post_init__(self) -> None:
        QueueKeys(self.queue)
        if isinstance(self.lease_ms, bool) or not isinstance(self.lease_ms, int) \
                or not 100 <= self.lease_ms <= 86_400_000:
            raise InvalidRequest("lease_ms", f"{self.lease_ms!r} is outside [100, 86400000]")
        if isinstance(self.max_batch_ms, bool) or not isinstance(self.max_batch_ms, int) \
                or not (self.max_batch_ms == 0 or 100 <= self.max_batch_ms <= 86_400_000):
            raise InvalidRequest("max_batch_ms",
                                 f"{self.max_batch_ms!r}: use 0 (off) or [100, 86400000]")
        if not self.name:
            object.__setattr__(self, "name", f"{socket.gethostname()}:{os.getpid()}:"
                                             f"{uuid.uuid4().hex[:6]}")
        if "|" in self.name:
            raise InvalidRequest("name", "must not contain '|'")


@dataclass
class Item:
    id: str
    envelope: bytes | None
    arrival_us: int
    attempts: int
    producer: str
    state: str  # run | expired | exhausted
    level: int


@dataclass
class Batch:
    id: str
    popped_us: int
    items: list[Item]


def parse_pop(reply: list[Any]) -> Batch | int:
    """A Batch, or the wait in ms until the next request falls due (-1: queue empty)."""
    head = int(reply[0])
    if head == 0:
        return int(reply[1])
    if head == -1:
        raise LookupError("queue has no policy")
    if head < 0:
        raise InvalidRequest(reply[1].decode(), "rejected by pop_batch")
    items = []
    for i in range(3, len(reply), 7):
        rid, env, arrival, attempts, producer, state, level = reply[i:i + 7]
        items.append(Item(rid.decode(), env, int(arrival), int(attempts),
                          producer.decode(errors="replace"),  # hand-written meta
                          state.decode(), int(level)))
    return Batch(str(head), int(reply[1]), items)


class Consumer:
    def __init__(self, model: BatchModel, config: ConsumerConfig | None = None,
                 client: redis.Redis | None = None):
        self.model = model
        self.config = config or ConsumerConfig()
        self.keys = QueueKeys(self.config.queue)
        self.redis = client or connect(self.config.redis_url)
        self.scripts = Scripts(self.redis)
        self.policy: Policy | None = None
        self.stopping = threading.Event()
        self._lease_stop = threading.Event()
        self._current: Batch | None = None
        self._lease_lost = False
        self._last_sweep = 0.0
        self.batches_done = 0
        self.requests_done = 0
        # Optional: called once per batch as on_batch(batch, ran, model_us, outcomes), e.g.
        # consumer.metrics.ConsumerMetrics. It must not raise.
        self.observer: Any = None

    # -- lifecycle ------------------------------------------------------------------
    def start(self) -> Policy:
        """Check Redis and settle the queue's policy (PolicyConflict if ours differs)."""
        self.policy = ensure_policy(self.redis, self.config.queue, self.config.policy)
        check_eviction_policy(self.redis)
        return self.policy

    def stop(self) -> None:
        """Finish the batch in hand, complete it, then leave the loop."""
        self.stopping.set()

    def run(self) -> None:
        if self.policy is None:
            self.start()
        lease = threading.Thread(target=self._lease_loop, name="batchgate-lease", daemon=True)
        lease.start()
        backoff = Backoff(f"consumer {self.config.name}")
        log.info("consumer %s serving queue %r with %s", self.config.name, self.config.queue,
                 self.policy)
        pending_pop: Any = None
        try:
            # A batch that rode in with the last completion is in hand: run it even if a
            # stop arrived meanwhile, rather than strand it until its lease expires.
            while not self.stopping.is_set() or isinstance(pending_pop, Batch):
                try:
                    self._sweep_if_due()
                    outcome = pending_pop if pending_pop is not None else self._pop()
                    pending_pop = None
                    backoff.succeeded()
                    if isinstance(outcome, Batch):
                        pending_pop = self._process(outcome)
                    else:
                        self._idle(outcome)
                except redis.RedisError as exc:
                    # Connection loss, but also OOM (maxmemory reached), MISCONF (disk),
                    # READONLY (failover), LOADING (restart): wait it out, don't exit. An
                    # abandoned batch keeps no lease, so the sweep re-queues it.
                    pending_pop = None
                    self._current = None
                    backoff.sleep_after(exc)
        finally:
            self.stopping.set()
            self._lease_stop.set()
            lease.join(timeout=5)
            with contextlib.suppress(redis.RedisError):
                self.redis.zrem(self.keys.consumers, self.config.name)
            log.info("consumer %s stopped after %d batches, %d requests", self.config.name,
                     self.batches_done, self.requests_done)

    # -- one step -------------------------------------------------------------------
    def _pop_call(self) -> tuple[Any, list[str], list[Any]]:
        return self.scripts.pop_batch, pop_keys(self.keys), [self.config.name,
                                                            self.config.lease_ms]

    def _pop(self) -> Batch | int:
        script, keys, args = self._pop_call()
        return self._parse(script(keys=keys, args=args))

    def _parse(self, reply: list[Any]) -> Batch | int:
        try:
            return parse_pop(reply)
        except LookupError:
            log.warning("queue %r lost its policy; storing ours again", self.config.queue)
            self.start()
            return 0

    def _process(self, batch: Batch) -> Batch | int | None:
        """Run one batch; returns the next pop's outcome when it rode with the completion."""
        self._current, self._lease_lost = batch, False
        outcomes: dict[str, tuple[str, bytes]] = {}
        runnable: list[tuple[Item, Any]] = []
        for item in batch.items:
            if item.state == "expired":
                outcomes[item.id] = ("expired", encode_error(
                    item.id, DEADLINE, "deadline passed before a consumer ran it"))
            elif item.state == "exhausted":
                outcomes[item.id] = ("dead", encode_error(
                    item.id, "DeadLettered", f"gave up after {item.attempts - 1} deliveries "
                    "(max_attempts): the consumer running it crashed or hung each time"))
            else:
                try:
                    runnable.append((item, decode_request(item.envelope or b"")))
                except ValueError as exc:
                    outcomes[item.id] = ("dead", encode_error(
                        item.id, "MalformedRequest", f"stored request is unreadable: {exc}"))
        early = outcomes
        if outcomes:  # answer these now rather than after the model
            self._complete(batch, outcomes)
            outcomes = {}
        model_us = 0
        if runnable:
            started = time.perf_counter()
            results = self._run_isolated([payload for _, payload in runnable])
            model_us = int((time.perf_counter() - started) * 1e6)
            for (item, _), (ok, value) in zip(runnable, results, strict=True):
                outcomes[item.id] = self._encode(item.id, ok, value)
        self.batches_done += 1
        self.requests_done += len(batch.items)
        if self.observer is not None:
            self.observer.on_batch(batch, len(runnable), model_us, {**early, **outcomes})
        if not outcomes:
            self._current = None
            return None
        # Complete this batch and pop the next one in a single round trip.
        stop = self.stopping.is_set()
        pipe = ScriptPipeline(self.redis)
        pipe.script(*self._complete_call(batch, outcomes))
        pipe.command("lpush", self.keys.model_samples, f"{len(runnable)}:{model_us}")
        pipe.command("ltrim", self.keys.model_samples, 0, SAMPLES_KEPT - 1)
        if not stop:
            pipe.script(*self._pop_call())
        try:
            replies = pipe.execute()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            self._complete_until_done(batch, outcomes, exc)
            return None
        self._current = None
        self._check_completion(batch, replies[0])
        return None if stop else self._parse(replies[-1])

    def _complete_until_done(self, batch: Batch, outcomes: dict[str, tuple[str, bytes]],
                             exc: BaseException) -> None:
        """Redis went away while the results were on their way: they are computed, so
        offer them again until Redis answers rather than re-run the batch. complete.lua is
        fenced, so a resend whose first copy did land is refused, never applied twice."""
        backoff = Backoff(f"consumer {self.config.name} (completing batch {batch.id})")
        while True:
            backoff.sleep_after(exc)
            try:
                self._complete(batch, outcomes)
                break
            except (redis.ConnectionError, redis.TimeoutError) as again:
                exc = again
        backoff.succeeded()
        self._current = None

    def _encode(self, request_id: str, ok: bool, value: Any) -> tuple[str, bytes]:
        if not ok:
            return "err", encode_error(request_id, value[0], value[1])
        try:
            return "ok", encode_result(request_id, value, self.config.max_result_bytes)
        except InvalidRequest as exc:
            return "err", encode_error(request_id, "InvalidResult", str(exc))

    def _run_isolated(self, payloads: list[Any]) -> list[tuple[bool, Any]]:
        """Run the model; if it raises, split the batch to isolate the failing payloads,
        so one poison request fails alone and the others are answered."""
        try:
            results = self.model(payloads)
        except Exception as exc:  # the model's failure is the request's, not ours
            if len(payloads) == 1:
                log.warning("model raised on a request: %s: %s", type(exc).__name__, exc)
                return [(False, (type(exc).__name__, str(exc)))]
            half = len(payloads) // 2
            return self._run_isolated(payloads[:half]) + self._run_isolated(payloads[half:])
        try:
            results = list(results)
        except TypeError:
            results = None
        if results is None or len(results) != len(payloads):
            got = "a non-list" if results is None else f"{len(results)} results"
            error = ("ModelContractError",
                     f"model returned {got} for a batch of {len(payloads)}")
            return [(False, error)] * len(payloads)
        return [(True, r) for r in results]

    def _complete_call(self, batch: Batch, outcomes: dict[str, tuple[str, bytes]],
                       ) -> tuple[Any, list[str], list[Any]]:
        producers = {item.id: item.producer for item in batch.items}
        ids = list(outcomes)
        args: list[Any] = [batch.id, self.policy.result_ttl_s if self.policy else 600, len(ids)]
        for rid in ids:
            args += [rid, outcomes[rid][0], outcomes[rid][1]]
        keys = complete_keys(self.keys, [(rid, producers[rid]) for rid in ids])
        return self.scripts.complete, keys, args

    def _complete(self, batch: Batch, outcomes: dict[str, tuple[str, bytes]]) -> None:
        script, keys, args = self._complete_call(batch, outcomes)
        self._check_completion(batch, script(keys=keys, args=args))

    def _check_completion(self, batch: Batch, reply: list[Any]) -> None:
        if int(reply[0]) == -1:
            log.warning("batch %s: lease expired and the batch was re-queued; its results "
                        "were refused (another consumer answers it)", batch.id)
        elif int(reply[1]) > 0:
            log.warning("batch %s: %d results refused (no longer in this batch)", batch.id,
                        int(reply[1]))

    # -- waiting --------------------------------------------------------------------
    def _idle(self, wait_ms: int) -> None:
        """Block until a marker wakes us, our due timer fires, or IDLE_BLOCK_S passes.

        Redis fires blocking timeouts up to 1/hz late (100 ms at the default hz 10), so the
        due time is kept by a local timer that pushes to this consumer's private wake key.
        The wait comes from Redis' clock; only its length is timed locally.
        """
        wake_key = self.keys.wake(self.config.name)
        timer = None
        if 0 <= wait_ms < IDLE_BLOCK_S * 1000:
            timer = threading.Timer(wait_ms / 1000, self._self_wake, args=(wake_key,))
            timer.daemon = True
            timer.start()
        try:
            self.redis.bzpopmin([self.keys.marker, wake_key], timeout=IDLE_BLOCK_S)
        finally:
            if timer is not None:
                timer.cancel()

    def _self_wake(self, wake_key: str) -> None:
        try:
            pipe = self.redis.pipeline(transaction=False)
            pipe.zadd(wake_key, {"due": 0})
            pipe.expire(wake_key, 60)
            pipe.execute()
        except redis.RedisError:
            pass  # the idle block times out by itself within IDLE_BLOCK_S

    def _sweep_if_due(self) -> None:
        interval = min(self.config.lease_ms / 4000, 5.0)
        now = time.monotonic()
        if now - self._last_sweep >= interval:
            self._last_sweep = now
            batches, requeued = self.scripts.requeue_expired(
                keys=requeue_keys(self.keys), args=[100])
            if batches:
                log.warning("re-queued %d requests of %d batches whose lease expired",
                            requeued, batches)

    def _lease_loop(self) -> None:
        """Heartbeat and renew the current batch's lease from a thread that is not the
        one running the model, so a long (CPU-bound) batch keeps its lease."""
        interval = min(self.config.lease_ms / 3000, 1.0)
        held, since = None, 0.0
        while not self._lease_stop.wait(interval):
            batch = self._current
            if batch is not held:
                held, since = batch, time.monotonic()
            if batch is not None and self.config.max_batch_ms and \
                    time.monotonic() - since > self.config.max_batch_ms / 1000:
                if not self._lease_lost:
                    self._lease_lost = True
                    log.error("batch %s: the model has run for over max_batch_ms=%d; treating "
                              "it as hung: lease not renewed, the batch will be re-queued",
                              batch.id, self.config.max_batch_ms)
                batch = None  # heartbeat only: the lease lapses, the sweep re-queues it
            try:
                ok = self.scripts.extend_lease(
                    keys=[self.keys.inflight, self.keys.consumers],
                    args=[self.config.name, batch.id if batch else "", self.config.lease_ms])
            except redis.RedisError as exc:
                log.debug("lease renewal failed: %s", exc)
                continue
            # Only a batch still in hand has lost its lease: one completed while the
            # renewal was in flight is simply no longer in the in-flight set.
            if batch is not None and int(ok) == 0 and self._current is batch \
                    and not self._lease_lost:
                self._lease_lost = True
                log.warning("batch %s: lease lost; its results will be refused", batch.id)


def check_eviction_policy(client: redis.Redis) -> None:
    """Warn if Redis may evict queue keys (requests would be lost silently)."""
    try:
        policy = client.config_get("maxmemory-policy").get("maxmemory-policy")
    except redis.RedisError as exc:
        log.warning("cannot read maxmemory-policy (%s); make sure it is 'noeviction', or "
                    "Redis may evict queued requests under memory pressure", exc)
        return
    if policy and policy != "noeviction":
        log.warning("Redis maxmemory-policy is %r: under memory pressure Redis may EVICT "
                    "queued requests and results. Set `maxmemory-policy noeviction`.", policy)
