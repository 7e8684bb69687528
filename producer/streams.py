"""One reader of partial results per producer (docs/streaming.md): every open
`handle.stream()` of a Producer (AsyncProducer) is read by one thread (task) with one
`XREAD` over all their streams, on one connection of its own outside the producer's pool:
however many streams are open, reading them costs one connection, and they never hold
the pool's connections up.

A stream opened while an XREAD blocks is read from the next one, at most BLOCK_MS later
(it loses nothing: it is read from its first entry). When the request's result is in, its
handle closes its stream here (nothing more is delivered to it) and reads what is left
itself: the consumer wrote the parts before the result.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from typing import Any

import redis

from scheduler_core.connection import Backoff, dedicated
from scheduler_core.streams import READ_COUNT, StreamCursor

log = logging.getLogger("batchgate.producer")
BLOCK_MS = 100  # one XREAD blocks at most this long: a newly opened stream waits no longer


def _deliver(open_streams: dict[str, tuple[StreamCursor, Any]], reply: Any,
             read: dict[str, StreamCursor]) -> None:
    """Hand each stream's entries to its reader, if it is still the one `read` was for
    (closed meanwhile, its handle reads the rest itself; opened again, it starts afresh)."""
    for key, entries in (reply.items() if isinstance(reply, dict) else reply or ()):
        name = key.decode() if isinstance(key, bytes) else key
        opened = open_streams.get(name)
        if opened is not None and opened[0] is read.get(name):
            cursor, events = opened
            for event in cursor.feed([(key, entries)]):
                events.put_nowait(event)


class StreamHub:
    """The reader thread of a Producer's open streams."""

    def __init__(self, client: Any, name: str):
        self._base, self._name = client, name
        self._client: Any = None
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._open: dict[str, tuple[StreamCursor, queue.SimpleQueue[Any]]] = {}
        self._thread: threading.Thread | None = None
        self._closed = False

    def open(self, key: str) -> tuple[StreamCursor, queue.SimpleQueue[Any]]:
        cursor, events = StreamCursor(key), queue.SimpleQueue()
        with self._lock:
            if self._closed:
                raise RuntimeError("the producer is closed")
            if key in self._open:
                raise RuntimeError("this request's stream is already being read")
            self._open[key] = (cursor, events)
            if self._thread is None:
                self._client = dedicated(self._base)
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"batchgate-streams-{self._name}")
                self._thread.start()
            self._changed.notify()
        return cursor, events

    def close_stream(self, key: str) -> None:
        """Deliver nothing more for `key`; its cursor is the caller's from now on."""
        with self._lock:
            self._open.pop(key, None)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._changed.notify()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._client is not None and self._client is not self._base:
            self._client.close()

    def _run(self) -> None:
        backoff = Backoff(f"producer {self._name} (stream reader)")
        while True:
            with self._lock:
                while not self._open and not self._closed:
                    self._changed.wait()
                if self._closed:
                    return
                read = {key: cursor for key, (cursor, _) in self._open.items()}
            try:
                reply = self._client.xread({key: cursor.last for key, cursor in read.items()},
                                           count=READ_COUNT, block=BLOCK_MS)
            except redis.RedisError as exc:
                backoff.sleep_after(exc)
                continue
            backoff.succeeded()
            with self._lock:
                _deliver(self._open, reply, read)


class AsyncStreamHub:
    """The reader task of an AsyncProducer's open streams."""

    def __init__(self, client: Any, name: str):
        self._base, self._name = client, name
        self._client: Any = None
        self._open: dict[str, tuple[StreamCursor, asyncio.Queue[Any]]] = {}
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def open(self, key: str) -> tuple[StreamCursor, asyncio.Queue[Any]]:
        cursor, events = StreamCursor(key), asyncio.Queue()
        if key in self._open:
            raise RuntimeError("this request's stream is already being read")
        self._open[key] = (cursor, events)
        if self._task is None:
            self._client = dedicated(self._base)
            self._task = asyncio.get_running_loop().create_task(self._run())
        self._changed.set()
        return cursor, events

    def close_stream(self, key: str) -> None:
        self._open.pop(key, None)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self._client is not None and self._client is not self._base:
            await self._client.aclose()

    async def _run(self) -> None:
        backoff = Backoff(f"producer {self._name} (stream reader)")
        while True:
            if not self._open:
                self._changed.clear()
                await self._changed.wait()
                continue
            read = {key: cursor for key, (cursor, _) in self._open.items()}
            try:
                reply = await self._client.xread(
                    {key: cursor.last for key, cursor in read.items()}, count=READ_COUNT,
                    block=BLOCK_MS)
            except redis.RedisError as exc:
                await asyncio.sleep(backoff.failed(exc))
                continue
            backoff.succeeded()
            _deliver(self._open, reply, read)
