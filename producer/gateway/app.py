"""`batchgate gateway`: an HTTP front for one queue, for apps in any language.

FastAPI app with an OpenAPI spec at `/openapi.json` (docs at `/docs`). One AsyncProducer
per process, opened and closed with the app's lifespan. Endpoints:

    POST   /v1/requests                 submit (optionally wait for the result)
    GET    /v1/requests/{request_id}    where a request is, and its result
    DELETE /v1/requests/{request_id}    cancel a request that has not started
    GET    /v1/stats                    queue statistics (as `batchgate stats --json`)
    GET    /healthz                     Redis reachable? (never needs a token)
    GET    /metrics                     Prometheus metrics (never needs a token)

Before the app sees a request, guard.py checks its token, its body's size and the time
its body takes; large submit bodies are parsed and checked in a thread (SubmitParser).

Needs the `gateway` extra (fastapi, uvicorn, prometheus_client).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import os
import re
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Annotated, Any

import orjson
import redis
import redis.asyncio
from fastapi import APIRouter, Depends, FastAPI, Path, Request, Response
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from producer.aio import AsyncProducer
from producer.gateway.guard import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_REQUEST_TIMEOUT_S,
    REQUEST_TIMEOUT_ENV,
    RequestGuard,
    Scope,
    header,
)
from producer.gateway.metrics import SUBMIT_PATH, GatewayMetrics, MetricsMiddleware
from producer.gateway.schemas import (
    HTTP_STATUS,
    REQUEST_ID_PATTERN,
    Health,
    Problem,
    QueueFullProblem,
    RequestState,
    SubmitRequest,
)
from producer.validation import cancel_envelope
from scheduler_core.admin import QueueStats, queue_stats, request_state_async
from scheduler_core.connection import DEFAULT_REDIS_URL, connect, connect_async
from scheduler_core.deadlines import expire_due_async
from scheduler_core.errors import InvalidRequest, QueueFull, RequestFailed
from scheduler_core.keys import QueueKeys
from scheduler_core.scripts import Scripts, cancel_keys
from scheduler_core.wire import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    EncodedPayload,
    encode_payload,
    lost_result,
)

log = logging.getLogger("batchgate.gateway")

HEALTH_TIMEOUT_S = 2.0
# Submit bodies from this size on are parsed and their payload checked and encoded in a
# thread (at most PARSE_THREADS at once), not on the event loop.
PARSE_IN_THREAD_BYTES = 64 << 10
PARSE_THREADS = 2
PREPARED = "batchgate.payload"  # scope key: the EncodedPayload, or its InvalidRequest
LONG_NUMBER = re.compile(rb"[0-9]{19}")  # orjson reads integers past 64 bits as floats
# What `batchgate gateway --workers N` hands its worker processes (app_from_env).
WORKER_ENV = {"redis_url": "BATCHGATE_REDIS_URL", "queue": "BATCHGATE_QUEUE",
              "token": "BATCHGATE_GATEWAY_TOKEN",
              "max_body_bytes": "BATCHGATE_GATEWAY_MAX_BODY_BYTES",
              "request_timeout_s": REQUEST_TIMEOUT_ENV}
DEFAULT_RETRY_AFTER_S = 1.0
# No pattern on the path: a malformed id is as unknown as a well-formed one nobody
# submitted, and answers 404 like it (a 422 would suggest the request exists).
RequestId = Annotated[str, Path(description="The id returned by POST /v1/requests (32 "
                                            "hex digits; anything else is answered 404).")]
ID = re.compile(REQUEST_ID_PATTERN)


def not_found(request_id: str) -> ApiError:
    return ApiError(404, "not_found", f"no request {request_id!r} (unknown, or its result "
                                      "expired)")


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


def json_response(status: int, body: Any, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(body), status_code=status, headers=headers,
                    media_type="application/json")


def state_response(state: RequestState) -> Response:
    headers = {"Location": f"/v1/requests/{state.id}"} if HTTP_STATUS[state.status] == 202 \
        else None
    return json_response(HTTP_STATUS[state.status], state.body(), headers)


class Gateway:
    """What the endpoints share: one AsyncProducer, one async and one sync Redis client."""

    def __init__(self, redis_url: str, queue: str):
        self.keys = QueueKeys(queue)
        self.redis_url = redis_url
        self.redis = connect_async(redis_url)
        self.producer = AsyncProducer(redis_url, queue, client=self.redis)
        self.sync_redis = connect(redis_url)  # for admin.queue_stats, run in a thread
        self.scripts = Scripts(self.redis)

    async def close(self) -> None:
        await self.producer.close()
        await self.redis.aclose()
        self.sync_redis.close()

    async def lookup(self, request_id: str) -> RequestState | None:
        """The request's state from Redis (any producer's request of this queue)."""
        found = await request_state_async(self.redis, self.keys.queue, request_id)
        if found is not None and found.status == "queued" \
                and await self._expire_if_due(request_id):
            found = await request_state_async(self.redis, self.keys.queue, request_id)
        if found is None:
            return None
        if found.result is not None:
            return RequestState.from_result(found.result)
        return RequestState(id=request_id, status=found.status)  # type: ignore[arg-type]

    async def cancel(self, request_id: str) -> int:
        """1 cancelled, 2 running (it will complete), 0 not waiting, 3 unknown to Redis."""
        meta = await self.redis.hget(self.keys.meta, request_id)
        return await self._cancel(request_id, meta, deadline=False)

    async def _expire_if_due(self, request_id: str) -> bool:
        """Expire a queued request whose deadline_ms has passed, as its producer would:
        consumers see it only when they pop it, and its status must follow its deadline
        whoever asks. Whether it was expired now."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.hget(self.keys.meta, request_id)
        pipe.time()
        meta, (seconds, micros) = await pipe.execute()
        fields = meta.decode().split(":") if meta is not None else []
        deadline_us = int(fields[2]) if len(fields) == 5 and fields[2].isdigit() else 0
        if not 0 < deadline_us <= seconds * 1_000_000 + micros:  # Redis' clock, as the Lua
            return False
        # expire_due.lua, as every server-side expiry: DeadlineExceeded, or under
        # on_timeout = delay a move to the delayed set.
        sweep = await expire_due_async(self.scripts, self.keys,
                                       self.producer.config.result_ttl_s)
        return bool(sweep.expired or sweep.delayed)

    async def _cancel(self, request_id: str, meta: bytes | None, deadline: bool) -> int:
        owner = self.producer.id
        fields = meta.decode().split(":") if meta is not None else []
        if len(fields) == 5 and fields[4]:  # the inbox of the producer that submitted it
            owner = fields[4]
        envelope, counter = cancel_envelope(request_id, deadline=deadline)
        reply = await self.scripts.cancel(
            keys=cancel_keys(self.keys, request_id, owner),
            args=[request_id, self.producer.config.result_ttl_s, envelope, counter])
        return int(reply)


