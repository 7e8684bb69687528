"""OpenAI-compatible routes: `POST /v1/completions`, `/v1/chat/completions`,
`/v1/embeddings` (answered here, a pure ASGI layer ahead of FastAPI, like hotpath.py),
and `GET /v1/models[/{model}]` (FastAPI: `models_router`).

`model` names the queue. A request becomes one batchgate request per prompt or input,
submitted, awaited and streamed with the gateway's own producer (Gateway.sharded); the
answer has the OpenAI API's shapes, its `usage`, its SSE chunks and `data: [DONE]`, and its
error object ({"error": {"message", "type", "param", "code"}}) and statuses.

What the model receives and returns (the contract, docs/gateway.md#openai-compatible-api):

- completions and chat: payload {"prompt": str} (or {"tokens": [int]} for a token prompt),
  with "max_new_tokens" when max_tokens is given, "messages" (chat: the messages, contents
  as text), "params" (the sampling fields given: temperature, top_p, stop, seed, ...) and
  "user"; the request's cost is max_tokens (1 without). Result: {"text": str} (or a
  string), optionally "prompt_tokens", "new_tokens" (or "completion_tokens") and
  "finish_reason". Streamed parts: {"text": str} (or a string).
- embeddings: payload {"text": str} (+ "user"). Result: a list of numbers, or
  {"embedding": [numbers]}, optionally "prompt_tokens".

Counts a model does not give are the byte-level tokenizer's (tokenizer.py).
"""

from __future__ import annotations

import array
import asyncio
import base64
import math
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import APIRouter, Depends, Request, Response

from producer.gateway import openai_schemas as s
from producer.gateway import tokenizer
from producer.gateway.guard import Receive, Scope, Send, header
from producer.gateway.hotpath import error_answer, header_tenant, is_json, read_body
from producer.gateway.queues import listed
from producer.gateway.schemas import MAX_WAIT_S, Problem, loads
from producer.validation import MAX_DEADLINE_MS
from scheduler_core.errors import (
    DeadlineExceeded,
    InvalidRequest,
    QueueFull,
    RequestCancelled,
    RequestFailed,
)
from scheduler_core.policy import MAX_REQUEST_COST, Priority
from scheduler_core.wire import Restart

if TYPE_CHECKING:
    from producer.gateway.app import Gateway

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
EMBEDDINGS_PATH = "/v1/embeddings"
PATHS = (COMPLETIONS_PATH, CHAT_PATH, EMBEDDINGS_PATH)
TIMEOUT_HEADER = b"x-request-timeout-ms"  # ours: the deadline, in ms
SDK_TIMEOUT_HEADER = b"x-stainless-read-timeout"  # the openai SDK's timeout, in seconds
MAX_INPUTS = 2048  # prompts or inputs in one request (the OpenAI API's own embeddings cap)
MAX_USER_CHARS = 256
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
SERVICE_TIERS = {"priority": Priority.HIGH, "flex": Priority.LOW}
# Fields carried to the model under "params" (its sampling knobs), when given.
SAMPLING = ("temperature", "top_p", "stop", "seed", "frequency_penalty", "presence_penalty",
            "logit_bias", "top_k", "min_p", "repetition_penalty")
# Accepted and not carried (the API's own bookkeeping, or choices batchgate makes itself).
IGNORED = ("service_tier", "store", "metadata", "stream_options", "prompt_cache_key",
           "safety_identifier", "logprobs", "top_logprobs", "echo", "n", "best_of", "suffix")
COMMON = ("model", "user", "priority", "stream", "max_tokens", *SAMPLING, *IGNORED)
FIELDS = {
    COMPLETIONS_PATH: frozenset((*COMMON, "prompt")),
    CHAT_PATH: frozenset((*COMMON, "messages", "max_completion_tokens", "response_format",
                          "tools", "tool_choice", "parallel_tool_calls")),
    EMBEDDINGS_PATH: frozenset(("model", "input", "user", "priority", "encoding_format",
                                "dimensions")),
}
OBJECTS = {COMPLETIONS_PATH: ("cmpl-", "text_completion"),
           CHAT_PATH: ("chatcmpl-", "chat.completion")}


