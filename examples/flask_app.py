"""A Flask (WSGI) app that sends its inference work through batchgate.

One sync Producer per process, shared by all request threads (it is thread-safe; one
listener thread receives every result). Errors come back as JSON: 422 bad input, 413 more
than 10,000 texts, 429 queue full (with Retry-After), 504 no result in time, 502 the
model failed. Under gunicorn, build the app per worker
(`gunicorn 'flask_app:create_app()'`) so that each worker process has its own Producer.

    batchgate consumer --model consumer.models:synthetic &
    BATCHGATE_REDIS_URL=redis://127.0.0.1:6379/0 flask --app examples/flask_app.py run
    curl -s localhost:5000/predict -H 'content-type: application/json' -d '{"text": "hi"}'
"""

from __future__ import annotations

import atexit
import math
import os
from collections.abc import Callable
from typing import Any

from flask import Flask, jsonify, request

from producer import DeadlineExceeded, InvalidRequest, Producer, QueueFull, RequestFailed


def create_app(redis_url: str | None = None, queue: str | None = None) -> Flask:
    app = Flask(__name__)
    producer = Producer(redis_url or os.environ.get("BATCHGATE_REDIS_URL",
                                                    "redis://127.0.0.1:6379/0"),
                        queue or os.environ.get("BATCHGATE_QUEUE", "default"))
    atexit.register(producer.close)

    def answer(work: Callable[[], dict[str, Any]]) -> Any:
        """batchgate's errors as JSON, with the statuses a client can act on."""
        try:
            return jsonify(work())
        except InvalidRequest as exc:  # e.g. an unknown priority; field "payloads": too
            # many texts for one atomic enqueue (10,000)
            return jsonify(error=str(exc)), 413 if exc.field == "payloads" else 422
        except QueueFull as exc:
            retry = max(1, math.ceil(exc.retry_after_s or 1))
            return jsonify(error="busy, retry later"), 429, {"Retry-After": str(retry)}
        except (DeadlineExceeded, TimeoutError):
            return jsonify(error="no result in time"), 504
        except RequestFailed as exc:
            return jsonify(error=str(exc)), 502

    @app.post("/predict")
    def predict() -> Any:
        body = request.get_json(silent=True)
        if not isinstance(body, dict) or not isinstance(body.get("text"), str):
            return jsonify(error='send {"text": "..."}'), 422

        def work() -> dict[str, Any]:
            handle = producer.submit({"text": body["text"]},
                                     priority=body.get("priority", "high"), deadline_ms=5_000)
            return {"id": handle.id, "result": handle.result(timeout=10)}
        return answer(work)

    @app.post("/predict_many")
    def predict_many() -> Any:
        """Several texts in one atomic enqueue; consumers batch them together."""
        body = request.get_json(silent=True)
        texts = body.get("texts") if isinstance(body, dict) else None
        if not isinstance(texts, list) or not texts:
            return jsonify(error='send {"texts": ["...", ...]}'), 422

        def work() -> dict[str, Any]:
            handles = producer.submit_many([{"text": t} for t in texts], priority="normal")
            return {"results": [h.result(timeout=10) for h in handles]}
        return answer(work)

    return app


app = create_app()  # `flask --app examples/flask_app.py run` finds it

if __name__ == "__main__":
    app.run(host="127.0.0.1", port=int(os.environ.get("PORT", "5000")), threaded=True)
