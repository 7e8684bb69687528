"""Validation and encoding of new requests, shared by Producer and AsyncProducer.

Everything here runs before any Redis call, so bad input never writes anything.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from scheduler_core.errors import InvalidRequest
from scheduler_core.keys import QueueKeys
from scheduler_core.policy import MAX_REQUEST_COST, Priority
from scheduler_core.scripts import NewRequest
from scheduler_core.tracing import current_trace
from scheduler_core.wire import (
    CANCELLED,
    DEADLINE,
    DEFAULT_MAX_PAYLOAD_BYTES,
    check_tenant,
    encode_error,
    encode_request,
)

MAX_DEADLINE_MS = 86_400_000  # 24 h
MAX_BATCH_SUBMIT = 10_000  # requests per submit_many call (one atomic script call)
# Checked with fullmatch (`$` alone also matches before a final "\n"). The gateway's schema
# uses the pattern as is: in JSON Schema (and pydantic's engine) `$` is the end of input.
IDEMPOTENCY_KEY = re.compile(r"^[A-Za-z0-9_.:-]{1,200}$")
DEFAULT_IDEMPOTENCY_TTL_S = 86_400


DEADLINE_GRACE_S = 0.01


def local_deadline(deadline_ms: int) -> float | None:
    """When (time.monotonic()) a producer may expire a request whose enqueue Redis has
    just acknowledged. Redis counts deadline_ms from its own enqueue, which happened
    before the acknowledgement arrived, so this is never earlier than Redis' deadline."""
    return time.monotonic() + deadline_ms / 1000 + DEADLINE_GRACE_S if deadline_ms else None


def new_id() -> str:
    # 128 random bits as 32 hex digits, like uuid4().hex without building a UUID object
    return os.urandom(16).hex()


def check_deadline(deadline_ms: Any) -> int:
    """0 for no deadline, else the validated number of milliseconds."""
    if deadline_ms is None:
        return 0
    if isinstance(deadline_ms, bool) or not isinstance(deadline_ms, (int, float)):
        raise InvalidRequest("deadline_ms",
                             f"must be a number of milliseconds, got {deadline_ms!r}")
    if not 1 <= deadline_ms <= MAX_DEADLINE_MS:
        raise InvalidRequest("deadline_ms", f"{deadline_ms} is outside [1, {MAX_DEADLINE_MS}]")
    return int(deadline_ms)


def check_cost(cost: Any, field: str = "cost") -> int:
    """A request's cost: an integer in [1, MAX_REQUEST_COST] (the user's own unit)."""
    if isinstance(cost, bool) or not isinstance(cost, int):
        raise InvalidRequest(field, f"must be a whole number >= 1, got {cost!r}")
    if not 1 <= cost <= MAX_REQUEST_COST:
        raise InvalidRequest(field, f"{cost} is outside [1, {MAX_REQUEST_COST}]")
    return cost


def check_costs(cost: Any, n: int) -> list[int]:
    """submit_many's cost: one value for every payload, or a sequence of one per payload."""
    if isinstance(cost, (list, tuple)):
        if len(cost) != n:
            raise InvalidRequest("cost", f"{len(cost)} costs for {n} payloads: give one "
                                         "value, or one per payload")
        return [check_cost(c, f"cost[{i}]" if n > 1 else "cost") for i, c in enumerate(cost)]
    return [check_cost(cost)] * n


def check_timeout(timeout: Any, field: str = "timeout") -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
        raise InvalidRequest(field, f"must be a number of seconds >= 0, got {timeout!r}")
    return float(timeout)


def check_idempotency_key(key: Any) -> str | None:
    if key is None:
        return None
    if not isinstance(key, str) or not IDEMPOTENCY_KEY.fullmatch(key):
        raise InvalidRequest(
            "idempotency_key",
            f"{key!r} must be 1-200 characters from letters, digits, '_', '.', ':' and '-'",
        )
    return key


@dataclass(frozen=True)
class ProducerConfig:
    queue: str
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    idempotency_ttl_s: int = DEFAULT_IDEMPOTENCY_TTL_S
    result_ttl_s: int = 600  # for results this producer writes itself (cancel, deadline)
    wait_replicas: int = 0  # acknowledge a submit only once this many replicas have it
    wait_timeout_ms: int = 1000  # each WAIT's limit; resent until WAIT_BUDGET_S has passed

    def __post_init__(self) -> None:
        QueueKeys(self.queue)
        for name, low, high in (("max_payload_bytes", 16, 512 << 20),
                                ("idempotency_ttl_s", 1, 30 * 86_400),
                                ("result_ttl_s", 1, 30 * 86_400),
                                ("wait_replicas", 0, 64), ("wait_timeout_ms", 1, 60_000)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise InvalidRequest(name, f"{value!r} is outside [{low}, {high}]")


def build_requests(config: ProducerConfig, payloads: Iterable[Any], priority: Any,
                   deadline_ms: Any, idempotency_keys: list[str | None] | None = None,
                   cost: Any = 1, store_result: Any = False,
                   tenant: Any = None) -> list[NewRequest]:
    level = int(Priority.parse(priority))
    deadline = check_deadline(deadline_ms)
    payloads = list(payloads)
    if not payloads:
        raise InvalidRequest("payloads", "is empty")
    if len(payloads) > MAX_BATCH_SUBMIT:
        raise InvalidRequest("payloads", f"{len(payloads)} requests, over the limit of "
                                         f"{MAX_BATCH_SUBMIT} per call")
    keys = idempotency_keys or [None] * len(payloads)
    trace = current_trace()  # the caller's span, if any: carried to the consumer's spans
    costs = check_costs(cost, len(payloads))
    tenant = check_tenant(tenant)
    if not isinstance(store_result, bool):
        raise InvalidRequest("store_result", f"must be True or False, got {store_result!r}")
    requests = []
    for index, (payload, key, c) in enumerate(zip(payloads, keys, costs, strict=True)):
        try:
            envelope = encode_request(payload, config.max_payload_bytes, trace, tenant)
        except InvalidRequest as exc:
            if len(payloads) == 1:
                raise
            raise InvalidRequest(f"payloads[{index}]", str(exc)) from None
        requests.append(NewRequest(new_id(), level, deadline, envelope,
                                   check_idempotency_key(key), c, store_result))
    return requests


def cancel_envelope(request_id: str, deadline: bool) -> tuple[bytes, str]:
    """The result a producer stores for a request it removes before it ran."""
    if deadline:
        return (encode_error(request_id, DEADLINE, "deadline passed before a consumer ran it"),
                "expired")
    return encode_error(request_id, CANCELLED, "cancelled before it ran"), "cancelled"
