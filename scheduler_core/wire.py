"""The wire format: what producers, Redis and consumers exchange. orjson only, no pickle.

Request envelope (in `{bg:q}:jobs[id]`, after its meta: see JobMeta):
    {"v": 1, "payload": <JSON value>}
    or, for a request of a named tenant (docs/tenants.md), with "tenant" first:
    {"v": 1, "tenant": "acme", "payload": <JSON value>}
    The scripts read the tenant by that exact prefix (TENANT_PREFIX, lua/_tenants.lua):
    a request without it belongs to the default tenant.
    optionally with "trace": {"traceparent": "00-...", "tracestate": "..."} (W3C trace
    context of the producer's span, scheduler_core/tracing.py); absent without one.
Result envelope (`result:<id>` and inbox items):
    {"v": 1, "id": "...", "ok": true,  "value": <JSON value>}
    {"v": 1, "id": "...", "ok": false, "error": {"type": "...", "message": "..."}}

Payloads and results are JSON values: dict (str keys), list, str, int (64-bit), finite
float, bool, None; nested at most MAX_DEPTH deep; at most the configured size encoded.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from enum import Enum
from typing import Any

import orjson

from scheduler_core.errors import (
    DeadlineExceeded,
    InvalidRequest,
    RequestCancelled,
    RequestFailed,
    RequestLost,
)

WIRE_VERSION = 1
MAX_DEPTH = 64
QUICK_CHECK_MAX_BYTES = 65_536  # _dumps checks larger values by the walk
DEFAULT_MAX_PAYLOAD_BYTES = 1 << 20  # 1 MiB
DEFAULT_MAX_RESULT_BYTES = 8 << 20  # 8 MiB
INT_MIN, INT_MAX = -(2**63), 2**64 - 1  # what orjson encodes

# Error types with a dedicated exception on the producer side.
DEADLINE = "DeadlineExceeded"
CANCELLED = "Cancelled"
LOST = "RequestLost"  # never stored: a producer's verdict on a request Redis no longer knows
LOST_MESSAGE = ("Redis no longer knows it: not waiting, not in flight, no result, not "
                "dead-lettered. Redis lost it (restarted without persistence, flushed, or "
                "failed over to a replica that lacked it), or its result expired "
                "(result_ttl_s) before it was collected; submit it again if it should run")


class Outcome(str, Enum):
    """Where a request stands in its batch, one vocabulary for every place that says it.

    The value is the code on the wire: the outcome complete.lua takes, and (RUN, EXPIRED)
    the state pop_batch.lua marks an item with. The name in lower case is the consumer's
    metrics label.
    """

    RUN = "run"  # not settled at the pop: the model runs it
    OK = "ok"
    FAILED = "err"
    EXPIRED = "expired"  # its deadline passed before a consumer ran it
    DEAD_LETTER = "dead"  # kept in the dead-letter set
    RETRY = "retry"  # the model raised a retry_on exception: it runs again after a backoff


# pop_batch.lua's item states: 'exhausted' (max_attempts deliveries used) is dead-lettered.
POPPED_STATES = {b"run": Outcome.RUN, b"expired": Outcome.EXPIRED,
                 b"exhausted": Outcome.DEAD_LETTER}


def check_json_value(value: Any, field: str) -> None:
    """Raise InvalidRequest naming `field` unless `value` is a plain, finite JSON value."""
    stack: list[tuple[Any, int, str]] = [(value, 0, field)]
    while stack:
        item, depth, where = stack.pop()
        if depth > MAX_DEPTH:
            raise InvalidRequest(where, f"nested deeper than {MAX_DEPTH} levels")
        if item is None or isinstance(item, (bool, str)):
            continue
        if isinstance(item, int):
            if not INT_MIN <= item <= INT_MAX:
                raise InvalidRequest(where, f"integer {item} does not fit in 64 bits")
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise InvalidRequest(where, f"{item!r} is not valid JSON (NaN/Infinity)")
        elif isinstance(item, dict):
            for key, sub in item.items():
                if not isinstance(key, str):
                    raise InvalidRequest(where, f"object key {key!r} is not a string")
                stack.append((sub, depth + 1, f"{where}.{key}"))
        elif isinstance(item, (list, tuple)):
            stack.extend((sub, depth + 1, f"{where}[{i}]") for i, sub in enumerate(item))
        else:
            raise InvalidRequest(where, f"{type(item).__name__} is not JSON-serialisable")


def _dumps(value: Any, field: str, max_bytes: int) -> bytes:
    """`value` as JSON, checked by check_json_value's rules.

    orjson also writes what those rules refuse (NaN as null, datetimes, dataclasses,
    nesting deeper than MAX_DEPTH), so its bytes are taken as they are only when they read
    back as the value itself and hold too few brackets to nest that deep (a bound: a
    bracket in a string counts too). Anything else takes the walk, which names the
    culprit; the bytes' check costs a fraction of the walk's. So does a value of more
    than QUICK_CHECK_MAX_BYTES: the walk gives up the GIL every few ms, where the read
    back is one C call that holds it throughout (a gateway checks large bodies in a
    thread so that its event loop is not held up)."""
    try:
        data: bytes | None = orjson.dumps(value)
    except orjson.JSONEncodeError:
        data = None
    if data is None or len(data) > QUICK_CHECK_MAX_BYTES \
            or data.count(b"[") + data.count(b"{") > MAX_DEPTH or orjson.loads(data) != value:
        check_json_value(value, field)
        if data is None:
            try:
                data = orjson.dumps(value)
            except orjson.JSONEncodeError as exc:  # e.g. a str with lone surrogates
                raise InvalidRequest(field, f"cannot be encoded as JSON: {exc}") from None
    return _within(data, field, max_bytes)


def _within(data: bytes, field: str, max_bytes: int) -> bytes:
    if len(data) > max_bytes:
        raise InvalidRequest(field, f"{len(data)} bytes encoded, over the limit of {max_bytes}")
    return data


@dataclass(frozen=True)
class EncodedPayload:
    """A payload checked and encoded ahead of its submit (`encode_payload`); producers
    send its bytes as they are. The gateway encodes large bodies' payloads in a thread, so
    that their checks do not hold up its event loop."""

    data: bytes


def encode_payload(payload: Any, max_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> EncodedPayload:
    """Check and encode `payload` (InvalidRequest naming the culprit, as `encode_request`)."""
    return EncodedPayload(_dumps(payload, "payload", max_bytes))


TRACE_FIELDS = ("traceparent", "tracestate")
MAX_TRACE_FIELD = 512  # W3C: tracestate is at most 32 entries, 512 characters in practice


def check_trace(trace: Any) -> dict[str, str]:
    """A W3C trace context as the envelope carries it; InvalidRequest naming the field."""
    if not isinstance(trace, dict) or "traceparent" not in trace:
        raise InvalidRequest("trace", "must be an object with a traceparent")
    for key, value in trace.items():
        if key not in TRACE_FIELDS:
            raise InvalidRequest(f"trace.{key}", f"unknown; use {' or '.join(TRACE_FIELDS)}")
        if not isinstance(value, str) or len(value) > MAX_TRACE_FIELD:
            raise InvalidRequest(f"trace.{key}",
                                 f"must be a string of at most {MAX_TRACE_FIELD} characters")
    return trace


# A tenant (docs/tenants.md): the characters of a queue name, so that it needs no escaping
# in JSON, in a Redis hash field or in a metric label. Checked with fullmatch.
TENANT_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
MAX_TENANT_NAME = 64
DEFAULT_TENANT = "default"  # what stats call the requests submitted without a tenant
# The envelope's first bytes for a named tenant; lua/_tenants.lua matches exactly this.
TENANT_PREFIX = b'{"v":%d,"tenant":"' % WIRE_VERSION


def check_tenant(tenant: Any, field: str = "tenant") -> str | None:
    """A request's tenant: None (the default tenant) or 1-64 characters from letters,
    digits, '_', '.', ':' and '-'; InvalidRequest naming `field` otherwise."""
    if tenant is None:
        return None
    if not isinstance(tenant, str) or not TENANT_NAME.fullmatch(tenant):
        raise InvalidRequest(field, f"{tenant!r} is not a valid tenant: 1-{MAX_TENANT_NAME} "
                                    "characters from letters, digits, '_', '.', ':' and '-'")
    return tenant


def encode_request(payload: Any, max_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
                   trace: dict[str, str] | None = None, tenant: str | None = None) -> bytes:
    """A request envelope; `trace` (W3C trace context) and `tenant` only when given."""
    body = _within(payload.data, "payload", max_bytes) if isinstance(payload, EncodedPayload) \
        else _dumps(payload, "payload", max_bytes)
    tenant = check_tenant(tenant)
    head = b'{"v":%d,' % WIRE_VERSION if tenant in (None, DEFAULT_TENANT) else \
        TENANT_PREFIX + tenant.encode() + b'",'
    if trace:
        return head + b'"payload":%s,"trace":%s}' % (body, orjson.dumps(check_trace(trace)))
    return head + b'"payload":%s}' % body


def request_tenant(envelope: bytes) -> str:
    """The tenant of a stored request envelope (DEFAULT_TENANT without one), as the
    scripts read it: by its prefix."""
    if envelope.startswith(TENANT_PREFIX):
        end = envelope.find(b'"', len(TENANT_PREFIX))
        name = envelope[len(TENANT_PREFIX):end].decode("ascii", "replace")
        if end > 0 and TENANT_NAME.fullmatch(name):
            return name
    return DEFAULT_TENANT


def decode_request(data: bytes) -> Any:
    """The payload of a stored request; ValueError if the entry is malformed."""
    return _request_envelope(data)["payload"]


def decode_request_traced(data: bytes) -> tuple[Any, dict[str, str] | None]:
    """(payload, trace context or None) of a stored request; ValueError if the entry is
    malformed. A malformed trace is None: telemetry never fails a request."""
    envelope = _request_envelope(data)
    trace = envelope.get("trace")
    if trace is not None:
        try:
            trace = check_trace(trace)
        except InvalidRequest:
            trace = None
    return envelope["payload"], trace


def _request_envelope(data: bytes) -> dict[str, Any]:
    try:
        envelope = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"request envelope is not JSON: {exc}") from None
    if not isinstance(envelope, dict) or envelope.get("v") != WIRE_VERSION:
        raise ValueError(f"request envelope has no supported version (want v={WIRE_VERSION})")
    if "payload" not in envelope:
        raise ValueError("request envelope has no payload")
    return envelope


def encode_result(request_id: str, value: Any, max_bytes: int = DEFAULT_MAX_RESULT_BYTES) -> bytes:
    """A success envelope; InvalidRequest(field='result') if the value is not sendable."""
    body = _dumps(value, "result", max_bytes)
    return b'{"v":%d,"id":%s,"ok":true,"value":%s}' % (
        WIRE_VERSION, orjson.dumps(request_id), body)


def encode_error(request_id: str, error_type: str, message: str,
                 attempts: list[Any] | None = None) -> bytes:
    """A failed request's result envelope; `attempts`: the failed runs of a request whose
    retries ran out (each {"attempt", "type", "message"}), kept in its dead letter."""
    error: dict[str, Any] = {"type": error_type, "message": message[:4000]}
    if attempts is not None:
        error["attempts"] = attempts
    return orjson.dumps({"v": WIRE_VERSION, "id": request_id, "ok": False, "error": error})


@dataclass(frozen=True)
class Result:
    """A finished request: `value` when ok, else `error_type` and `message`."""

    id: str
    ok: bool
    value: Any = None
    error_type: str = ""
    message: str = ""

    def unwrap(self) -> Any:
        """The value, or the request's error raised as an exception."""
        if self.ok:
            return self.value
        raise self.exception()

    def exception(self) -> RequestFailed:
        if self.error_type == DEADLINE:
            return DeadlineExceeded(self.id, self.message, self.error_type)
        if self.error_type == CANCELLED:
            return RequestCancelled(self.id, self.message, self.error_type)
        if self.error_type == LOST:
            return RequestLost(self.id, self.message, self.error_type)
        return RequestFailed(self.id, self.message, self.error_type)


