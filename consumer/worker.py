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
import random
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import fields, replace
from typing import Any

import orjson
import redis

from consumer.auto_delay import DelayKeeper
from consumer.batch import (
    IDLE_UNTIL_WOKEN,
    POP_NOW,
    Answers,
    Batch,
    Cost,
    ExpireDue,
    Finished,
    Idle,
    Item,
    Next,
    describe_error,
    expired_answer,
    parse_pop,
)
from consumer.config import ConsumerConfig
from consumer.due_timer import DueTimer
from consumer.lease import EXIT_MODEL_HUNG, Held, LeaseKeeper, LeaseTimes, Report
from consumer.loader import BatchModel
from consumer.overlap import ALONE, COMPLETION, MODEL, Overlap, SentFetch, Shape
from consumer.refit import CostRefit
from consumer.streaming import Emit, StreamWriter
from scheduler_core.admin import ensure_policy, store_policy, unknown_requests
from scheduler_core.connection import Backoff, Outage, connect
from scheduler_core.deadlines import expire_due
from scheduler_core.errors import InvalidRequest, NotReplicated
from scheduler_core.keys import QueueKeys
from scheduler_core.policy import Policy, describe_policy
from scheduler_core.registry import register_queue
from scheduler_core.scripts import (
    ScriptPipeline,
    Scripts,
    SentScript,
    complete_keys,
    pop_keys,
    requeue_keys,
)
from scheduler_core.wire import (
    Outcome,
    decode_request,
    decode_request_traced,
    encode_error,
    encode_result,
)

log = logging.getLogger("batchgate.consumer")

# The queue's shard count changed while running (its shards are fixed at start).
EXIT_SHARDS_CHANGED = 4
IDLE_BLOCK_S = 1.0  # longest idle block: bounds heartbeat, sweep and shutdown latency
# Replies to complete.lua that are offered again (the results are kept) rather than
# dropped: Redis away, or out of memory under `maxmemory` (noeviction) until room is made.
COMPLETION_RETRIED = (redis.ConnectionError, redis.TimeoutError,
                      redis.exceptions.OutOfMemoryError, redis.exceptions.ClusterDownError,
                      redis.exceptions.TryAgainError, redis.exceptions.MovedError,
                      redis.exceptions.ReadOnlyError)
# Bound once: a member looked up through its Enum class is slow, and these run per request.
RUN, OK, FAILED, RETRY = Outcome.RUN, Outcome.OK, Outcome.FAILED, Outcome.RETRY