def _gateway(request: Request) -> Gateway:
    return request.app.state.gateway


BEARER = HTTPBearer(auto_error=False, description="`Authorization: Bearer <token>`, the "
                                                  "token given to `batchgate gateway`.")


def bearer_auth(token: str) -> Any:
    expected = token.encode()

    async def check(credentials: Annotated[HTTPAuthorizationCredentials | None,
                                           Depends(BEARER)]) -> None:
        if credentials is None or not hmac.compare_digest(
                credentials.credentials.encode(), expected):
            raise ApiError(401, "unauthorized", "missing or wrong bearer token",
                           headers={"WWW-Authenticate": "Bearer"})
    return check


def _problem(description: str, model: type = Problem) -> dict[str, Any]:
    return {"model": model, "description": description}


COMMON = {422: _problem("Bad input; `field` names it."),
          503: _problem("Redis is unreachable.")}
STATE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"model": RequestState, "description": "Done: `result` holds the model's result."},
    202: {"model": RequestState, "description": "Queued or running; poll the Location."},
    404: _problem("Unknown id (or its result expired after result_ttl_s)."),
    410: {"model": RequestState, "description": "Cancelled before it ran."},
    502: {"model": RequestState, "description": "The model failed on it, or it was "
                                                "dead-lettered; see `error`."},
    504: {"model": RequestState, "description": "Its deadline_ms passed before it ran."},
    **COMMON,
}


