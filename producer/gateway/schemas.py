"""The HTTP gateway's request and response bodies (they make its OpenAPI spec)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, JsonValue

from producer.validation import IDEMPOTENCY_KEY, MAX_DEADLINE_MS
from scheduler_core.admin import status_of
from scheduler_core.policy import MAX_REQUEST_COST
from scheduler_core.wire import Result

MAX_WAIT_S = 300.0
DEFAULT_WAIT_S = 30.0
REQUEST_ID_PATTERN = r"^[0-9a-f]{32}$"



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
    wait: bool = Field(default=False, description="Wait for the result and return it.")
    timeout_s: Annotated[float, Field(ge=0, le=MAX_WAIT_S)] = Field(
        default=DEFAULT_WAIT_S,
        description="With wait: seconds to wait. If no result came by then the answer is "
                    "202 with status queued/running, and the request stays queued.")


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

    @classmethod
    def from_result(cls, result: Result) -> RequestState:
        if result.ok:
            return cls(id=result.id, status="done", result=result.value)
        status: Status = status_of(result)  # type: ignore[assignment]
        return cls(id=result.id, status=status,
                   error=ErrorInfo(type=result.error_type, message=result.message))

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"id": self.id, "status": self.status}
        if self.status == "done":
            body["result"] = self.result
        if self.error is not None:
            body["error"] = self.error.model_dump()
        return body


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


class Health(BaseModel):
    status: Literal["ok", "unavailable"]
    redis: str
