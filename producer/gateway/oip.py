"""Open Inference Protocol v2 (KServe v2, Triton's HTTP API): health, server and model
metadata, readiness and `POST /v2/models/{name}/infer`, with JSON tensors and the binary
tensor data extension (`Inference-Header-Content-Length`). `{name}` is the queue.

What the model receives (docs/gateway.md#open-inference-protocol-v2): a JSON object,
one key per input tensor. A tensor of one element (shape [], [1], [1, 1], ...) is that
element; a larger one, nested lists in its shape. BYTES elements are UTF-8 strings.
What it returns: an object is one output tensor per key; anything else is one output
named `output`. A string is BYTES, a bool BOOL, an integer INT64, a float FP32, a
(regular) nested list a tensor of their type in its shape; any other value is BYTES
holding its JSON text.

`parameters.priority` and `parameters.timeout` read as Triton's dynamic batcher reads
them: priority 0 is the default level (normal), 1 the highest (high), 2 normal, 3 and
above low; timeout is in microseconds, the time the request may wait in the queue: the
request's deadline (rounded up to whole ms).
"""

from __future__ import annotations

import asyncio
import math
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson
import redis
from fastapi import APIRouter, Depends, Request, Response
from pydantic import BaseModel, Field

from producer.gateway.queues import listed
from producer.gateway.schemas import MAX_WAIT_S
from producer.validation import MAX_DEADLINE_MS
from scheduler_core.errors import (
    DeadlineExceeded,
    InvalidRequest,
    QueueFull,
    RequestCancelled,
    RequestFailed,
)
from scheduler_core.keys import CONSUMER_ALIVE_S
from scheduler_core.policy import Priority

if TYPE_CHECKING:
    from producer.gateway.app import Gateway

HEADER_LENGTH = "inference-header-content-length"
MAX_ELEMENTS = 1 << 22  # per tensor: a bound before any element is read
MAX_DEPTH = 32  # of a JSON tensor's nesting, and of a shape
# datatype -> struct code (little-endian, as the extension sends them); BYTES apart.
FIXED = {"BOOL": "?", "UINT8": "B", "UINT16": "H", "UINT32": "I", "UINT64": "Q",
         "INT8": "b", "INT16": "h", "INT32": "i", "INT64": "q", "FP16": "e", "FP32": "f",
         "FP64": "d"}
INTEGERS = {"UINT8": (0, 255), "UINT16": (0, 65535), "UINT32": (0, 2**32 - 1),
            "UINT64": (0, 2**64 - 1), "INT8": (-128, 127), "INT16": (-32768, 32767),
            "INT32": (-2**31, 2**31 - 1), "INT64": (-2**63, 2**63 - 1)}
VERSION = "1"


class OIPError(Exception):
    """An answer in the protocol's error shape: {"error": message}."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def error_response(status: int, message: str, headers: dict[str, str] | None = None
                   ) -> Response:
    return Response(orjson.dumps({"error": message}), status_code=status, headers=headers,
                    media_type="application/json")


# -- tensors in ---------------------------------------------------------------------------------

def _shape(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or len(value) > MAX_DEPTH or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value):
        raise OIPError(400, f"input {name!r}: shape must be a list of at most {MAX_DEPTH} "
                            f"non-negative integers, got {str(value)[:64]}")
    count = math.prod(value)
    if count > MAX_ELEMENTS:
        raise OIPError(400, f"input {name!r}: {count} elements, over the limit of "
                            f"{MAX_ELEMENTS}")
    return value


def _flatten(data: Any, name: str) -> list[Any]:
    """A JSON tensor's data, flat (it may be nested, as the protocol allows)."""
    out: list[Any] = []
    stack = [(data, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, list):
            if depth >= MAX_DEPTH:
                raise OIPError(400, f"input {name!r}: data nested over {MAX_DEPTH} levels")
            stack.extend((x, depth + 1) for x in reversed(item))
        else:
            out.append(item)
        if len(out) > MAX_ELEMENTS:
            raise OIPError(400, f"input {name!r}: over {MAX_ELEMENTS} elements")
    return out


def _check_json(flat: list[Any], datatype: str, name: str) -> list[Any]:
    if datatype == "BYTES":
        ok = all(isinstance(x, str) for x in flat)
    elif datatype == "BOOL":
        ok = all(isinstance(x, bool) for x in flat)
    elif datatype in INTEGERS:
        low, high = INTEGERS[datatype]
        ok = all(isinstance(x, int) and not isinstance(x, bool) and low <= x <= high
                 for x in flat)
    else:
        ok = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in flat)
    if not ok:
        raise OIPError(400, f"input {name!r}: data does not match datatype {datatype}")
    return flat


