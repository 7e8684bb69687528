"""RQ baseline: the job function, one RQ job per request.

The model is loaded once per worker process (`load`, called by rq_worker.py before the
worker starts), as a careful RQ user would do; each job runs it on a batch of one.

So that RQ's latency is not inflated by polling for results, the job pushes a small notice
[index, enqueued_at, start, end, pid] to the benchmark's inbox list (one RPUSH, inside the
job) before returning; RQ then stores the return value and the job status as usual, and
that bookkeeping still counts in RQ's throughput.
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Any

import orjson
from rq import get_current_job

MODEL: Any = None


def load(spec: str, kwargs: dict[str, Any]) -> None:
    global MODEL
    from consumer.loader import load_model

    MODEL = load_model(spec, kwargs)


def infer(index: int, payload: Any, inbox: str) -> Any:
    t0 = time.time()
    result = MODEL([payload])[0]
    t1 = time.time()
    job = get_current_job()
    at = job.enqueued_at
    if at is not None and at.tzinfo is None:  # RQ < 2 stores naive UTC datetimes
        at = at.replace(tzinfo=datetime.timezone.utc)
    enqueued = at.timestamp() if at is not None else 0.0
    job.connection.rpush(inbox, orjson.dumps([index, enqueued, t0, t1, os.getpid()]))
    return result
