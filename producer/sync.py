"""Producer: the synchronous client (threads, WSGI apps, scripts)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import redis

from producer.base import (
    MAX_IN_FLIGHT,
    POLL_MAX_S,
    POLL_S,
    RESENT,
    WAIT_BUDGET_S,
    CancelOutcome,
    OnResult,
    ProducerBase,
    Submission,
    rearm,
    take_batch,
)
from producer.streams import StreamHub
from producer.validation import check_timeout
from scheduler_core.compat import require_redis_version
from scheduler_core.connection import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_REDIS_URL,
    Backoff,
    close_node_clients,
    connect,
    dedicated,
    refresh_topology,
    slot_owner,
)
from scheduler_core.deadlines import expire_due
from scheduler_core.policy import Priority
from scheduler_core.registry import register_queue
from scheduler_core.scripts import ScriptPipeline, Scripts
from scheduler_core.streams import READ_COUNT, START
from scheduler_core.wire import Result, decode_result

log = logging.getLogger("batchgate.producer")
_RESOLVING = threading.Lock()
DoneCallback = Callable[["Handle"], Any]
RESOLVED = object()  # put in an open stream's events when the result is in


class Handle:
    """A submitted request. `result()` blocks until its result arrives;
    `add_done_callback(fn)` calls `fn(handle)` when it does, whoever waits."""

    def __init__(self, producer: Producer, request_id: str):
        self.id = request_id
        self._producer = producer
        self._deadline_at: float | None = None  # monotonic time after which it may expire
        self._accepted_at = 0.0
        self._poll_at: float | None = None
        self._result: Result | None = None
        # Held until the result is in: a bare lock is one C call to make, where an Event
        # (or a concurrent.futures.Future) builds a Condition per request.
        self._pending = threading.Lock()
        self._pending.acquire()
        self._callbacks: list[DoneCallback] | None = None
        self._streams: list[queue.SimpleQueue[Any]] | None = None  # open stream()s' events
        self._future: concurrent.futures.Future[Any] | None = None

    def __repr__(self) -> str:
        return f"<Handle {self.id} {'done' if self.done() else 'pending'}>"

    def _resolve(self, result: Result) -> None:
        with _RESOLVING:  # the listener and a poll may race to resolve one handle
            if self._result is not None:
                return
            self._result = result
            callbacks, self._callbacks = self._callbacks, None
            streams, self._streams = self._streams, None
        self._pending.release()
        for events in streams or ():
            events.put(RESOLVED)
        for fn in callbacks or ():
            self._call(fn)

    def _call(self, fn: DoneCallback) -> None:
        try:
            fn(self)
        except Exception:  # a broken callback must not stop the listener
            log.exception("done callback %r of request %s raised", fn, self.id)

    def add_done_callback(self, fn: DoneCallback) -> None:
        """Call `fn(handle)` once the request has ended (result, failure, deadline or
        cancel), as concurrent.futures.Future does: at once, in this thread, if it
        already has; else in the thread that resolves it, usually the producer's
        listener thread. Keep `fn` short (hand long work to an executor): results of
        other requests wait while it runs. An exception it raises is logged."""
        with _RESOLVING:
            pending = self._result is None
            if pending:
                self._callbacks = [*(self._callbacks or ()), fn]
        if not pending:
            self._call(fn)

    @property
    def future(self) -> concurrent.futures.Future[Any]:
        """A concurrent.futures.Future for this request (for `concurrent.futures.wait`,
        `as_completed` or libraries that take futures), made on first use: its result
        is `result()`'s value, or the exception `result()` raises. Cancelling the future
        does nothing (it is already running); use `cancel()`."""
        with _RESOLVING:
            made = self._future is None
            if made:
                self._future = concurrent.futures.Future()
                self._future.set_running_or_notify_cancel()
            future = self._future
        if made:
            self.add_done_callback(_settle_future)
        assert future is not None
        return future

    def _wait(self, timeout: float) -> bool:
        if self._pending.acquire(timeout=max(0.0, timeout)):
            self._pending.release()  # let any other waiter through as well
        return self._result is not None

    def done(self) -> bool:
        return self._result is not None

    def result(self, timeout: float | None = None) -> Any:
        """The model's result for this request.

        Raises RequestFailed (the model raised, or the request was dead-lettered),
        DeadlineExceeded (not run before its deadline_ms), RequestCancelled, RequestLost
        (Redis no longer knows the request: it lost it, or its result expired), or
        TimeoutError if nothing arrived within `timeout` seconds (the request stays queued).
        """
        timeout = check_timeout(timeout)
        end = None if timeout is None else time.monotonic() + timeout
        while self._result is None:
            now = time.monotonic()
            if end is not None and now >= end:
                if not self._producer._poll(self):
                    raise TimeoutError(f"no result for request {self.id} within {timeout}s")
                break
            # The listener delivers and polls; this thread only expires its request at its
            # deadline, and checks the stored result now and then should the listener stall.
            step = POLL_MAX_S if end is None else min(POLL_MAX_S, end - now)
            if self._deadline_at is not None:
                step = min(step, self._deadline_at - now)
            if self._wait(step):
                break
            if self._deadline_at is not None and time.monotonic() >= self._deadline_at:
                self._producer._expire(self)
            elif step == POLL_MAX_S:
                self._producer._poll(self)
        assert self._result is not None
        return self._result.unwrap()

    def stream(self, timeout: float | None = None, after: str | None = None) -> Iterator[Any]:
        """The request's partial results as its model emits them (a model that streams,
        docs/streaming.md), in order; a `Restart` when the request starts over (drop the
        parts received so far: those after it are the new run's, from the first). The
        iteration ends once the result is in (then `result()` does not wait); a model
        that does not stream yields nothing. TimeoutError if the result has not arrived
        within `timeout` seconds (the request stays queued). The producer reads every
        open stream with one XREAD on one connection (producer/streams.py). Any number of
        stream()s of one request may be open at once, each from the first part, or from
        the one after the entry id `after` (see `entries`)."""
        with contextlib.closing(self.entries(timeout, after)) as entries:
            for _entry_id, event in entries:
                yield event

    def entries(self, timeout: float | None = None,
                after: str | None = None) -> Iterator[tuple[str, Any]]:
        """As `stream`, with each event's stream entry id: `(entry_id, event)`. Pass the
        last id seen as `after` to resume a stream where a reader left it."""
        timeout = check_timeout(timeout)
        end = None if timeout is None else time.monotonic() + timeout
        hub = self._producer._stream_hub()
        reader = hub.open(self._producer.keys.stream(self.id), after or START)
        cursor, events = reader
        with _RESOLVING:  # _resolve wakes the stream up (RESOLVED) from now on
            if self._result is None:
                self._streams = [*(self._streams or ()), events]
        try:
            while self._result is None:
                now = time.monotonic()
                if end is not None and now >= end:
                    if not self._producer._poll(self):
                        raise TimeoutError(f"no result for request {self.id} within "
                                           f"{timeout}s")
                    break
                step = POLL_MAX_S if end is None else min(POLL_MAX_S, end - now)
                if self._deadline_at is not None:
                    step = min(step, self._deadline_at - now)
                try:
                    event = events.get(timeout=max(0.0, step))
                except queue.Empty:
                    if self._deadline_at is not None and time.monotonic() >= self._deadline_at:
                        self._producer._expire(self)
                    elif step == POLL_MAX_S:
                        self._producer._poll(self)
                    continue
                if event is not RESOLVED:
                    yield event
        finally:
            hub.close_stream(reader)  # the reader delivers nothing more: the rest is ours
            with _RESOLVING:  # closed early: _resolve has nothing to wake
                if self._streams is not None:
                    self._streams = [e for e in self._streams if e is not events] or None
        while True:
            try:
                event = events.get_nowait()
            except queue.Empty:
                break
            if event is not RESOLVED:
                yield event
        client = self._producer._redis
        while True:  # the parts were written before the result: this read sees them all
            reply = client.xread({cursor.key: cursor.last}, count=READ_COUNT)
            if not reply:
                return
            yield from cursor.feed(reply)

    def cancel(self) -> CancelOutcome:
        """Remove the request if it is still waiting: 'cancelled' (it will never run, its
        result is RequestCancelled), 'running' (already in a batch: it will complete),
        'finished' (it already has a result, or was dead-lettered), or 'lost' (Redis no
        longer knows it: lost, or its result expired; the handle fails with RequestLost)."""
        return self._producer._cancel(self, deadline=False)


def _settle_future(handle: Handle) -> None:
    future = handle._future
    assert future is not None and handle._result is not None
    if handle._result.ok:
        future.set_result(handle._result.value)
    else:
        future.set_exception(handle._result.exception())


class Producer(ProducerBase[Handle]):
    """Submits requests to one queue; one listener thread receives all their results.

    Results come back through this instance's inbox (one Redis list), drained by a single
    thread on a connection of its own that resolves the waiting handles. A request
    submitted with `store_result=True` (or an idempotency key) has its result also stored
    by id for `result_ttl_s`, so that `fetch(id)` finds it later, from any process. Any
    number of threads may submit at once: they share a pool of at most
    `max_connections` connections, and submits that arrive while enqueue calls are in
    flight travel together in the next one.
    """

    def __init__(self, redis_url: str = DEFAULT_REDIS_URL, queue: str = "default", *,
                 max_payload_bytes: int | None = None, idempotency_ttl_s: int | None = None,
                 client: redis.Redis | None = None, on_result: OnResult | None = None,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS, wait_replicas: int = 0,
                 wait_timeout_ms: int | None = None):
        super().__init__(queue, max_payload_bytes, idempotency_ttl_s, on_result,
                         wait_replicas, wait_timeout_ms)
        self._redis = client or connect(redis_url, max_connections)
        self._owns_client = client is None
        self._scripts = Scripts(self._redis)
        self._closed = threading.Event()
        self._listener: threading.Thread | None = None
        self._listener_redis: Any = None
        self._stream_reader: StreamHub | None = None
        self._stream_lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._timer: threading.Thread | None = None  # the deadline timer, made by a deadline
        self._timer_cond = threading.Condition()

    # -- public API -----------------------------------------------------------------
    def connect(self) -> Producer:
        """Do now what the first submit would otherwise do on its request's time: connect,
        check the Redis version, load the enqueue script and start the result listener.
        Call it at startup so that the first request after a deploy is not the slow one.
        Returns the producer."""
        if self._closed.is_set():
            raise RuntimeError("producer is closed")
        require_redis_version(self._redis)
        self._scripts.preload("enqueue")
        self._ensure_listener()
        return self

    def submit(self, payload: Any, priority: Priority | int | str = Priority.NORMAL,
               deadline_ms: float | None = None, idempotency_key: str | None = None,
               cost: int = 1, store_result: bool = False, tenant: str | None = None
               ) -> Handle:
        """Enqueue one request; returns its Handle once Redis has accepted it.

        Raises InvalidRequest (a ValueError naming the field) before writing anything, or
        QueueFull when the queue's max_queue_size would be exceeded. `cost` (an integer
        >= 1, in your own unit: tokens to generate, input length) is what the queue's
        cost settings budget (docs/scheduling.md); over the queue's max_cost it raises
        InvalidRequest naming `cost` (or, with over_cost=truncate, is capped).

        The result comes to this producer's handle either way; `store_result=True` also
        stores it by id for result_ttl_s, for `fetch(id)` from any process (a request
        with an idempotency key is always stored).

        `tenant` (1-64 characters from letters, digits, '_', '.', ':', '-'; None = the
        default tenant) is who the request is for: the queue's tenant quotas apply to it
        (TenantLimit, a QueueFull, when over one) and stats count it (docs/tenants.md).
        """
        return self._submit([payload], priority, deadline_ms, [idempotency_key], cost=cost,
                            store_result=store_result, tenant=tenant)[0]

    def submit_many(self, payloads: Iterable[Any], priority: Priority | int | str =
                    Priority.NORMAL, deadline_ms: float | None = None,
                    idempotency_keys: list[str | None] | None = None,
                    cost: int | Sequence[int] = 1, store_result: bool = False,
                    tenant: str | None = None) -> list[Handle]:
        """Enqueue up to 10,000 requests in one atomic script call (one round trip):
        all are accepted or, on bad input or QueueFull, none is. `cost`: one value for
        all, or one per payload. `store_result`, `tenant`: as submit's, for all of them."""
        return self._submit(payloads, priority, deadline_ms, idempotency_keys, cost=cost,
                            store_result=store_result, tenant=tenant)

    @staticmethod
    def as_completed(handles: Iterable[Handle], timeout: float | None = None
                     ) -> Iterator[Handle]:
        """Yield each handle as its request ends (finished ones first), like
        concurrent.futures.as_completed; no thread per handle. Raises TimeoutError if
        some have not ended `timeout` seconds after the call."""
        timeout = check_timeout(timeout)
        end = None if timeout is None else time.monotonic() + timeout
        unique = list(dict.fromkeys(handles))
        ended: queue.SimpleQueue[Handle] = queue.SimpleQueue()
        for handle in unique:
            handle.add_done_callback(ended.put)
        for _ in unique:
            try:
                yield ended.get(timeout=None if end is None
                                else max(0.0, end - time.monotonic()))
            except queue.Empty:
                left = sum(not h.done() for h in unique)
                raise TimeoutError(f"{left} of {len(unique)} requests not finished within "
                                   f"{timeout}s") from None

    def fetch(self, request_id: str) -> Result | None:
        """The stored result of a request of this queue submitted with
        `store_result=True` (or an idempotency key), or None if there is none: still
        waiting or running, unknown, expired after result_ttl_s, or submitted without
        asking for storage (its result went only to its producer's handle)."""
        raw = self._redis.get(self.keys.result(request_id))
        return decode_result(raw) if raw is not None else None

    def close(self) -> None:
        self._closed.set()
        with self._timer_cond:
            self._timer_cond.notify_all()
        if self._timer is not None:
            self._timer.join(timeout=5)
        if self._listener is not None:
            self._wake_listener()
            self._listener.join(timeout=5)
        if self._listener_redis is not None and self._listener_redis is not self._redis:
            self._listener_redis.close()
        if self._stream_reader is not None:
            self._stream_reader.close()
        if self._owns_client:
            close_node_clients(self._redis)
            self._redis.close()

    def _stream_hub(self) -> StreamHub:
        """The reader of this producer's open streams, made on first use."""
        if self._stream_reader is None:
            with self._stream_lock:
                if self._stream_reader is None:
                    self._stream_reader = StreamHub(self._redis, self.id)
        return self._stream_reader

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------
    def _submit(self, payloads: Iterable[Any], priority: Any, deadline_ms: Any,
                idempotency_keys: list[str | None] | None, cost: Any = 1,
                store_result: Any = False, tenant: Any = None) -> list[Handle]:
        if self._closed.is_set():
            raise RuntimeError("producer is closed")
        submission, handles = self._prepare(
            payloads, priority, deadline_ms, idempotency_keys, lambda rid: Handle(self, rid),
            cost, store_result, tenant)
        try:
            require_redis_version(self._redis)  # once per client: BLMPOP needs Redis 7
            self._ensure_listener()
            ids = self._enqueue(submission)
        except BaseException:
            self._forget(submission.requests)
            raise
        if self._accepted(submission.requests, handles, ids, submission.deadlines):
            self._arm_timer()
        return handles

    # -- the deadline timer ------------------------------------------------------------
    def _arm_timer(self) -> None:
        """A new earliest deadline: (start and) wake the deadline timer to wait for it."""
        with self._timer_cond:
            if self._timer is None:
                self._timer = threading.Thread(
                    target=self._deadline_loop, name=f"batchgate-deadlines-{self.id[:8]}",
                    daemon=True)
                self._timer.start()
            self._timer_cond.notify_all()

    def _deadline_loop(self) -> None:
        """Wait for the earliest deadline of this producer's requests, then take the
        requests past their deadline out of the queue (expire_due.lua: their results
        reach the inbox, and the listener resolves the handles). No polling: it sleeps
        until that moment, or until an earlier deadline arrives."""
        while True:
            with self._timer_cond:
                while not self._closed.is_set():
                    at = self._next_deadline
                    delay = None if at is None else at - time.monotonic()
                    if delay is not None and delay <= 0:
                        break
                    self._timer_cond.wait(delay)
                if self._closed.is_set():
                    return
            due = self._take_due()
            if due:
                try:
                    self._expire_all_due()
                except Exception as exc:  # Redis away, or a policy altered by hand
                    log.warning("producer: could not expire requests past their deadline "
                                "(%s); trying again", exc)
                    self._expiry_failed(due)

    def _enqueue(self, sub: Submission) -> list[str]:
        """Send `sub` with whatever else waits to be sent, and return its ids.

        At most MAX_IN_FLIGHT threads send at a time. A thread arriving while they are
        busy queues its submission and sleeps; a sender that is done hands its place to
        the oldest sleeper, which takes every submission queued meanwhile (its own first)
        into one call. Nobody waits for a timer: a lone submit goes at once.
        """
        sub.waiter = threading.Lock()
        sub.waiter.acquire()
        with self._send_lock:
            self._pending.append(sub)
            batch = None
            if self._in_flight < MAX_IN_FLIGHT:
                self._in_flight += 1
                batch = take_batch(self._pending)
        if batch is None:
            try:
                sub.waiter.acquire()  # released once sent by another thread, or handed the lead
            except BaseException:  # Ctrl-C: leave nobody waiting on this thread
                self._abandon(sub)
                raise
            batch = sub.handed
        if batch is not None:
            try:
                self._send(batch)
            finally:
                self._hand_off()
        return sub.outcome()

    def _register(self, batch: list[Submission]) -> None:
        """Once per producer, after its first accepted enqueue (a refused one writes
        nothing): one ZADD. Its failure never fails the submit, which is done."""
        if self._registered or not any(sub.ids for sub in batch):
            return
        try:
            register_queue(self._redis, self.config.queue)
            self._registered = True
        except redis.ResponseError as exc:  # an ACL limited to the queue's keys
            self._registered = True
            log.debug("queue registry not updated: %s", exc)
        except redis.RedisError as exc:  # tried again at the next submit
            log.debug("queue registry not updated: %s", exc)

    def _send(self, batch: list[Submission]) -> None:
        try:
            keys, args = self._batch_call(batch)
            if not self._settle(batch, self._enqueue_calls([(keys, args)], True)[0]):
                self._settle_each(batch, self._enqueue_calls(self._each_call(batch), False))
        except BaseException as exc:  # each of its callers gets the error
            self._fail(batch, exc)
        finally:
            self._register(batch)
            for sub in batch:
                if sub.waiter.locked():  # not if its caller was interrupted (_abandon)
                    sub.waiter.release()

    def _enqueue_calls(self, calls: Iterable[tuple[list[str], list[Any]]],
                       raise_on_error: bool) -> list[Any]:
        """Run enqueue calls in one round trip. With wait_replicas, after a WAIT that
        confirms them, resending through a failover (or too few replicas) until
        WAIT_BUDGET_S has passed."""
        calls = list(calls)
        if not self.config.wait_replicas and len(calls) == 1 and raise_on_error:
            keys, args = calls[0]  # the common case: one EVALSHA (loads on NOSCRIPT)
            return [self._scripts.enqueue(keys=keys, args=args)]
        if not self.config.wait_replicas:
            pipe = ScriptPipeline(self._redis)
            for keys, args in calls:
                pipe.script(self._scripts.enqueue, keys, args)
            return pipe.execute(raise_on_error)
        backoff = Backoff(f"producer {self.id[:8]} (waiting for replicas)")
        give_up = time.monotonic() + WAIT_BUDGET_S
        while True:
            pipe = ScriptPipeline(self._redis, self.config.wait_replicas,
                                  self.config.wait_timeout_ms)
            for keys, args in calls:
                pipe.script(self._scripts.enqueue, keys, args)
            try:
                replies = pipe.execute(raise_on_error)
                backoff.succeeded()
                return replies
            except RESENT as exc:
                if time.monotonic() >= give_up:
                    raise
                backoff.sleep_after(exc)

    def _abandon(self, sub: Submission) -> None:
        """The caller of `sub` is leaving before its answer: still queued, it is dropped
        (nothing written); handed the lead, it is sent for the others queued with it."""
        with self._send_lock:
            queued = sub in self._pending
            if queued:
                self._pending.remove(sub)
        if not queued and sub.handed is not None and sub.ids is None and sub.error is None:
            try:
                self._send(sub.handed)
            finally:
                self._hand_off()

    def _hand_off(self) -> None:
        with self._send_lock:
            if not self._pending:
                self._in_flight -= 1
                return
            nxt = self._pending[0]
            nxt.handed = take_batch(self._pending)
        nxt.waiter.release()

    def _ensure_listener(self) -> None:
        if self._listener is None:
            with self._lock:
                if self._listener is None:
                    self._listener_redis = dedicated(self._redis)
                    self._listener = threading.Thread(
                        target=self._listen, name=f"batchgate-listener-{self.id[:8]}",
                        daemon=True)
                    self._listener.start()

    def _listen(self) -> None:
        inbox = self.keys.inbox(self.id)
        backoff = Backoff("producer listener")
        next_sweep = time.monotonic() + POLL_S
        while not self._closed.is_set():
            try:
                popped = self._listener_redis.blmpop(1, 1, inbox, direction="LEFT",
                                                     count=512)
                backoff.succeeded()
            except redis.RedisError as exc:  # also NOPERM, READONLY after a failover, ...
                if self._closed.is_set():
                    return
                backoff.sleep_after(exc)
                continue
            for raw in popped[1] if popped else ():
                if raw:  # b"" is close()'s wake-up
                    self._deliver(raw)
            if time.monotonic() >= next_sweep:
                try:
                    self._sweep()
                except Exception:  # a broken sweep must not stop the deliveries
                    log.exception("producer listener: sweep failed")
                next_sweep = time.monotonic() + POLL_S

    def _sweep(self) -> None:
        """Fetch stored results that the inbox did not deliver (the deadline timer
        expires requests)."""
        _, poll = self._due()
        for chunk in poll:
            try:  # on a cluster, the MULTI goes to the primary serving the queue's slot
                pipe = slot_owner(self._redis, self.keys.jobs).pipeline(transaction=True)
                checked = self._poll_reads(pipe, chunk)
                self._polled(chunk, checked, pipe.execute())
            except redis.RedisError as exc:
                refresh_topology(self._redis, exc)
                return  # polled again at the next sweep

    def _wake_listener(self) -> None:
        """End the listener's blocking pop now instead of at its 1 s timeout: an empty
        item in this producer's own inbox (skipped; it expires if never popped)."""
        inbox = self.keys.inbox(self.id)
        try:
            pipe = self._redis.pipeline(transaction=False)
            pipe.lpush(inbox, b"")
            pipe.expire(inbox, 10)
            pipe.execute()
        except redis.RedisError:
            pass  # the pop times out by itself

    def _poll(self, handle: Handle) -> bool:
        """Resolve `handle` from its stored result, if there is one."""
        try:
            return self._resolve_stored(handle, self.fetch(handle.id))
        except (redis.ConnectionError, redis.TimeoutError):
            return False

    def _cancel(self, handle: Handle, deadline: bool) -> CancelOutcome:
        keys, args, envelope = self._cancel_call(handle.id, deadline)
        return self._cancelled(handle, self._scripts.cancel(keys=keys, args=args), envelope)

    def _expire(self, handle: Handle) -> None:
        """Past its deadline: take what is due out of the queue (expire_due.lua) so it
        is never run; its DeadlineExceeded reaches the inbox. One attempt; if it is
        already running, or delayed (on_timeout = delay), its result will come."""
        handle._deadline_at = None
        try:
            self._expire_all_due()
        except (redis.ConnectionError, redis.TimeoutError):
            rearm(handle)

    def _expire_all_due(self) -> None:
        """Sweeps until no request is past its deadline: the handles taken off the timer
        are not looked at again (each sweep is bounded; Redis serves others between)."""
        while expire_due(self._scripts, self.keys, self.config.result_ttl_s).more:
            pass
