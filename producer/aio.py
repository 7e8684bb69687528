"""AsyncProducer: the asyncio client for async web apps (FastAPI, aiohttp, ...).

Same contract as `producer.sync.Producer`; one listener task per instance drains the
inbox and resolves the awaiting handles.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable
from typing import Any

import redis
import redis.asyncio

from producer.base import POLL_S, CancelOutcome, OnResult, ProducerBase
from producer.validation import check_timeout
from scheduler_core.compat import require_redis_version_async
from scheduler_core.connection import DEFAULT_REDIS_URL, Backoff, connect_async
from scheduler_core.policy import Priority
from scheduler_core.scripts import Scripts, enqueue_reply
from scheduler_core.wire import Result, decode_result

log = logging.getLogger("batchgate.producer")


class AsyncHandle:
    def __init__(self, producer: AsyncProducer, request_id: str):
        self.id = request_id
        self._producer = producer
        self._deadline_at: float | None = None
        self._event = asyncio.Event()
        self._result: Result | None = None

    def _resolve(self, result: Result) -> None:
        if self._result is None:
            self._result = result
            self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    async def result(self, timeout: float | None = None) -> Any:
        """As `Handle.result`, awaitable."""
        timeout = check_timeout(timeout)
        end = None if timeout is None else time.monotonic() + timeout
        while not self._event.is_set():
            now = time.monotonic()
            if end is not None and now >= end:
                if not await self._producer._poll(self):
                    raise TimeoutError(f"no result for request {self.id} within {timeout}s")
                break
            step = POLL_S if end is None else min(POLL_S, end - now)
            if self._deadline_at is not None:
                step = min(step, max(0.0, self._deadline_at - now))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._event.wait(), step)
                break
            if self._deadline_at is not None and time.monotonic() >= self._deadline_at:
                await self._producer._expire(self)
            await self._producer._poll(self)
        assert self._result is not None
        return self._result.unwrap()

    async def cancel(self) -> CancelOutcome:
        return await self._producer._cancel(self, deadline=False)


class AsyncProducer(ProducerBase[AsyncHandle]):
    """Use as `async with AsyncProducer(url, queue) as p:` or call `await p.close()`."""

    def __init__(self, redis_url: str = DEFAULT_REDIS_URL, queue: str = "default", *,
                 max_payload_bytes: int | None = None, idempotency_ttl_s: int | None = None,
                 client: redis.asyncio.Redis | None = None, on_result: OnResult | None = None):
        super().__init__(queue, max_payload_bytes, idempotency_ttl_s, on_result)
        self._redis = client or connect_async(redis_url)
        self._owns_client = client is None
        self._scripts = Scripts(self._redis)
        self._closed = False
        self._listener: asyncio.Task[None] | None = None

    async def submit(self, payload: Any, priority: Priority | int | str = Priority.NORMAL,
                     deadline_ms: float | None = None,
                     idempotency_key: str | None = None) -> AsyncHandle:
        return (await self._submit([payload], priority, deadline_ms, [idempotency_key]))[0]

    async def submit_many(self, payloads: Iterable[Any],
                          priority: Priority | int | str = Priority.NORMAL,
                          deadline_ms: float | None = None,
                          idempotency_keys: list[str | None] | None = None) -> list[AsyncHandle]:
        return await self._submit(payloads, priority, deadline_ms, idempotency_keys)

    async def fetch(self, request_id: str) -> Result | None:
        raw = await self._redis.get(self.keys.result(request_id))
        return decode_result(raw) if raw is not None else None

    async def close(self) -> None:
        self._closed = True
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._listener
        if self._owns_client:
            await self._redis.aclose()

    async def __aenter__(self) -> AsyncProducer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _submit(self, payloads: Iterable[Any], priority: Any, deadline_ms: Any,
                      idempotency_keys: list[str | None] | None) -> list[AsyncHandle]:
        if self._closed:
            raise RuntimeError("producer is closed")
        requests, handles, keys, args = self._prepare(
            payloads, priority, deadline_ms, idempotency_keys,
            lambda rid: AsyncHandle(self, rid))
        try:
            await require_redis_version_async(self._redis)  # once per client: BLMPOP needs 7
            if self._listener is None:
                self._listener = asyncio.get_running_loop().create_task(self._listen())
            ids = enqueue_reply(self.keys, await self._scripts.enqueue(keys=keys, args=args))
        except BaseException:
            self._forget(requests)
            raise
        self._accepted(requests, handles, ids)
        return handles

    async def _listen(self) -> None:
        inbox = self.keys.inbox(self.id)
        backoff = Backoff("async producer listener")
        while not self._closed:
            try:
                popped = await self._redis.blmpop(1, 1, inbox, direction="LEFT", count=512)
                backoff.succeeded()
            except redis.RedisError as exc:  # also NOPERM, READONLY after a failover, ...
                await asyncio.sleep(backoff.failed(exc))
                continue
            for raw in popped[1] if popped else ():
                if raw:  # b"" is close()'s wake-up
                    self._deliver(raw)

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
        handle._deadline_at = None
        try:
            await self._cancel(handle, deadline=True)
        except (redis.ConnectionError, redis.TimeoutError):
            handle._deadline_at = time.monotonic() + POLL_S
