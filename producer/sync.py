"""Producer: the synchronous client (threads, WSGI apps, scripts)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

import redis

from producer.base import POLL_S, CancelOutcome, OnResult, ProducerBase
from producer.validation import check_timeout
from scheduler_core.compat import require_redis_version
from scheduler_core.connection import DEFAULT_REDIS_URL, Backoff, connect
from scheduler_core.policy import Priority
from scheduler_core.scripts import Scripts, enqueue_reply
from scheduler_core.wire import Result, decode_result

log = logging.getLogger("batchgate.producer")
_RESOLVING = threading.Lock()


class Handle:
    """A submitted request. `result()` blocks until its result arrives."""

    def __init__(self, producer: Producer, request_id: str):
        self.id = request_id
        self._producer = producer
        self._deadline_at: float | None = None  # monotonic time after which it may expire
        self._result: Result | None = None
        # Held until the result is in: a bare lock is one C call to make, where an Event
        # builds a Condition per request.
        self._pending = threading.Lock()
        self._pending.acquire()

    def __repr__(self) -> str:
        return f"<Handle {self.id} {'done' if self.done() else 'pending'}>"

    def _resolve(self, result: Result) -> None:
        with _RESOLVING:  # the listener and a poll may race to resolve one handle
            if self._result is not None:
                return
            self._result = result
        self._pending.release()

    def _wait(self, timeout: float) -> bool:
        if self._pending.acquire(timeout=timeout):
            self._pending.release()  # let any other waiter through as well
        return self._result is not None

    def done(self) -> bool:
        return self._result is not None

    def result(self, timeout: float | None = None) -> Any:
        """The model's result for this request.

        Raises RequestFailed (the model raised, or the request was dead-lettered),
        DeadlineExceeded (not run before its deadline_ms), RequestCancelled, or
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
            step = POLL_S if end is None else min(POLL_S, end - now)
            if self._deadline_at is not None:
                step = min(step, max(0.0, self._deadline_at - now))
            if self._wait(step):
                break
            if self._deadline_at is not None and time.monotonic() >= self._deadline_at:
                self._producer._expire(self)
            self._producer._poll(self)
        assert self._result is not None
        return self._result.unwrap()

    def cancel(self) -> CancelOutcome:
        """Remove the request if it is still waiting: 'cancelled' (it will never run, its
        result is RequestCancelled), 'running' (already in a batch: it will complete), or
        'finished' (it already has a result)."""
        return self._producer._cancel(self, deadline=False)


class Producer(ProducerBase[Handle]):
    """Submits requests to one queue; one listener thread receives all their results.

    Results come back through this instance's inbox (one Redis list), drained by a single
    thread that resolves the waiting handles, and are also stored by id for
    `result_ttl_s` so that `fetch(id)` finds them later, from any process.
    """

    def __init__(self, redis_url: str = DEFAULT_REDIS_URL, queue: str = "default", *,
                 max_payload_bytes: int | None = None, idempotency_ttl_s: int | None = None,
                 client: redis.Redis | None = None, on_result: OnResult | None = None):
        super().__init__(queue, max_payload_bytes, idempotency_ttl_s, on_result)
        self._redis = client or connect(redis_url)
        self._owns_client = client is None
        self._scripts = Scripts(self._redis)
        self._closed = threading.Event()
        self._listener: threading.Thread | None = None

    # -- public API -----------------------------------------------------------------
    def submit(self, payload: Any, priority: Priority | int | str = Priority.NORMAL,
               deadline_ms: float | None = None, idempotency_key: str | None = None) -> Handle:
        """Enqueue one request; returns its Handle once Redis has accepted it.

        Raises InvalidRequest (a ValueError naming the field) before writing anything, or
        QueueFull when the queue's max_queue_size would be exceeded.
        """
        return self._submit([payload], priority, deadline_ms, [idempotency_key])[0]

    def submit_many(self, payloads: Iterable[Any], priority: Priority | int | str =
                    Priority.NORMAL, deadline_ms: float | None = None,
                    idempotency_keys: list[str | None] | None = None) -> list[Handle]:
        """Enqueue up to 10,000 requests in one atomic script call (one round trip):
        all are accepted or, on bad input or QueueFull, none is."""
        return self._submit(payloads, priority, deadline_ms, idempotency_keys)

    def fetch(self, request_id: str) -> Result | None:
        """The stored result of any request of this queue, or None if there is none (still
        waiting or running, unknown, or expired after result_ttl_s)."""
        raw = self._redis.get(self.keys.result(request_id))
        return decode_result(raw) if raw is not None else None

    def close(self) -> None:
        self._closed.set()
        if self._listener is not None:
            self._wake_listener()
            self._listener.join(timeout=5)
        if self._owns_client:
            self._redis.close()

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------
    def _submit(self, payloads: Iterable[Any], priority: Any, deadline_ms: Any,
                idempotency_keys: list[str | None] | None) -> list[Handle]:
        if self._closed.is_set():
            raise RuntimeError("producer is closed")
        requests, handles, keys, args = self._prepare(
            payloads, priority, deadline_ms, idempotency_keys, lambda rid: Handle(self, rid))
        try:
            require_redis_version(self._redis)  # once per client: BLMPOP needs Redis 7
            self._ensure_listener()
            ids = enqueue_reply(self.keys, self._scripts.enqueue(keys=keys, args=args))
        except BaseException:
            self._forget(requests)
            raise
        self._accepted(requests, handles, ids)
        return handles

    def _ensure_listener(self) -> None:
        if self._listener is None:
            with self._lock:
                if self._listener is None:
                    self._listener = threading.Thread(
                        target=self._listen, name=f"batchgate-listener-{self.id[:8]}",
                        daemon=True)
                    self._listener.start()

    def _listen(self) -> None:
        inbox = self.keys.inbox(self.id)
        backoff = Backoff("producer listener")
        while not self._closed.is_set():
            try:
                popped = self._redis.blmpop(1, 1, inbox, direction="LEFT", count=512)
                backoff.succeeded()
            except redis.RedisError as exc:  # also NOPERM, READONLY after a failover, ...
                if self._closed.is_set():
                    return
                backoff.sleep_after(exc)
                continue
            for raw in popped[1] if popped else ():
                if raw:  # b"" is close()'s wake-up
                    self._deliver(raw)

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
        """Past its deadline and still waiting: remove it so it is never run."""
        handle._deadline_at = None  # one attempt; if running, its result will come
        try:
            self._cancel(handle, deadline=True)
        except (redis.ConnectionError, redis.TimeoutError):
            handle._deadline_at = time.monotonic() + POLL_S
