"""The gateway's hot routes as a pure ASGI app, ahead of FastAPI's stack: `POST
/v1/requests` (submit, and with `"wait": true` its result) and `GET` (or `HEAD`)
`/v1/requests/{id}`. Everything else goes on to FastAPI.

FastAPI documents these two operations (app.py declares them, for the OpenAPI spec and for
405 answers) but never runs them: its request objects, dependency injection, pydantic
models and middleware layers cost ~3x the CPU of the work itself (docs/benchmarks.md).
Here a submit body is parsed with orjson and checked by `schemas.parse_submit` (the
producer library's checks, held to the spec's models by a test); answers are built as
plain dicts. Errors have the same shapes and statuses as FastAPI's handlers give them:
both use `error_answer`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import re
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import orjson
import redis

from producer.gateway.guard import Receive, Scope, Send, answer, header
from producer.gateway.metrics import SUBMIT_PATH, GatewayMetrics
from producer.gateway.schemas import (
    HTTP_STATUS,
    REQUEST_ID_PATTERN,
    Submit,
    parse_submit,
    state_body,
)
from scheduler_core.errors import InvalidRequest, QueueFull, RequestFailed, TenantLimit
from scheduler_core.streams import check_entry_id
from scheduler_core.wire import Restart, check_tenant, lost_result

if TYPE_CHECKING:
    from producer.gateway.app import Gateway

REQUEST_PREFIX = SUBMIT_PATH + "/"
REQUEST_PATH = REQUEST_PREFIX + "{request_id}"  # the route template (metrics, spec)
WAIT = "batchgate.wait"  # scope key: the submit's `wait`, for its metrics
# Submit bodies from this size on are parsed and their payload checked and encoded in a
# thread (at most PARSE_THREADS at once), not on the event loop.
PARSE_IN_THREAD_BYTES = 64 << 10
PARSE_THREADS = 2
DEFAULT_RETRY_AFTER_S = 1.0
ID = re.compile(REQUEST_ID_PATTERN)

Headers = list[tuple[bytes, bytes]]
Answer = tuple[int, Any, Headers]  # status, JSON body, extra headers


class ApiError(Exception):
    """An error answer: HTTP status, Problem body, headers."""

    def __init__(self, status: int, error: str, message: str, *, field: str | None = None,
                 headers: dict[str, str] | None = None, **extra: Any):
        super().__init__(message)
        self.status = status
        self.body = {"error": error, "message": message, **extra}
        if field is not None:
            self.body["field"] = field
        self.headers = headers or {}


def sse(event: str, data: Any, entry_id: str | None = None) -> dict[str, Any]:
    """One server-sent event as an ASGI body message (more to come); `entry_id`, the
    stream entry's id, is what a client sends back as Last-Event-ID to resume."""
    head = b"" if entry_id is None else b"id: " + entry_id.encode() + b"\n"
    return {"type": "http.response.body", "more_body": True,
            "body": head + b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) +
            b"\n\n"}


async def disconnected(receive: Receive) -> None:
    """Returns once the client has gone (its body is read already): uvicorn's send() stays
    silent after a hang-up, so a long answer learns of it only here."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_gone(work: Awaitable[Any], receive: Receive) -> asyncio.Future[Any] | None:
    """Run `work` until it ends, or until the client hangs up (then it is cancelled, which
    closes what it holds, and None is returned); else its finished task (`.result()`
    returns its value or raises its error)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(disconnected(receive))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)
    return None if task.cancelled() else task


def last_event_id(scope: Scope) -> str | None:
    """The Last-Event-ID header (a stream entry id the gateway sent), checked."""
    value = header(scope, b"last-event-id")
    if value is None:
        return None
    return check_entry_id(value.decode("latin-1").strip(), "Last-Event-ID")


def not_found(request_id: str) -> ApiError:
    return ApiError(404, "not_found", f"no request {request_id!r} (unknown, or its result "
                                      "expired)")


def _api_error(exc: Exception) -> Answer:
    assert isinstance(exc, ApiError)
    return exc.status, exc.body, [(k.lower().encode(), v.encode())
                                  for k, v in exc.headers.items()]


def _invalid(exc: Exception) -> Answer:
    assert isinstance(exc, InvalidRequest)
    return 422, {"error": "invalid_request", "message": str(exc), "field": exc.field}, []


def _redis_down(exc: Exception) -> Answer:
    return 503, {"error": "redis_unavailable", "message": str(exc)}, [(b"retry-after", b"1")]


def _redis_full(exc: Exception) -> Answer:
    return 503, {"error": "redis_full", "message": f"Redis is at maxmemory (noeviction): "
                                                   f"{exc}"}, [(b"retry-after", b"5")]