def _from_binary(raw: bytes, datatype: str, count: int, name: str) -> list[Any]:
    if datatype == "BYTES":
        out, at = [], 0
        while at < len(raw):
            if at + 4 > len(raw):
                raise OIPError(400, f"input {name!r}: truncated BYTES element")
            (size,) = struct.unpack_from("<I", raw, at)
            element = raw[at + 4:at + 4 + size]
            if len(element) != size:
                raise OIPError(400, f"input {name!r}: truncated BYTES element")
            try:
                out.append(element.decode("utf-8"))
            except UnicodeDecodeError:
                raise OIPError(400, f"input {name!r}: BYTES element {len(out)} is not "
                                    "UTF-8 text") from None
            at += 4 + size
        return out
    width = struct.calcsize("<" + FIXED[datatype])
    if len(raw) != width * count:
        raise OIPError(400, f"input {name!r}: binary_data_size {len(raw)} is not {count} "
                            f"{datatype} elements of {width} bytes")
    return list(struct.unpack(f"<{count}{FIXED[datatype]}", raw))


def _nest(flat: list[Any], shape: list[int]) -> Any:
    if math.prod(shape) == 1:
        return flat[0]
    for dim in reversed(shape[1:]):
        flat = [flat[i:i + dim] for i in range(0, len(flat), dim)] if dim else []
    return flat


def read_inputs(head: dict[str, Any], binary: bytes) -> dict[str, Any]:
    """The model's payload: one key per input tensor (see the module)."""
    inputs = head.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise OIPError(400, "inputs: required, a non-empty list of tensors")
    payload: dict[str, Any] = {}
    at = 0
    for i, tensor in enumerate(inputs):
        if not isinstance(tensor, dict) or not isinstance(tensor.get("name"), str):
            raise OIPError(400, f"inputs[{i}]: must be an object with a name")
        name = tensor["name"]
        if name in payload:
            raise OIPError(400, f"input {name!r}: given twice")
        datatype = tensor.get("datatype")
        if datatype not in FIXED and datatype != "BYTES":
            raise OIPError(400, f"input {name!r}: datatype {str(datatype)[:32]!r} is not "
                                f"one of {', '.join([*FIXED, 'BYTES'])}")
        shape = _shape(tensor.get("shape"), name)
        count = math.prod(shape)
        size = (tensor.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            if isinstance(size, bool) or not isinstance(size, int) or size < 0 or \
                    at + size > len(binary):
                raise OIPError(400, f"input {name!r}: binary_data_size {str(size)[:32]} is "
                                    f"past the {len(binary)} bytes of binary data")
            flat = _from_binary(binary[at:at + size], datatype, count, name)
            at += size
        elif "data" in tensor:
            flat = _check_json(_flatten(tensor["data"], name), datatype, name)
        else:
            raise OIPError(400, f"input {name!r}: no data (JSON `data` or binary_data_size)")
        if len(flat) != count:
            raise OIPError(400, f"input {name!r}: {len(flat)} elements for shape {shape}")
        if count == 0:
            raise OIPError(400, f"input {name!r}: has no elements")
        payload[name] = _nest(flat, shape)
    if at != len(binary):
        raise OIPError(400, f"{len(binary) - at} bytes of binary data belong to no input")
    return payload


# -- tensors out --------------------------------------------------------------------------------

def _datatype(flat: list[Any]) -> str | None:
    if all(isinstance(x, bool) for x in flat):
        return "BOOL"
    if all(isinstance(x, int) and not isinstance(x, bool) and -2**63 <= x < 2**63
           for x in flat):
        return "INT64"
    if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in flat):
        return "FP32"
    if all(isinstance(x, str) for x in flat):
        return "BYTES"
    return None


