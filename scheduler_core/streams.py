"""Reading a request's partial results (`{bg:q}:stream:<id>`): the cursor over one stream's
entries that producer/streams.py's readers and handle.stream() walk; the I/O stays with
them. docs/streaming.md.

The consumer writes a request's parts before its result (stream_append.lua, then
complete.lua), so a read that starts after the result is in sees every part.
"""

from __future__ import annotations

from typing import Any

from scheduler_core.wire import decode_stream_entry

READ_COUNT = 512  # entries per stream per XREAD


class StreamCursor:
    """The position in one request's stream."""

    def __init__(self, key: str):
        self.key = key
        self.last = "0-0"

    def feed(self, reply: Any) -> list[Any]:
        """The events of an XREAD reply (parts and Restart markers), in order."""
        events: list[Any] = []
        for _key, entries in (reply.items() if isinstance(reply, dict) else reply or ()):
            for entry_id, fields in entries:
                self.last = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                events.append(decode_stream_entry(fields)[1])
        return events
