"""What Producer and AsyncProducer share: configuration, the handle registry, the script
arguments and how concurrent submits are coalesced. The subclasses add only their I/O
(threads or asyncio)."""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, Protocol, TypeVar

import redis

from producer.validation import (
    ProducerConfig,
    build_requests,
    cancel_envelope,
    local_deadline,
    new_id,
)
from scheduler_core.errors import InvalidRequest, NotReplicated, QueueFull
from scheduler_core.keys import QueueKeys
from scheduler_core.scripts import (
    NewRequest,
    Scripts,
    cancel_keys,
    enqueue_call,
    enqueue_deadlines,
    enqueue_reply,
)
from scheduler_core.wire import Result, decode_result, lost_result

log = logging.getLogger("batchgate.producer")

CancelOutcome = Literal["cancelled", "running", "finished", "lost"]
CANCEL_OUTCOMES: dict[int, CancelOutcome] = {1: "cancelled", 2: "running", 0: "finished",
                                             3: "lost"}
# Lost-inbox fallback (a result popped from the inbox whose reply never arrived, an inbox
# expired): the listener checks `result:<id>` of a handle POLL_S after its submit, then at
# doubling ages, at most POLL_MAX_S apart, many ids per MGET. Only requests submitted with
# store_result (or an idempotency key) have one; the others' results exist only in the
# inbox.
POLL_S = 1.0
POLL_MAX_S = 30.0
# From this age on, the same poll also asks whether Redis still knows the request (in
# jobs: waiting, in flight or dead-lettered), in the same MULTI as the result and the
# inbox's length: one that is nowhere, has no stored result, while the inbox is empty (a
# finished request's result may wait there, unread), was lost by Redis (or its result
# expired or was lost in transit), and its handle fails with RequestLost. Younger handles
# skip the check: it is not needed on the hot path.
LOST_CHECK_AFTER_S = 2.0
SWEEP_CHUNK = 500  # handles per MGET or cancel pipeline in a sweep

# Coalescing: submits that wait while enqueue calls are in flight travel together in the
# next call. Two calls in flight keep one producer's connection busy while it prepares
# the next; the caps keep one call's time inside Redis (which blocks every other client
# meanwhile) to a few milliseconds.
MAX_IN_FLIGHT = 2
# With wait_replicas: how long a submit keeps resending its enqueue (safe: the script
# adds an id only once) until enough replicas confirm it, through a failover's outage.
WAIT_BUDGET_S = 30.0
# Errors after which an acknowledged call is resent (a failover in progress).
RESENT = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ClusterDownError,
          redis.exceptions.TryAgainError, redis.exceptions.MovedError,
          redis.exceptions.ReadOnlyError, NotReplicated)
MAX_COALESCED_REQUESTS = 1_000
MAX_COALESCED_BYTES = 4 << 20


class SubmittedHandle(Protocol):
    """What the shared producer logic needs of a handle."""

    id: str  # the request's id; after an idempotent duplicate, the first request's
    _deadline_at: float | None  # time.monotonic() after which the producer may expire it
    _accepted_at: float  # time.monotonic() when Redis accepted it
    _poll_at: float | None  # when the listener next checks its stored result
    _result: Result | None  # set once it has ended

    def _resolve(self, result: Result) -> None:
        """Deliver its result (the first call wins; later ones are ignored)."""


H = TypeVar("H", bound=SubmittedHandle)
# Called by the listener for every result this producer's inbox delivers, before the
# handle is resolved (the demo and the benchmark stamp arrival times with it).
OnResult = Callable[[Result], None]


@dataclass(eq=False)
class Submission:
    """The requests of one submit/submit_many call, waiting for their enqueue. Each keeps
    its all-or-nothing answer: `ids`, or `error` (QueueFull, a Redis error)."""

    requests: list[NewRequest]
    size: int = 0  # envelope bytes
    ids: list[str] | None = None
    deadlines: list[int] | None = None  # ms: the deadline each got (the policy's default)
    error: BaseException | None = None
    waiter: Any = field(default=None, repr=False)  # the I/O side's signal (lock, future)
    handed: list[Submission] | None = field(default=None, repr=False)  # sync: lead this

    def outcome(self) -> list[str]:
        if self.error is not None:
            raise self.error
        assert self.ids is not None
        return self.ids