# Looked up along the exception's MRO, as Starlette looks up its exception handlers.
ERROR_ANSWERS: dict[type[BaseException], Callable[[Exception], Answer]] = {
    ApiError: _api_error,
    InvalidRequest: _invalid,
    redis.ConnectionError: _redis_down,
    redis.TimeoutError: _redis_down,
    redis.exceptions.ReadOnlyError: _redis_down,  # a replica, after a failover
    redis.exceptions.OutOfMemoryError: _redis_full,  # maxmemory with noeviction
}


def error_answer(exc: Exception) -> Answer | None:
    """The answer to an error the gateway expects (bad input, 429, Redis down), or None."""
    for cls in type(exc).__mro__:
        handler = ERROR_ANSWERS.get(cls)
        if handler is not None:
            return handler(exc)
    return None


def state_answer(state: dict[str, Any]) -> Answer:
    """A request state's answer: the HTTP status follows the status (schemas.HTTP_STATUS);
    202 points at where to poll."""
    status = HTTP_STATUS[state["status"]]
    if status == 202:
        return status, state, [(b"location", f"{REQUEST_PREFIX}{state['id']}".encode())]
    return status, state, []


def queue_full(exc: QueueFull) -> ApiError:
    retry = exc.retry_after_s or DEFAULT_RETRY_AFTER_S
    headers = {"Retry-After": str(max(1, math.ceil(retry)))}
    if isinstance(exc, TenantLimit):
        return ApiError(429, "tenant_limit", str(exc), depth=exc.depth, limit=exc.limit,
                        retry_after_s=retry, tenant=exc.tenant, quota=exc.limit_name,
                        headers=headers)
    return ApiError(429, "queue_full", str(exc), depth=exc.depth, limit=exc.limit,
                    retry_after_s=retry, headers=headers)


def header_tenant(scope: Scope) -> str | None:
    """The X-Tenant header a proxy set, checked (InvalidRequest naming X-Tenant). Sent
    more than once it is refused, not read first-wins: a proxy that adds its header
    instead of replacing the client's must not let the client's copy choose the tenant."""
    sent = [value for key, value in scope["headers"] if key == b"x-tenant"]
    if not sent:
        return None
    if len(sent) > 1:
        raise InvalidRequest("X-Tenant", f"sent {len(sent)} times; at most once (a proxy "
                                         "must replace the client's X-Tenant, not add one)")
    return check_tenant(sent[0].decode("latin-1"), "X-Tenant")


def submit_tenant(scope: Scope, submit: Submit) -> str | None:
    """The submit's tenant: its body's `tenant` or the X-Tenant header a proxy set; both
    given must agree (InvalidRequest naming tenant)."""
    named = header_tenant(scope)
    if named is None:
        return submit.tenant
    if submit.tenant is not None and submit.tenant != named:
        raise InvalidRequest("tenant", f"{submit.tenant!r} differs from the X-Tenant header "
                                       f"{named!r}")
    return named


@functools.lru_cache(maxsize=64)
def is_json(content_type: bytes | None) -> bool:
    """application/json or application/*+json, as FastAPI reads a body as JSON."""
    maintype, _, subtype = (content_type or b"").partition(b";")[0].strip().lower() \
        .partition(b"/")
    return maintype == b"application" and (subtype == b"json" or subtype.endswith(b"+json"))


