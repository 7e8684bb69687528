"""The dashboard's FastAPI app: the page, its live feed (server-sent events) and, with a
token, the actions (policy change, dead-letter retry and purge) on the queues it shows
(with --queue, only those).

Every URL the page uses is relative, so it works under any path prefix (a proxy that
strips it, or --root-path / X-Forwarded-Prefix for one that does not).
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import redis
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool

from batchgate.present import busy_first, for_people
from scheduler_core.admin import change_policy
from scheduler_core.deadletter import purge, retry
from scheduler_core.errors import BatchgateError, InvalidRequest
from scheduler_core.keys import validate_queue_name
from scheduler_core.ops.snapshot import Rates, readable_snapshots, shown_queues
from scheduler_core.policy import LIMITS, Strategy
from scheduler_core.registry import DEFAULT_MAX_QUEUES, QueueFinder

STATIC = Path(__file__).parent / "static"
MAX_IDS = 1000  # dead-letter ids per action call
# In index.html: where the snapshot goes when the page is served.
SNAPSHOT_SLOT = '<script id="snapshot" type="application/json">null</script>'


class Feed:
    """The snapshot of the queues shown (at most `max_queues` found ones, the most active:
    scheduler_core/registry.py), shared by all viewers: read from Redis at most once per
    `interval_s`, whatever the number of open pages; `queues_left_out` counts the others."""

    def __init__(self, client: redis.Redis, interval_s: float, only: list[str] | None,
                 max_queues: int = DEFAULT_MAX_QUEUES):
        self._client, self.interval_s, self._only = client, interval_s, only
        self.max_queues = max_queues
        self._finder = QueueFinder(client)
        self._rates = Rates()
        self._lock = asyncio.Lock()
        self._at = float("-inf")
        self._body = b""

    def _read(self) -> bytes:
        try:
            queues, left_out = shown_queues(self._client, self._only, self.max_queues,
                                            self._finder)
            read, unreadable = readable_snapshots(self._client, queues)
            snaps = busy_first([for_people(self._rates.update(s)) for s in read])
        except redis.RedisError as exc:  # the page says so, and keeps what it shows
            return orjson.dumps({"error": f"cannot read Redis: {exc}", "at": time.time()})
        return orjson.dumps({"queues": snaps, "queues_left_out": left_out,
                             "unreadable": unreadable, "at": time.time()})

    async def latest(self) -> bytes:
        async with self._lock:
            if time.monotonic() - self._at >= self.interval_s * 0.9:
                self._body = await run_in_threadpool(self._read)
                self._at = time.monotonic()
            return self._body


def _error(status: int, message: str, field: str | None = None) -> JSONResponse:
    body: dict[str, Any] = {"error": message}
    if field:
        body["field"] = field
    return JSONResponse(body, status_code=status)


def create_app(client: redis.Redis, token: str | None = None, interval_s: float = 0.5,
               only: list[str] | None = None, root_path: str = "",
               max_queues: int = DEFAULT_MAX_QUEUES) -> FastAPI:
    # No trailing-slash redirects: their Location would be built from the Host header.
    app = FastAPI(title="batchgate dashboard", root_path=root_path, docs_url=None,
                  redoc_url=None, openapi_url=None, redirect_slashes=False)
    feed = Feed(client, interval_s, only, max_queues)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.middleware("http")
    async def forwarded_prefix(request: Request, call_next: Any) -> Response:
        # Behind a proxy that keeps its prefix: the app's own URLs start there.
        prefix = request.headers.get("x-forwarded-prefix")
        if prefix and not root_path:
            request.scope["root_path"] = prefix.rstrip("/")
        response = await call_next(request)
        return response

    page = (STATIC / "index.html").read_text()

    @app.get("/", include_in_schema=False)
    async def index() -> HTMLResponse:
        # The current snapshot rides in the page, so it is complete at once, before the
        # live feed's first event. "<" escaped: nothing in the data can close the script.
        snapshot = (await feed.latest()).replace(b"<", b"\\u003c").decode()
        filled = SNAPSHOT_SLOT.replace("null", snapshot)
        return HTMLResponse(page.replace(SNAPSHOT_SLOT, filled, 1),
                            headers={"Cache-Control": "no-cache"})

    @app.get("/api/config")
    async def config() -> dict[str, Any]:
        return {"actions": token is not None, "interval_s": interval_s,
                "strategies": [s.value for s in Strategy],
                "limits": {k: list(v) for k, v in LIMITS.items()}}

    @app.get("/api/snapshot")
    async def snapshot() -> Response:
        return Response(await feed.latest(), media_type="application/json")

    @app.get("/events")
    async def events(request: Request) -> StreamingResponse:
        async def stream() -> AsyncIterator[bytes]:
            yield f"retry: {int(interval_s * 1000)}\n\n".encode()
            while not await request.is_disconnected():
                yield b"data: " + await feed.latest() + b"\n\n"
                await asyncio.sleep(interval_s)
        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache",
                                          "X-Accel-Buffering": "no"})

    def authorized(request: Request) -> JSONResponse | None:
        if token is None:
            return _error(403, "the dashboard is read-only: start it with --token to allow "
                               "actions")
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(),
                                                                 token.encode()):
            return _error(401, "missing or wrong token (Authorization: Bearer TOKEN)")
        return None

    async def body_of(request: Request) -> dict[str, Any]:
        try:
            body = orjson.loads(await request.body() or b"{}")
        except orjson.JSONDecodeError as exc:
            raise InvalidRequest("body", f"not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise InvalidRequest("body", "must be a JSON object")
        return body

    async def act(request: Request, queue: str, work: Any) -> JSONResponse:
        denied = authorized(request)
        if denied is not None:
            return denied
        if only and queue not in only:
            # Started with --queue: an allow-list for the actions too, not only the page.
            return _error(404, f"queue {queue!r} is not served by this dashboard (queues: "
                               f"{', '.join(sorted(set(only)))})")
        try:
            validate_queue_name(queue)
            body = await body_of(request)
            return JSONResponse(await run_in_threadpool(work, body))
        except InvalidRequest as exc:
            return _error(400, str(exc), exc.field)
        except BatchgateError as exc:
            return _error(409, str(exc))

    def dead_ids(body: dict[str, Any]) -> list[str] | None:
        if body.get("all") is True and "ids" not in body:
            return None
        ids = body.get("ids")
        if not isinstance(ids, list) or not ids or len(ids) > MAX_IDS \
                or not all(isinstance(i, str) and 0 < len(i) <= 256 for i in ids):
            raise InvalidRequest("ids", f"give 1-{MAX_IDS} request ids (strings), or "
                                        '{"all": true}')
        return ids

    @app.post("/api/queues/{queue}/dead-letters/retry")
    async def retry_dead(queue: str, request: Request) -> JSONResponse:
        def work(body: dict[str, Any]) -> dict[str, int]:
            done, skipped = retry(client, queue, dead_ids(body))
            return {"retried": done, "skipped": skipped}
        return await act(request, queue, work)

    @app.post("/api/queues/{queue}/dead-letters/purge")
    async def purge_dead(queue: str, request: Request) -> JSONResponse:
        def work(body: dict[str, Any]) -> dict[str, int]:
            done, skipped = purge(client, queue, dead_ids(body))
            return {"purged": done, "skipped": skipped}
        return await act(request, queue, work)

    @app.post("/api/queues/{queue}/policy")
    async def set_policy(queue: str, request: Request) -> JSONResponse:
        def work(body: dict[str, Any]) -> dict[str, Any]:
            known = {"strategy", *LIMITS}
            unknown = sorted(set(body) - known)
            if unknown:
                raise InvalidRequest(unknown[0], f"not a policy field (known: "
                                                 f"{', '.join(sorted(known))})")
            return {"policy": change_policy(client, queue, body)[1].to_dict()}
        return await act(request, queue, work)

    return app
