"""The web-app examples, run as a user runs them: a real server process on a free port, real
HTTP requests, real `batchgate consumer` processes and a private redis-server."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from helpers.processes import free_port
from helpers.servers import ServerProcess


def app_env(redis_url: str, queue: str) -> dict[str, str]:
    return {"BATCHGATE_REDIS_URL": redis_url, "BATCHGATE_QUEUE": queue}


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
        # The lifespan closes the producer: a clean shutdown on SIGTERM (uvicorn then
        # re-raises the signal, hence -SIGTERM).
        assert server.stop() in (0, -signal.SIGTERM)
        assert "Application shutdown complete" in server.output()
        assert "Traceback" not in server.output()
    finally:
        server.close()


def test_flask_example(shared_redis, queue, start_consumer):
    start_consumer(shared_redis.url, queue, "--model", "consumer.models:synthetic")
    port = free_port()
    server = ServerProcess([sys.executable, "-m", "flask", "--app", "examples/flask_app.py",
                            "run", "--port", str(port)], port,
                           env=app_env(shared_redis.url, queue))
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
        assert "Traceback" not in server.output()
    finally:
        server.close()