async def read_body(receive: Receive) -> bytes | None:
    """The request's body (RequestGuard has read it, within its limits), or None if the
    client left."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks) if len(chunks) > 1 else chunks[0]


class HotPath:
    """Answers the hot routes itself; passes any other request (and the lifespan) to
    `app`. `gateway` returns the process's Gateway (made in the app's lifespan); `routes`
    are FastAPI's route objects of the two operations, set as the scope's route so that
    metrics label them as FastAPI's routing would."""

    def __init__(self, app: Any, gateway: Callable[[], Gateway], metrics: GatewayMetrics,
                 routes: dict[str, Any], max_payload_bytes: int):
        self.app = app
        self.gateway = gateway
        self.metrics = metrics
        self.submit_route = routes[SUBMIT_PATH]
        self.request_route = routes[REQUEST_PATH]
        self.max_payload_bytes = max_payload_bytes
        self.executor = ThreadPoolExecutor(PARSE_THREADS, thread_name_prefix="batchgate-parse")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path, method = scope["path"], scope["method"]
            if path == SUBMIT_PATH and method == "POST":
                scope["route"] = self.submit_route
                await self.serve(self.submit(scope, receive, send), send)
                return
            if path.startswith(REQUEST_PREFIX) and method in ("GET", "HEAD") and \
                    "/" not in path[len(REQUEST_PREFIX):] and len(path) > len(REQUEST_PREFIX):
                scope["route"] = self.request_route
                await self.serve(self.get(path[len(REQUEST_PREFIX):]), send)
                return
        await self.app(scope, receive, send)

    async def serve(self, handler: Awaitable[Answer | None], send: Send) -> None:
        try:
            answered = await handler
        except Exception as exc:
            answered = error_answer(exc)
            if answered is None:
                raise  # uvicorn answers 500 and logs it
        if answered is not None:
            await answer(send, *answered)

    async def get(self, request_id: str) -> Answer:
        """GET /v1/requests/{request_id}: where it is, and its result."""
        state = await self.gateway().lookup(request_id) if ID.fullmatch(request_id) else None
        if state is None:
            raise not_found(request_id)
        return state_answer(state)

    async def stream(self, handle: Any, timeout_s: float, after: str | None,
                     receive: Receive, send: Send) -> None:
        """`"stream": true`: server-sent events, `part`/`restart` as they come (each with
        its stream entry id, from the one after `after`), then the final `result`,
        `error` or `timeout` with the request's state. A client that hangs up ends it
        at once: its stream reader is closed."""
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
            (b"x-request-id", handle.id.encode())]})
        relayed = await unless_gone(self.relay(handle, timeout_s, after, send), receive)
        if relayed is not None:
            relayed.result()  # raises what the relay raised

    async def relay(self, handle: Any, timeout_s: float, after: str | None,
                    send: Send) -> None:
        """The events of `stream`, while the client is there."""
        waiting, streams = self.metrics.waiting, self.metrics.streams
        waiting.inc()
        streams.inc()
        final = "timeout"
        try:
            try:
                async with contextlib.aclosing(handle.entries(timeout_s, after)) as entries:
                    async for entry_id, event in entries:
                        if isinstance(event, Restart):
                            await send(sse("restart", {"restart": event.attempt}, entry_id))
                        else:
                            await send(sse("part", event, entry_id))
            except TimeoutError:
                pass
            except redis.RedisError as exc:  # the answer has begun: the final event says it
                await send({**sse("error", {"id": handle.id, "error": "redis_unavailable",
                                            "message": str(exc)}), "more_body": False})
                return
            if handle.done():
                try:
                    value = await handle.result(timeout=0)
                    final, state = "result", {"id": handle.id, "status": "done",
                                              "result": value}
                except RequestFailed:  # failed, expired or cancelled: its state says which
                    final = "error"
                    state = await self.gateway().lookup(handle.id) or \
                        state_body(lost_result(handle.id))
            else:
                state = await self.gateway().lookup(handle.id) or \
                    {"id": handle.id, "status": "queued"}
        finally:
            waiting.dec()
            streams.dec()
        await send({**sse(final, state), "more_body": False})

    async def submit(self, scope: Scope, receive: Receive, send: Send) -> Answer | None:
        """POST /v1/requests: 202 with the id, or with `wait` the request's state once it
        is done or `timeout_s` passed; with `stream`, server-sent events (sent here). A
        client that hangs up while it waits is let go at once (the request goes on)."""
        body = await read_body(receive)
        if body is None:
            return None  # the client left
        submit = await self.parse(scope, body)
        after = last_event_id(scope) if submit.stream else None
        scope[WAIT] = submit.wait or submit.stream
        gateway = self.gateway()
        try:
            handle = await gateway.sharded.submit(
                submit.payload, priority=submit.priority, deadline_ms=submit.deadline_ms,
                idempotency_key=submit.idempotency_key, cost=submit.cost,
                # stored: GET /v1/requests/<id> reads it, from any gateway
                store_result=True, tenant=submit_tenant(scope, submit))
        except QueueFull as exc:
            raise queue_full(exc) from None
        if submit.stream:
            await self.stream(handle, submit.timeout_s, after, receive, send)
            return None
        if not submit.wait:
            return state_answer({"id": handle.id, "status": "queued"})
        waiting = self.metrics.waiting
        waiting.inc()
        try:
            waited = await unless_gone(handle.result(timeout=submit.timeout_s), receive)
            if waited is None:
                return None  # the client left: nobody to answer
            return 200, {"id": handle.id, "status": "done", "result": waited.result()}, []
        except (TimeoutError, RequestFailed):
            pass  # still waiting, or failed/expired/cancelled: its stored state says which
        finally:
            waiting.dec()
        state = await gateway.lookup(handle.id)  # its result, or one MULTI over its states
        # Accepted, yet Redis no longer knows it (lost with its data, or its result
        # expired): it failed (RequestLost), rather than 202 with a Location that 404s.
        return state_answer(state or state_body(lost_result(handle.id)))

    async def parse(self, scope: Scope, body: bytes) -> Submit:
        """The checked submit; a large body is parsed and checked in a thread."""
        if not is_json(header(scope, b"content-type")):
            raise InvalidRequest("body", "send a JSON object with Content-Type: "
                                         "application/json")
        if not body:
            raise InvalidRequest("body", "is empty; send a JSON object")
        if len(body) < PARSE_IN_THREAD_BYTES:
            return parse_submit(body, self.max_payload_bytes)
        return await asyncio.get_running_loop().run_in_executor(
            self.executor, parse_submit, body, self.max_payload_bytes)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
