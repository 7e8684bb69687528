"""The consumer loop: pop a due batch atomically, run the model, complete it, repeat.

One process runs one loop (one model, one device). A lease thread renews the batch's lease
and heartbeats while the model runs; any consumer re-queues batches whose lease expired.
While a backlog waits, the next pop and the last completion run beside the model
(consumer/overlap.py); otherwise a completion and the next pop share one round trip.
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

from consumer.due_timer import DueTimer
from consumer.loader import BatchModel
from consumer.overlap import Completer, Prefetcher
from scheduler_core.admin import ensure_policy
from scheduler_core.connection import DEFAULT_REDIS_URL, Backoff, connect
from scheduler_core.errors import InvalidRequest
from scheduler_core.keys import QueueKeys
from scheduler_core.policy import Policy
from scheduler_core.scripts import (
    ScriptPipeline,
    Scripts,
    complete_keys,
    extend_lease_keys,
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
IDLE_UNTIL_WOKEN = -1.0  # a pop outcome: nothing due, block until a marker wakes us


@dataclass(frozen=True)
class ConsumerConfig:
    redis_url: str = DEFAULT_REDIS_URL
    queue: str = "default"
    lease_ms: int = 10_000  # a batch not renewed for this long is re-queued
    # A batch running longer than this is deemed hung: its lease is no longer renewed, so
    # another consumer re-runs it (and this one's late results are refused). 0 = never.
    max_batch_ms: int = 0
    max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES
    # While a backlog waits, fetch the next batch and write the last one's results beside
    # the model (consumer/overlap.py). Off: one batch at a time, nothing held ahead.
    overlap: bool = True
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
        if not isinstance(self.overlap, bool):
            raise InvalidRequest("overlap", f"{self.overlap!r} is not true or false")
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
    remaining: int = 0  # requests still pending after this pop
    # (answers known before the model runs, [(item, decoded payload)]), once decoded
    prepared: tuple[dict[str, tuple[str, bytes]], list[tuple[Item, Any]]] | None = \
        field(default=None, repr=False)


@dataclass
class Finished:
    """(Part of) a batch's answers on their way to complete.lua."""
    batch: Batch
    outcomes: dict[str, tuple[str, bytes]]  # already encoded (expired, dead, malformed)
    runnable: list[Item] = field(default_factory=list)
    results: list[tuple[bool, Any]] = field(default_factory=list)  # per runnable item
    model_us: int = 0
    answered_early: dict[str, tuple[str, bytes]] = field(default_factory=dict)
    last: bool = True  # the batch's final completion: observed, its model time recorded