def build_router(auth: Any | None) -> APIRouter:
    router = APIRouter(prefix="/v1", dependencies=[Depends(auth)] if auth else [],
                       responses={401: _problem("Missing or wrong bearer token.")}
                       if auth else {})

    @router.post("/requests", status_code=202, responses={
        **STATE_RESPONSES,
        202: {"model": RequestState, "description": "Accepted (wait=false), or still queued "
                                                    "or running after timeout_s."},
        404: _problem("Not used by this endpoint."),
        408: _problem("The body did not arrive within --request-timeout-s of the headers."),
        413: _problem("The body is over --max-body-bytes."),
        429: {"model": QueueFullProblem, "description": "QueueFull: retry after Retry-After "
                                                        "seconds.",
              "headers": {"Retry-After": {"schema": {"type": "integer"}}}},
    }, summary="Submit a request", response_model=RequestState)
    async def submit(body: SubmitRequest, request: Request) -> Response:
        gateway = _gateway(request)
        request.scope["batchgate.wait"] = body.wait
        prepared = request.scope.pop(PREPARED, None)  # a large body's payload (SubmitParser)
        if isinstance(prepared, InvalidRequest):
            raise prepared
        try:
            handle = await gateway.producer.submit(
                body.payload if prepared is None else prepared, priority=body.priority,
                deadline_ms=body.deadline_ms, idempotency_key=body.idempotency_key)
        except QueueFull as exc:
            retry = exc.retry_after_s or DEFAULT_RETRY_AFTER_S
            raise ApiError(429, "queue_full", str(exc), depth=exc.depth, limit=exc.limit,
                           retry_after_s=retry,
                           headers={"Retry-After": str(max(1, math.ceil(retry)))}) from None
        if not body.wait:
            return state_response(RequestState(id=handle.id, status="queued"))
        metrics: GatewayMetrics = request.app.state.metrics
        metrics.waiting.inc()
        try:
            value = await handle.result(timeout=body.timeout_s)
            return state_response(RequestState(id=handle.id, status="done", result=value))
        except (TimeoutError, RequestFailed):
            pass  # still waiting, or failed/expired/cancelled: its stored state says which
        finally:
            metrics.waiting.dec()
        state = await gateway.lookup(handle.id)  # one MULTI: a request that exists is seen
        # Accepted, yet Redis no longer knows it (lost with its data, or its result
        # expired): it failed (RequestLost), rather than 202 with a Location that 404s.
        return state_response(state or RequestState.from_result(lost_result(handle.id)))

    @router.get("/requests/{request_id}", responses=STATE_RESPONSES,
                summary="A request's state and result", response_model=RequestState)
    async def get_request(request_id: RequestId, request: Request) -> Response:
        state = await _gateway(request).lookup(request_id) if ID.fullmatch(request_id) else None
        if state is None:
            raise not_found(request_id)
        return state_response(state)

    @router.delete("/requests/{request_id}", responses={
        200: {"model": RequestState, "description": "Cancelled: it will never run."},
        404: _problem("Unknown id."),
        409: {"model": RequestState, "description": "Too late: running or finished."},
        **COMMON,
    }, summary="Cancel a request that has not started", response_model=RequestState)
    async def cancel(request_id: RequestId, request: Request) -> Response:
        gateway = _gateway(request)
        if not ID.fullmatch(request_id):
            raise not_found(request_id)
        outcome = await gateway.cancel(request_id)
        state = await gateway.lookup(request_id)
        if outcome == 1 or (state is not None and state.status == "cancelled"):
            state = state or RequestState(id=request_id, status="cancelled")
            return json_response(200, state.body())
        if state is None:
            raise not_found(request_id)
        return json_response(409, state.body())

    @router.get("/stats", response_model=QueueStats, responses=COMMON,
                summary="Queue statistics")
    async def stats(request: Request) -> Response:
        gateway = _gateway(request)
        result = await run_in_threadpool(queue_stats, gateway.sync_redis, gateway.keys.queue)
        return json_response(200, result.to_dict())

    return router


