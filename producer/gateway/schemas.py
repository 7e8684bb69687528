"""The HTTP gateway's request and response bodies: the pydantic models make its OpenAPI
spec; the gateway itself reads a submit body with `parse_submit` (orjson, and the producer
library's checks), the same rules, held together with the models by
tests/test_gateway_schemas.py, and writes request states with `state_body`."""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, JsonValue

from producer.validation import (
    IDEMPOTENCY_KEY,
    MAX_DEADLINE_MS,
    check_cost,
    check_deadline,
    check_idempotency_key,
    check_timeout,
)
from scheduler_core.admin import status_of
from scheduler_core.errors import InvalidRequest
from scheduler_core.policy import MAX_REQUEST_COST, Priority
from scheduler_core.wire import TENANT_NAME, EncodedPayload, Result, check_tenant, encode_payload

MAX_WAIT_S = 300.0
DEFAULT_WAIT_S = 30.0
REQUEST_ID_PATTERN = r"^[0-9a-f]{32}$"
LONG_NUMBER = re.compile(rb"[0-9]{19}")  # orjson reads integers past 64 bits as floats
PRIORITY_NAMES = frozenset(p.name.lower() for p in Priority)  # as the spec spells them


def _integral(value: Any) -> Any:
    """JSON Schema counts 2.0 as an integer; so does the gateway (strings stay rejected)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Status = Literal["queued", "running", "done", "failed", "expired", "cancelled"]

# HTTP status of a request in each state, for `POST ... wait=true` and `GET /v1/requests/{id}`
HTTP_STATUS: dict[str, int] = {
    "queued": 202,  # not finished yet: poll GET /v1/requests/{id}
    "running": 202,
    "done": 200,
    "failed": 502,  # the model raised, or the request was dead-lettered
    "expired": 504,  # deadline_ms passed before a consumer ran it; it was not run
    "cancelled": 410,  # cancelled before it ran; it will never have a result
}


class SubmitRequest(BaseModel):
    """One inference request."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={
        "examples": [{"payload": {"text": "hello"}, "priority": "high", "deadline_ms": 2000,
                      "wait": True, "timeout_s": 10}]})

    payload: JsonValue = Field(
        description="Any JSON value (at most 1 MiB encoded, 64 levels deep, integers within "
                    "64 bits); the model receives it as is.")
    priority: Literal["high", "normal", "low"] | Annotated[
        int, Field(ge=0, le=2), BeforeValidator(_integral)] = Field(
        default="normal",
        description="high (0): served at once; normal (1): may wait max_queue_delay_ms to "
                    "fill a batch; low (2): runs when nothing else waits.")
    deadline_ms: Annotated[
        int, Field(ge=1, le=MAX_DEADLINE_MS), BeforeValidator(_integral)] | None = Field(
        default=None, description="Do not run the request after this many ms; it then ends "
                                  "as `expired` (HTTP 504).")
    idempotency_key: Annotated[str, Field(pattern=IDEMPOTENCY_KEY.pattern)] | None = Field(
        default=None, description="Resubmitting with the same key returns the first "
                                  "request's id instead of enqueuing a duplicate.")
    cost: Annotated[int, Field(ge=1, le=MAX_REQUEST_COST), BeforeValidator(_integral)] = Field(
        default=1, description="The request's cost in the queue's unit (tokens to generate, "
                               "input length): what the queue's max_cost, max_batch_cost and "
                               "cost_buckets count. Over max_cost: 422 naming `cost` (or, "
                               "with over_cost=truncate, capped).")
    tenant: Annotated[str, Field(pattern=f"^{TENANT_NAME.pattern}$")] | None = Field(
        default=None, description="Who the request is for (docs/tenants.md): the queue's "
                                  "tenant quotas apply to it (429 when over one). An "
                                  "X-Tenant header, where a proxy sets it, gives the same; "
                                  "both given must agree. None: the default tenant.")
    wait: bool = Field(default=False, description="Wait for the result and return it.")
    stream: bool = Field(
        default=False,
        description="Answer with server-sent events (text/event-stream): `part` for each "
                    "partial result a streaming model emits (data: the part), `restart` "
                    "when the request starts over (data: {\"restart\": attempt}; drop the "
                    "parts so far), then one final event with the RequestState: `result` "
                    "(done), `error` (failed, expired, cancelled) or `timeout` (no result "
                    "within timeout_s: queued or running), and the answer ends. "
                    "See docs/streaming.md.")
    timeout_s: Annotated[float, Field(ge=0, le=MAX_WAIT_S)] = Field(
        default=DEFAULT_WAIT_S,
        description="With wait: seconds to wait. If no result came by then the answer is "
                    "202 with status queued/running, and the request stays queued. With "
                    "stream: seconds the stream waits for the result.")


class ErrorInfo(BaseModel):
    type: str = Field(description="DeadlineExceeded, Cancelled, or the model's exception "
                                  "type (e.g. ValueError, DeadLettered)")
    message: str


class RequestState(BaseModel):
    """Where a request is. `result` is set when status is done, `error` when it is failed,
    expired or cancelled."""

    id: str
    status: Status
    result: JsonValue = None
    error: ErrorInfo | None = None


def state_body(result: Result) -> dict[str, Any]:
    """The RequestState of a finished request, as the gateway sends it (a plain dict:
    building the model would walk the result once more)."""
    if result.ok:
        return {"id": result.id, "status": "done", "result": result.value}
    return {"id": result.id, "status": status_of(result),
            "error": {"type": result.error_type, "message": result.message}}