def _regular(value: Any) -> tuple[list[int], list[Any]] | None:
    """(shape, flat elements) of a regular nested list; None if it is ragged or empty."""
    shape, level = [], value
    while isinstance(level, list):
        if not level or len(shape) >= MAX_DEPTH:
            return None
        shape.append(len(level))
        level = level[0]
    flat = value
    for _ in shape[1:]:
        if not all(isinstance(x, list) and len(x) == len(flat[0]) for x in flat):
            return None
        flat = [x for row in flat for x in row]
    if any(isinstance(x, list) for x in flat):
        return None
    return shape, flat


def to_tensor(name: str, value: Any) -> tuple[dict[str, Any], list[Any]]:
    """The output tensor of a result value (see the module), and its flat data."""
    found = _regular(value) if isinstance(value, list) else ([1], [value])
    datatype = _datatype(found[1]) if found is not None else None
    if found is None or datatype is None:
        found, datatype = ([1], [orjson.dumps(value).decode()]), "BYTES"
    shape, flat = found
    return {"name": name, "datatype": datatype, "shape": shape}, flat


def _binary(datatype: str, flat: list[Any]) -> bytes:
    if datatype == "BYTES":
        parts = []
        for element in flat:
            data = element.encode()
            parts.append(struct.pack("<I", len(data)) + data)
        return b"".join(parts)
    return struct.pack(f"<{len(flat)}{FIXED[datatype]}", *flat)