class OpenAIError(Exception):
    """An answer in the OpenAI error shape."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: list[tuple[bytes, bytes]] | None = None):
        super().__init__(message)
        self.status = status
        self.body = {"error": {"message": message, "type": type, "param": param,
                               "code": code}}
        self.headers = headers or []


def invalid(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, f"{param}: {message}", param=param, code="invalid_value")


def unknown_model(name: Any, served: Any) -> OpenAIError:
    return OpenAIError(404, f"The model {name!r} does not exist on this gateway (models: "
                            f"{listed(served)})", param="model", code="model_not_found")


STATE_ERRORS = {"expired": DeadlineExceeded, "cancelled": RequestCancelled,
                "failed": RequestFailed}
NO_RETRY = [(b"x-should-retry", b"false")]  # the openai SDK retries 5xx unless told not to


def failure(exc: RequestFailed) -> OpenAIError:
    """A batchgate request that ended without a result, as an OpenAI error."""
    if isinstance(exc, DeadlineExceeded):
        return OpenAIError(504, f"deadline passed before the request ran: {exc}",
                           type="timeout_error", code="deadline_exceeded", headers=NO_RETRY)
    if isinstance(exc, RequestCancelled):
        return OpenAIError(409, str(exc), code="cancelled", headers=NO_RETRY)
    return OpenAIError(500, f"the model failed: {exc}", type="server_error",
                       code="model_error", headers=NO_RETRY)


# The payload's fields (built here from the body) as the client named them.
PAYLOAD_FIELDS = {"tokens": "prompt", "text": "input", "max_new_tokens": "max_tokens"}


def client_param(field: str) -> str:
    """The body's field behind `field`, an error's field that may name the payload built
    from it (the wire refuses what it cannot carry: "payload.tokens[1]" is "prompt[1]")."""
    if field == "cost":
        return "max_tokens"
    if not field.startswith("payload."):
        return field
    path = field.removeprefix("payload.").removeprefix("params.")
    head, sep, rest = path.partition("[")
    head, dot, tail = head.partition(".")
    return PAYLOAD_FIELDS.get(head, head) + dot + tail + sep + rest


def as_openai(exc: Exception) -> OpenAIError | None:
    """The gateway's own errors (bad input, queue full, Redis down) in the OpenAI shape."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, QueueFull):
        retry = max(1, math.ceil(exc.retry_after_s or 1))
        return OpenAIError(429, str(exc), type="rate_limit_error", code="queue_full",
                           headers=[(b"retry-after", str(retry).encode())])
    if isinstance(exc, InvalidRequest):
        param = client_param(exc.field)
        message = str(exc)
        if param != exc.field and message.startswith(exc.field + ":"):
            message = param + message[len(exc.field):]
        return OpenAIError(400, message, param=param, code="invalid_value")
    answered = error_answer(exc)
    if answered is None:
        return None
    status, body, headers = answered
    return OpenAIError(status, body.get("message", ""), type="server_error"
                       if status >= 500 else "invalid_request_error",
                       code=body.get("error"), headers=headers)


# -- reading a request ------------------------------------------------------------------------

def _int(value: Any, param: str, low: int, high: int) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise invalid(param, f"must be an integer in [{low}, {high}], got {value!r}")
    return value


def priority_of(body: dict[str, Any]) -> Priority:
    """`priority` as vLLM reads it (an integer, lower is more urgent, 0 the default):
    below 0 high, 0 normal, above 0 low; or a name, "high", "normal", "low". Without it,
    `service_tier` "priority" is high and "flex" low."""
    value = body.get("priority")
    if value is None:
        return SERVICE_TIERS.get(body.get("service_tier"), Priority.NORMAL)  # type: ignore[arg-type]
    if isinstance(value, str) and value in ("high", "normal", "low"):
        return Priority[value.upper()]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return Priority.HIGH if value < 0 else Priority.NORMAL if value == 0 else Priority.LOW
    raise invalid("priority", f"must be an integer (vLLM's: below 0 high, 0 normal, above 0 "
                              f"low) or \"high\", \"normal\", \"low\"; got {value!r}")