def take_batch(pending: deque[Submission]) -> list[Submission]:
    """The submissions at the head of `pending` that fit in one enqueue call (at least
    one: a submit_many alone may exceed the caps)."""
    first = pending.popleft()
    batch, count, size = [first], len(first.requests), first.size
    while pending:
        nxt = pending[0]
        count += len(nxt.requests)
        size += nxt.size
        if count > MAX_COALESCED_REQUESTS or size > MAX_COALESCED_BYTES:
            break
        batch.append(pending.popleft())
    return batch


class ProducerBase(Generic[H]):
    _scripts: Scripts  # the subclass's, registered on its client

    def __init__(self, queue: str, max_payload_bytes: int | None,
                 idempotency_ttl_s: int | None, on_result: OnResult | None = None,
                 wait_replicas: int = 0, wait_timeout_ms: int | None = None):
        overrides = {k: v for k, v in (("max_payload_bytes", max_payload_bytes),
                                       ("idempotency_ttl_s", idempotency_ttl_s),
                                       ("wait_replicas", wait_replicas),
                                       ("wait_timeout_ms", wait_timeout_ms)) if v is not None}
        self.config = ProducerConfig(queue=queue, **overrides)
        self.keys = QueueKeys(queue)
        self.id = new_id()
        self._handles: dict[str, H] = {}
        # Further handles answered under an id already in _handles: idempotent duplicates.
        self._duplicates: dict[str, list[H]] = {}
        self._lock = threading.Lock()  # the sync listener thread resolves handles too
        self._on_result = on_result
        self._pending: deque[Submission] = deque()
        self._in_flight = 0
        # The deadline timer's heap of (deadline, seq, handle), and its next firing: the
        # earliest deadline of a waiting handle (time.monotonic()). Entries of handles
        # that ended meanwhile are dropped as they reach the top, so the timer wakes for
        # waiting handles only: about once per deadline span, plus once per expiry. Weak
        # references: a handle that has ended is not kept alive until its deadline.
        self._deadlines: list[tuple[float, int, weakref.ref[H]]] = []
        self._deadline_seq = itertools.count()
        self._next_deadline: float | None = None
        self._registered = False  # the queue marked seen (scheduler_core/registry.py)

    def _prepare(self, payloads: Iterable[Any], priority: Any, deadline_ms: Any,
                 idempotency_keys: list[str | None] | None,
                 make_handle: Callable[[str], H], cost: Any = 1,
                 store_result: Any = False, tenant: Any = None
                 ) -> tuple[Submission, list[H]]:
        """Validate (raising before any write) and register handles. Handles are
        registered first so that no result can arrive before its handle."""
        requests = build_requests(self.config, payloads, priority, deadline_ms,
                                  idempotency_keys, cost, store_result, tenant)
        handles = [make_handle(r.id) for r in requests]
        with self._lock:
            for r, h in zip(requests, handles, strict=True):
                self._handles[r.id] = h
        return Submission(requests, sum(len(r.envelope) for r in requests)), handles

    def _forget(self, requests: list[NewRequest]) -> None:
        with self._lock:
            for r in requests:
                self._handles.pop(r.id, None)

    def _accepted(self, requests: list[NewRequest], handles: list[H], ids: list[str],
                  deadlines: list[int] | None = None) -> bool:
        """Arm deadlines and polls; an idempotent duplicate is answered under the first
        request's id. `deadlines`: the deadline (ms) each request got from enqueue.lua,
        its own or its level's default. True if the earliest deadline moved earlier (the
        deadline timer must be re-armed)."""
        now = time.monotonic()
        given = deadlines or [r.deadline_ms for r in requests]
        earlier = False
        with self._lock:
            for request, h, effective, deadline_ms in zip(requests, handles, ids, given,
                                                          strict=True):
                h._deadline_at = local_deadline(deadline_ms)
                if h._deadline_at is not None:
                    earlier |= self._push_deadline(h)
                h._accepted_at, h._poll_at = now, now + POLL_S
                if effective != request.id:
                    self._handles.pop(request.id, None)
                    h.id = effective
                    if effective in self._handles:
                        self._duplicates.setdefault(effective, []).append(h)
                    else:
                        self._handles[effective] = h
        return earlier

    def _take(self, request_id: str) -> list[H]:
        """Unregister and return every handle waiting for `request_id`."""
        with self._lock:
            first = self._handles.pop(request_id, None)
            more = self._duplicates.pop(request_id, ()) if self._duplicates else ()
        return [first, *more] if first is not None else list(more)

    def _deliver(self, raw: bytes) -> None:
        """Resolve the handles an inbox item belongs to. Called once per result envelope
        the inbox delivers, after the `on_result` hook."""
        try:
            result = decode_result(raw)
        except (ValueError, KeyError) as exc:
            log.error("dropping malformed result envelope: %s", exc)
            return
        if self._on_result is not None:
            try:
                self._on_result(result)
            except Exception:  # a broken hook must not stop the listener
                log.exception("on_result hook failed for %s", result.id)
        for handle in self._take(result.id):
            handle._resolve(result)

    # -- coalesced enqueue (the I/O sides send and signal) -----------------------------
    def _batch_call(self, batch: list[Submission]) -> tuple[list[str], list[Any]]:
        requests = batch[0].requests if len(batch) == 1 else \
            [r for s in batch for r in s.requests]
        # Several submissions: a refusal sends each again alone (_settle), so this call's
        # refusal is not counted against a tenant (it would count twice).
        return enqueue_call(self.keys, self.id, requests, self.config.idempotency_ttl_s,
                            trial=len(batch) > 1)

    def _settle(self, batch: list[Submission], reply: Any) -> bool:
        """Hand each submission its ids from one coalesced call's reply. False when the
        call was refused as a whole (QueueFull) while holding several submissions: then
        nothing was written and each must be sent again alone, so that one caller's
        QueueFull is its own and not its neighbours'."""
        try:
            ids = enqueue_reply(self.keys, reply)
        except (QueueFull, InvalidRequest) as exc:
            if len(batch) > 1:
                return False
            batch[0].error = exc
            return True
        deadlines = enqueue_deadlines(reply)
        start = 0
        for sub in batch:
            sub.ids = ids[start:start + len(sub.requests)]
            sub.deadlines = deadlines[start:start + len(sub.requests)]
            start += len(sub.requests)
        return True

    def _each_call(self, batch: list[Submission]) -> list[tuple[list[str], list[Any]]]:
        """One enqueue call per submission, to send in arrival order in one pipeline."""
        return [enqueue_call(self.keys, self.id, sub.requests, self.config.idempotency_ttl_s)
                for sub in batch]

    def _settle_each(self, batch: list[Submission], replies: list[Any]) -> None:
        for sub, reply in zip(batch, replies, strict=True):
            if isinstance(reply, Exception):
                sub.error = reply
                continue
            try:
                sub.ids = enqueue_reply(self.keys, reply)
                sub.deadlines = enqueue_deadlines(reply)
            except (QueueFull, InvalidRequest) as exc:
                sub.error = exc

    @staticmethod
    def _fail(batch: list[Submission], exc: BaseException) -> None:
        for sub in batch:
            if sub.ids is None and sub.error is None:
                sub.error = exc

    # -- the deadline timer -------------------------------------------------------------
    def _push_deadline(self, h: H) -> bool:
        """Add `h` at its _deadline_at (under self._lock); True if it is the earliest."""
        at = h._deadline_at
        assert at is not None
        heapq.heappush(self._deadlines, (at, next(self._deadline_seq), weakref.ref(h)))
        if self._next_deadline is None or at < self._next_deadline:
            self._next_deadline = at
            return True
        return False

    def _take_due(self) -> list[H]:
        """The waiting handles past their deadline (one expiry attempt each); the timer's
        next time becomes the earliest deadline of the others."""
        heap, due = self._deadlines, []
        with self._lock:
            now = time.monotonic()
            while heap:
                at, _, ref = heap[0]
                h = ref()
                live = h is not None and h._deadline_at == at and h._result is None
                if live and at > now:
                    break
                heapq.heappop(heap)
                if h is not None and live:
                    h._deadline_at = None
                    due.append(h)
            self._next_deadline = heap[0][0] if heap else None
        return due

    def _expiry_failed(self, handles: list[H]) -> None:
        """An expiry that could not reach Redis: try again a little later."""
        with self._lock:
            for h in handles:
                rearm(h)
                self._push_deadline(h)

    # -- the listener's sweep ------------------------------------------------------------
    def _due(self) -> tuple[list[list[H]], list[list[H]]]:
        """Chunks of the handles due for a check of their stored result (the next one
        planned); their deadlines are the deadline timer's."""
        with self._lock:
            handles = [*self._handles.values(),
                       *(h for more in self._duplicates.values() for h in more)]
        now = time.monotonic()
        poll = []
        for h in handles:
            if h._poll_at is not None and now >= h._poll_at:
                h._poll_at = now + min(POLL_MAX_S, max(POLL_S, now - h._accepted_at))
                poll.append(h)
        return [], _chunks(poll)

    def _poll_reads(self, pipe: Any, handles: list[H]) -> list[H]:
        """Queue on `pipe` (a MULTI, sync or asyncio) the reads of a poll of `handles`:
        whether Redis still knows those old enough to check (see LOST_CHECK_AFTER_S),
        then all their stored results. Returns the handles checked."""
        now = time.monotonic()
        checked = [h for h in handles if now - h._accepted_at >= LOST_CHECK_AFTER_S]
        for h in checked:
            pipe.hexists(self.keys.jobs, h.id)
        pipe.llen(self.keys.inbox(self.id))
        pipe.mget([self.keys.result(h.id) for h in handles])
        return checked

    @staticmethod
    def _maybe_lost(checked: list[H], replies: list[Any]) -> bool:
        """Whether a poll's replies may declare a handle lost (then the async listener
        first lets a pop already in flight deliver what it took)."""
        *known, unread, _ = replies
        return not unread and not all(known)

    def _polled(self, handles: list[H], checked: list[H], replies: list[Any]) -> None:
        """Resolve the handles with a stored result, and as lost those Redis no longer
        knows. One MULTI: a request that completes between the reads cannot be taken for
        lost (the result is stored as the request leaves jobs, atomically)."""
        *known, unread, raws = replies
        stored = {}
        for handle, raw in zip(handles, raws, strict=True):
            if raw is not None:
                stored[handle.id] = raw
                self._resolve_all(handle, decode_result(raw))
        # Results still in the inbox are delivered by the listener's next pop: none of
        # this poll's handles is taken for lost meanwhile.
        lost = [] if unread else [h for h, exists in zip(checked, known, strict=True)
                                  if not exists and h.id not in stored]
        if lost:
            log.warning("%d requests (%s, ...) no longer exist in Redis (lost, or their "
                        "result expired): their handles fail with RequestLost", len(lost),
                        lost[0].id)
        for handle in lost:
            self._resolve_all(handle, lost_result(handle.id))

    # -- cancel, poll ------------------------------------------------------------------
    def _cancel_call(self, request_id: str, deadline: bool) -> tuple[list[str], list[Any], bytes]:
        envelope, counter = cancel_envelope(request_id, deadline)
        return (cancel_keys(self.keys, request_id, self.id),
                [request_id, self.config.result_ttl_s, envelope, counter], envelope)

    def _cancelled(self, handle: H, reply: Any, envelope: bytes) -> CancelOutcome:
        outcome = CANCEL_OUTCOMES[int(reply)]
        if outcome == "lost" and handle._result is not None:
            return "finished"  # its result, not stored by id, reached the handle already
        if outcome == "cancelled":
            self._resolve_all(handle, decode_result(envelope))
        elif outcome == "lost":
            self._resolve_all(handle, lost_result(handle.id))
        return outcome

    def _resolve_stored(self, handle: H, result: Result | None) -> bool:
        if result is None:
            return False
        self._resolve_all(handle, result)
        return True

    def _resolve_all(self, handle: H, result: Result) -> None:
        for other in self._take(handle.id):
            other._resolve(result)
        handle._resolve(result)


def _chunks(items: list[H]) -> list[list[H]]:
    return [items[i:i + SWEEP_CHUNK] for i in range(0, len(items), SWEEP_CHUNK)]


def rearm(handle: SubmittedHandle) -> None:
    """An expiry that could not reach Redis: try again a little later."""
    handle._deadline_at = time.monotonic() + POLL_S
