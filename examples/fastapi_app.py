"""A FastAPI app that sends its inference work through batchgate.

One AsyncProducer per app (it holds one Redis connection pool and one listener task that
receives every result), opened and closed with the app's lifespan. `GET /jobs/{id}`
answers 404 for an id that is not one (32 hex digits) or that the queue does not know
(never submitted, or its result expired after result_ttl_s), so a typo does not poll
forever; `{"done": false, "status": "queued" | "running"}` while it waits or runs.

    pip install -e '.[gateway]'               # from a checkout: fastapi + uvicorn (docs/install.md)
    batchgate consumer --model consumer.models:synthetic &
    BATCHGATE_REDIS_URL=redis://127.0.0.1:6379/0 uvicorn --app-dir examples fastapi_app:app
    curl -s localhost:8000/predict -H 'content-type: application/json' -d '{"text": "hi"}'
"""

from __future__ import annotations

import os
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal

from fastapi import FastAPI, HTTPException, Request
from pydantic import BaseModel

from producer import AsyncProducer, DeadlineExceeded, QueueFull, RequestFailed
from scheduler_core.admin import request_state_async
from scheduler_core.connection import connect_async

REDIS_URL = os.environ.get("BATCHGATE_REDIS_URL", "redis://127.0.0.1:6379/0")
QUEUE = os.environ.get("BATCHGATE_QUEUE", "default")
JOB_ID = re.compile(r"^[0-9a-f]{32}$")  # the ids producers hand out


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    client = connect_async(REDIS_URL)  # one pool for the producer and the job lookups
    async with AsyncProducer(REDIS_URL, QUEUE, client=client) as producer:
        app.state.producer, app.state.redis = producer, client
        yield
    await client.aclose()


app = FastAPI(title="example: FastAPI + batchgate", lifespan=lifespan)


class Item(BaseModel):
    text: str
    priority: Literal["high", "normal", "low"] = "high"


def producer_of(request: Request) -> AsyncProducer:
    return request.app.state.producer


@app.post("/predict")
async def predict(item: Item, request: Request) -> dict[str, Any]:
    """Online: enqueue, wait for the batched result, answer."""
    try:
        handle = await producer_of(request).submit(
            {"text": item.text}, priority=item.priority, deadline_ms=5_000)
        return {"id": handle.id, "result": await handle.result(timeout=10)}
    except QueueFull:
        raise HTTPException(429, "busy, retry later", headers={"Retry-After": "1"}) from None
    except (DeadlineExceeded, TimeoutError):
        raise HTTPException(504, "no result in time") from None
    except RequestFailed as exc:
        raise HTTPException(502, str(exc)) from None


@app.post("/jobs", status_code=202)
async def submit_job(item: Item, request: Request) -> dict[str, str]:
    """Fire and forget: answer with the id at once; GET /jobs/{id} later (from any
    replica: the result is stored by id, store_result=True)."""
    handle = await producer_of(request).submit({"text": item.text}, priority="low",
                                               store_result=True)
    return {"id": handle.id}


@app.get("/jobs/{job_id}")
async def get_job(job_id: str, request: Request) -> dict[str, Any]:
    # Any process or replica can answer: the state is in Redis.
    found = await request_state_async(request.app.state.redis, QUEUE, job_id) \
        if JOB_ID.fullmatch(job_id) else None
    if found is None:
        raise HTTPException(404, f"no job {job_id!r} (unknown, or its result expired)")
    result = found.result
    if result is None:
        return {"id": job_id, "done": False, "status": found.status}
    if not result.ok:
        return {"id": job_id, "done": True, "error": result.message}
    return {"id": job_id, "done": True, "result": result.value}


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=int(os.environ.get("PORT", "8000")))
