"""Reading a request's partial results (`{bg:q}:stream:<id>`): the cursor over one stream's
entries that producer/streams.py's readers and handle.stream() walk; the I/O stays with
them. docs/streaming.md.

The consumer writes a request's parts before its result (stream_append.lua, then
complete.lua), so a read that starts after the result is in sees every part.

Any number of readers may read one stream, each with its own cursor: a shared read starts
at the earliest of their positions, and each cursor takes only the entries after its own.
"""

from __future__ import annotations

import re
from typing import Any

from scheduler_core.errors import InvalidRequest
from scheduler_core.wire import decode_stream_entry

READ_COUNT = 512  # entries per stream per XREAD
START = "0-0"  # before the first entry
ENTRY_ID = re.compile(r"[0-9]{1,20}-[0-9]{1,20}")  # a Redis stream entry id, ms-seq
MAX_ENTRY_PART = 2**64 - 1  # each of ms and seq


def entry_order(entry_id: str) -> tuple[int, int]:
    """An entry id as a comparable (ms, seq)."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq)


def check_entry_id(value: Any, field: str) -> str:
    """`value` if it is a stream entry id (as an SSE `id:` or a previous read gave it),
    else InvalidRequest naming `field`."""
    if not isinstance(value, str) or not ENTRY_ID.fullmatch(value):
        raise InvalidRequest(field, "must be a stream entry id as the stream gave it "
                                    "(<ms>-<seq>, e.g. 1700000000000-0)")
    if max(entry_order(value)) > MAX_ENTRY_PART:  # Redis would refuse it mid-answer
        raise InvalidRequest(field, f"{value!r}: <ms> and <seq> are unsigned 64-bit "
                                    f"numbers, at most {MAX_ENTRY_PART}")
    return value


class StreamCursor:
    """One reader's position in one request's stream."""

    def __init__(self, key: str, after: str = START):
        self.key = key
        self.last = check_entry_id(after, "after")
        self._order = entry_order(after)

    def before(self, other: StreamCursor) -> bool:
        return self._order < other._order

    def feed(self, reply: Any) -> list[tuple[str, Any]]:
        """(entry id, event) of each entry of an XREAD reply past this cursor (parts and
        Restart markers), in order; entries at or before it (a read shared with a reader
        further behind) are skipped."""
        events: list[tuple[str, Any]] = []
        for _key, entries in (reply.items() if isinstance(reply, dict) else reply or ()):
            for raw_id, fields in entries:
                entry_id = raw_id.decode() if isinstance(raw_id, bytes) else raw_id
                order = entry_order(entry_id)
                if order <= self._order:
                    continue
                self.last, self._order = entry_id, order
                events.append((entry_id, decode_stream_entry(fields)[1]))
        return events
