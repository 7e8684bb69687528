"""What the HTTP gateway checks before its app sees a request (RequestGuard, a pure ASGI
middleware), so that nobody can make it read, hold or parse more than it allows:

1. The bearer token, when the gateway has one, for `/v1/*` and `/v2/models/*`: a request
   without it is answered 401 from its headers; its body is never read.
2. The body's size: a Content-Length over `max_body_bytes` is answered 413 at once
   (nothing read); a body sent without one (chunked) is counted as it arrives and answered
   413 as soon as it crosses the limit. The whole body is read here, at most that much.
3. The body's time: one that has not fully arrived `request_timeout_s` after the headers
   is answered 408. (Slow headers are bounded by the server protocol: protocol.py.)

A 401, 413 or 408 sent before the body was read closes the connection.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from scheduler_core.wire import DEFAULT_MAX_PAYLOAD_BYTES

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
# asyncio.timeout_at (3.11+) arms a timer; wait_for would run a task per message.
_timeout_at = getattr(asyncio, "timeout_at", None)

# /healthz, /metrics and /v2/health/* stay open (docs/gateway.md)
PROTECTED_PREFIXES = ("/v1/", "/v2/models")
# A body may be larger than the payload it carries (the other fields, whitespace, \u
# escapes): twice the payload limit, plus 64 KiB.
DEFAULT_MAX_BODY_BYTES = 2 * DEFAULT_MAX_PAYLOAD_BYTES + (64 << 10)
DEFAULT_REQUEST_TIMEOUT_S = 30.0
REQUEST_TIMEOUT_ENV = "BATCHGATE_GATEWAY_REQUEST_TIMEOUT_S"  # --request-timeout-s


class BodyTooLarge(Exception):
    pass


def header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


async def answer(send: Send, status: int, body: dict[str, Any],
                 headers: list[tuple[bytes, bytes]] | None = None, close: bool = False) -> None:
    """A JSON answer in the gateway's error shape, sent by the guard itself."""
    data = orjson.dumps(body)
    fields = [(b"content-type", b"application/json"),
              (b"content-length", str(len(data)).encode()), *(headers or [])]
    if close:
        fields.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": fields})
    await send({"type": "http.response.body", "body": data})


def problem(error: str, message: str, field: str | None = None) -> dict[str, Any]:
    return {"error": error, "message": message, **({"field": field} if field else {})}


class RequestGuard:
    def __init__(self, app: Any, *, token: str | None, max_body_bytes: int,
                 request_timeout_s: float):
        self.app = app
        self.token = token.encode() if token else None
        self.max_body_bytes = max_body_bytes
        self.request_timeout_s = request_timeout_s

    def authorized(self, scope: Scope) -> bool:
        """The request carries `Authorization: Bearer <token>` (or none is needed)."""
        if self.token is None:
            return True
        scheme, _, credentials = (header(scope, b"authorization") or b"").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(credentials.strip(),
                                                                   self.token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length_header = header(scope, b"content-length")
        has_body = header(scope, b"transfer-encoding") is not None or \
            length_header not in (None, b"0")
        if scope["path"].startswith(PROTECTED_PREFIXES) and not self.authorized(scope):
            await answer(send, 401, problem("unauthorized", "missing or wrong bearer token"),
                         [(b"www-authenticate", b"Bearer")], close=has_body)
            return
        if length_header is not None and length_header.isdigit() and \
                int(length_header) > self.max_body_bytes:
            await answer(send, 413, problem(
                "body_too_large", f"body: Content-Length {int(length_header)} is over the "
                f"limit of {self.max_body_bytes} bytes (--max-body-bytes)", "body"), close=True)
            return
        if not has_body:
            await self.app(scope, receive, send)
            return
        try:
            body = await self._read(receive)
        except BodyTooLarge:
            await answer(send, 413, problem(
                "body_too_large", f"body: over the limit of {self.max_body_bytes} bytes "
                "(--max-body-bytes)", "body"), close=True)
            return
        except asyncio.TimeoutError:
            await answer(send, 408, problem(
                "request_timeout", f"body: not received within {self.request_timeout_s:g} s "
                "of the headers (--request-timeout-s)", "body"), close=True)
            return
        if body is None:
            return  # the client left
        await self.app(scope, _replay(body, receive), send)

    async def _read(self, receive: Receive) -> bytes | None:
        """The whole body, or None if the client disconnected; BodyTooLarge past the
        limit, asyncio.TimeoutError past the deadline."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.request_timeout_s
        chunks, size = [], 0
        while True:
            if _timeout_at is None:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            else:
                async with _timeout_at(deadline):
                    message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise BodyTooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The app's receive: the body read by the guard, then the connection's own events."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> dict[str, Any]:
        return pending.pop() if pending else await receive()
    return replayed