class SubmitParser:
    """Prepares large `POST /v1/requests` bodies off the event loop (a RequestGuard hook):
    in a thread, parses the JSON, checks and encodes its payload (the producer's checks,
    which walk every value), and hands the app the body with `"payload": null` and the
    EncodedPayload (or its InvalidRequest) in the scope. The app then parses a few bytes.

    A body that is not a JSON object is replaced by a small one that fails the same way, so
    the app answers as it always does (one error shape, one place)."""

    def __init__(self, max_payload_bytes: int):
        self.max_payload_bytes = max_payload_bytes
        self.executor = ThreadPoolExecutor(PARSE_THREADS, thread_name_prefix="batchgate-parse")

    async def __call__(self, scope: Scope, body: bytes) -> bytes:
        content_type = (header(scope, b"content-type") or b"").partition(b";")[0].strip()
        maintype, _, subtype = content_type.lower().partition(b"/")
        if len(body) < PARSE_IN_THREAD_BYTES or maintype != b"application" or not (
                subtype == b"json" or subtype.endswith(b"+json")):
            return body  # small, or not parsed as JSON by the app anyway
        prepared, body = await asyncio.get_running_loop().run_in_executor(
            self.executor, self.parse, body)
        if prepared is not None:
            scope[PREPARED] = prepared
        return body

    def parse(self, body: bytes) -> tuple[EncodedPayload | InvalidRequest | None, bytes]:
        try:
            submitted = _loads(body)
        except json.JSONDecodeError:
            return None, b"{"  # the app answers: body: JSON decode error
        except Exception:  # not UTF-8, nested past the recursion limit
            return None, b"\xff"  # the app answers: body: There was an error parsing ...
        if not isinstance(submitted, dict):
            return None, b"[]"  # the app answers: body: Input should be a valid dictionary
        # Other fields keep their values (they are validated by the app); unknown ones are
        # refused for their name, whatever their value.
        rest = {name: value if name in SubmitRequest.model_fields else None
                for name, value in submitted.items() if name != "payload"}
        prepared: EncodedPayload | InvalidRequest | None = None
        if "payload" in submitted:
            try:
                prepared = encode_payload(submitted["payload"], self.max_payload_bytes)
            except InvalidRequest as exc:
                prepared = exc
            rest["payload"] = None
        return prepared, json.dumps(rest).encode()

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


def _loads(body: bytes) -> Any:
    """`json.loads(body)`, as the app reads a body (NaN and integers past 64 bits are then
    refused with the field that holds them), through orjson where it reads the same, 2-3x
    faster (the parse holds the GIL): orjson refuses what json accepts beyond RFC 8259
    (NaN, a BOM, lone surrogates), and reads integers of 19 digits or more as floats."""
    if not LONG_NUMBER.search(body):
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError:
            pass
    return json.loads(body)


