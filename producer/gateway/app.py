"""`batchgate gateway`: an HTTP front for one queue, for apps in any language.

FastAPI app with an OpenAPI spec at `/openapi.json` (docs at `/docs`). One AsyncProducer
per process (one per shard on a sharded queue, see Gateway), opened and closed with the
app's lifespan. Endpoints:

    POST   /v1/requests                 submit (optionally wait for the result)
    GET    /v1/requests/{request_id}    where a request is, and its result
    DELETE /v1/requests/{request_id}    cancel a request that has not started
    GET    /v1/stats                    queue statistics (as `batchgate stats --json`)
    GET    /healthz                     Redis reachable? (never needs a token)
    GET    /metrics                     Prometheus metrics (never needs a token)

With several queues (`--queue a --queue b`), those routes serve the first, and
`/v1/queues/{queue}/...` each of them (queues.py). The OpenAI-compatible routes
(openai_api.py) and the Open Inference Protocol v2 routes (oip.py) name the queue as
their model.

A request goes through pure ASGI layers before FastAPI (GatewayAPI): metrics.py counts and
times it; guard.py checks its token, its body's size and the time its body takes;
hotpath.py answers the hot routes (submit, and a request's state) itself. FastAPI serves
the rest, and the OpenAPI spec of all of them.

Needs the `gateway` extra (fastapi, uvicorn, prometheus_client).
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import logging
import os
import re
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from typing import Annotated, Any

import orjson
import redis
import redis.asyncio
from fastapi import APIRouter, Depends, FastAPI, Path, Request, Response
from fastapi.exception_handlers import http_exception_handler
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from producer.aio import AsyncProducer
from producer.gateway.guard import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_REQUEST_TIMEOUT_S,
    REQUEST_TIMEOUT_ENV,
    Receive,
    RequestGuard,
    Scope,
    Send,
)
from producer.gateway.hotpath import (
    ERROR_ANSWERS,
    REQUEST_PATH,
    ApiError,
    HotPath,
    error_answer,
    not_found,
)
from producer.gateway.metrics import SUBMIT_PATH, GatewayMetrics, MetricsMiddleware
from producer.gateway.oip import OIPError, oip_error, oip_router
from producer.gateway.openai_api import OpenAIPath, models_router
from producer.gateway.queues import QUEUE_PATH, QueueRouter, current
from producer.gateway.schemas import (
    REQUEST_ID_PATTERN,
    Health,
    Problem,
    QueueFullProblem,
    RequestState,
    SubmitRequest,
    state_body,
)
from producer.sharded import AsyncShardedProducer
from producer.validation import ProducerConfig, cancel_envelope
from scheduler_core.admin import shard_state_async
from scheduler_core.connection import (
    DEFAULT_REDIS_URL,
    connect,
    connect_async,
    refresh_topology_async,
    slot_owner_async,
)
from scheduler_core.deadlines import expire_due_async
from scheduler_core.keys import QueueKeys, queue_clock_us
from scheduler_core.lifetime import die_with_marked_parent
from scheduler_core.ops.stats import QueueStats, queue_stats
from scheduler_core.scripts import Scripts, cancel_keys
from scheduler_core.wire import DEFAULT_MAX_PAYLOAD_BYTES, decode_result, split_job

log = logging.getLogger("batchgate.gateway")

HEALTH_TIMEOUT_S = 2.0
GC_THRESHOLD = 20_000  # allocations between young-generation collections (Python: 700)
# What `batchgate gateway --workers N` hands its worker processes (app_from_env).
WORKER_ENV = {"redis_url": "BATCHGATE_REDIS_URL", "queue": "BATCHGATE_QUEUE",
              "token": "BATCHGATE_GATEWAY_TOKEN",
              "max_body_bytes": "BATCHGATE_GATEWAY_MAX_BODY_BYTES",
              "request_timeout_s": REQUEST_TIMEOUT_ENV,
              "wait_replicas": "BATCHGATE_WAIT_REPLICAS",
              "wait_timeout_ms": "BATCHGATE_WAIT_TIMEOUT_MS"}
# No pattern on the path: a malformed id is as unknown as a well-formed one nobody
# submitted, and answers 404 like it (a 422 would suggest the request exists).
RequestId = Annotated[str, Path(description="The id returned by POST /v1/requests (32 "
                                            "hex digits; anything else is answered 404).")]
ID = re.compile(REQUEST_ID_PATTERN)
# The operations hotpath.HotPath answers before FastAPI's routing: declared here for the
# OpenAPI spec (and so that other methods on their paths get 405), never run by FastAPI.
ANSWERED_BY_HOTPATH = "answered by producer.gateway.hotpath.HotPath, before FastAPI"


def json_response(status: int, body: Any, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(body), status_code=status, headers=headers,
                    media_type="application/json")


class Gateway:
    """What the endpoints share: the producer, one async and one sync Redis client.

    A sharded queue (policy `shards` > 1, docs/scaling.md) is served through an
    AsyncShardedProducer: submits are placed round robin over the shards, and a request's
    state, cancel and stream are looked up in whichever shard holds it. The shard count
    is read at startup (`open`; if Redis is down then, on the first request), then again
    at most every SHARDS_REFRESH_S by the requests (see producer/sharded.py), so that a
    `batchgate policy set --shards` needs no restart."""

    def __init__(self, redis_url: str, queue: str, wait_replicas: int = 0,
                 wait_timeout_ms: int = ProducerConfig.wait_timeout_ms):
        self.keys = QueueKeys(queue)  # the logical queue (= shard 0)
        self.redis_url = redis_url
        self.redis = connect_async(redis_url)
        self.sharded = AsyncShardedProducer(redis_url, queue, client=self.redis,
                                            wait_replicas=wait_replicas,
                                            wait_timeout_ms=wait_timeout_ms)
        self.result_ttl_s = ProducerConfig(queue).result_ttl_s  # the producers' (defaults)
        self.sync_redis = connect(redis_url)  # for queue_stats, run in a thread
        self.scripts = Scripts(self.redis)

    async def open(self) -> None:
        """Read the queue's shard count and connect its producers (AsyncProducer.connect);
        with Redis down, leave it to the first request."""
        try:
            await self.sharded.connect()
        except (redis.RedisError, OSError) as exc:
            log.warning("gateway: cannot read queue %r's shard count yet (%s); reading it "
                        "on the first request", self.keys.queue, str(exc) or type(exc).__name__)
            return
        if self.sharded.shards > 1:
            log.info("gateway: queue %r has %d shards", self.keys.queue, self.sharded.shards)

    async def shards(self) -> list[AsyncProducer]:
        """One producer per shard, in shard order (the count re-read, see the class)."""
        await self.sharded.refresh()
        return self.sharded.producers

    async def close(self) -> None:
        await self.sharded.close()
        await self.redis.aclose()
        self.sync_redis.close()

    async def lookup(self, request_id: str) -> dict[str, Any] | None:
        """The request's state from Redis (any producer's request of this queue), as a
        RequestState body."""
        shards = await self.shards()
        if len(shards) == 1:
            keys: QueueKeys | None = shards[0].keys
            raw = await self.redis.get(self.keys.result(request_id))
        else:
            keys, raw = await self._locate(shards, request_id)
        if raw is not None:  # finished: its result says how (one GET, not the MULTI)
            return state_body(decode_result(raw))
        if keys is None:
            return None
        found = await shard_state_async(self.redis, keys, request_id)
        if found is not None and found.status == "queued" \
                and await self._expire_if_due(keys, request_id):
            found = await shard_state_async(self.redis, keys, request_id)
        if found is None:
            return None
        if found.result is not None:
            return state_body(found.result)
        return {"id": request_id, "status": found.status}

    async def _locate(self, shards: list[AsyncProducer],
                      request_id: str) -> tuple[QueueKeys | None, bytes | None]:
        """(the shard holding the request, its stored result): one pipeline over the
        shards. A request never moves between shards; within one, `jobs` is read before
        the result, so a request that completes in between is seen in one of them."""
        pipe = self.redis.pipeline(transaction=False)
        for producer in shards:
            pipe.hexists(producer.keys.jobs, request_id)
            pipe.get(producer.keys.result(request_id))
        replies = await pipe.execute()
        for producer, known, raw in zip(shards, replies[::2], replies[1::2], strict=True):
            if raw is not None or known:
                return producer.keys, raw
        return None, None

    async def cancel(self, request_id: str) -> int:
        """1 cancelled, 2 running (it will complete), 0 not waiting, 3 unknown to Redis."""
        shards = await self.shards()
        shard, job = shards[0], None
        if len(shards) == 1:
            job = await self.redis.hget(self.keys.jobs, request_id)
        else:  # the shard whose jobs know it; none: shard 0 answers "not waiting/unknown"
            pipe = self.redis.pipeline(transaction=False)
            for producer in shards:
                pipe.hget(producer.keys.jobs, request_id)
            for producer, raw in zip(shards, await pipe.execute(), strict=True):
                if raw is not None:
                    shard, job = producer, raw
                    break
        return await self._cancel(shard, request_id, job, deadline=False)

    async def _expire_if_due(self, keys: QueueKeys, request_id: str) -> bool:
        """Expire a queued request whose deadline_ms has passed, as its producer would:
        consumers see it only when they pop it, and its status must follow its deadline
        whoever asks. Whether it was expired now."""
        # With Redis' TIME: on a cluster, on the primary serving the shard's slot.
        owner = await slot_owner_async(self.redis, keys.jobs)
        pipe = owner.pipeline(transaction=False)
        pipe.hget(keys.jobs, request_id)
        pipe.time()
        pipe.get(keys.clock)
        try:
            job, time_reply, offset = await pipe.execute()
        except redis.RedisError as exc:
            await refresh_topology_async(self.redis, exc)
            raise
        meta = split_job(job)[0] if job is not None else None
        deadline_us = meta.deadline_us if meta is not None else 0
        if not 0 < deadline_us <= queue_clock_us(time_reply, offset):  # the scripts' clock
            return False
        # expire_due.lua, as every server-side expiry: DeadlineExceeded, or under
        # on_timeout = delay a move to the delayed set.
        sweep = await expire_due_async(self.scripts, keys, self.result_ttl_s)
        return bool(sweep.expired or sweep.delayed)

    async def _cancel(self, shard: AsyncProducer, request_id: str, job: bytes | None,
                      deadline: bool) -> int:
        owner = shard.id
        meta = split_job(job)[0] if job is not None else None
        if meta is not None and meta.producer:  # the inbox of the producer that submitted it
            owner = meta.producer
        envelope, counter = cancel_envelope(request_id, deadline=deadline)
        reply = await self.scripts.cancel(
            keys=cancel_keys(shard.keys, request_id, owner),
            args=[request_id, self.result_ttl_s, envelope, counter])
        return int(reply)


def _gateway(request: Request) -> Gateway:
    return current(request.app)


def _gateways(request: Request) -> dict[str, Gateway]:
    return request.app.state.gateways


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


# One server-sent event of a streamed submit; `data` is JSON: the part, {"restart":
# attempt}, or the final RequestState.
SSE_EVENT = {"type": "object", "required": ["event", "data"], "properties": {
    "event": {"type": "string", "enum": ["part", "restart", "result", "error", "timeout"]},
    "data": {"type": "string", "contentMediaType": "application/json"}}}


def build_router(auth: Any | None) -> APIRouter:
    router = APIRouter(prefix="/v1", dependencies=[Depends(auth)] if auth else [],
                       responses={401: _problem("Missing or wrong bearer token.")}
                       if auth else {})

    @router.post("/requests", status_code=202, responses={
        **STATE_RESPONSES,
        200: {"model": RequestState,
              "description": "Done (wait=true): `result` holds the model's result. With "
                             "stream=true: server-sent events, `part` and `restart` as they "
                             "come, then one final `result`, `error` or `timeout` event whose "
                             "data is the RequestState (docs/streaming.md).",
              "content": {"text/event-stream": {"schema": SSE_EVENT}}},
        202: {"model": RequestState, "description": "Accepted (wait=false), or still queued "
                                                    "or running after timeout_s."},
        404: _problem("Not used by this endpoint."),
        408: _problem("The body did not arrive within --request-timeout-s of the headers."),
        413: _problem("The body is over --max-body-bytes."),
        429: {"model": QueueFullProblem, "description": "QueueFull: retry after Retry-After "
                                                        "seconds.",
              "headers": {"Retry-After": {"schema": {"type": "integer"}}}},
    }, summary="Submit a request", response_model=RequestState)
    async def submit(body: SubmitRequest) -> Response:
        raise AssertionError(ANSWERED_BY_HOTPATH)

    @router.get(REQUEST_PATH.removeprefix("/v1"), responses=STATE_RESPONSES,
                summary="A request's state and result", response_model=RequestState)
    async def get_request(request_id: RequestId) -> Response:
        raise AssertionError(ANSWERED_BY_HOTPATH)

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
        if outcome == 1 or (state is not None and state["status"] == "cancelled"):
            return json_response(200, state or {"id": request_id, "status": "cancelled"})
        if state is None:
            raise not_found(request_id)
        return json_response(409, state)

    @router.get("/stats", response_model=QueueStats, responses=COMMON,
                summary="Queue statistics")
    async def stats(request: Request) -> Response:
        gateway = _gateway(request)
        result = await run_in_threadpool(queue_stats, gateway.sync_redis, gateway.keys.queue)
        return json_response(200, result.to_dict())

    return router


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own errors (404, 405)."""
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 405:  # Allow: every method of the path, not only the first route's
        methods = {method for route in request.app.state.routes()
                   if isinstance(route, APIRoute) and route.path_regex.match(request.url.path)
                   for method in route.methods}
        return json_response(405, {"error": "method_not_allowed", "message": str(exc.detail)},
                             {"Allow": ", ".join(sorted(methods))})
    return await http_exception_handler(request, exc)


