"""Reading a request's partial results (`{bg:q}:stream:<id>`), for Handle.stream and
AsyncHandle.stream: the cursor over the entries both walk; the I/O stays with them.

The consumer writes a request's parts before its result (stream_append.lua, then
complete.lua), so a read that starts after the result is in sees every part: a reader
checks for the result first, then reads, and stops once the result was in before an
empty read.
"""

from __future__ import annotations

from typing import Any

from scheduler_core.wire import STREAM_END, STREAM_PART, STREAM_RESTART, decode_stream_entry

READ_COUNT = 512  # entries per XREAD
BLOCK_MS = 250  # one XREAD blocks at most this long (then the reader checks for the result)
END_WAIT_S = 1.0  # after a run's end marker: wait this long for the result, then read again


class StreamCursor:
    """The position in one request's stream and what the entries so far said."""

    def __init__(self, key: str):
        self.key = key
        self.last = "0-0"
        self.ended = False  # the current run's end marker was read: its result is coming

    def feed(self, reply: Any) -> list[Any]:
        """The events of an XREAD reply (parts and Restart markers), in order."""
        events: list[Any] = []
        for _key, entries in reply or ():
            for entry_id, fields in entries:
                self.last = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                kind, value = decode_stream_entry(fields)
                if kind == STREAM_END:
                    self.ended = True
                    continue
                self.ended = False
                if kind in (STREAM_PART, STREAM_RESTART):
                    events.append(value)
        return events
