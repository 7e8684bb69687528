"""The consumer loop: pop a due batch atomically, run the model, complete it, repeat.

One process runs one loop (one model, one device). A lease thread (consumer/lease.py)
renews the batch's lease and heartbeats while the model runs; any consumer re-queues
batches whose lease expired. While a backlog waits, the next pop and the last completion
run beside the model (consumer/overlap.py); otherwise a completion and the next pop share
one round trip.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field, fields, replace
from typing import Any

import redis

from consumer.batch import (
    IDLE_UNTIL_WOKEN,
    POP_NOW,
    Answers,
    Batch,
    ExpireDue,
    Finished,
    Idle,
    Item,
    Next,
    parse_pop,
)
from consumer.due_timer import DueTimer
from consumer.lease import EXIT_MODEL_HUNG, Held, LeaseKeeper, LeaseTimes
from consumer.loader import BatchModel
from consumer.overlap import Overlap
from scheduler_core.admin import ensure_policy, store_policy, unknown_requests
from scheduler_core.connection import DEFAULT_REDIS_URL, Backoff, connect
from scheduler_core.deadlines import expire_due
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
    Outcome,
    decode_request,
    encode_error,
    encode_result,
)

log = logging.getLogger("batchgate.consumer")

IDLE_BLOCK_S = 1.0  # longest idle block: bounds heartbeat, sweep and shutdown latency
# Replies to complete.lua that are offered again (the results are kept) rather than
# dropped: Redis away, or out of memory under `maxmemory` (noeviction) until room is made.
COMPLETION_RETRIED = (redis.ConnectionError, redis.TimeoutError,
                      redis.exceptions.OutOfMemoryError)
# Bound once: a member looked up through its Enum class is slow, and these run per request.
RUN, OK, FAILED = Outcome.RUN, Outcome.OK, Outcome.FAILED


@dataclass(frozen=True)
class ConsumerConfig:
    redis_url: str = DEFAULT_REDIS_URL
    queue: str = "default"
    lease_ms: int = 10_000  # a batch not renewed for this long is re-queued
    # A batch the model runs longer than this is deemed hung: its lease is no longer
    # renewed, the batch fetched ahead is given back, and lease_ms later, unless the model
    # returned, the process exits with EXIT_MODEL_HUNG (a stuck thread cannot be
    # interrupted; a supervisor starts a fresh process). 0 = never.
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
        if isinstance(self.max_result_bytes, bool) or not isinstance(self.max_result_bytes, int) \
                or not 16 <= self.max_result_bytes <= 512 << 20:
            raise InvalidRequest("max_result_bytes",
                                 f"{self.max_result_bytes!r} is outside [16, {512 << 20}]")
        if not isinstance(self.overlap, bool):
            raise InvalidRequest("overlap", f"{self.overlap!r} is not true or false")
        if not self.name:
            object.__setattr__(self, "name", f"{socket.gethostname()}:{os.getpid()}:"
                                             f"{uuid.uuid4().hex[:6]}")
        if "|" in self.name:
            raise InvalidRequest("name", "must not contain '|'")


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
        self._current: Batch | None = None  # the batch in hand (model, then completion)
        self._in_model: Batch | None = None  # the batch while the model runs it
        self._last_sweep = 0.0
        self._overlap: Overlap | None = None  # made by run(), which owns its threads
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

    def _exit_hung(self) -> None:
        """The lease thread's call once a hung model's batch has lapsed (everything else
        was given back or written): the stuck thread cannot be interrupted, so the
        process exits and its supervisor (or systemd, Kubernetes) starts a fresh one."""
        log.error("consumer %s: the model is still hung lease_ms=%d after max_batch_ms=%d; "
                  "exiting with status %d", self.config.name, self.config.lease_ms,
                  self.config.max_batch_ms, EXIT_MODEL_HUNG)
        with contextlib.suppress(redis.RedisError):
            self.redis.zrem(self.keys.consumers, self.config.name)
        logging.shutdown()  # flush the log: os._exit skips it
        os._exit(EXIT_MODEL_HUNG)

    def run(self) -> None:
        if self.policy is None:
            self.start()
        if self.config.overlap:
            self._overlap = Overlap(self._fetch, self._finish, self.stopping)
        held = Held(lambda: self._current, lambda: self._in_model)
        if self._overlap is not None:
            held = replace(held, fetched=self._overlap.fetched,
                           completing=self._overlap.completing)
        lease = LeaseKeeper(self.redis, self.scripts, self.keys, self.config.name,
                            LeaseTimes(self.config.lease_ms, self.config.max_batch_ms), held,
                            on_policy=self._policy_seen, on_hung=self._exit_hung,
                            result_ttl_s=lambda: self.policy.result_ttl_s if self.policy
                            else 600)
        lease.start()
        backoff = Backoff(f"consumer {self.config.name}")
        log.info("consumer %s serving queue %r with %s", self.config.name, self.config.queue,
                 self.policy)
        next_step: Next = POP_NOW
        try:
            # A batch already popped (it rode in with the last completion, or was
            # prefetched) is run even if a stop arrived meanwhile, rather than stranded
            # until its lease expires.
            while not self.stopping.is_set() or isinstance(next_step, Batch):
                try:
                    self._sweep_if_due()
                    step, next_step = next_step, POP_NOW
                    if isinstance(step, Batch):
                        next_step = self._process(step)
                    elif isinstance(step, Idle):
                        next_step = self._idle(step)
                    else:
                        next_step = self._pop()
                    backoff.succeeded()
                except redis.RedisError as exc:
                    # Connection loss, but also OOM (maxmemory reached), MISCONF (disk),
                    # READONLY (failover), LOADING (restart): wait it out, don't exit. An
                    # abandoned batch keeps no lease, so the sweep re-queues it.
                    self._current = None
                    if not isinstance(next_step, Batch):
                        next_step = self._overlap.salvage() if self._overlap is not None \
                            else POP_NOW
                    backoff.sleep_after(exc)
        finally:
            self.stopping.set()
            if self._overlap is not None:
                self._overlap.close()  # computed results are written before we leave
            if self._due_timer is not None:
                self._due_timer.close()
            lease.stop()
            with contextlib.suppress(redis.RedisError):
                self.redis.zrem(self.keys.consumers, self.config.name)
            log.info("consumer %s stopped after %d batches, %d requests", self.config.name,
                     self.batches_done, self.requests_done)

    # -- one step -------------------------------------------------------------------
    def _pop_call(self) -> tuple[Any, list[str], list[Any]]:
        return self.scripts.pop_batch, pop_keys(self.keys), [self.config.name,
                                                            self.config.lease_ms]

    def _pop(self) -> Next:
        script, keys, args = self._pop_call()
        return self._parse(script(keys=keys, args=args))

    def _fetch(self) -> Next:
        """The prefetcher's job: pop, and decode the payloads while the model runs."""
        outcome = self._pop()
        if isinstance(outcome, Batch):
            outcome.prepared = self._prepare(outcome)
        return outcome

    def _parse(self, reply: list[Any]) -> Next:
        try:
            step = parse_pop(reply)
        except LookupError:
            self._restore_policy()
            return POP_NOW
        if isinstance(step, ExpireDue):
            self._expire_due()
            return POP_NOW
        return step

    def _expire_due(self) -> None:
        """Take the requests past their deadline out of the queue (their producers get
        DeadlineExceeded), so that none of them fills or joins a batch."""
        assert self.policy is not None
        try:
            sweep = expire_due(self.scripts, self.keys, self.policy.result_ttl_s)
        except InvalidRequest as exc:  # a stored policy altered by hand: do not spin
            log.error("queue %r: cannot expire requests past their deadline: %s",
                      self.config.queue, exc)
            self.stopping.wait(1.0)
            return
        if sweep.expired or sweep.delayed:
            log.debug("expired %d, delayed %d requests past their deadline", sweep.expired,
                      sweep.delayed)

    # -- the queue's policy, as it changes under us ------------------------------------
    def _restore_policy(self) -> None:
        """The queue's policy is gone (Redis lost its data): store the one this consumer
        last ran with, not its flags or the defaults, so that a data loss does not change
        the rules. If another process stored one first, adopt that."""
        assert self.policy is not None
        lost = self.policy
        stored = store_policy(self.redis, self.config.queue, lost, replace=False)
        if stored == lost:
            log.warning("queue %r lost its policy (did Redis lose its data?); stored again "
                        "the one this consumer last ran with: %s", self.config.queue, lost)
        self._adopt_policy(stored)

    def _policy_seen(self, raw: dict[bytes, bytes]) -> None:
        """The lease thread's read of the stored policy, every lease_ms / 3 (at most 1 s)."""
        if not raw:
            self._restore_policy()
        else:
            self._adopt_policy(Policy.from_redis(raw))

    def _adopt_policy(self, stored: Policy) -> None:
        """Follow a changed stored policy (pop_batch.lua applies it anyway; result_ttl_s
        applies from the next completion on); say so, loudly where it contradicts the
        flags this consumer was started with."""
        old = self.policy
        if stored == old or old is None:
            return
        self.policy = stored
        changed = ", ".join(f"{f.name} {getattr(old, f.name)} -> {getattr(stored, f.name)}"
                            for f in fields(stored)
                            if getattr(stored, f.name) != getattr(old, f.name))
        log.warning("queue %r: policy changed (%s); following it", self.config.queue, changed)
        conflict = stored.differences({k: v for k, v in self.config.policy.items()
                                       if v is not None})
        if conflict:
            detail = ", ".join(f"{k}={have} (flag: {want})"
                               for k, (have, want) in conflict.items())
            log.error("queue %r: the stored policy now contradicts this consumer's flags: "
                      "%s. It follows the stored policy (every consumer of a queue applies "
                      "the same rules); restart it without these flags or with the new "
                      "values", self.config.queue, detail)

    def _prepare(self, batch: Batch) -> tuple[Answers, list[tuple[Item, Any]]]:
        """Answers known without the model (expired, exhausted, unreadable), and the
        runnable items with their decoded payloads."""
        early: Answers = {}
        runnable: list[tuple[Item, Any]] = []
        for item in batch.items:
            if item.state is RUN:
                try:
                    runnable.append((item, decode_request(item.envelope or b"")))
                except ValueError as exc:
                    early[item.id] = (Outcome.DEAD_LETTER, encode_error(
                        item.id, "MalformedRequest", f"stored request is unreadable: {exc}"))
            elif item.state is Outcome.EXPIRED:
                early[item.id] = (Outcome.EXPIRED, encode_error(
                    item.id, DEADLINE, "deadline passed before a consumer ran it"))
            else:
                early[item.id] = (Outcome.DEAD_LETTER, encode_error(
                    item.id, "DeadLettered", f"gave up after {item.attempts - 1} deliveries "
                    "(max_attempts): the consumer running it crashed or hung each time"))
        return early, runnable

    def _process(self, batch: Batch) -> Next:
        """Run one batch and hand its answers over; returns what the loop does next."""
        self._current = batch
        early, runnable = batch.prepared or self._prepare(batch)
        batch.prepared = None
        self.batches_done += 1
        self.requests_done += len(batch.items)
        overlap = self._overlap
        if overlap is not None and not overlap.wanted(batch, len(runnable)):
            overlap = None  # this batch runs alone
        if runnable:
            if early:  # answer these now rather than after the model
                self._hand_over(Finished(batch, early, last=False), overlap)
            if overlap is not None:
                overlap.prefetch(len(runnable))
            done = self._run_model(batch, runnable, early)
        else:
            done = Finished(batch, early)
        if overlap is not None:
            overlap.complete(done)
            self._current = None
            return overlap.take()
        # Complete this batch and pop the next one in a single round trip, unless the
        # queue was empty at this pop: such a pop would most likely find nothing, and
        # would delay the results (Redis answers a pipeline as a whole). Then block after
        # completing; an arrival meanwhile left the wake-up marker, so the block returns
        # at once.
        reply = self._finish(done, pop_next=batch.remaining > 0 and not self.stopping.is_set())
        self._current = None
        if reply is not None:
            return self._parse(reply)
        return POP_NOW if batch.remaining else IDLE_UNTIL_WOKEN

    def _run_model(self, batch: Batch, runnable: list[tuple[Item, Any]],
                   answered_early: Answers) -> Finished:
        started = time.perf_counter()
        self._in_model = batch  # the lease thread's hang clock runs while this is set
        try:
            results = self._run_isolated([payload for _, payload in runnable])
        finally:
            self._in_model = None
        model_s = time.perf_counter() - started
        if self._overlap is not None:
            self._overlap.ran(len(runnable), model_s)
        return Finished(batch, {}, [item for item, _ in runnable], results, int(model_s * 1e6),
                        answered_early=answered_early)

    def _hand_over(self, job: Finished, overlap: Overlap | None) -> None:
        if overlap is not None:
            overlap.complete(job)
        else:
            self._finish(job)

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
        except COMPLETION_RETRIED as exc:
            self._complete_until_done(job.batch, complete, exc)
            return None
        self._check_completion(job.batch, replies[0])
        return replies[-1] if pop_next else None

    def _complete_until_done(self, batch: Batch, complete: tuple[Any, list[str], list[Any]],
                             exc: BaseException) -> None:
        """Redis went away (or is out of memory) while the results were on their way:
        they are computed, so offer them again until Redis takes them rather than re-run
        the batch; the batch stays held, so the lease thread keeps renewing it.
        complete.lua is fenced, so a resend whose first copy did land is refused, never
        applied twice."""
        backoff = Backoff(f"consumer {self.config.name} (completing batch {batch.id})")
        script, keys, args = complete
        while True:
            backoff.sleep_after(exc)
            try:
                self._check_completion(batch, script(keys=keys, args=args))
                break
            except COMPLETION_RETRIED as again:
                exc = again
        backoff.succeeded()

    def _encode(self, request_id: str, ok: bool, value: Any) -> tuple[Outcome, bytes]:
        if not ok:
            return FAILED, encode_error(request_id, value[0], value[1])
        try:
            return OK, encode_result(request_id, value, self.config.max_result_bytes)
        except InvalidRequest as exc:
            return FAILED, encode_error(request_id, "InvalidResult", str(exc))

    def _run_isolated(self, payloads: list[Any]) -> list[tuple[bool, Any]]:
        """Run the model; if it raises, split the batch to isolate the failing payloads,
        so one poison request fails alone and the others are answered."""
        try:
            results = self.model(payloads)
        except Exception as exc:  # the model's failure is the request's, not ours
            if len(payloads) == 1:
                message = _describe(exc)
                log.warning("model raised on a request: %s: %s", type(exc).__name__, message)
                return [(False, (type(exc).__name__, message))]
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

    def _complete_call(self, batch: Batch, outcomes: Answers,
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
            self._log_refused(batch)
        elif int(reply[1]) > 0:
            log.warning("batch %s: %d results refused (no longer in this batch)", batch.id,
                        int(reply[1]))

    def _log_refused(self, batch: Batch) -> None:
        """Say why a batch's results were refused: its lease lapsed and it was re-queued
        (another consumer answers it), or Redis no longer knows its requests."""
        try:
            lost = unknown_requests(self.redis, self.keys, [item.id for item in batch.items])
        except redis.RedisError as exc:
            log.warning("batch %s: its results were refused (lease expired, or Redis lost "
                        "the batch; could not check which: %s)", batch.id, exc)
            return
        if lost:
            log.warning("batch %s: its results were refused: %d of its %d requests no longer "
                        "exist (Redis lost them? restarted without persistence, or "
                        "flushed); nobody will answer them", batch.id, len(lost),
                        len(batch.items))
        else:
            log.warning("batch %s: lease expired and the batch was re-queued; its results "
                        "were refused (another consumer answers it)", batch.id)

    # -- waiting --------------------------------------------------------------------
    def _idle(self, idle: Idle) -> Next:
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
        if idle.due_in_ms is not None and idle.due_in_ms < IDLE_BLOCK_S * 1000:
            self._due_timer.set(time.monotonic() + idle.due_in_ms / 1000)
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


def _describe(exc: BaseException) -> str:
    """The exception's message; a model's exception whose __str__ raises must fail its
    request, not the consumer."""
    try:
        return str(exc)
    except Exception:  # any failure to print is the model's, not ours
        return "<unprintable>"


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
