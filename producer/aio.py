"""AsyncProducer: the asyncio client for async web apps (FastAPI, aiohttp, ...).

Same contract as `producer.sync.Producer`; one listener task per instance drains the
inbox, on a connection of its own, and resolves the awaiting handles. Submits made in the
same event-loop turn, or while earlier enqueue calls are in flight, travel together.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

import redis
import redis.asyncio

from producer import base
from producer.base import CancelOutcome, OnResult, ProducerBase, Submission
from producer.streams import AsyncStreamHub
from producer.validation import check_timeout
from scheduler_core import connection
from scheduler_core.compat import require_redis_version_async
from scheduler_core.connection import Backoff, dedicated
from scheduler_core.deadlines import expire_due_async
from scheduler_core.policy import Priority
from scheduler_core.registry import register_queue_async
from scheduler_core.scripts import AsyncScriptPipeline, Scripts
from scheduler_core.streams import READ_COUNT, START
from scheduler_core.wire import Result, decode_result

log = logging.getLogger("batchgate.producer")
RESOLVED = object()  # put in an open stream's events when the result is in


class AsyncHandle:
    def __init__(self, producer: AsyncProducer, request_id: str):
        self.id = request_id
        self._producer = producer
        self._deadline_at: float | None = None
        self._accepted_at = 0.0
        self._poll_at: float | None = None
        self._result: Result | None = None
        self._waiter: asyncio.Future[None] | None = None  # made when someone awaits
        self._streams: list[asyncio.Queue[Any]] | None = None  # open stream()s' events

    def _resolve(self, result: Result) -> None:
        if self._result is None:
            self._result = result
            if self._waiter is not None and not self._waiter.done():
                self._waiter.set_result(None)
            streams, self._streams = self._streams, None
            for events in streams or ():
                events.put_nowait(RESOLVED)

    def done(self) -> bool:
        return self._result is not None

    async def result(self, timeout: float | None = None) -> Any:
        """As `Handle.result`, awaitable."""
        timeout = check_timeout(timeout)
        end = None if timeout is None else time.monotonic() + timeout
        while self._result is None:
            now = time.monotonic()
            if end is not None and now >= end:
                if not await self._producer._poll(self):
                    raise TimeoutError(f"no result for request {self.id} within {timeout}s")
                break
            step = base.POLL_MAX_S if end is None else min(base.POLL_MAX_S, end - now)
            if self._deadline_at is not None:
                step = min(step, self._deadline_at - now)
            if self._waiter is None:
                self._waiter = asyncio.get_running_loop().create_future()
            # asyncio.wait, unlike wait_for, runs no task per call and leaves the future be.
            await asyncio.wait((self._waiter,), timeout=max(0.0, step))
            if self._result is not None:
                break
            if self._deadline_at is not None and time.monotonic() >= self._deadline_at:
                await self._producer._expire(self)
            elif step == base.POLL_MAX_S:
                await self._producer._poll(self)
        assert self._result is not None
        return self._result.unwrap()

    async def stream(self, timeout: float | None = None,
                     after: str | None = None) -> AsyncIterator[Any]:
        """As `Handle.stream`, an async iterator: `async for part in handle.stream()`."""
        async with contextlib.aclosing(self.entries(timeout, after)) as entries:
            async for _entry_id, event in entries:
                yield event

    async def entries(self, timeout: float | None = None,
                      after: str | None = None) -> AsyncIterator[tuple[str, Any]]:
        """As `Handle.entries`: `stream`'s events with their entry ids, from the entry
        after `after`."""
        timeout = check_timeout(timeout)
        end = None if timeout is None else time.monotonic() + timeout
        hub = self._producer._stream_hub()
        reader = hub.open(self._producer.keys.stream(self.id), after or START)
        cursor, events = reader
        if self._result is None:  # _resolve wakes the stream up (RESOLVED) from now on
            self._streams = [*(self._streams or ()), events]
        try:
            while self._result is None:
                now = time.monotonic()
                if end is not None and now >= end:
                    if not await self._producer._poll(self):
                        raise TimeoutError(f"no result for request {self.id} within "
                                           f"{timeout}s")
                    break
                step = base.POLL_MAX_S if end is None else min(base.POLL_MAX_S, end - now)
                if self._deadline_at is not None:
                    step = min(step, self._deadline_at - now)
                try:
                    event = await asyncio.wait_for(events.get(), max(0.0, step))
                except asyncio.TimeoutError:
                    if self._deadline_at is not None and time.monotonic() >= self._deadline_at:
                        await self._producer._expire(self)
                    elif step == base.POLL_MAX_S:
                        await self._producer._poll(self)
                    continue
                if event is not RESOLVED:
                    yield event
        finally:
            hub.close_stream(reader)  # the reader delivers nothing more: the rest is ours
            if self._streams is not None:  # closed early: _resolve has nothing to wake
                self._streams = [e for e in self._streams if e is not events] or None
        while not events.empty():
            event = events.get_nowait()
            if event is not RESOLVED:
                yield event
        client = self._producer._redis
        while True:  # the parts were written before the result: this read sees them all
            reply = await client.xread({cursor.key: cursor.last}, count=READ_COUNT)
            if not reply:
                return
            for entry in cursor.feed(reply):
                yield entry

    async def cancel(self) -> CancelOutcome:
        """As `Handle.cancel`, awaitable."""
        return await self._producer._cancel(self, deadline=False)


class AsyncProducer(ProducerBase[AsyncHandle]):
    """Use as `async with AsyncProducer(url, queue) as p:` or call `await p.close()`."""

    def __init__(self, redis_url: str = connection.DEFAULT_REDIS_URL, queue: str = "default", *,
                 max_payload_bytes: int | None = None, idempotency_ttl_s: int | None = None,
                 client: redis.asyncio.Redis | None = None, on_result: OnResult | None = None,
                 max_connections: int = connection.DEFAULT_MAX_CONNECTIONS,
                 wait_replicas: int = 0, wait_timeout_ms: int | None = None):
        super().__init__(queue, max_payload_bytes, idempotency_ttl_s, on_result,
                         wait_replicas, wait_timeout_ms)
        self._redis = client or connection.connect_async(redis_url, max_connections)
        self._owns_client = client is None
        self._scripts = Scripts(self._redis)
        self._closed = False
        self._listener: asyncio.Task[None] | None = None
        self._listener_redis: Any = None
        self._stream_reader: AsyncStreamHub | None = None
        self._kick_scheduled = False
        self._sends: set[asyncio.Task[None]] = set()
        self._sweeper: asyncio.Task[None] | None = None
        self._pops = 0  # the listener's pops delivered so far (see _pop_after)
        # The deadline timer: a call at the earliest deadline, moved when an earlier comes.
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._expirer: asyncio.Task[None] | None = None

    async def submit(self, payload: Any, priority: Priority | int | str = Priority.NORMAL,
                     deadline_ms: float | None = None,
                     idempotency_key: str | None = None, cost: int = 1,
                     store_result: bool = False, tenant: str | None = None) -> AsyncHandle:
        """As Producer.submit."""
        return (await self._submit([payload], priority, deadline_ms, [idempotency_key],
                                   cost=cost, store_result=store_result, tenant=tenant))[0]

    async def submit_many(self, payloads: Iterable[Any],
                          priority: Priority | int | str = Priority.NORMAL,
                          deadline_ms: float | None = None,
                          idempotency_keys: list[str | None] | None = None,
                          cost: int | Sequence[int] = 1,
                          store_result: bool = False,
                          tenant: str | None = None) -> list[AsyncHandle]:
        return await self._submit(payloads, priority, deadline_ms, idempotency_keys, cost=cost,
                                  store_result=store_result, tenant=tenant)

    async def fetch(self, request_id: str) -> Result | None:
        """As Producer.fetch: only results submitted with store_result=True are stored."""
        raw = await self._redis.get(self.keys.result(request_id))
        return decode_result(raw) if raw is not None else None

    def _stream_hub(self) -> AsyncStreamHub:
        """The reader of this producer's open streams, made on first use."""
        if self._stream_reader is None:
            self._stream_reader = AsyncStreamHub(self._redis, self.id)
        return self._stream_reader

    async def close(self) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        if self._pending:
            self._kick()
        while self._sends:  # submits already queued get their answer
            await asyncio.gather(*self._sends, return_exceptions=True)
        for task in (self._listener, self._sweeper, self._expirer):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self._listener_redis is not None and self._listener_redis is not self._redis:
            await self._listener_redis.aclose()
        if self._stream_reader is not None:
            await self._stream_reader.close()
        if self._owns_client:
            await connection.aclose_node_clients(self._redis)
            await self._redis.aclose()

    async def __aenter__(self) -> AsyncProducer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> AsyncProducer:
        """Do now what the first submit would otherwise do on its request's time: connect,
        check the Redis version, load the enqueue script and start the result listener.
        Call it at startup so that the first request after a deploy is not the slow one.
        Returns the producer."""
        if self._closed:
            raise RuntimeError("producer is closed")
        await require_redis_version_async(self._redis)
        await self._redis.script_load(self._scripts.enqueue.script)
        self._ensure_listener()
        return self

    def _ensure_listener(self) -> None:
        if self._listener is None:
            self._listener_redis = dedicated(self._redis)
            self._listener = asyncio.get_running_loop().create_task(self._listen())

    async def _submit(self, payloads: Iterable[Any], priority: Any, deadline_ms: Any,
                      idempotency_keys: list[str | None] | None,
                      cost: Any = 1, store_result: Any = False,
                      tenant: Any = None) -> list[AsyncHandle]:
        if self._closed:
            raise RuntimeError("producer is closed")
        submission, handles = self._prepare(
            payloads, priority, deadline_ms, idempotency_keys,
            lambda rid: AsyncHandle(self, rid), cost, store_result, tenant)
        loop = asyncio.get_running_loop()
        try:
            await require_redis_version_async(self._redis)  # once per client: BLMPOP needs 7
            self._ensure_listener()
            ids = await self._enqueue(submission, loop)
        except BaseException:
            self._forget(submission.requests)
            raise
        if self._accepted(submission.requests, handles, ids, submission.deadlines):
            self._arm_timer()
        return handles

    # -- the deadline timer ------------------------------------------------------------
    def _arm_timer(self) -> None:
        """Call _on_deadline at the earliest deadline of this producer's requests (the
        event loop's timer: no polling)."""
        at = self._next_deadline
        if self._closed or at is None or (self._timer is not None and self._timer_at == at):
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = asyncio.get_running_loop().call_later(
            max(0.0, at - time.monotonic()), self._on_deadline)

    def _on_deadline(self) -> None:
        self._timer = self._timer_at = None
        if self._expirer is None or self._expirer.done():
            self._expirer = asyncio.get_running_loop().create_task(self._expire_due())
        else:  # one still running: look again shortly
            self._timer_at = time.monotonic() + 0.001
            self._timer = asyncio.get_running_loop().call_later(0.001, self._on_deadline)

    async def _expire_due(self) -> None:
        """Take the requests past their deadline out of the queue (expire_due.lua): their
        results reach the inbox, and the listener resolves the handles."""
        due = self._take_due()
        if due:
            try:
                await self._expire_all_due()
            except Exception as exc:  # Redis away, or a policy altered by hand
                log.warning("async producer: could not expire requests past their "
                            "deadline (%s); trying again", exc)
                self._expiry_failed(due)
        self._arm_timer()

    async def _enqueue(self, sub: Submission, loop: asyncio.AbstractEventLoop) -> list[str]:
        if self._in_flight == 0 and not self._pending:
            # Nothing else going on: send it from this task at once (no hop through the
            # loop); submits arriving meanwhile queue and go together after it.
            self._in_flight += 1
            await self._send([sub])
            return sub.outcome()
        sub.waiter = loop.create_future()
        self._pending.append(sub)
        if not self._kick_scheduled:
            # After the tasks ready in this turn of the loop: their submits go together.
            self._kick_scheduled = True
            loop.call_soon(self._kick)
        try:
            return await sub.waiter
        except BaseException:
            with contextlib.suppress(ValueError):  # cancelled before it was sent:
                self._pending.remove(sub)  # nothing is written
            raise

    def _kick(self) -> None:
        """Start enqueue calls for the waiting submissions, up to MAX_IN_FLIGHT at once;
        what arrives meanwhile waits for the next free slot, and goes together."""
        self._kick_scheduled = False
        while self._pending and self._in_flight < base.MAX_IN_FLIGHT:
            self._in_flight += 1
            batch = base.take_batch(self._pending)
            task = asyncio.get_running_loop().create_task(self._send(batch))
            self._sends.add(task)
            task.add_done_callback(self._sends.discard)

    async def _register(self) -> None:
        """Once per producer, after its first accepted enqueue (a refused one writes
        nothing): one ZADD, in a task of its own beside the submits. Its failure never
        fails a submit."""
        try:
            await register_queue_async(self._redis, self.config.queue)
        except redis.ResponseError as exc:  # an ACL limited to the queue's keys
            log.debug("queue registry not updated: %s", exc)
        except (redis.RedisError, OSError) as exc:  # tried again at the next submit
            self._registered = False
            log.debug("queue registry not updated: %s", exc)

    async def _send(self, batch: list[Submission]) -> None:
        try:
            keys, args = self._batch_call(batch)
            if not self._settle(batch, (await self._enqueue_calls([(keys, args)], True))[0]):
                self._settle_each(batch, await self._enqueue_calls(self._each_call(batch),
                                                                   False))
        except BaseException as exc:  # each of its callers gets the error
            self._fail(batch, exc)
        finally:
            self._in_flight -= 1
            if not self._registered and any(sub.ids for sub in batch):
                self._registered = True
                task = asyncio.get_running_loop().create_task(self._register())
                self._sends.add(task)  # close() waits for it, as for the sends
                task.add_done_callback(self._sends.discard)
            for sub in batch:
                if sub.waiter is not None and not sub.waiter.done():
                    if sub.ids is not None:
                        sub.waiter.set_result(sub.ids)
                    elif isinstance(sub.error, asyncio.CancelledError):
                        sub.waiter.cancel()
                    else:
                        sub.waiter.set_exception(sub.error)
            self._kick()

    async def _enqueue_calls(self, calls: Any, raise_on_error: bool) -> list[Any]:
        """As Producer._enqueue_calls."""
        calls = list(calls)
        if not self.config.wait_replicas and len(calls) == 1 and raise_on_error:
            keys, args = calls[0]  # the common case: one EVALSHA (loads on NOSCRIPT)
            return [await self._scripts.enqueue(keys=keys, args=args)]
        if not self.config.wait_replicas:
            pipe = AsyncScriptPipeline(self._redis)
            for keys, args in calls:
                pipe.script(self._scripts.enqueue, keys, args)
            return await pipe.execute(raise_on_error)
        backoff = Backoff(f"async producer {self.id[:8]} (waiting for replicas)")
        give_up = time.monotonic() + base.WAIT_BUDGET_S
        while True:
            pipe = AsyncScriptPipeline(self._redis, self.config.wait_replicas,
                                       self.config.wait_timeout_ms)
            for keys, args in calls:
                pipe.script(self._scripts.enqueue, keys, args)
            try:
                replies = await pipe.execute(raise_on_error)
                backoff.succeeded()
                return replies
            except base.RESENT as exc:
                if time.monotonic() >= give_up:
                    raise
                await asyncio.sleep(backoff.failed(exc))

    async def _listen(self) -> None:
        inbox = self.keys.inbox(self.id)
        backoff = Backoff("async producer listener")
        next_sweep = time.monotonic() + base.POLL_S
        while not self._closed:
            try:
                popped = await self._listener_redis.blmpop(1, 1, inbox, direction="LEFT",
                                                           count=512)
                backoff.succeeded()
            except redis.RedisError as exc:  # also NOPERM, READONLY after a failover, ...
                await asyncio.sleep(backoff.failed(exc))
                continue
            for raw in popped[1] if popped else ():
                if raw:  # an empty item is a wake-up marker (Producer.close's), no result
                    self._deliver(raw)
            self._pops += 1
            if time.monotonic() >= next_sweep and (self._sweeper is None
                                                   or self._sweeper.done()):
                # A task of its own: results keep flowing while it waits for Redis.
                self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
                next_sweep = time.monotonic() + base.POLL_S

    async def _pop_after(self, pops: int) -> None:
        """Wait (at most 2 * POLL_S) until the listener has delivered two more pops than
        `pops`, the count when a sweep sent its MULTI: the sweep runs beside the listener,
        whose pop (the one in flight, or the next) may have taken a result from the
        inbox before the MULTI ran and not yet delivered it."""
        give_up = time.monotonic() + 2 * base.POLL_S
        while self._pops <= pops + 1 and time.monotonic() < give_up and not self._closed:
            await asyncio.sleep(0.01)

    async def _sweep(self) -> None:
        """As Producer._sweep."""
        try:
            await self._sweep_once()
        except Exception:
            log.exception("async producer listener: sweep failed")

    async def _sweep_once(self) -> None:
        _, poll = self._due()
        for chunk in poll:
            try:  # on a cluster, the MULTI goes to the primary serving the queue's slot
                owner = await connection.slot_owner_async(self._redis, self.keys.jobs)
                pipe = owner.pipeline(transaction=True)
                checked = self._poll_reads(pipe, chunk)
                pops = self._pops
                replies = await pipe.execute()
                if self._maybe_lost(checked, replies):
                    await self._pop_after(pops)
                self._polled(chunk, checked, replies)
            except redis.RedisError as exc:
                await connection.refresh_topology_async(self._redis, exc)
                return

    async def _poll(self, handle: AsyncHandle) -> bool:
        try:
            return self._resolve_stored(handle, await self.fetch(handle.id))
        except (redis.ConnectionError, redis.TimeoutError):
            return False

    async def _cancel(self, handle: AsyncHandle, deadline: bool) -> CancelOutcome:
        keys, args, envelope = self._cancel_call(handle.id, deadline)
        return self._cancelled(handle, await self._scripts.cancel(keys=keys, args=args),
                               envelope)

    async def _expire(self, handle: AsyncHandle) -> None:
        """As Producer._expire."""
        handle._deadline_at = None
        try:
            await self._expire_all_due()
        except (redis.ConnectionError, redis.TimeoutError):
            base.rearm(handle)

    async def _expire_all_due(self) -> None:
        """As Producer._expire_all_due."""
        while (await expire_due_async(self._scripts, self.keys,
                                      self.config.result_ttl_s)).more:
            pass
