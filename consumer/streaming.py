"""Partial results of a model that streams (`streams = True`, docs/streaming.md).

Such a model is called as `model(payloads, emit=emit)` (with `costs=` too if it also
accepts costs) and calls `emit({index: part, ...})` once per step with the parts of that
step, index being the request's position in `payloads`. Each call is one stream_append.lua
call for the whole step, fenced by the batch id like complete.lua: once the batch's lease
is lost, parts are dropped (a re-run will stream them again, after a restart marker).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import redis

from consumer.batch import Item
from scheduler_core.keys import QueueKeys
from scheduler_core.scripts import stream_keys
from scheduler_core.wire import STREAM_PART, STREAM_RESTART, encode_part

log = logging.getLogger("batchgate.consumer")

STREAM_MAXLEN = 10_000  # entries a request's stream keeps (older ones are trimmed)
MAX_ENTRIES_PER_CALL = 4096  # stream_append.lua's bound on n


class StreamWriter:
    """The streams of one batch's runnable requests, in the order the model sees them."""

    def __init__(self, client: Any, script: Any, keys: QueueKeys, batch_id: str,
                 items: list[Item], ttl_s: int, max_part_bytes: int):
        self.client, self.script, self.keys = client, script, keys
        self.batch_id, self.items = batch_id, items
        self.ttl_s, self.max_part_bytes = ttl_s, max_part_bytes
        self.stale = False  # the batch lost its lease: nothing more is written
        self._restart: set[int] = set()  # rows whose next part starts a re-run

    def start(self) -> None:
        """A re-delivered request (attempts > 1) starts over: say so before its parts."""
        self._append([(item.id, STREAM_RESTART, str(item.attempts))
                      for item in self.items if item.attempts > 1])

    def restart(self, items: list[Item]) -> None:
        """These requests will run again from the start (elsewhere, or later): say so."""
        self._append([(item.id, STREAM_RESTART, str(item.attempts)) for item in items])

    def emitter(self) -> Emit:
        return Emit(self, 0, len(self.items))

    def rerun(self, start: int, stop: int) -> None:
        """Rows start..stop-1 run again (the batch was split to isolate a failure)."""
        self._restart.update(range(start, stop))

    def emit(self, rows: dict[int, Any]) -> None:
        entries: list[tuple[str, str, Any]] = []
        for row, part in rows.items():
            item = self.items[row]
            if row in self._restart:
                self._restart.discard(row)
                entries.append((item.id, STREAM_RESTART, str(item.attempts)))
            entries.append((item.id, STREAM_PART, encode_part(part, self.max_part_bytes)))
        self._append(entries)

    def _append(self, entries: list[tuple[str, str, Any]]) -> None:
        for at in range(0, len(entries), MAX_ENTRIES_PER_CALL):
            if self.stale:
                return
            chunk = entries[at:at + MAX_ENTRIES_PER_CALL]
            args: list[Any] = [self.batch_id, self.ttl_s, STREAM_MAXLEN, len(chunk)]
            for entry in chunk:
                args += entry
            try:
                reply = self.script(keys=stream_keys(self.keys, [e[0] for e in chunk]),
                                    args=args, client=self.client)
            except redis.RedisError as exc:  # parts are best effort; the result is not
                log.warning("batch %s: partial results not written: %s", self.batch_id, exc)
                continue
            if int(reply[0]) == -1:
                self.stale = True
                log.warning("batch %s: lease lost, its partial results are dropped",
                            self.batch_id)


class Emit:
    """The `emit` a streaming model is given: `emit({index: part, ...})`, once per step."""

    def __init__(self, writer: StreamWriter, offset: int, size: int):
        self._writer, self._offset, self._size = writer, offset, size

    def __call__(self, parts: Mapping[int, Any]) -> None:
        if not isinstance(parts, Mapping):
            raise TypeError(f"emit takes a mapping {{index: part}}, got "
                            f"{type(parts).__name__}")
        rows = {}
        for index, part in parts.items():
            if isinstance(index, bool) or not isinstance(index, int) \
                    or not 0 <= index < self._size:
                raise IndexError(f"emit: index {index!r} is outside the batch of {self._size}")
            rows[self._offset + index] = part
        if rows:
            self._writer.emit(rows)

    def split(self, start: int, stop: int) -> Emit:
        """The emit of payloads[start:stop] run again on their own."""
        self._writer.rerun(self._offset + start, self._offset + stop)
        return Emit(self._writer, self._offset + start, stop - start)
