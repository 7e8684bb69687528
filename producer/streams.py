"""One reader of partial results per producer (docs/streaming.md): every open
`handle.stream()` of a Producer (AsyncProducer) is read by one thread (task) with one
`XREAD` over all their streams, on one connection of its own outside the producer's pool:
however many streams are open, reading them costs one connection, and they never hold
the pool's connections up.

A stream opened while an XREAD blocks is read from the next one, at most BLOCK_MS later
(it loses nothing: it is read from its first entry, or the one after `after`). When the
request's result is in, its handle closes its stream here (nothing more is delivered to
it) and reads what is left itself: the consumer wrote the parts before the result.

One stream may have several readers at once (two handles of one idempotent request, two
gateway clients): each has its own cursor and events; the shared XREAD reads the stream
from the reader furthest behind, and each cursor takes the entries after its own position.
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
from scheduler_core.streams import READ_COUNT, START, StreamCursor

log = logging.getLogger("batchgate.producer")
BLOCK_MS = 100  # one XREAD blocks at most this long: a newly opened stream waits no longer


Reader = tuple[StreamCursor, Any]  # a cursor and its events' queue


def _positions(read: dict[str, list[Reader]]) -> dict[str, str]:
    """Where the shared XREAD reads each stream from: its reader furthest behind."""
    positions = {}
    for key, readers in read.items():
        behind = readers[0][0]
        for cursor, _ in readers[1:]:
            if cursor.before(behind):
                behind = cursor
        positions[key] = behind.last
    return positions


def _deliver(open_streams: dict[str, list[Reader]], reply: Any,
             read: dict[str, list[Reader]]) -> None:
    """Hand each stream's entries to each of the readers `read` was for that is still open
    (closed meanwhile, its handle reads the rest itself)."""
    for key, entries in (reply.items() if isinstance(reply, dict) else reply or ()):
        name = key.decode() if isinstance(key, bytes) else key
        still = open_streams.get(name, ())
        for reader in read.get(name, ()):
            if any(reader is r for r in still):
                cursor, events = reader
                for event in cursor.feed([(key, entries)]):
                    events.put_nowait(event)


def _remove(open_streams: dict[str, list[Reader]], reader: Reader) -> None:
    readers = open_streams.get(reader[0].key)
    if readers is not None:
        readers[:] = [r for r in readers if r is not reader]
        if not readers:
            del open_streams[reader[0].key]


class StreamHub:
    """The reader thread of a Producer's open streams."""

    def __init__(self, client: Any, name: str):
        self._base, self._name = client, name
        self._client: Any = None
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._open: dict[str, list[Reader]] = {}
        self._thread: threading.Thread | None = None
        self._closed = False

    def open(self, key: str, after: str = START) -> tuple[StreamCursor, queue.SimpleQueue[Any]]:
        """A new reader of `key`, from the entry after `after`."""
        reader: Reader = (StreamCursor(key, after), queue.SimpleQueue())
        with self._lock:
            if self._closed:
                raise RuntimeError("the producer is closed")
            self._open.setdefault(key, []).append(reader)
            if self._thread is None:
                self._client = dedicated(self._base)
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"batchgate-streams-{self._name}")
                self._thread.start()
            self._changed.notify()
        return reader

    def readers(self) -> int:
        """How many readers are open."""
        with self._lock:
            return sum(map(len, self._open.values()))

    def close_stream(self, reader: Reader) -> None:
        """Deliver nothing more to `reader`; its cursor is the caller's from now on."""
        with self._lock:
            _remove(self._open, reader)

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
                read = {key: list(readers) for key, readers in self._open.items()}
            try:
                reply = self._client.xread(_positions(read), count=READ_COUNT,
                                           block=BLOCK_MS)
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
        self._open: dict[str, list[Reader]] = {}
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def open(self, key: str, after: str = START) -> tuple[StreamCursor, asyncio.Queue[Any]]:
        """A new reader of `key`, from the entry after `after`."""
        reader: Reader = (StreamCursor(key, after), asyncio.Queue())
        self._open.setdefault(key, []).append(reader)
        if self._task is None:
            self._client = dedicated(self._base)
            self._task = asyncio.get_running_loop().create_task(self._run())
        self._changed.set()
        return reader

    def readers(self) -> int:
        """How many readers are open."""
        return sum(map(len, self._open.values()))

    def close_stream(self, reader: Reader) -> None:
        _remove(self._open, reader)

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
            read = {key: list(readers) for key, readers in self._open.items()}
            try:
                reply = await self._client.xread(_positions(read), count=READ_COUNT,
                                                 block=BLOCK_MS)
            except redis.RedisError as exc:
                await asyncio.sleep(backoff.failed(exc))
                continue
            backoff.succeeded()
            _deliver(self._open, reply, read)