async def _invalid(request: Request, exc: Exception) -> Response:
    if isinstance(exc, InvalidRequest):
        return json_response(422, {"error": "invalid_request", "message": str(exc),
                                   "field": exc.field})
    assert isinstance(exc, RequestValidationError)
    # One documented body, {error, message, field}: pydantic's own error list is not
    # passed on (its locations name validator internals, not fields a client sent).
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = list(first.get("loc", ()))
    field = str(loc[1]) if len(loc) > 1 and loc[0] in ("body", "path", "query") else "body"
    if first.get("type") == "json_invalid":
        field = "body"
    message = f"{field}: {first.get('msg', 'invalid')}" if errors else "invalid request"
    if field == "priority":  # a union: the first branch's message would hide 0-2
        message = (f"priority: {first.get('input')!r} is not a priority; use \"high\", "
                   "\"normal\", \"low\" or 0, 1, 2")
    if field == "body" and "json" not in request.headers.get("content-type", ""):
        message = "body: send a JSON object with Content-Type: application/json"
    return json_response(422, {"error": "invalid_request", "message": message, "field": field})


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own errors; an unparsable body (e.g. not UTF-8) is bad input like any."""
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 400:
        return json_response(422, {"error": "invalid_request", "field": "body",
                                   "message": f"body: {exc.detail}"})
    if exc.status_code == 405:  # Allow: every method of the path, not only the first route's
        methods = {method for route in request.app.state.routes()
                   if isinstance(route, APIRoute) and route.path_regex.match(request.url.path)
                   for method in route.methods}
        return json_response(405, {"error": "method_not_allowed", "message": str(exc.detail)},
                             {"Allow": ", ".join(sorted(methods))})
    return await http_exception_handler(request, exc)


async def _api_error(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return json_response(exc.status, exc.body, exc.headers)


async def _redis_down(_request: Request, exc: Exception) -> Response:
    return json_response(503, {"error": "redis_unavailable", "message": str(exc)},
                         {"Retry-After": "1"})


async def _redis_full(_request: Request, exc: Exception) -> Response:
    return json_response(503, {"error": "redis_full", "message": f"Redis is at maxmemory "
                                                                 f"(noeviction): {exc}"},
                         {"Retry-After": "5"})


def create_app(redis_url: str = DEFAULT_REDIS_URL, queue: str = "default",
               token: str | None = None, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S) -> FastAPI:
    """The gateway for `queue`; with `token`, /v1/* needs `Authorization: Bearer <token>`.
    Bodies over `max_body_bytes`, or not received within `request_timeout_s` of their
    headers, are refused (413, 408) before the app reads them."""
    QueueKeys(queue)  # validate the name now, not on the first request
    metrics = GatewayMetrics()
    parser = SubmitParser(DEFAULT_MAX_PAYLOAD_BYTES)  # the AsyncProducer's payload limit

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.gateway = Gateway(redis_url, queue)
        try:
            yield
        finally:
            parser.close()
            await app.state.gateway.close()

    # No trailing-slash redirects: their Location would be built from the Host header.
    app = FastAPI(title="batchgate gateway", version="1", lifespan=lifespan,
                  redirect_slashes=False,
                  description=f"Submit inference requests to batchgate queue `{queue}`.")
    app.state.metrics = metrics
    router = build_router(bearer_auth(token) if token else None)
    app.include_router(router)

    def routes() -> Iterator[Any]:
        """Every route with a path (FastAPI may keep an included router's routes apart)."""
        return (route for route in (*router.routes, *app.router.routes)
                if hasattr(route, "path_regex"))
    app.state.routes = routes
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(InvalidRequest, _invalid)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(redis.ConnectionError, _redis_down)
    app.add_exception_handler(redis.TimeoutError, _redis_down)
    app.add_exception_handler(redis.exceptions.OutOfMemoryError, _redis_full)  # noeviction
    app.add_exception_handler(redis.exceptions.ReadOnlyError, _redis_down)  # failover
    # The last added is the outermost: metrics count every answer, the guard's included.
    app.add_middleware(RequestGuard, token=token, max_body_bytes=max_body_bytes,
                       request_timeout_s=request_timeout_s,
                       prepare={("POST", SUBMIT_PATH): parser})
    app.add_middleware(MetricsMiddleware, metrics=metrics, routes=routes)
    health = {"ok": True}

    @app.get("/healthz", response_model=Health, summary="Redis reachable?",
             responses={503: {"model": Health, "description": "Redis is unreachable."}})
    async def healthz(request: Request) -> Response:
        """No token needed, so no detail given: the kind of error only (the gateway logs
        what Redis answered when it stops answering)."""
        try:
            await asyncio.wait_for(_gateway(request).redis.ping(), HEALTH_TIMEOUT_S)
        except (redis.RedisError, OSError, asyncio.TimeoutError) as exc:
            if health.pop("ok", False):
                log.warning("healthz: Redis unavailable: %s", str(exc) or type(exc).__name__)
            return json_response(503, {"status": "unavailable", "redis": type(exc).__name__})
        health["ok"] = True
        return json_response(200, {"status": "ok", "redis": "ok"})

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics() -> Response:
        data, content_type = metrics.exposition()
        return Response(data, media_type=content_type)

    return app


def app_from_env() -> FastAPI:
    """The app of one `batchgate gateway --workers N` worker process."""
    env = os.environ
    return create_app(env.get(WORKER_ENV["redis_url"], DEFAULT_REDIS_URL),
                      env.get(WORKER_ENV["queue"], "default"),
                      token=env.get(WORKER_ENV["token"]) or None,
                      max_body_bytes=int(env.get(WORKER_ENV["max_body_bytes"],
                                                 DEFAULT_MAX_BODY_BYTES)),
                      request_timeout_s=float(env.get(WORKER_ENV["request_timeout_s"],
                                                      DEFAULT_REQUEST_TIMEOUT_S)))
