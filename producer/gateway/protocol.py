"""The gateway's HTTP protocol: uvicorn's httptools protocol with a deadline on request
headers (slowloris). uvicorn times out idle keep-alive connections (`timeout_keep_alive`)
but not a connection that sends nothing after connecting, nor headers that trickle in.
Here a request's headers must be complete within the timeout of the connection opening
(its first request) or of their first byte (the next requests on a keep-alive
connection), or the connection is answered 408 and closed. The body has its own deadline,
counted from the headers (guard.RequestGuard).

uvicorn builds the protocol itself, in every worker process: the timeout is read from
REQUEST_TIMEOUT_ENV, which `batchgate gateway` sets from --request-timeout-s.

It also sends an answer's head and body in one write (HeldHead): uvicorn writes the head
as soon as the app starts its answer, and the body in a second write, two TCP segments
for the client to wake up for where one does.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from producer.gateway.guard import DEFAULT_REQUEST_TIMEOUT_S, REQUEST_TIMEOUT_ENV

_MESSAGE = b"request headers not received in time (--request-timeout-s)"
TIMED_OUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
             b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(_MESSAGE), _MESSAGE))


INTERIM = b"HTTP/1.1 100 Continue\r\n\r\n"


class HeldHead:
    """The transport as one answer's cycle (uvicorn's RequestResponseCycle) sees it: a
    head that announces its Content-Length is held, and goes out with the first write of
    the body (or when the cycle closes the connection). Anything else is written at once:
    a 100 Continue, a chunked answer, and everything after the head."""

    __slots__ = ("transport", "head", "held")

    def __init__(self, transport: asyncio.Transport):
        self.transport = transport
        self.head = b""
        self.held = False  # True once the head was held or written: the rest goes through

    def write(self, data: bytes) -> None:
        if self.held:
            if self.head:
                self.transport.writelines((self.head, data))  # one writev
                self.head = b""
                return
        elif data != INTERIM:
            self.held = True
            if b"\r\ncontent-length: " in data:  # the head; uvicorn lower-cases names
                self.head = data
                return
        self.transport.write(data)

    def close(self) -> None:
        if self.head:
            self.transport.write(self.head)
            self.head = b""
        self.transport.close()

    def is_closing(self) -> bool:
        return self.transport.is_closing()


class HeaderTimeoutProtocol(HttpToolsProtocol):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.header_timeout_s = float(os.environ.get(REQUEST_TIMEOUT_ENV,
                                                     DEFAULT_REQUEST_TIMEOUT_S))
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._header_timer is None:  # the next request of a keep-alive connection
            self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()
        cycle = self.cycle  # the new request's (not yet running), or an upgrade's old one
        if cycle is not None and cycle.transport is self.transport and \
                self.scope["method"] != "HEAD":  # a HEAD answer has no body to wait for
            cycle.transport = HeldHead(self.transport)  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._timed_out)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _timed_out(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.write(TIMED_OUT)
            self.transport.close()