def deadline_of(scope: Scope) -> int | None:
    """The deadline in ms: X-Request-Timeout-Ms, else the openai SDK's own timeout
    (X-Stainless-Read-Timeout, seconds), else none."""
    raw = header(scope, TIMEOUT_HEADER)
    if raw is not None:
        if not raw.isdigit() or not 1 <= int(raw) <= MAX_DEADLINE_MS:
            raise invalid("X-Request-Timeout-Ms", f"must be a whole number of ms in [1, "
                                                  f"{MAX_DEADLINE_MS}], got {raw[:32]!r}")
        return int(raw)
    raw = header(scope, SDK_TIMEOUT_HEADER)
    try:
        seconds = float(raw) if raw is not None else math.nan
    except ValueError:
        return None  # the SDK's own header: not the caller's error
    if not 0 < seconds < math.inf:  # NaN, negative, zero, infinite: none
        return None
    return min(MAX_DEADLINE_MS, max(1, math.ceil(seconds * 1000)))


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise invalid(param, f"must be a non-empty string, got {type(value).__name__}")
    return value


def _content(message: Any, i: int) -> tuple[str, str]:
    """A chat message's role and content as text (a list of text parts is joined)."""
    if not isinstance(message, dict):
        raise invalid(f"messages[{i}]", "must be an object with role and content")
    role, content = message.get("role"), message.get("content")
    if role not in CHAT_ROLES:
        raise invalid(f"messages[{i}].role", f"must be one of {', '.join(sorted(CHAT_ROLES))}"
                                             f", got {role!r}")
    if content is None:
        return role, ""
    if isinstance(content, str):
        return role, content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or \
                    not isinstance(part.get("text"), str):
                raise invalid(f"messages[{i}].content[{j}]", "only text parts "
                                                            "({\"type\": \"text\", \"text\": "
                                                            "str}) are supported")
            parts.append(part["text"])
        return role, "".join(parts)
    raise invalid(f"messages[{i}].content", "must be a string or a list of text parts")