def write_outputs(name: str, request_id: str, head: dict[str, Any], result: Any
                  ) -> Response:
    values = result if isinstance(result, dict) else {"output": result}
    wanted = head.get("outputs")
    everything_binary = bool((head.get("parameters") or {}).get("binary_data_output"))
    requested: list[tuple[str, bool]] = []
    if wanted is None:
        requested = [(key, everything_binary) for key in values]
    elif isinstance(wanted, list):
        for i, output in enumerate(wanted):
            if not isinstance(output, dict) or not isinstance(output.get("name"), str):
                raise OIPError(400, f"outputs[{i}]: must be an object with a name")
            if output["name"] not in values:
                raise OIPError(400, f"output {output['name']!r}: the model returned no such "
                                    f"output (it returned: {', '.join(values)})")
            binary = (output.get("parameters") or {}).get("binary_data", everything_binary)
            requested.append((output["name"], bool(binary)))
    else:
        raise OIPError(400, "outputs: must be a list")
    outputs, blobs = [], []
    for key, binary in requested:
        tensor, flat = to_tensor(key, values[key])
        if binary:
            blob = _binary(tensor["datatype"], flat)
            tensor["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            tensor["data"] = flat
        outputs.append(tensor)
    body = orjson.dumps({"model_name": name, "model_version": VERSION, "id": request_id,
                         "outputs": outputs})
    if not blobs:
        return Response(body, media_type="application/json")
    return Response(body + b"".join(blobs), media_type="application/octet-stream",
                    headers={"Inference-Header-Content-Length": str(len(body))})


# -- the request --------------------------------------------------------------------------------

def priority_of(parameters: dict[str, Any]) -> Priority:
    value = parameters.get("priority", 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise OIPError(400, f"parameters.priority: must be an integer >= 0, got {value!r}")
    return {0: Priority.NORMAL, 1: Priority.HIGH, 2: Priority.NORMAL}.get(value, Priority.LOW)


def deadline_of(parameters: dict[str, Any]) -> int | None:
    value = parameters.get("timeout")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or \
            not 1 <= value <= MAX_DEADLINE_MS * 1000:
        raise OIPError(400, f"parameters.timeout: must be microseconds in [1, "
                            f"{MAX_DEADLINE_MS * 1000}], got {value!r}")
    return max(1, math.ceil(value / 1000))


def split_body(body: bytes, header_length: str | None) -> tuple[dict[str, Any], bytes]:
    if header_length is None:
        json_part, binary = body, b""
    elif not header_length.isdigit() or int(header_length) > len(body):
        raise OIPError(400, f"Inference-Header-Content-Length {header_length[:32]!r} is not "
                            f"a length within the {len(body)}-byte body")
    else:
        json_part, binary = body[:int(header_length)], body[int(header_length):]
    try:
        head = orjson.loads(json_part)
    except orjson.JSONDecodeError:
        raise OIPError(400, "the inference request header is not valid JSON") from None
    if not isinstance(head, dict):
        raise OIPError(400, "the inference request must be a JSON object")
    return head, binary


def input_error(exc: InvalidRequest) -> str:
    """The wire's refusal of the payload built from the inputs, naming the input (the
    payload is {input name: data}): "payload.x[1]: ..." is "input 'x': [1]: ..."."""
    message = str(exc)
    if not exc.field.startswith("payload.") or not message.startswith(exc.field + ":"):
        return message
    path = exc.field.removeprefix("payload.")
    cut = min((i for i in (path.find("["), path.find(".")) if i >= 0), default=len(path))
    where = path[cut:].removeprefix(".")
    return f"input {path[:cut]!r}: " + (f"{where}: " if where else "") + \
        message[len(exc.field) + 2:]


async def infer(gateway: Gateway, name: str, body: bytes, header_length: str | None
                ) -> Response:
    head, binary = split_body(body, header_length)
    parameters = head.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise OIPError(400, "parameters: must be an object")
    request_id = head.get("id", "")
    if not isinstance(request_id, str):
        raise OIPError(400, "id: must be a string")
    payload = read_inputs(head, binary)
    try:
        handle = await gateway.sharded.submit(payload, priority=priority_of(parameters),
                                              deadline_ms=deadline_of(parameters))
    except QueueFull as exc:
        return error_response(429, str(exc),
                              {"Retry-After": str(max(1, math.ceil(exc.retry_after_s or 1)))})
    except InvalidRequest as exc:  # the producer's checks: NaN, past 64 bits, over 1 MiB
        raise OIPError(400, input_error(exc)) from None
    try:
        result = await handle.result(timeout=MAX_WAIT_S)
    except DeadlineExceeded as exc:
        raise OIPError(504, f"request timeout expired before it ran: {exc}") from None
    except RequestCancelled as exc:
        raise OIPError(409, str(exc)) from None
    except RequestFailed as exc:
        raise OIPError(500, f"the model failed: {exc}") from None
    except TimeoutError:
        raise OIPError(504, f"no result within {MAX_WAIT_S:g} s (it may still run)") from None
    return write_outputs(name, request_id or handle.id, head, result)


# The JSON inference request, for the spec (read by read_inputs; the binary extension
# sends this header first, then the tensors' bytes).
INFER_REQUEST = {"type": "object", "required": ["inputs"], "properties": {
    "id": {"type": "string"},
    "parameters": {"type": "object", "properties": {
        "priority": {"type": "integer", "minimum": 0},
        "timeout": {"type": "integer", "minimum": 1, "maximum": MAX_DEADLINE_MS * 1000},
        "binary_data_output": {"type": "boolean"}}},
    "inputs": {"type": "array", "minItems": 1, "items": {
        "type": "object", "required": ["name", "shape", "datatype"], "properties": {
            "name": {"type": "string"},
            "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
            "datatype": {"type": "string", "enum": [*FIXED, "BYTES"]},
            "parameters": {"type": "object"},
            "data": {"type": "array"}}}},
    "outputs": {"type": "array", "items": {
        "type": "object", "required": ["name"], "properties": {
            "name": {"type": "string"}, "parameters": {"type": "object"}}}}}}


class ModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[dict[str, Any]] = Field(description="Not declared: the model reads what "
                                                     "its payload holds (docs/gateway.md).")
    outputs: list[dict[str, Any]]


class OIPProblem(BaseModel):
    error: str


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    described = {400: "Bad input, naming the tensor or parameter.",
                 404: "No such model: `name` is not a queue this gateway serves.",
                 409: "Cancelled before it ran.", 429: "The queue is full (Retry-After).",
                 500: "The model failed.",
                 503: "Not ready: Redis unreachable, or no consumer alive.",
                 504: "parameters.timeout passed before the request ran, or no result "
                      "within 300 s."}
    return {s: {"model": OIPProblem, "description": described[s]} for s in statuses}


def oip_router(auth: Any | None, gateways: Callable[[Request], dict[str, Any]]) -> APIRouter:
    router = APIRouter(prefix="/v2", tags=["Open Inference Protocol v2"])
    secured = [Depends(auth)] if auth else []
    unauthorized = {401: {"model": OIPProblem, "description": "Missing or wrong bearer "
                                                              "token."}} if auth else {}

    def gateway(request: Request, name: str) -> Gateway:
        served = gateways(request)
        if name not in served:
            raise OIPError(404, f"model {name!r} is not served by this gateway (models: "
                                f"{listed(served)})")
        return served[name]

    @router.get("/health/live", summary="The gateway is up")
    async def live() -> Response:
        return Response(orjson.dumps({"live": True}), media_type="application/json")

    @router.get("/health/ready", summary="Redis reachable", responses=_errors(503))
    async def ready(request: Request) -> Response:
        try:
            await asyncio.wait_for(request.app.state.gateway.redis.ping(), 2.0)
        except (redis.RedisError, OSError, asyncio.TimeoutError):
            return error_response(503, "Redis is unreachable")
        return Response(orjson.dumps({"ready": True}), media_type="application/json")

    @router.get("", summary="Server metadata", dependencies=secured, responses=unauthorized)
    async def server_metadata() -> Response:
        return Response(orjson.dumps({"name": "batchgate", "version": VERSION,
                                      "extensions": ["binary_tensor_data"]}),
                        media_type="application/json")

    @router.get("/models/{name}", response_model=ModelMetadata, dependencies=secured,
                responses={**_errors(404), **unauthorized},
                summary="Model metadata (`name`: the queue)")
    async def metadata(name: str, request: Request) -> Response:
        gateway(request, name)
        return Response(orjson.dumps({"name": name, "versions": [VERSION],
                                      "platform": "batchgate", "inputs": [], "outputs": []}),
                        media_type="application/json")

    @router.get("/models/{name}/ready", dependencies=secured,
                responses={**_errors(404, 503), **unauthorized},
                summary="A consumer of the queue is alive")
    async def model_ready(name: str, request: Request) -> Response:
        keys = gateway(request, name).keys
        client = request.app.state.gateway.redis
        seconds, micros = await client.time()
        now_us = seconds * 1_000_000 + micros
        alive = await client.zcount(keys.consumers, now_us - CONSUMER_ALIVE_S * 1e6, "+inf")
        if not alive:
            return error_response(503, f"model {name!r}: no consumer alive")
        return Response(orjson.dumps({"name": name, "ready": True}),
                        media_type="application/json")

    infer_doc = {"summary": "Run the model (JSON tensors, or the binary tensor data "
                            "extension)", "dependencies": secured,
                 "responses": {200: {"description": "The outputs; with binary outputs, "
                                                    "application/octet-stream after an "
                                                    "Inference-Header-Content-Length JSON "
                                                    "header."},
                               **_errors(400, 404, 409, 429, 500, 503, 504),
                               **unauthorized},
                 "openapi_extra": {"requestBody": {"required": True, "content": {
                     "application/json": {"schema": INFER_REQUEST}}}}}

    @router.post("/models/{name}/infer", **infer_doc)
    async def run(name: str, request: Request) -> Response:
        return await infer(gateway(request, name), name, await request.body(),
                           request.headers.get(HEADER_LENGTH))

    @router.post("/models/{name}/versions/{version}/infer", **infer_doc)
    async def run_version(name: str, version: str, request: Request) -> Response:
        return await infer(gateway(request, name), name, await request.body(),
                           request.headers.get(HEADER_LENGTH))

    return router


async def oip_error(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, OIPError)
    return error_response(exc.status, str(exc))