def parse_pop(reply: list[Any]) -> Batch | float:
    """A Batch, or the wait in ms until the next request falls due (IDLE_UNTIL_WOKEN:
    nothing waits)."""
    head = int(reply[0])
    if head == 0:
        wait_us = int(reply[1])
        return wait_us / 1000 if wait_us >= 0 else IDLE_UNTIL_WOKEN
    if head == -1:
        raise LookupError("queue has no policy")
    if head < 0:
        raise InvalidRequest(reply[1].decode(), "rejected by pop_batch")
    items = []
    for i in range(4, len(reply), 7):
        rid, env, arrival, attempts, producer, state, level = reply[i:i + 7]
        items.append(Item(rid.decode(), env, int(arrival), int(attempts),
                          producer.decode(errors="replace"),  # hand-written meta
                          state.decode(), int(level)))
    return Batch(str(head), int(reply[1]), items, remaining=int(reply[3]))


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
        self._prefetcher: Prefetcher | None = None  # both run only inside run()
        self._completer: Completer | None = None
        self._model_s: dict[int, float] = {}  # last model time per batch size
        self._due_timer: DueTimer | None = None  # made by the first idle wait
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
        self._prefetcher = Prefetcher(self._fetch)
        self._completer = Completer(self._finish, lambda job: job.batch)
        backoff = Backoff(f"consumer {self.config.name}")
        log.info("consumer %s serving queue %r with %s", self.config.name, self.config.queue,
                 self.policy)
        pending_pop: Any = None
        try:
            # A batch already popped (it rode in with the last completion, or was
            # prefetched) is run even if a stop arrived meanwhile, rather than stranded
            # until its lease expires.
            while not self.stopping.is_set() or isinstance(pending_pop, Batch):
                try:
                    self._sweep_if_due()
                    outcome = pending_pop if pending_pop is not None else self._pop()
                    pending_pop = None
                    backoff.succeeded()
                    if isinstance(outcome, Batch):
                        pending_pop = self._process(outcome)
                    else:
                        pending_pop = self._idle(outcome)
                except redis.RedisError as exc:
                    # Connection loss, but also OOM (maxmemory reached), MISCONF (disk),
                    # READONLY (failover), LOADING (restart): wait it out, don't exit. An
                    # abandoned batch keeps no lease, so the sweep re-queues it.
                    self._current = None
                    if not isinstance(pending_pop, Batch):
                        pending_pop = self._take_prefetched(fetch_now=False, salvage=True)
                    backoff.sleep_after(exc)
        finally:
            self.stopping.set()
            self._completer.close()  # computed results are written before we leave
            self._prefetcher.close()
            if self._due_timer is not None:
                self._due_timer.close()
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

    def _pop(self) -> Batch | float:
        script, keys, args = self._pop_call()
        return self._parse(script(keys=keys, args=args))

    def _fetch(self) -> Batch | float:
        """The prefetcher's job: pop, and decode the payloads while the model runs."""
        outcome = self._pop()
        if isinstance(outcome, Batch):
            outcome.prepared = self._prepare(outcome)
        return outcome

    def _parse(self, reply: list[Any]) -> Batch | float:
        try:
            return parse_pop(reply)
        except LookupError:
            log.warning("queue %r lost its policy; storing ours again", self.config.queue)
            self.start()
            return 0

    def _prepare(self, batch: Batch,
                 ) -> tuple[dict[str, tuple[str, bytes]], list[tuple[Item, Any]]]:
        """Answers known without the model (expired, exhausted, unreadable), and the
        runnable items with their decoded payloads."""
        early: dict[str, tuple[str, bytes]] = {}
        runnable: list[tuple[Item, Any]] = []
        for item in batch.items:
            if item.state == "expired":
                early[item.id] = ("expired", encode_error(
                    item.id, DEADLINE, "deadline passed before a consumer ran it"))
            elif item.state == "exhausted":
                early[item.id] = ("dead", encode_error(
                    item.id, "DeadLettered", f"gave up after {item.attempts - 1} deliveries "
                    "(max_attempts): the consumer running it crashed or hung each time"))
            else:
                try:
                    runnable.append((item, decode_request(item.envelope or b"")))
                except ValueError as exc:
                    early[item.id] = ("dead", encode_error(
                        item.id, "MalformedRequest", f"stored request is unreadable: {exc}"))
        return early, runnable

    def _process(self, batch: Batch) -> Batch | float | None:
        """Run one batch; returns the next pop's outcome when it rode with the completion
        or was prefetched."""
        self._current, self._lease_lost = batch, False
        early, runnable = batch.prepared or self._prepare(batch)
        batch.prepared = None
        # A backlog waits: fetch the next batch and write this one's results beside the
        # model (consumer/overlap.py). Only inside run(), which owns the helper threads;
        # not for a re-delivered request: it may crash the process, which would take a
        # batch fetched ahead (and charge its requests an attempt) with it; and not when
        # this batch size last ran faster than a fetch: there is nothing to hide the
        # fetch behind, and handing work between threads would cost more than it saves.
        expected = self._model_s.get(len(runnable))
        overlap = self.config.overlap and self._prefetcher is not None \
            and batch.remaining > 0 and not self.stopping.is_set() \
            and all(it.attempts == 1 for it in batch.items) \
            and (expected is None or expected >= self._prefetcher.lead_s)
        self.batches_done += 1
        self.requests_done += len(batch.items)
        if early:  # answer these now rather than after the model
            self._hand_over(Finished(batch, early, last=not runnable), overlap)
        if not runnable:
            self._current = None
            return None
        if overlap:
            assert self._prefetcher is not None
            self._prefetcher.arm(time.monotonic() + max(0.0, (expected or 0.0)
                                                        - self._prefetcher.lead_s))
        started = time.perf_counter()
        results = self._run_isolated([payload for _, payload in runnable])
        model_s = time.perf_counter() - started
        self._model_s[len(runnable)] = model_s
        done = Finished(batch, {}, [item for item, _ in runnable], results, int(model_s * 1e6),
                        answered_early=early)
        if overlap:
            self._hand_over(done, overlap)
            self._current = None
            return self._take_prefetched(fetch_now=not self.stopping.is_set())
        if batch.remaining == 0:
            # The queue was empty at this pop: a pop sent with the completion would most
            # likely find nothing, and would delay the results (Redis answers a pipeline
            # as a whole). Complete alone, then block; an arrival meanwhile left the
            # wake-up marker, so the block returns at once.
            self._finish(done)
            self._current = None
            return IDLE_UNTIL_WOKEN
        # Complete this batch and pop the next one in a single round trip.
        reply = self._finish(done, pop_next=not self.stopping.is_set())
        self._current = None
        return None if reply is None else self._parse(reply)

    def _hand_over(self, job: Finished, overlap: bool) -> None:
        if overlap:
            assert self._completer is not None
            self._completer.submit(job)
        else:
            self._finish(job)

    def _take_prefetched(self, fetch_now: bool, salvage: bool = False,
                         ) -> Batch | float | None:
        """The prefetched outcome (fetched now if its time has not come yet). salvage: after
        an error, keep a batch already popped, drop anything else."""
        got = self._prefetcher.take(fetch_now) if self._prefetcher is not None else None
        if got is None:
            return None
        ok, value = got
        if salvage:
            return value if ok and isinstance(value, Batch) else None
        if not ok:
            raise value
        return value

    def _finish(self, job: Finished, pop_next: bool = False) -> list[Any] | None:
        """Encode and write a batch's answers; with pop_next, pop the next batch in the
        same round trip and return its raw reply."""
        outcomes = dict(job.outcomes)
        for item, (ok, value) in zip(job.runnable, job.results, strict=True):
            outcomes[item.id] = self._encode(item.id, ok, value)
        if job.last and self.observer is not None:
            self.observer.on_batch(job.batch, len(job.runnable), job.model_us,
                                   {**job.answered_early, **outcomes})
        sample = f"{len(job.runnable)}:{job.model_us}" if job.runnable else None
        complete = self._complete_call(job.batch, outcomes, sample)
        pipe = ScriptPipeline(self.redis)
        pipe.script(*complete)
        if pop_next:
            pipe.script(*self._pop_call())
        try:
            replies = pipe.execute()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            self._complete_until_done(job.batch, complete, exc)
            return None
        self._check_completion(job.batch, replies[0])
        return replies[-1] if pop_next else None

    def _complete_until_done(self, batch: Batch, complete: tuple[Any, list[str], list[Any]],
                             exc: BaseException) -> None:
        """Redis went away while the results were on their way: they are computed, so
        offer them again until Redis answers rather than re-run the batch. complete.lua is
        fenced, so a resend whose first copy did land is refused, never applied twice."""
        backoff = Backoff(f"consumer {self.config.name} (completing batch {batch.id})")
        script, keys, args = complete
        while True:
            backoff.sleep_after(exc)
            try:
                self._check_completion(batch, script(keys=keys, args=args))
                break
            except (redis.ConnectionError, redis.TimeoutError) as again:
                exc = again
        backoff.succeeded()

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
                       model_sample: str | None = None) -> tuple[Any, list[str], list[Any]]:
        producers = {item.id: item.producer for item in batch.items}
        ids = list(outcomes)
        args: list[Any] = [batch.id, self.policy.result_ttl_s if self.policy else 600, len(ids)]
        for rid in ids:
            args += [rid, outcomes[rid][0], outcomes[rid][1]]
        if model_sample is not None:
            args.append(model_sample)
        keys = complete_keys(self.keys, [(rid, producers[rid]) for rid in ids])
        return self.scripts.complete, keys, args

    def _check_completion(self, batch: Batch, reply: list[Any]) -> None:
        if int(reply[0]) == -1:
            log.warning("batch %s: lease expired and the batch was re-queued; its results "
                        "were refused (another consumer answers it)", batch.id)
        elif int(reply[1]) > 0:
            log.warning("batch %s: %d results refused (no longer in this batch)", batch.id,
                        int(reply[1]))

    # -- waiting --------------------------------------------------------------------
    def _idle(self, wait_ms: float) -> Batch | float:
        """Block until a marker wakes us, our due timer fires, or IDLE_BLOCK_S passes;
        then pop. The pop is sent behind the block in one write, so Redis runs it the
        moment the block ends: no round trip between the wake-up and the batch.

        Redis fires blocking timeouts up to 1/hz late (100 ms at the default hz 10), so the
        due time is kept by a local timer that pushes to this consumer's private wake key.
        The wait comes from Redis' clock; only its length is timed locally.
        """
        wake_key = self.keys.wake(self.config.name)
        if self._due_timer is None:
            self._due_timer = DueTimer(lambda: self._self_wake(wake_key))
        if 0 <= wait_ms < IDLE_BLOCK_S * 1000:
            self._due_timer.set(time.monotonic() + wait_ms / 1000)
        pipe = ScriptPipeline(self.redis)
        pipe.command("bzpopmin", [self.keys.marker, wake_key], IDLE_BLOCK_S)
        pipe.script(*self._pop_call())
        try:
            replies = pipe.execute()
        finally:
            self._due_timer.cancel()
        return self._parse(replies[-1])

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
            # Also the batches popped ahead or still completing (consumer/overlap.py).
            others = [b for b in self._batches_aside() if b is not batch]
            pipe = ScriptPipeline(self.redis)
            for held_batch in [batch, *others]:
                pipe.script(self.scripts.extend_lease, extend_lease_keys(self.keys),
                            [self.config.name, held_batch.id if held_batch else "",
                             self.config.lease_ms])
            try:
                ok = pipe.execute()[0]
            except redis.RedisError as exc:
                log.debug("lease renewal failed: %s", exc)
                continue
            # Only a batch still in hand has lost its lease: one completed while the
            # renewal was in flight is simply no longer in the in-flight set.
            if batch is not None and int(ok) == 0 and self._current is batch \
                    and not self._lease_lost:
                self._lease_lost = True
                log.warning("batch %s: lease lost; its results will be refused", batch.id)

    def _batches_aside(self) -> list[Batch]:
        aside = self._completer.batches() if self._completer is not None else []
        ready = self._prefetcher.ready() if self._prefetcher is not None else None
        return [*aside, ready] if isinstance(ready, Batch) else aside


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
