"""The OpenAI-compatible routes' bodies, for the OpenAPI spec (openai_api.py reads and
writes them as plain JSON; tests/test_openai_api.py holds the two together through the
real openai SDK)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue

PRIORITY = Field(default=None, description="vLLM's priority: an integer, lower is more "
                                           "urgent (below 0: high, 0: normal, above 0: low), "
                                           "or \"high\", \"normal\", \"low\".")
MAX_TOKENS = Field(default=None, ge=1, description="New tokens to generate: the model's "
                                                   "max_new_tokens and the request's cost.")
USER = Field(default=None, max_length=256, description="The caller (tenant), carried to the "
                                                       "model as `user`.")


class Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="The queue that serves the request.")
    stream: bool = Field(default=False, description="Server-sent events: chunks, then "
                                                    "`data: [DONE]`.")
    stream_options: dict[str, bool] | None = None
    max_tokens: int | None = MAX_TOKENS
    priority: int | Literal["high", "normal", "low"] | None = PRIORITY
    user: str | None = USER
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    n: Literal[1] | None = None
    service_tier: str | None = Field(default=None, description="Without `priority`: "
                                                               "\"priority\" is high, "
                                                               "\"flex\" low.")
    store: bool | None = None
    metadata: dict[str, str] | None = None


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    best_of: Literal[1] | None = None
    echo: Literal[False] | None = None
    logprobs: None = None
    suffix: None = None


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = MAX_TOKENS
    response_format: JsonValue = None
    tools: JsonValue = None
    tool_choice: JsonValue = None
    parallel_tool_calls: bool | None = None
    logprobs: Literal[False] | None = None


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="The queue that serves the request.")
    input: str | list[str]
    encoding_format: Literal["float", "base64"] | None = Field(
        default=None, description="base64: little-endian float32s (the openai SDK's default).")
    priority: int | Literal["high", "normal", "low"] | None = PRIORITY
    user: str | None = USER
    dimensions: None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int


class Choice(BaseModel):
    index: int
    finish_reason: str = Field(description="The model's, else length (all of max_tokens "
                                           "used) or stop.")
    logprobs: None = None


class CompletionChoice(Choice):
    text: str


class ChatChoice(Choice):
    message: dict[str, str] = Field(description="{\"role\": \"assistant\", \"content\": "
                                                "text}")


class Answer(BaseModel):
    id: str = Field(description="cmpl- or chatcmpl-, then the batchgate request id (of the "
                                "first prompt)")
    created: int
    model: str
    usage: Usage


class Completion(Answer):
    """Streamed (stream=true): `text/event-stream` chunks of this shape, then
    `data: [DONE]`."""

    object: Literal["text_completion"]
    choices: list[CompletionChoice]


class ChatCompletion(Answer):
    """Streamed (stream=true): `chat.completion.chunk` objects with a `delta`, then
    `data: [DONE]`."""

    object: Literal["chat.completion"]
    choices: list[ChatChoice]


class Embedding(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str


class EmbeddingList(BaseModel):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: Usage


class Model(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[Model]


class ErrorDetail(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, rate_limit_error, timeout_error, "
                                  "server_error")
    param: str | None = Field(description="The offending field, e.g. max_tokens")
    code: str | None = Field(description="invalid_value, unknown_parameter, model_not_found, "
                                         "queue_full, deadline_exceeded, timeout, cancelled, "
                                         "model_error, bad_model_result, redis_unavailable")


class Error(BaseModel):
    error: ErrorDetail


def _error(description: str) -> dict[str, Any]:
    return {"model": Error, "description": description}


ERRORS: dict[int, dict[str, Any]] = {
    400: _error("Bad input: `param` names the field (unknown fields included)."),
    404: _error("`model` is not a queue this gateway serves (code model_not_found)."),
    408: _error("The body did not arrive within --request-timeout-s."),
    409: _error("The request was cancelled before it ran (code cancelled)."),
    413: _error("The body is over --max-body-bytes."),
    429: _error("The queue is full (code queue_full): retry after Retry-After seconds."),
    500: _error("The model failed (model_error) or broke the contract (bad_model_result); "
                "X-Should-Retry: false."),
    503: _error("Redis is unreachable (redis_unavailable)."),
    504: _error("The deadline (X-Request-Timeout-Ms, or the SDK's timeout) passed before the "
                "request ran (deadline_exceeded), or no result came within it (timeout); "
                "X-Should-Retry: false."),
}


def responses(stream: bool = True) -> dict[int | str, dict[str, Any]]:
    out: dict[int | str, dict[str, Any]] = dict(ERRORS)
    if stream:
        out[200] = {"description": "The answer; with stream=true, server-sent events "
                                   "(`data: <chunk>` ... `data: [DONE]`).",
                    "content": {"text/event-stream": {"schema": {"type": "string"}}}}
    return out