def render_chat(messages: list[dict[str, str]]) -> str:
    """The prompt of a chat for a model that takes text: one `role: content` line per
    message, then `assistant:` (models that know chats read "messages" instead)."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


class Job:
    """A checked OpenAI request: the batchgate payloads it becomes, and how to answer."""

    def __init__(self, path: str, body: Any):
        if not isinstance(body, dict):
            raise invalid("body", f"must be a JSON object, got {type(body).__name__}")
        unknown = next((name for name in body if name not in FIELDS[path]), None)
        if unknown is not None:
            raise OpenAIError(400, f"Unrecognized request argument supplied: {unknown}",
                              param=str(unknown), code="unknown_parameter")
        self.path = path
        self.model = body.get("model")
        if not isinstance(self.model, str) or not self.model:
            raise invalid("model", "required: the name of a queue this gateway serves")
        self.priority = priority_of(body)
        self.stream = body.get("stream") or False
        if not isinstance(self.stream, bool):
            raise invalid("stream", f"must be true or false, got {self.stream!r}")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise invalid("stream_options", "must be an object")
        self.include_usage = options.get("include_usage") is True
        for name, allowed in (("n", 1), ("best_of", 1)):
            if body.get(name) not in (None, allowed):
                raise invalid(name, f"only {allowed} is supported, got {body[name]!r}")
        for name in ("echo", "logprobs", "top_logprobs", "suffix"):
            if body.get(name) not in (None, False):
                raise invalid(name, "is not supported by batchgate")
        extra: dict[str, Any] = {}
        user = body.get("user")
        if user is not None:
            if not isinstance(user, str) or len(user) > MAX_USER_CHARS:
                raise invalid("user", f"must be a string of at most {MAX_USER_CHARS} "
                                      "characters")
            extra["user"] = user
        if path == EMBEDDINGS_PATH:
            self._embeddings(body, extra)
            return
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        param = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        self.max_tokens = None if limit is None else _int(limit, param, 1, MAX_REQUEST_COST)
        if self.max_tokens is not None:
            extra["max_new_tokens"] = self.max_tokens
        params = {name: body[name] for name in SAMPLING if body.get(name) is not None}
        if path == CHAT_PATH:
            for name in ("response_format", "tools", "tool_choice", "parallel_tool_calls"):
                if body.get(name) is not None:
                    params[name] = body[name]
        if params:
            extra["params"] = params
        self.prompts = self._chat(body) if path == CHAT_PATH else self._prompts(body)
        if self.stream and len(self.prompts) > 1:
            raise invalid("prompt", "stream takes one prompt")
        self.payloads = [{**prompt, **extra} for prompt in self.prompts]
        self.costs = [self.max_tokens or 1] * len(self.payloads)

    def _prompts(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return [{"prompt": _text(prompt, "prompt")}]
        if isinstance(prompt, list) and prompt and len(prompt) <= MAX_INPUTS:
            if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
                return [{"tokens": prompt}]
            if all(isinstance(p, str) for p in prompt):
                return [{"prompt": _text(p, f"prompt[{i}]")} for i, p in enumerate(prompt)]
            if all(isinstance(p, list) and p and all(
                    isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompt):
                return [{"tokens": p} for p in prompt]
        raise invalid("prompt", f"must be a string, a list of 1-{MAX_INPUTS} strings, or "
                                "token ids ([int] or [[int]])")

    def _chat(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or len(messages) > MAX_INPUTS:
            raise invalid("messages", f"must be a list of 1-{MAX_INPUTS} messages")
        texts = [dict(zip(("role", "content"), _content(m, i), strict=True))
                 for i, m in enumerate(messages)]
        return [{"prompt": render_chat(texts), "messages": texts}]

    def _embeddings(self, body: dict[str, Any], extra: dict[str, Any]) -> None:
        self.format = body.get("encoding_format") or "float"
        if self.format not in ("float", "base64"):
            raise invalid("encoding_format", f"must be \"float\" or \"base64\", got "
                                             f"{self.format!r}")
        if body.get("dimensions") is not None:
            raise invalid("dimensions", "is not supported: the model's own size is returned")
        if self.stream:
            raise invalid("stream", "embeddings do not stream")
        given = body.get("input")
        inputs = [given] if isinstance(given, str) else given
        if not isinstance(inputs, list) or not 1 <= len(inputs) <= MAX_INPUTS or \
                not all(isinstance(text, str) for text in inputs):
            raise invalid("input", f"must be a string or a list of 1-{MAX_INPUTS} strings "
                                   "(token ids are not supported: send text)")
        self.prompts = [{"text": _text(text, f"input[{i}]")} for i, text in enumerate(inputs)]
        self.payloads = [{**prompt, **extra} for prompt in self.prompts]
        self.costs = [1] * len(self.payloads)
        self.max_tokens = None


# -- writing an answer ------------------------------------------------------------------------

def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 \
        else None


def prompt_tokens(prompt: dict[str, Any], result: Any) -> int:
    given = _count(result.get("prompt_tokens")) if isinstance(result, dict) else None
    if given is not None:
        return given
    if "tokens" in prompt:
        return len(prompt["tokens"])
    return tokenizer.count(prompt.get("prompt", prompt.get("text", "")))


def text_of(result: Any) -> tuple[str, int | None, str | None]:
    """(text, completion tokens if the model said, finish_reason if it said)."""
    if isinstance(result, str):
        return result, None, None
    if isinstance(result, dict) and isinstance(result.get("text"), str):
        tokens = _count(result.get("new_tokens", result.get("completion_tokens")))
        if tokens is None and isinstance(result.get("tokens"), list):
            tokens = len(result["tokens"])
        reason = result.get("finish_reason")
        return result["text"], tokens, reason if isinstance(reason, str) else None
    raise OpenAIError(500, "the model's result has no text (the contract: {\"text\": str} "
                           "or a string)", type="server_error", code="bad_model_result",
                      headers=NO_RETRY)


def finish(job: Job, tokens: int, said: str | None) -> str:
    if said is not None:
        return said
    return "length" if job.max_tokens is not None and tokens >= job.max_tokens else "stop"


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def completion_body(job: Job, request_id: str, results: list[Any]) -> dict[str, Any]:
    prefix, kind = OBJECTS[job.path]
    choices, used_prompt, used_completion = [], 0, 0
    for index, (prompt, result) in enumerate(zip(job.prompts, results, strict=True)):
        text, tokens, said = text_of(result)
        tokens = tokenizer.count(text) if tokens is None else tokens
        used_prompt += prompt_tokens(prompt, result)
        used_completion += tokens
        choice: dict[str, Any] = {"index": index, "finish_reason": finish(job, tokens, said),
                                  "logprobs": None}
        if job.path == CHAT_PATH:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choices.append(choice)
    return {"id": prefix + request_id, "object": kind, "created": int(time.time()),
            "model": job.model, "choices": choices, "usage": usage(used_prompt, used_completion)}


def embedding_of(result: Any) -> list[float]:
    vector = result.get("embedding") if isinstance(result, dict) else result
    if not isinstance(vector, list) or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) for x in vector):
        raise OpenAIError(500, "the model's result is not an embedding (the contract: a list "
                               "of numbers or {\"embedding\": [...]})", type="server_error",
                          code="bad_model_result", headers=NO_RETRY)
    return vector


def packed(vector: list[float]) -> str:
    """base64 of little-endian float32s, as the openai SDK decodes `encoding_format`
    base64 (its default)."""
    floats = array.array("f", vector)
    if sys.byteorder != "little":
        floats.byteswap()
    return base64.b64encode(floats.tobytes()).decode()


def embeddings_body(job: Job, results: list[Any]) -> dict[str, Any]:
    data, used = [], 0
    for index, (prompt, result) in enumerate(zip(job.prompts, results, strict=True)):
        vector = embedding_of(result)
        data.append({"object": "embedding", "index": index,
                     "embedding": packed(vector) if job.format == "base64" else vector})
        used += prompt_tokens(prompt, result)
    return {"object": "list", "data": data, "model": job.model,
            "usage": {"prompt_tokens": used, "total_tokens": used}}


def chunk(job: Job, request_id: str, created: int, text: str | None,
          reason: str | None = None, role: bool = False) -> dict[str, Any]:
    """One streamed chunk of a completion (`text`) or chat (`delta`)."""
    prefix, kind = OBJECTS[job.path]
    choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
    if job.path == CHAT_PATH:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    return {"id": prefix + request_id, "object": kind + ".chunk" if job.path == CHAT_PATH
            else kind, "created": created, "model": job.model, "choices": [choice]}


def event(data: Any) -> dict[str, Any]:
    return {"type": "http.response.body", "more_body": True,
            "body": b"data: " + orjson.dumps(data) + b"\n\n"}


LEFT = object()  # until_answered: the client left (a result may be None)
DONE = {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False}


async def until_disconnect(receive: Receive) -> None:
    """Returns when the client has gone (the body was read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class OpenAIPath:
    """Answers the OpenAI routes; passes anything else to `app`. `gateways` returns the
    {queue: Gateway} of the process; `routes` FastAPI's declared routes (metrics labels)."""

    def __init__(self, app: Any, gateways: Callable[[], dict[str, Gateway]],
                 routes: dict[str, Any]):
        self.app = app
        self.gateways = gateways
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or \
                scope["path"] not in PATHS:
            await self.app(scope, receive, send)
            return
        scope["route"] = self.routes.get(scope["path"])
        try:
            await self.serve(scope, receive, send)
        except Exception as exc:
            error = as_openai(exc)
            if error is None:
                raise
            await send_error(send, error)

    async def serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await read_body(receive)
        if body is None:
            return
        if not is_json(header(scope, b"content-type")):
            raise invalid("body", "send a JSON object with Content-Type: application/json")
        try:
            parsed = loads(body)
        except (ValueError, RecursionError):
            raise invalid("body", "is not valid JSON") from None
        gateways = self.gateways()
        model = parsed.get("model") if isinstance(parsed, dict) else None
        if isinstance(model, str) and model not in gateways:  # first: whatever else is wrong
            raise unknown_model(model, gateways)
        job = Job(scope["path"], parsed)
        gateway = gateways[job.model]
        deadline_ms = deadline_of(scope)
        tenant = header_tenant(scope)  # the proxy's X-Tenant: quotas apply here too
        wait_s = deadline_ms / 1000 if deadline_ms is not None else MAX_WAIT_S
        # store_result: how it ended, for until_answered (and GET /v1/requests/{id})
        if len(job.payloads) == 1:
            handles = [await gateway.sharded.submit(
                job.payloads[0], priority=job.priority, deadline_ms=deadline_ms,
                cost=job.costs[0], store_result=True, tenant=tenant)]
        else:
            handles = await gateway.sharded.submit_many(
                job.payloads, priority=job.priority, deadline_ms=deadline_ms, cost=job.costs,
                store_result=True, tenant=tenant)
        scope["batchgate.wait"] = True
        ids = handles[0].id
        if job.stream:
            await self.stream(job, gateway, handles[0], wait_s, receive, send)
            return
        work = handles[0].result(timeout=wait_s) if len(handles) == 1 else \
            asyncio.gather(*(handle.result(timeout=wait_s) for handle in handles))
        results = await self.until_answered(work, gateway, [h.id for h in handles], receive)
        if results is LEFT:
            return
        if len(handles) == 1:
            results = [results]
        answer = embeddings_body(job, results) if job.path == EMBEDDINGS_PATH \
            else completion_body(job, ids, results)
        await send_json(send, 200, answer, [(b"x-request-id", ids.encode())])

    async def until_answered(self, work: Awaitable[Any], gateway: Gateway, ids: list[str],
                             receive: Receive) -> Any:
        """`work`'s outcome; LEFT if the client left first (its requests are then cancelled
        if they have not started). A request that failed, or did not finish in time, raises
        its OpenAI error."""
        # The work runs in this task, which the watcher cancels if the client leaves: one
        # task more per request, not two and an asyncio.wait.
        this = asyncio.current_task()
        assert this is not None
        left, over = [], []

        def client_left(watcher: asyncio.Task[None]) -> None:
            if not watcher.cancelled() and not over:  # not once the work is over
                left.append(True)
                this.cancel()
        watcher = asyncio.ensure_future(until_disconnect(receive))
        watcher.add_done_callback(client_left)
        try:
            return await work
        except asyncio.CancelledError:
            if not left:
                raise  # cancelled from outside, not by the client leaving
            this.uncancel()
            await asyncio.gather(*(gateway.cancel(i) for i in ids), return_exceptions=True)
            return LEFT
        except RequestFailed as exc:
            raise failure(exc) from None
        except TimeoutError:
            pass
        finally:
            over.append(True)
            watcher.cancel()
        for request_id in ids:  # its stored state: expired (the Gateway expires it if due)
            state = await gateway.lookup(request_id)
            if state is not None and state["status"] in STATE_ERRORS:
                raise failure(STATE_ERRORS[state["status"]](
                    request_id, (state.get("error") or {}).get("message", ""),
                    (state.get("error") or {}).get("type", "RequestFailed")))
        raise OpenAIError(504, "no result within the request's timeout (it may still run)",
                          type="timeout_error", code="timeout", headers=NO_RETRY)

    async def stream(self, job: Job, gateway: Gateway, handle: Any, wait_s: float,
                     receive: Receive, send: Send) -> None:
        """SSE chunks as the model's parts come, the last chunk with finish_reason (and a
        usage chunk with stream_options.include_usage), then `data: [DONE]`. An error after
        the answer began is a chunk {"error": {...}}, then [DONE]."""
        created = int(time.time())
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
            (b"x-request-id", handle.id.encode())]})
        if job.path == CHAT_PATH:
            await send(event(chunk(job, handle.id, created, "", role=True)))

        async def relay() -> tuple[Any, int]:
            sent = 0
            try:
                async for part in handle.stream(timeout=wait_s):
                    if isinstance(part, Restart):
                        if not sent:  # nothing to take back
                            continue
                        raise OpenAIError(500, "the request restarted on another consumer "
                                               "after its first parts were sent",
                                          type="server_error", code="restarted")
                    piece = part if isinstance(part, str) else part.get("text") \
                        if isinstance(part, dict) else None
                    if isinstance(piece, str) and piece:
                        await send(event(chunk(job, handle.id, created, piece)))
                        sent += 1
            except TimeoutError:
                pass
            return await handle.result(timeout=0 if not handle.done() else None), sent

        try:
            outcome = await self.until_answered(relay(), gateway, [handle.id], receive)
            if outcome is LEFT:
                return
            result, sent = outcome
            text, tokens, said = text_of(result)
            if not sent and text:  # a model that does not stream: its text in one chunk
                await send(event(chunk(job, handle.id, created, text)))
            tokens = tokenizer.count(text) if tokens is None else tokens
            await send(event(chunk(job, handle.id, created, None if job.path == CHAT_PATH
                                   else "", finish(job, tokens, said))))
            if job.include_usage:
                tail = chunk(job, handle.id, created, None)
                tail["choices"], tail["usage"] = [], usage(
                    prompt_tokens(job.prompts[0], result), tokens)
                await send(event(tail))
        except Exception as exc:
            error = as_openai(exc)
            if error is None:
                raise
            await send(event(error.body))
        await send(DONE)