class Worker:
    """The loop of one consumer (consumer/api.py's Consumer runs it; consumer/sharded.py
    runs one per shard). `observer`, if given, is called once per batch as
    on_batch(batch, ran, model_us, outcomes) (e.g. consumer.metrics.ConsumerMetrics) and
    must not raise; `tracer` (consumer.tracing.BatchTracer) records each batch's spans."""

    def __init__(self, model: BatchModel, config: ConsumerConfig | None = None,
                 client: redis.Redis | None = None, *, tracer: Any = None,
                 observer: Any = None):
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
        # What the lease thread publishes for dashboards (`{bg:q}:consumer:<name>`).
        # Failed requests wait in `failures` for its next tick.
        self.info: dict[str, str] = {"host": socket.gethostname(), "pid": str(os.getpid()),
                                     "device": self.config.device or "",
                                     "started_ms": str(int(time.time() * 1000))}
        self.failures: deque[dict[str, Any]] = deque(maxlen=100)
        # Under max_queue_delay_ms=auto, the delay derived about once a second.
        self.delay = DelayKeeper(self.redis, self.keys)
        # A Redis outage as this consumer's loops meet it: the main loop and completions
        # being retried log it once between them.
        self.outage = Outage(f"consumer {self.config.name}")
        self.observer = observer
        self.tracer = tracer
        # Pop the next batch in the completion's round trip (off under consumer/sharded.py,
        # which picks the shard of each batch itself).
        self.pop_after_complete = True
        self.shards_changed = False  # the queue's shard count changed under us: restart
        self.continuous = None  # the --batching continuous loop, when that is the mode
        if self.config.batching == "static" and not callable(model):
            raise InvalidRequest("batching", "this model runs step by step only (no batch "
                                             "call): use --batching continuous")
        if self.config.batching == "continuous":
            from consumer.continuous import ContinuousLoop, check_step_model

            check_step_model(model)
            self.continuous = ContinuousLoop(self)

    @property
    def _model_takes_costs(self) -> bool:
        """Whether the model opted into the costs (`accepts_costs = True`)."""
        return bool(getattr(self.model, "accepts_costs", False))

    @property
    def _model_streams(self) -> bool:
        """Whether the model streams partial results (`streams = True`, consumer/streaming.py)."""
        return bool(getattr(self.model, "streams", False))

    # -- lifecycle ------------------------------------------------------------------
    def prepare(self) -> Policy:
        """Check Redis and settle the queue's policy (PolicyConflict if ours differs)."""
        self.policy = ensure_policy(self.redis, self.config.queue, self.config.policy)
        check_eviction_policy(self.redis)
        with contextlib.suppress(redis.ResponseError):  # an ACL limited to the queue's keys
            register_queue(self.redis, self.config.queue)
        self.delay.follow(self.policy)
        self.delay.step(force=True)  # the first pop already applies a derived delay
        self.scripts.preload("pop_batch", "complete", "extend_lease", "requeue_expired",
                             "expire_due")
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
        with self.services():
            log.info("consumer %s serving queue %r with %s%s", self.config.name,
                     self.config.queue, describe_policy(self.policy, self.delay.delay_ms),
                     ", batching continuous" if self.continuous is not None else "")
            if self.continuous is not None:
                self.continuous.run()
                return
            backoff = Backoff(outage=self.outage)
            next_step: Next = POP_NOW
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
                    elif self._overlap is not None:
                        next_step = self._overlap.fetch_here()  # pop + decode, timed
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

    @contextlib.contextmanager
    def services(self) -> Iterator[None]:
        """The threads beside the loop (lease, cost refit, derived delay, overlap) while
        the caller runs it; on leaving, whatever was computed is written and this consumer
        leaves the queue's consumer list. consumer/sharded.py runs one per shard."""
        if self.policy is None:
            self.prepare()
        if self.config.overlap and self.continuous is None:
            self._overlap = Overlap(self._fetch, self._finish, self.stopping,
                                    send=self._send_fetch)
        held = Held(lambda: self._current, lambda: self._in_model) \
            if self.continuous is None else self.continuous.held()
        if self._overlap is not None:
            held = replace(held, fetched=self._overlap.fetched,
                           completing=self._overlap.completing)
        lease = LeaseKeeper(self.redis, self.scripts, self.keys, self.config.name,
                            LeaseTimes(self.config.lease_ms, self.config.max_batch_ms), held,
                            on_policy=self._policy_seen, on_hung=self._exit_hung,
                            report=Report(self._about, self.failures),
                            result_ttl_s=lambda: self.policy.result_ttl_s if self.policy
                            else 600)
        lease.start()
        refit = CostRefit(self.redis, self.keys, self.config.cost_refit_s) \
            if self.config.cost_refit_s else None
        if refit is not None:
            refit.start()
        self.delay.start()
        try:
            yield
        finally:
            self.stopping.set()
            if self._overlap is not None:
                self._overlap.close()  # computed results are written before we leave
            if self._due_timer is not None:
                self._due_timer.close()
            lease.stop()
            if refit is not None:
                refit.stop()
            self.delay.stop()
            with contextlib.suppress(redis.RedisError):
                self.redis.zrem(self.keys.consumers, self.config.name)
                self.redis.delete(self.keys.consumer_info(self.config.name))
            log.info("consumer %s stopped after %d batches, %d requests", self.config.name,
                     self.batches_done, self.requests_done)

    def _about(self) -> dict[str, str]:
        if self.continuous is not None:  # the popped batches open, the sequences running
            return {**self.info, "batches": str(self.batches_done),
                    "requests": str(self.requests_done), **self.continuous.about()}
        current = self._current
        return {**self.info, "batches": str(self.batches_done),
                "requests": str(self.requests_done),
                "batch": current.id if current is not None else "",
                "batch_size": str(len(current.items)) if current is not None else "0"}

    # -- one step -------------------------------------------------------------------
    def _pop_call(self) -> tuple[Any, list[str], list[Any]]:
        args: list[Any] = [self.config.name, self.config.lease_ms]
        delay_ms = self.delay.delay_ms  # max_queue_delay_ms=auto: the delay derived for now
        bucket = -self.config.only_bucket or self.config.prefer_bucket  # ARGV[3]
        if bucket or delay_ms is not None:
            args.append(bucket)
        if delay_ms is not None:
            args.append(delay_ms)
        return self.scripts.pop_batch, pop_keys(self.keys), args

    def _pop(self) -> Next:
        script, keys, args = self._pop_call()
        return self._parse(script(keys=keys, args=args))

    def _fetch(self) -> Next:
        """The prefetcher's job: pop, and decode the payloads while the model runs."""
        return self._decoded(self._pop())

    def _send_fetch(self) -> SentFetch:
        """The next pop sent now, read and decoded later: Redis pops while this thread
        works on the batch before."""
        sent_s = time.monotonic()
        sent = SentScript(self.redis, *self._pop_call())

        def receive() -> Next:
            step = self._parse(sent.reply())
            if isinstance(step, Batch):  # its reply may have waited unread for a model run
                step.received_s = sent_s
            return self._decoded(step)
        return SentFetch(sent.ready, receive)

    def _decoded(self, outcome: Next) -> Next:
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
        self.delay.follow(self.policy)

    def _adopt_policy(self, stored: Policy) -> None:
        """Follow a changed stored policy (pop_batch.lua applies it anyway; result_ttl_s
        applies from the next completion on); say so, loudly where it contradicts the
        flags this consumer was started with."""
        old = self.policy
        if stored == old or old is None:
            return
        self.policy = stored
        if stored.shards != old.shards:
            # Its shard list is fixed at start (consumer/sharded.py): serve the new one
            # after a restart rather than leave shards unserved.
            log.error("queue %r: shards changed %d -> %d; this consumer exits with status "
                      "%d to be restarted", self.config.queue, old.shards, stored.shards,
                      EXIT_SHARDS_CHANGED)
            self.shards_changed = True
            self.stop()
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
        traced = self.tracer is not None
        for item in batch.items:
            if item.state is RUN:
                try:
                    if traced:
                        payload, item.trace = decode_request_traced(item.envelope or b"")
                    else:
                        payload = decode_request(item.envelope or b"")
                    runnable.append((item, payload))
                except ValueError as exc:
                    early[item.id] = (Outcome.DEAD_LETTER, encode_error(
                        item.id, "MalformedRequest", f"stored request is unreadable: {exc}"))
            elif item.state is Outcome.EXPIRED:
                early[item.id] = expired_answer(item)
            else:
                early[item.id] = (Outcome.DEAD_LETTER, encode_error(
                    item.id, "DeadLettered",
                    f"gave up after {item.attempts - 1} deliveries {self._why_exhausted}"))
        return early, runnable

    @property
    def _why_exhausted(self) -> str:
        """Why a request's deliveries ran out: under a retry policy, retries count too."""
        if self.policy is not None and self.policy.retry_on and self.policy.retry_max > 1:
            return ("(max_attempts, or retry_max if larger): each ended without a result: "
                    "its consumer crashed or hung, or its model raised a retry_on exception")
        return "(max_attempts): the consumer running it crashed or hung each time"

    def _process(self, batch: Batch) -> Next:
        """Run one batch and hand its answers over; returns what the loop does next."""
        self._current = batch
        if self.delay.derived is not None:
            self.delay.observe(batch)
        early, runnable = batch.prepared or self._prepare(batch)
        batch.prepared = None
        if self.policy is None or self.policy.on_timeout == "reject":
            runnable = self._drop_past_deadline(batch, early, runnable)
        self.batches_done += 1
        self.requests_done += len(batch.items)
        overlap = self._overlap
        shape = self._shape(runnable) if overlap is not None else None
        plan = overlap.plan(batch, shape) if overlap is not None else ALONE
        if runnable:
            if early:  # answer these now rather than after the model
                self._hand_over(Finished(batch, early, last=False),
                                overlap if plan != ALONE else None)
            if plan == MODEL:
                overlap.prefetch(shape)
            elif plan == COMPLETION:
                overlap.send_fetch(shape)
            done = self._run_model(batch, runnable, early, shape)
        else:
            done = Finished(batch, early)
        if plan != ALONE:
            # Beside the model the Completer encodes; beside a pop only the send is left
            # to it: two threads working Python would pass the GIL back and forth.
            if plan != MODEL:
                self._prepare_completion(done)
            overlap.complete(done)
            self._current = None
            return overlap.take()  # POP_NOW unless a fetch ahead was armed (MODEL)
        # Complete this batch and pop the next one in a single round trip, unless the
        # queue was empty at this pop: such a pop would most likely find nothing, and
        # would delay the results (Redis answers a pipeline as a whole). Then block after
        # completing; an arrival meanwhile left the wake-up marker, so the block returns
        # at once.
        reply = self._finish(done, pop_next=self.pop_after_complete and batch.remaining > 0
                             and not self.stopping.is_set())
        self._current = None
        if reply is not None:
            return self._parse(reply)
        return POP_NOW if batch.remaining else IDLE_UNTIL_WOKEN

    def _drop_past_deadline(self, batch: Batch, early: Answers,
                            runnable: list[tuple[Item, Any]]) -> list[tuple[Item, Any]]:
        """A batch held since its pop (fetched ahead, sent for, or behind a slow
        completion) may hold requests whose deadline passed meanwhile: they do not run,
        and are answered DeadlineExceeded with the batch's other early answers (through
        complete.lua, fenced by the batch id: once)."""
        late = batch.past_deadline()
        if not late:
            return runnable
        for item in late:
            early[item.id] = expired_answer(item)
        return [(item, payload) for item, payload in runnable if item.id not in early]

    def _shape(self, runnable: list[tuple[Item, Any]]) -> Shape:
        """(size, cost units) of the model's batch, by which its time is expected."""
        costs = [item.cost for item, _ in runnable]
        return len(costs), self.policy.batch_cost(costs) if self.policy else len(costs)

    def _run_model(self, batch: Batch, runnable: list[tuple[Item, Any]],
                   answered_early: Answers, shape: Shape | None) -> Finished:
        started = time.perf_counter()
        started_ns = time.time_ns() if self.tracer is not None else 0
        self._in_model = batch  # the lease thread's hang clock runs while this is set
        try:
            costs = [Cost(item.cost, item.requested) for item, _ in runnable] \
                if self._model_takes_costs else None
            writer = self._stream_writer(batch, [item for item, _ in runnable]) \
                if self._model_streams else None
            if writer is not None:
                writer.start()
            results = self._run_isolated([payload for _, payload in runnable], costs,
                                         writer.emitter() if writer is not None else None)
        finally:
            self._in_model = None
        model_s = time.perf_counter() - started
        if self.tracer is not None:
            self._trace_model(batch, runnable, results, started_ns)
        self.delay.record(len(runnable), model_s)
        if self._overlap is not None and shape is not None:
            self._overlap.ran(shape, model_s)
        return Finished(batch, {}, [item for item, _ in runnable], results, int(model_s * 1e6),
                        answered_early=answered_early)

    def _trace_model(self, batch: Batch, runnable: list[tuple[Item, Any]],
                     results: list[tuple[bool, Any]], started_ns: int) -> None:
        try:
            batch.span = self.tracer.model_ran(
                batch, [item for item, _ in runnable],
                self.policy.strategy.value if self.policy else "", started_ns, time.time_ns(),
                sum(1 for ok, _ in results if not ok))
        except Exception:  # tracing must never stop the consumer
            log.exception("tracing failed")

    def _hand_over(self, job: Finished, overlap: Overlap | None) -> None:
        if overlap is not None:
            overlap.complete(job)
        else:
            self._finish(job)

    def _finish(self, job: Finished, pop_next: bool = False) -> list[Any] | None:
        """Encode and write a batch's answers; with pop_next, pop the next batch in the
        same round trip and return its raw reply."""
        span = job.batch.span if job.last else None
        if span is None:
            return self._write(job, pop_next)
        job.batch.span = None
        error: BaseException | None = None
        try:
            return self._write(job, pop_next)
        except BaseException as exc:
            error = exc
            raise
        finally:
            try:
                self.tracer.completed(span, error)
            except Exception:  # tracing must never stop the consumer
                log.exception("tracing failed")

    def _prepare_completion(self, job: Finished) -> tuple[Any, list[str], list[Any]]:
        """The job's complete.lua call, made once: encode the answers and build the call
        (the Python work of a completion; done ahead, a Completer thread only sends it)."""
        if job.call is None:
            outcomes = dict(job.outcomes)
            for item, (ok, value) in zip(job.runnable, job.results, strict=True):
                outcomes[item.id] = self._retry_or_encode(item, ok, value)
            if job.last and self.observer is not None:
                self.observer.on_batch(job.batch, len(job.runnable), job.model_us,
                                       {**job.answered_early, **outcomes})
            sample = f"{len(job.runnable)}:{job.model_us}" if job.runnable else None
            job.call = self._complete_call(job.batch, outcomes, sample)
        return job.call

    def _write(self, job: Finished, pop_next: bool) -> list[Any] | None:
        complete = self._prepare_completion(job)
        pipe = ScriptPipeline(self.redis, self.config.wait_replicas, self.config.wait_timeout_ms)
        pipe.script(*complete)
        if pop_next:
            pipe.script(*self._pop_call())
        try:
            replies = pipe.execute()
        except NotReplicated as exc:  # written, not yet on enough replicas
            job.refused = int(exc.replies[0][0]) == -1
            self._check_completion(job.batch, exc.replies[0])
            self._complete_until_done(job.batch, complete, exc, landed=True)
            return exc.replies[-1] if pop_next else None
        except COMPLETION_RETRIED as exc:
            self._complete_until_done(job.batch, complete, exc)
            return None
        job.refused = int(replies[0][0]) == -1
        self._check_completion(job.batch, replies[0])
        return replies[-1] if pop_next else None

    def _complete_until_done(self, batch: Batch, complete: tuple[Any, list[str], list[Any]],
                             exc: BaseException, landed: bool = False) -> None:
        """Redis went away (or is out of memory, or too few replicas confirmed under
        --wait-replicas) while the results were on their way: they are computed, so offer
        them again until Redis takes them rather than re-run the batch; the batch stays
        held, so the lease thread keeps renewing it. complete.lua is fenced, so a resend
        whose first copy did land is refused, never applied twice (and not reported:
        `landed` says the first copy's reply was seen)."""
        backoff = Backoff(outage=self.outage, where=f" (completing batch {batch.id})")
        try:
            while True:
                backoff.sleep_after(exc)
                pipe = ScriptPipeline(self.redis, self.config.wait_replicas,
                                      self.config.wait_timeout_ms)
                pipe.script(*complete)
                try:
                    reply = pipe.execute()[0]
                except NotReplicated as again:
                    landed = landed or int(again.replies[0][0]) != -1
                    exc = again
                    continue
                except COMPLETION_RETRIED as again:
                    exc = again
                    continue
                if not (landed and int(reply[0]) == -1):
                    self._check_completion(batch, reply)
                break
        finally:  # Redis answered (or this loop is gone): its part of the outage is over
            backoff.succeeded()

    def _retry_or_encode(self, item: Item, ok: bool, value: Any) -> tuple[Outcome, bytes]:
        """A request whose model raised a retry_on exception (value: its type, message
        and the names of its class and bases) runs again after its backoff, until its
        run is the policy's retry_max-th: then it is dead-lettered with that error."""
        policy = self.policy
        if ok or len(value) < 3 or policy is None or not policy.retries(value[2]):
            return self._encode(item.id, ok, value)
        error_type, message = value[0], value[1]
        self._failed(item.id, error_type, message, attempt=item.attempts)
        run = {"attempt": item.attempts, "type": error_type, "message": message[:1000]}
        if item.attempts < policy.retry_max:
            backoff_ms = policy.retry_backoff(item.attempts, random.random())
            log.info("request %s: run %d of %d raised %s; again in %d ms", item.id,
                     item.attempts, policy.retry_max, error_type, backoff_ms)
            return RETRY, f"{backoff_ms}|".encode() + orjson.dumps(run)
        return Outcome.DEAD_LETTER, encode_error(item.id, error_type, message,
                                                 self._runs_before(item) + [run])

    def _runs_before(self, item: Item) -> list[Any]:
        """The failed runs complete.lua kept of a request whose retries ran out (its dead
        letter lists them); [] if Redis cannot say now: the last error is kept anyway.
        Only this round's: a dead letter retried starts its attempts at 1 again."""
        try:
            listed = [orjson.loads(raw) for raw in
                      self.redis.lrange(self.keys.attempts(item.id), 0, -1)]
        except (redis.RedisError, orjson.JSONDecodeError) as exc:
            log.warning("request %s: its earlier runs' errors are not in its dead letter: %s",
                        item.id, exc)
            return []
        runs: list[Any] = []
        for run in reversed(listed):  # newest first, while the attempts go down
            if run.get("attempt", 0) >= (runs[-1] if runs else {"attempt": item.attempts}
                                         )["attempt"]:
                break
            runs.append(run)
        return runs[::-1]

    def _encode(self, request_id: str, ok: bool, value: Any) -> tuple[Outcome, bytes]:
        if not ok:
            self._failed(request_id, value[0], value[1])
            return FAILED, encode_error(request_id, value[0], value[1])
        try:
            return OK, encode_result(request_id, value, self.config.max_result_bytes)
        except InvalidRequest as exc:
            self._failed(request_id, "InvalidResult", str(exc))
            return FAILED, encode_error(request_id, "InvalidResult", str(exc))

    def _failed(self, request_id: str, error_type: str, message: str,
                attempt: int | None = None) -> None:
        entry = {"id": request_id, "type": str(error_type), "message": str(message)[:200],
                 "consumer": self.config.name, "at_ms": int(time.time() * 1000)}
        if attempt is not None:  # a retry_on error: each run's is listed
            entry["attempt"] = attempt
        self.failures.append(entry)

    def _stream_writer(self, batch: Batch, items: list[Item]) -> StreamWriter:
        return StreamWriter(self.redis, self.scripts.stream_append, self.keys, batch.id, items,
                            self.policy.result_ttl_s if self.policy else 600,
                            self.config.max_result_bytes)

    def _run_isolated(self, payloads: list[Any], costs: list[Cost] | None = None,
                      emit: Emit | None = None) -> list[tuple[bool, Any]]:
        """Run the model; if it raises, split the batch to isolate the failing payloads,
        so one poison request fails alone and the others are answered. A model that
        opts in (`accepts_costs`) is also given the requests' costs: model(payloads,
        costs=...); one that streams (`streams`) its emit: model(payloads, emit=...)."""
        kwargs: dict[str, Any] = {}
        if costs is not None:
            kwargs["costs"] = costs
        if emit is not None:
            kwargs["emit"] = emit
        try:
            results = self.model(payloads, **kwargs) if kwargs else self.model(payloads)
        except Exception as exc:  # the model's failure is the request's, not ours
            if len(payloads) == 1:
                message = describe_error(exc)
                log.warning("model raised on a request: %s: %s", type(exc).__name__, message)
                # The names of its class and bases: retry_on may name any of them.
                names = tuple(cls.__name__ for cls in type(exc).__mro__)
                return [(False, (type(exc).__name__, message, names))]
            half, size = len(payloads) // 2, len(payloads)
            return self._run_isolated(payloads[:half],
                                      None if costs is None else costs[:half],
                                      None if emit is None else emit.split(0, half)) + \
                self._run_isolated(payloads[half:], None if costs is None else costs[half:],
                                   None if emit is None else emit.split(half, size))
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
        keys = complete_keys(self.keys, [(rid, producers[rid]) for rid in ids],
                             {rid for rid in ids if outcomes[rid][0] is RETRY})
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
            # Without a stored result, a request another consumer already answered
            # after the re-queue is gone too: both cases are named.
            log.warning("batch %s: its results were refused: %d of its %d requests no longer "
                        "exist (Redis lost them? restarted without persistence, or "
                        "flushed; or another consumer answered them after their lease "
                        "lapsed, with no result stored by id)", batch.id, len(lost),
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
        pipe.command("bzpopmin", [self.wake_marker, wake_key], IDLE_BLOCK_S)
        pipe.script(*self._pop_call())
        try:
            replies = pipe.execute()
        finally:
            self._due_timer.cancel()
        return self._parse(replies[-1])

    @property
    def wake_marker(self) -> str:
        """The marker this consumer blocks on: a dedicated consumer, its bucket's own."""
        only = self.config.only_bucket
        return self.keys.bucket_marker(only) if only else self.keys.marker

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