def lost_result(request_id: str) -> Result:
    """The outcome of a request that Redis no longer knows (RequestLost)."""
    return Result(id=request_id, ok=False, error_type=LOST, message=LOST_MESSAGE)


def decode_result(data: bytes) -> Result:
    envelope = orjson.loads(data)
    if not isinstance(envelope, dict) or envelope.get("v") != WIRE_VERSION:
        raise ValueError(f"result envelope has no supported version (want v={WIRE_VERSION})")
    if envelope.get("ok"):
        return Result(id=envelope["id"], ok=True, value=envelope.get("value"))
    error = envelope.get("error") or {}
    return Result(
        id=envelope["id"],
        ok=False,
        error_type=str(error.get("type", "RequestFailed")),
        message=str(error.get("message", "")),
    )


# The value of `{bg:q}:jobs[id]`: "<meta>|<envelope>", the Lua scripts' format_job (in
# scheduler_core/lua/_common.lua); no meta field holds '|'.
_JOB_META = re.compile(rb"([0-2]):(\d+):(\d+):(\d+):([01]):([\w.\-]*)(?::(\d+))?(?::(\d+))?\|")


@dataclass(frozen=True)
class JobMeta:
    """What Redis keeps beside a waiting, in-flight or dead-lettered request's envelope."""

    priority: int  # as submitted (aging moves the request, not this)
    arrival_us: int  # Redis time of its enqueue (its score in pending)
    deadline_us: int  # 0: none
    attempts: int  # deliveries that ended without a result (crash, hang, dead-lettered)
    keep: bool  # its result is stored by id as well (store_result, idempotency key)
    producer: str  # whose inbox gets the result ('' for none)
    cost: int = 1
    requested: int = 1  # the cost asked for, where over_cost=truncate capped it


