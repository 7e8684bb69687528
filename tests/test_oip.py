"""Open Inference Protocol v2 through the real `tritonclient.http` (binary and JSON
tensors), and many queues behind one gateway, against real gateway and consumer
processes."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
np = pytest.importorskip("numpy")
triton = pytest.importorskip("tritonclient.http")
from helpers.servers import ServerProcess, gateway_factory  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from scheduler_core.admin import store_policy  # noqa: E402
from scheduler_core.policy import Policy  # noqa: E402

HEAD = (b'{"inputs": [{"name": "x", "shape": [1], "datatype": "INT32", '
        b'"parameters": {"binary_data_size": 4}}]}')


@pytest.fixture
def start_gateway() -> Iterator[Callable[..., ServerProcess]]:
    yield from gateway_factory()


def triton_client(gateway: ServerProcess) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(gateway.url.removeprefix("http://"))


def test_tritonclient_health_metadata_and_infer(shared_redis, queue, inprocess_consumer,
                                                start_gateway):
    gateway = start_gateway(shared_redis.url, queue)
    client = triton_client(gateway)
    assert client.is_server_live() and client.is_server_ready()
    assert not client.is_model_ready(queue)  # no consumer yet
    inprocess_consumer("consumer.models:noop", redis_url=shared_redis.url, queue=queue)
    end = time.monotonic() + 10  # ready once its first heartbeat is in
    while not client.is_model_ready(queue):
        assert time.monotonic() < end
        time.sleep(0.05)
    assert client.get_model_metadata(queue)["name"] == queue
    assert client.get_server_metadata()["extensions"] == ["binary_tensor_data"]
    with pytest.raises(InferenceServerException, match="'nope' is not served"):
        client.get_model_metadata("nope")
    assert not client.is_model_ready("nope")

    matrix = np.arange(6, dtype=np.float32).reshape(2, 3)
    text = np.array([b"h\xc3\xa9llo"], dtype=np.object_)
    ids = np.array([[7]], dtype=np.int64)
    for binary in (True, False):  # the binary tensor data extension, and JSON tensors
        inputs = [triton.InferInput("matrix", [2, 3], "FP32"),
                  triton.InferInput("text", [1], "BYTES"),
                  triton.InferInput("ids", [1, 1], "INT64")]
        for tensor, value in zip(inputs, (matrix, text, ids), strict=True):
            tensor.set_data_from_numpy(value, binary_data=binary)
        outputs = [triton.InferRequestedOutput(name, binary_data=binary)
                   for name in ("matrix", "text", "ids")]
        result = client.infer(queue, inputs, outputs=outputs, priority=1, timeout=5_000_000)
        # noop echoes its payload: {"matrix": [[...]], "text": "héllo", "ids": 7}
        assert np.array_equal(result.as_numpy("matrix"), matrix)
        # tritonclient gives BYTES elements as bytes from binary data, str from JSON
        assert [x.decode() if isinstance(x, bytes) else x
                for x in result.as_numpy("text").tolist()] == ["héllo"]
        assert result.as_numpy("ids").tolist() == [7]
        assert result.get_output("ids")["datatype"] == "INT64"
    # No outputs named: tritonclient asks for every output in binary
    everything = client.infer(queue, inputs[:1])
    assert np.array_equal(everything.as_numpy("matrix"), matrix)

    with pytest.raises(InferenceServerException, match="model 'nope'"):
        client.infer("nope", inputs[:1])


def test_oip_priority_timeout_and_hostile_bodies(shared_redis, queue, start_gateway):
    """parameters.timeout (µs) is the deadline: with no consumer the request expires
    (504); bad bodies are 400 naming what is wrong."""
    gateway = start_gateway(shared_redis.url, queue)
    client = triton_client(gateway)
    tensor = triton.InferInput("x", [1], "INT32")
    tensor.set_data_from_numpy(np.array([1], dtype=np.int32))
    with pytest.raises(InferenceServerException, match="timeout expired") as info:
        client.infer(queue, [tensor], timeout=200_000)
    assert info.value.status() == "504"
    url = f"/v2/models/{queue}/infer"
    with httpx.Client(base_url=gateway.url, timeout=20) as http:
        cases = [
            (b"{", {}, "not valid JSON"),
            (b"[]", {}, "JSON object"),
            (b'{"inputs": []}', {}, "inputs"),
            (b'{"inputs": [{"name": "x", "shape": [-1], "datatype": "INT32", "data": [1]}]}',
             {}, "shape"),
            (b'{"inputs": [{"name": "x", "shape": [1], "datatype": "INT32", "data": ["a"]}]}',
             {}, "datatype INT32"),
            (b'{"inputs": [{"name": "x", "shape": [1], "datatype": "INT8", "data": [300]}]}',
             {}, "datatype INT8"),
            (b'{"inputs": [{"name": "x", "shape": [3], "datatype": "INT32", "data": [1, 2]}]}',
             {}, "input 'x': 2 elements for shape [3]"),
            (b'{"inputs": [{"name": "x", "shape": [1], "datatype": "BF16", "data": [1]}]}',
             {}, "BF16"),
            (b'{"inputs": [{"name": "x", "shape": [1], "datatype": "INT32", "data": [1]}], '
             b'"parameters": {"priority": -1}}', {}, "priority"),
            (HEAD + b"\x01\x00\x00", {"Inference-Header-Content-Length": str(len(HEAD))},
             "binary"),
            (b'{"inputs": []}', {"Inference-Header-Content-Length": "999"},
             "Inference-Header-Content-Length"),
            (b'{"inputs": [{"name": "x", "shape": [4000000000], "datatype": "INT8", '
             b'"data": [1]}]}', {}, "elements"),
            (HEAD.replace(b'"INT32"', b'"FP32" ') + b"\x00\x00\xc0\x7f",  # NaN: not JSON
             {"Inference-Header-Content-Length": str(len(HEAD))},
             "input 'x': nan is not valid JSON"),
            (HEAD + b"\x01\x00\x00\x00\x00", {"Inference-Header-Content-Length":
                                                str(len(HEAD))}, "belong to no input"),
        ]
        for body, headers, words in cases:
            response = http.post(url, content=body, headers=headers)
            assert response.status_code == 400, (body, response.text)
            assert words in response.json()["error"], (body, response.text)
        spec = http.get("/openapi.json").json()
    for path in ("/v2/health/live", "/v2/health/ready", "/v2/models/{name}",
                 "/v2/models/{name}/ready", "/v2/models/{name}/infer"):
        assert path in spec["paths"]
    assert {"400", "404", "429", "500", "504"} <= set(
        spec["paths"]["/v2/models/{name}/infer"]["post"]["responses"])


def test_one_gateway_serves_two_queues_with_their_own_policies(
        shared_redis, queue, inprocess_consumer, start_gateway):
    """`--queue a --queue b`: the native routes serve `a`, /v1/queues/{queue}/... each,
    the OpenAI and OIP routes name either as the model; each queue's policy is its own
    (b refuses past its max_queue_size, a does not); an unknown queue is a 404 naming it."""
    second = queue + "-b"
    store_policy(shared_redis.client(), second, Policy(max_queue_size=1), replace=True)
    inprocess_consumer("consumer.models:noop", redis_url=shared_redis.url, queue=queue)
    gateway = start_gateway(shared_redis.url, queue, "--queue", second)
    with httpx.Client(base_url=gateway.url, timeout=20) as http:
        native = http.post("/v1/requests", json={"payload": 1, "wait": True})
        on_a = http.post(f"/v1/queues/{queue}/requests", json={"payload": 2, "wait": True})
        assert native.json()["result"] == 1 and on_a.json()["result"] == 2
        queued = http.post(f"/v1/queues/{second}/requests", json={"payload": 3})
        assert queued.status_code == 202
        request_id = queued.json()["id"]
        assert queued.headers["Location"] == f"/v1/queues/{second}/requests/{request_id}"
        assert http.get(queued.headers["Location"]).json()["status"] == "queued"
        assert http.get(f"/v1/requests/{request_id}").status_code == 404  # not queue a's
        full = http.post(f"/v1/queues/{second}/requests", json={"payload": 4})
        assert full.status_code == 429 and full.json()["limit"] == 1
        for _ in range(3):  # queue a has no max_queue_size
            assert http.post("/v1/requests", json={"payload": 5}).status_code == 202
        assert http.get(f"/v1/queues/{second}/stats").json()["queue"] == second
        assert http.delete(f"/v1/queues/{second}/requests/{request_id}").status_code == 200
        unknown = http.post("/v1/queues/nope/requests", json={"payload": 1})
        assert unknown.status_code == 404 and "'nope'" in unknown.json()["message"]
        models = http.get("/v1/models").json()["data"]
        assert [m["id"] for m in models] == [queue, second]
        assert http.get(f"/v2/models/{second}").status_code == 200
        spec = http.get("/openapi.json").json()
        assert {"/v1/queues/{queue}/requests", "/v1/queues/{queue}/requests/{request_id}",
                "/v1/queues/{queue}/stats"} <= set(spec["paths"])
        assert "404" in spec["paths"]["/v1/queues/{queue}/requests"]["post"]["responses"]


def test_queue_patterns_expand_to_registered_queues(shared_redis, queue, start_gateway):
    from scheduler_core.registry import register_queue

    client = shared_redis.client()
    for name in (f"{queue}-x", f"{queue}-y"):
        register_queue(client, name)
    gateway = start_gateway(shared_redis.url, f"{queue}-*")
    with httpx.Client(base_url=gateway.url, timeout=20) as http:
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == \
            [f"{queue}-x", f"{queue}-y"]


def test_tritonclient_runs_the_built_in_generator(shared_redis, queue, inprocess_consumer,
                                                  start_gateway):
    """The built-in generator answers OIP as it is: `prompt` BYTES [1] and
    `max_new_tokens` INT32 [1] are its payload; its result's keys are the outputs. (The
    consumer runs in this process: the route under test is the gateway's.)"""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    inprocess_consumer("consumer.models:generator", redis_url=shared_redis.url, queue=queue,
                       device="cpu", torch_threads=1,
                       model_args={"vocab": 512, "layers": 2, "dim": 32, "heads": 2,
                                   "positions": 128})
    gateway = start_gateway(shared_redis.url, queue)
    client = triton_client(gateway)
    prompt = triton.InferInput("prompt", [1], "BYTES")
    prompt.set_data_from_numpy(np.array([b"hello"], dtype=np.object_))
    budget = triton.InferInput("max_new_tokens", [1], "INT32")
    budget.set_data_from_numpy(np.array([4], dtype=np.int32))
    result = client.infer(queue, [prompt, budget])
    assert result.as_numpy("new_tokens").tolist() == [4]
    assert result.as_numpy("tokens").shape == (4,)
    assert result.get_output("text")["datatype"] == "BYTES"