async def send_json(send: Send, status: int, body: Any,
                    headers: list[tuple[bytes, bytes]] | None = None) -> None:
    data = orjson.dumps(body)
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
        *(headers or [])]})
    await send({"type": "http.response.body", "body": data})


async def send_error(send: Send, error: OpenAIError) -> None:
    await send_json(send, error.status, error.body, error.headers)


# -- the FastAPI side: /v1/models, and the spec of the routes above ------------------------------

def model_card(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "batchgate"}


def models_router(auth: Any | None, gateways: Callable[[Request], dict[str, Any]]) -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["OpenAI-compatible"],
                       dependencies=[Depends(auth)] if auth else [],
                       responses={401: {"model": Problem, "description": "Missing or wrong "
                                                                         "bearer token."}}
                       if auth else {})
    errors = s.ERRORS

    @router.get("/models", response_model=s.ModelList, summary="The queues, as models")
    async def list_models(request: Request) -> Response:
        cards = [model_card(name) for name in gateways(request)]
        return Response(orjson.dumps({"object": "list", "data": cards}),
                        media_type="application/json")

    @router.get("/models/{model}", response_model=s.Model, summary="One queue, as a model",
                responses={404: errors[404]})
    async def get_model(model: str, request: Request) -> Response:
        served = gateways(request)
        if model not in served:
            error = unknown_model(model, served)
            return Response(orjson.dumps(error.body), status_code=404,
                            media_type="application/json")
        return Response(orjson.dumps(model_card(model)), media_type="application/json")

    answered = "answered by producer.gateway.openai_api.OpenAIPath, before FastAPI"

    @router.post("/completions", response_model=s.Completion, responses=s.responses(),
                 summary="OpenAI completions (`model`: the queue)")
    async def completions(body: s.CompletionRequest) -> Response:
        raise AssertionError(answered)

    @router.post("/chat/completions", response_model=s.ChatCompletion,
                 responses=s.responses(), summary="OpenAI chat completions (`model`: the "
                                                  "queue)")
    async def chat_completions(body: s.ChatRequest) -> Response:
        raise AssertionError(answered)

    @router.post("/embeddings", response_model=s.EmbeddingList,
                 responses=s.responses(stream=False),
                 summary="OpenAI embeddings (`model`: the queue)")
    async def embeddings(body: s.EmbeddingRequest) -> Response:
        raise AssertionError(answered)

    return router