def split_job(raw: bytes) -> tuple[JobMeta | None, bytes]:
    """A jobs value's meta and envelope; (None, raw) where it has no readable meta (a
    value written by hand)."""
    m = _JOB_META.match(raw)
    if m is None:
        return None, raw
    p, a, d, n, k, producer, c, r = m.groups()
    cost = int(c) if c else 1
    return JobMeta(int(p), int(a), int(d), int(n), k == b"1", producer.decode(), cost,
                   int(r) if r else cost), raw[m.end():]


def delivered_job(raw: bytes) -> tuple[int, str, int, int, bytes, int]:
    """A jobs value as pop_batch.lua delivers it: (arrival_us, producer, cost, requested,
    envelope, deadline_us); split_job's fields without its JobMeta, for the consumer's hot
    path. A value without meta (pop_batch gives a hand-written one a meta of its own) reads
    as arrival 0, no producer, cost 1, the whole value as its envelope and no deadline."""
    m = _JOB_META.match(raw)
    if m is None:
        return 0, "", 1, 1, raw, 0
    _, a, d, _, _, producer, c, r = m.groups()
    cost = int(c) if c else 1
    return (int(a), producer.decode(), cost, int(r) if r else cost, raw[m.end():],
            0 if d == b"0" else int(d))


def format_job(meta: JobMeta, envelope: bytes) -> bytes:
    """The jobs value of `meta` and `envelope` (tests and tools that write one)."""
    text = (f"{meta.priority}:{meta.arrival_us}:{meta.deadline_us}:{meta.attempts}:"
            f"{int(meta.keep)}:{meta.producer}")
    if meta.requested != meta.cost:
        text += f":{meta.cost}:{meta.requested}"
    elif meta.cost != 1:
        text += f":{meta.cost}"
    return text.encode() + b"|" + envelope