async def _expected_error(_request: Request, exc: Exception) -> Response:
    """The errors hotpath.error_answer knows (ApiError, bad input, Redis down or full)."""
    answered = error_answer(exc)
    assert answered is not None
    status, body, headers = answered
    return Response(orjson.dumps(body), status_code=status, media_type="application/json",
                    headers={name.decode(): value.decode() for name, value in headers})


class GatewayAPI(FastAPI):
    """FastAPI, entered through `front`: the gateway's pure ASGI layers (metrics, guard,
    hot path), which pass what they do not answer, and the lifespan, to `framework`."""

    front: Any = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.front(scope, receive, send)

    async def framework(self, scope: Scope, receive: Receive, send: Send) -> None:
        await super().__call__(scope, receive, send)


def tune_collector() -> None:
    """For a process that serves the gateway: what is loaded at startup (FastAPI,
    pydantic, the spec: most of the heap) lives as long as the process, so it is moved out
    of the cyclic collector's sight (gc.freeze), and the collector runs less often. With
    many requests in flight, their objects outlive the young generation and bring on
    older-generation collections that walked that heap (measured: docs/benchmarks.md)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_THRESHOLD, *gc.get_threshold()[1:])


def create_app(redis_url: str = DEFAULT_REDIS_URL, queue: str | Sequence[str] = "default",
               token: str | None = None, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
               wait_replicas: int = 0,
               wait_timeout_ms: int = ProducerConfig.wait_timeout_ms,
               tune_gc: bool = False) -> FastAPI:
    """The gateway for `queue` (or several: the first is the default); with `token`,
    /v1/* and /v2/models/* need `Authorization: Bearer <token>`.
    Bodies over `max_body_bytes`, or not received within `request_timeout_s` of their
    headers, are refused (413, 408) before the app reads them. `wait_replicas`: a submit
    is accepted once that many replicas have it (AsyncProducer's). `tune_gc`: the app
    owns its process (`batchgate gateway`), tune its garbage collector at startup
    (tune_collector)."""
    # Validate the name and the WAIT knobs now, not on the first request.
    queues = [queue] if isinstance(queue, str) else list(dict.fromkeys(queue))
    if not queues:
        raise ValueError("a gateway needs at least one queue")
    for name in queues:
        ProducerConfig(queue=name, wait_replicas=wait_replicas,
                       wait_timeout_ms=wait_timeout_ms)
    queue = queues[0]
    metrics = GatewayMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.gateways = {name: Gateway(redis_url, name, wait_replicas, wait_timeout_ms)
                              for name in queues}
        app.state.gateway = app.state.gateways[queue]
        for gateway in app.state.gateways.values():
            await gateway.open()
        if tune_gc:
            tune_collector()
        try:
            yield
        finally:
            hot.close()
            for gateway in app.state.gateways.values():
                await gateway.close()

    # No trailing-slash redirects: their Location would be built from the Host header.
    app = GatewayAPI(title="batchgate gateway", version="1", lifespan=lifespan,
                     redirect_slashes=False,
                     description="Submit inference requests to batchgate queues "
                                 f"{', '.join(f'`{name}`' for name in queues)}.")
    app.state.metrics = metrics
    auth = bearer_auth(token) if token else None
    router = build_router(auth)
    app.include_router(router)
    for route in list(router.routes):  # the spec of /v1/queues/{queue}/... (queues.py)
        if isinstance(route, APIRoute):
            app.add_api_route(
                QUEUE_PATH + route.path.removeprefix("/v1"), route.endpoint,
                methods=list(route.methods), response_model=route.response_model,
                status_code=route.status_code, summary=f"{route.summary} (queue `queue`)",
                responses={**route.responses, 404: _problem(
                    "Unknown id, or `queue` is not served by this gateway.")},
                dependencies=route.dependencies, name=f"queue_{route.name}",
                openapi_extra={"parameters": [{"name": "queue", "in": "path",
                                               "required": True,
                                               "schema": {"type": "string"}}]})
    openai_routes = models_router(auth, _gateways)
    app.include_router(openai_routes)
    app.include_router(oip_router(auth, _gateways))
    app.add_exception_handler(OIPError, oip_error)

    def routes() -> Iterator[Any]:
        """Every route with a path (FastAPI may keep an included router's routes apart)."""
        return (route for route in (*router.routes, *app.router.routes)
                if hasattr(route, "path_regex"))
    app.state.routes = routes
    app.add_exception_handler(StarletteHTTPException, _http_error)
    for error in ERROR_ANSWERS:
        app.add_exception_handler(error, _expected_error)
    # Outermost first: metrics count every answer, the guard's included.
    hot = HotPath(app.framework, lambda: current(app), metrics,
                  {route.path: route for route in router.routes
                   if isinstance(route, APIRoute) and route.path in (SUBMIT_PATH, REQUEST_PATH)},
                  DEFAULT_MAX_PAYLOAD_BYTES)  # the AsyncProducer's payload limit
    served = OpenAIPath(hot, lambda: app.state.gateways,
                        {route.path: route for route in openai_routes.routes
                         if isinstance(route, APIRoute) and "POST" in route.methods})
    app.front = MetricsMiddleware(RequestGuard(QueueRouter(served, lambda: app.state.gateways),
                                               token=token, max_body_bytes=max_body_bytes,
                                               request_timeout_s=request_timeout_s),
                                  metrics=metrics, routes=routes)
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
    """The app of one `batchgate gateway --workers N` worker process, which dies with the
    gateway process that started it (scheduler_core/lifetime.py)."""
    die_with_marked_parent()
    env = os.environ
    return create_app(env.get(WORKER_ENV["redis_url"], DEFAULT_REDIS_URL),
                      env.get(WORKER_ENV["queue"], "default").split(","),
                      token=env.get(WORKER_ENV["token"]) or None,
                      max_body_bytes=int(env.get(WORKER_ENV["max_body_bytes"],
                                                 DEFAULT_MAX_BODY_BYTES)),
                      request_timeout_s=float(env.get(WORKER_ENV["request_timeout_s"],
                                                      DEFAULT_REQUEST_TIMEOUT_S)),
                      wait_replicas=int(env.get(WORKER_ENV["wait_replicas"], 0)),
                      wait_timeout_ms=int(env.get(WORKER_ENV["wait_timeout_ms"], 1000)),
                      tune_gc=True)
