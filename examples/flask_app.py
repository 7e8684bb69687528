"""A Flask (WSGI) app that sends its inference work through batchgate.

One sync Producer per process, shared by all request threads (it is thread-safe; one
listener thread receives every result). Under gunicorn, build the app per worker
(`gunicorn 'flask_app:create_app()'`) so that each worker process has its own Producer.

    batchgate consumer --model consumer.models:synthetic &
    BATCHGATE_REDIS_URL=redis://127.0.0.1:6379/0 flask --app examples/flask_app.py run
    curl -s localhost:5000/predict -H 'content-type: application/json' -d '{"text": "hi"}'
"""

from __future__ import annotations

import atexit
import os
from typing import Any

from flask import Flask, jsonify, request

from producer import DeadlineExceeded, Producer, QueueFull, RequestFailed


def create_app(redis_url: str | None = None, queue: str | None = None) -> Flask:
    app = Flask(__name__)
    producer = Producer(redis_url or os.environ.get("BATCHGATE_REDIS_URL",
                                                    "redis://127.0.0.1:6379/0"),
                        queue or os.environ.get("BATCHGATE_QUEUE", "default"))
    atexit.register(producer.close)

    @app.post("/predict")
    def predict() -> Any:
        body = request.get_json(silent=True)
        if not isinstance(body, dict) or not isinstance(body.get("text"), str):
            return jsonify(error='send {"text": "..."}'), 422
        try:
            handle = producer.submit({"text": body["text"]},
                                     priority=body.get("priority", "high"), deadline_ms=5_000)
            return jsonify(id=handle.id, result=handle.result(timeout=10))
        except ValueError as exc:  # InvalidRequest, e.g. an unknown priority
            return jsonify(error=str(exc)), 422
        except QueueFull:
            return jsonify(error="busy, retry later"), 429, {"Retry-After": "1"}
        except (DeadlineExceeded, TimeoutError):
            return jsonify(error="no result in time"), 504
        except RequestFailed as exc:
            return jsonify(error=str(exc)), 502

    @app.post("/predict_many")
    def predict_many() -> Any:
        """Several texts in one atomic enqueue; consumers batch them together."""
        texts = (request.get_json(silent=True) or {}).get("texts")
        if not isinstance(texts, list) or not texts:
            return jsonify(error='send {"texts": ["...", ...]}'), 422
        handles = producer.submit_many([{"text": t} for t in texts], priority="normal")
        return jsonify(results=[h.result(timeout=10) for h in handles])

    return app


app = create_app()  # `flask --app examples/flask_app.py run` finds it

if __name__ == "__main__":
    app.run(host="127.0.0.1", port=int(os.environ.get("PORT", "5000")), threaded=True)