# The value of `{bg:q}:costs[id]` while request `id` waits: "<cost>:<bucket>:<priority>",
# the Lua scripts' cost_record (scheduler_core/lua/_queue.lua). bucket: the cost bucket set
# (`{bg:q}:bucket:<bucket>`) the request is listed in, 0 for none; priority: the one it
# was submitted at (aging reads it there, not from the payload). An older version wrote
# "<cost>:<bucket>".
_COST_RECORD = re.compile(rb"(\d{1,10}):([0-5])(?::([0-2]))?")


def cost_record(cost: int, bucket: int, priority: int | None = None) -> bytes:
    """The costs value of a waiting request of `cost` listed in bucket set `bucket` (0:
    none), submitted at `priority`, as enqueue.lua writes it (tests and tools that write
    a request by hand); without a priority, as an older version wrote it."""
    if priority is None:
        return f"{cost}:{bucket}".encode()
    return f"{cost}:{bucket}:{priority}".encode()


def fair_member(tenant: str, arrival_us: int, request_id: str) -> str:
    """A waiting request's member in its level's fair set under fairness (lua/_fair.lua):
    "<tenant>|<arrival, 17 digits>|<id>", so that the set's lex order is by tenant, then
    arrival."""
    return f"{tenant}|{arrival_us:017d}|{request_id}"


def split_cost_record(raw: bytes) -> tuple[int, int] | None:
    """(cost, bucket) of a costs value; None where it is not one."""
    m = _COST_RECORD.fullmatch(raw)
    return (int(m[1]), int(m[2])) if m else None


# Partial results (`{bg:q}:stream:<id>`, a Redis stream; docs/streaming.md). Each entry has
# one field: STREAM_PART -> orjson of a part, or STREAM_RESTART -> the attempt that starts
# over (a re-delivered request runs again from the start).
STREAM_PART, STREAM_RESTART = "p", "r"


@dataclass(frozen=True)
class Restart:
    """What `handle.stream()` yields when the request starts over (its consumer died, or
    its batch was split to isolate a failing request): drop the parts received so far;
    the parts that follow are the new run's, from the first. `attempt` is the delivery
    that restarts (1 for a re-run within one delivery)."""

    attempt: int


def encode_part(value: Any, max_bytes: int = DEFAULT_MAX_RESULT_BYTES) -> bytes:
    """A partial result as a stream entry stores it; InvalidRequest(field='part') if the
    value is not sendable."""
    return _dumps(value, "part", max_bytes)


def decode_stream_entry(fields: dict[Any, Any]) -> tuple[str, Any]:
    """(kind, value) of one stream entry: (STREAM_PART, the part) or (STREAM_RESTART,
    Restart)."""
    for raw_kind, raw in fields.items():
        kind = raw_kind.decode() if isinstance(raw_kind, bytes) else str(raw_kind)
        if kind == STREAM_PART:
            return kind, orjson.loads(raw)
        if kind == STREAM_RESTART:
            return kind, Restart(int(raw))
    raise ValueError(f"stream entry has no known field: {sorted(map(str, fields))}")
