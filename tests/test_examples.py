"""The web-app examples, run as a user runs them: a real server process on a free port, real
HTTP requests, real `batchgate consumer` processes and a private redis-server."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

# The examples need the gateway extra (FastAPI) and flask: skipped where absent.
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("flask")

from helpers.processes import free_port  # noqa: E402
from helpers.servers import ServerProcess  # noqa: E402
from helpers.support import configure  # noqa: E402

from scheduler_core.ops.stats import queue_stats  # noqa: E402


def app_env(redis_url: str, queue: str) -> dict[str, str]:
    return {"BATCHGATE_REDIS_URL": redis_url, "BATCHGATE_QUEUE": queue}


def flask_server(redis_url: str, queue: str) -> ServerProcess:
    port = free_port()
    return ServerProcess([sys.executable, "-m", "flask", "--app", "examples/flask_app.py",
                          "run", "--port", str(port)], port, env=app_env(redis_url, queue))


def test_fastapi_example(shared_redis, queue, start_consumer):
    start_consumer(shared_redis.url, queue, "--model", "consumer.models:synthetic")
    port = free_port()
    server = ServerProcess([sys.executable, "-m", "uvicorn", "--app-dir", "examples",
                            "fastapi_app:app", "--port", str(port)], port,
                           env=app_env(shared_redis.url, queue), ready_path="/docs")
    try:
        async def predict_all(n: int) -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
                return await asyncio.gather(*(
                    client.post("/predict", json={"text": f"t{i}"}) for i in range(n)))

        responses = asyncio.run(predict_all(40))
        assert [r.status_code for r in responses] == [200] * 40
        assert [r.json()["result"] for r in responses] == [{"text": f"t{i}"} for i in range(40)]

        with httpx.Client(base_url=server.url, timeout=20) as client:
            bad = client.post("/predict", json={"text": "x", "priority": "urgent"})
            assert bad.status_code == 422
            job = client.post("/jobs", json={"text": "later"})
            assert job.status_code == 202
            job_id = job.json()["id"]
            deadline = time.monotonic() + 10
            while not (state := client.get(f"/jobs/{job_id}").json())["done"]:
                assert time.monotonic() < deadline, state
                time.sleep(0.05)
            assert state == {"id": job_id, "done": True, "result": {"text": "later"}}
            # A typo must not poll forever: ids that are not ids, or that the queue does
            # not know, are 404.
            for unknown in ("not-an-id", "0" * 32, job_id.upper()):
                missing = client.get(f"/jobs/{unknown}")
                assert missing.status_code == 404, (unknown, missing.text)
                assert "no job" in missing.json()["detail"]
        # The lifespan closes the producer: a clean shutdown on SIGTERM (uvicorn then
        # re-raises the signal, hence -SIGTERM).
        assert server.stop() in (0, -signal.SIGTERM)
        assert "Application shutdown complete" in server.output()
        assert "Traceback" not in server.output()
    finally:
        server.close()


def test_flask_example(shared_redis, queue, start_consumer):
    start_consumer(shared_redis.url, queue, "--model", "consumer.models:synthetic")
    server = flask_server(shared_redis.url, queue)
    try:
        with httpx.Client(base_url=server.url, timeout=20) as client:
            def predict(i: int) -> httpx.Response:
                return client.post("/predict", json={"text": f"f{i}"})

            with ThreadPoolExecutor(16) as pool:
                responses = list(pool.map(predict, range(32)))
            assert [r.status_code for r in responses] == [200] * 32
            assert [r.json()["result"] for r in responses] == [{"text": f"f{i}"}
                                                               for i in range(32)]
            many = client.post("/predict_many", json={"texts": [f"m{i}" for i in range(25)]})
            assert many.status_code == 200
            assert many.json()["results"] == [{"text": f"m{i}"} for i in range(25)]
            bad = client.post("/predict", json={"text": "x", "priority": "urgent"})
            assert bad.status_code == 422
            assert "priority" in bad.json()["error"]
            too_many = client.post("/predict_many", json={"texts": ["t"] * 10_001})
            assert too_many.status_code == 413
            assert "10000" in too_many.json()["error"]
        assert "Traceback" not in server.output()
    finally:
        server.close()


def test_flask_example_answers_json_when_the_queue_is_full(shared_redis, queue):
    configure(shared_redis.url, queue, max_queue_size=3)  # and no consumer: it fills up
    server = flask_server(shared_redis.url, queue)
    try:
        with httpx.Client(base_url=server.url, timeout=20) as client:
            many = client.post("/predict_many", json={"texts": ["a", "b", "c", "d"]})
            assert many.status_code == 429, many.text
            assert many.json() == {"error": "busy, retry later"}
            assert int(many.headers["Retry-After"]) >= 1
            assert queue_stats(shared_redis.client(), queue).depth["normal"] == 0  # atomic
        assert "Traceback" not in server.output()
    finally:
        server.close()