class Problem(BaseModel):
    """Every error answer: a machine-readable `error`, a message, and for 422 the field."""

    error: str = Field(description="invalid_request, unauthorized, not_found, queue_full, "
                                   "redis_unavailable")
    message: str
    field: str | None = Field(default=None, description="422: the offending field, e.g. "
                                                        "priority, or a path into the payload "
                                                        "such as payload.items[3]")


class QueueFullProblem(Problem):
    depth: int
    limit: int
    retry_after_s: float
    tenant: str | None = Field(default=None, description="tenant_limit: the tenant over "
                                                         "its quota")
    quota: str | None = Field(default=None, description="tenant_limit: the quota (max_waiting, "
                                                        "rps, cps, burst, cost_burst); "
                                                        "`limit` is its setting")


class Health(BaseModel):
    status: Literal["ok", "unavailable"]
    redis: str


SUBMIT_FIELDS = tuple(SubmitRequest.model_fields)
_FIELD_SET = frozenset(SUBMIT_FIELDS)


@dataclass(frozen=True)
class Submit:
    """A checked submit body: the payload checked and encoded, the rest normalised."""

    payload: EncodedPayload
    priority: Priority
    deadline_ms: int | None
    idempotency_key: str | None
    wait: bool
    timeout_s: float
    cost: int = 1
    stream: bool = False
    tenant: str | None = None


def loads(body: bytes) -> Any:
    """`json.loads(body)` (NaN and integers past 64 bits are then refused by the payload
    checks, naming the field that holds them), through orjson where it reads the same,
    2-3x faster: orjson refuses what json accepts beyond RFC 8259 (NaN, a BOM, lone
    surrogates), and reads integers of 19 digits or more as floats."""
    if not LONG_NUMBER.search(body):
        with contextlib.suppress(orjson.JSONDecodeError):
            return orjson.loads(body)
    return json.loads(body)


def parse_submit(data: bytes, max_payload_bytes: int) -> Submit:
    """A `POST /v1/requests` body, parsed and checked (`check_submit`); InvalidRequest
    with field `body` if it is not JSON."""
    try:
        body = loads(data)
    except json.JSONDecodeError as exc:
        raise InvalidRequest("body", f"JSON decode error: {exc.msg} at character "
                                     f"{exc.pos}") from None
    except (ValueError, RecursionError):  # not UTF-8, nested past the recursion limit
        raise InvalidRequest("body", "There was an error parsing the body") from None
    return check_submit(body, max_payload_bytes)


def check_submit(body: Any, max_payload_bytes: int) -> Submit:
    """The fields of a parsed submit body, checked as SubmitRequest describes them (the
    spec) by the producer library's own checks, which name the field; the JSON types
    the spec asks for are checked first (no "HIGH", no 1.5 ms). The payload comes last,
    checked and encoded once (a payload that only the library refuses, past 64 bits or
    64 levels, names its path: `payload.items[3]`)."""
    if not isinstance(body, dict):
        raise InvalidRequest("body", f"must be a JSON object, got {type(body).__name__}")
    if "payload" not in body:
        raise InvalidRequest("payload", "required (any JSON value: what the model receives)")
    priority = _priority(body.get("priority", "normal"))
    deadline_ms = body.get("deadline_ms")
    if deadline_ms is not None:
        deadline_ms = _integral(deadline_ms)
        if isinstance(deadline_ms, bool) or not isinstance(deadline_ms, int):
            raise InvalidRequest("deadline_ms", f"must be a whole number of milliseconds, "
                                                f"got {deadline_ms!r}")
        deadline_ms = check_deadline(deadline_ms)
    key = check_idempotency_key(body.get("idempotency_key"))
    cost = check_cost(_integral(body.get("cost", 1)))
    tenant = check_tenant(body.get("tenant"))
    wait = body.get("wait", False)
    if not isinstance(wait, bool):
        raise InvalidRequest("wait", f"must be true or false, got {wait!r}")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequest("stream", f"must be true or false, got {stream!r}")
    timeout_s = body.get("timeout_s", DEFAULT_WAIT_S)
    checked = None if timeout_s is None else check_timeout(timeout_s, "timeout_s")
    if checked is None or checked > MAX_WAIT_S:
        raise InvalidRequest("timeout_s", f"must be a number of seconds in [0, "
                                          f"{MAX_WAIT_S:g}], got {timeout_s!r}")
    if not body.keys() <= _FIELD_SET:
        unknown = next(name for name in body if name not in _FIELD_SET)
        raise InvalidRequest(unknown, "Extra inputs are not permitted (the fields are "
                                      f"{', '.join(SUBMIT_FIELDS)})")
    return Submit(encode_payload(body["payload"], max_payload_bytes), priority, deadline_ms,
                  key, wait, checked, cost, stream, tenant)


def _priority(value: Any) -> Priority:
    value = _integral(value)
    if not isinstance(value, str) or value in PRIORITY_NAMES:  # not "HIGH", " high"
        with contextlib.suppress(InvalidRequest):
            return Priority.parse(value)
    raise InvalidRequest("priority", f"{value!r} is not a priority; use \"high\", "
                                     "\"normal\", \"low\" or 0, 1, 2")
