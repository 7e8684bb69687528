"""`batchgate gateway`: serve the HTTP gateway (producer.gateway.app) with uvicorn.

Imports FastAPI and uvicorn only when run, so `batchgate --help` works without them.
"""

from __future__ import annotations

import contextlib
import logging
import os

import click
import redis

from scheduler_core.compat import connect_checked
from scheduler_core.options import queue_option, redis_url_option

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


@click.command("gateway")
@redis_url_option
@queue_option
@click.option("--host", envvar="BATCHGATE_GATEWAY_HOST", default=DEFAULT_HOST,
              show_default=True,
              help="Address to listen on (0.0.0.0 in a container). Env: BATCHGATE_GATEWAY_HOST.")
@click.option("--port", envvar="BATCHGATE_GATEWAY_PORT", type=click.IntRange(0, 65535),
              default=DEFAULT_PORT, show_default=True,
              help="Port to listen on. Env: BATCHGATE_GATEWAY_PORT.")
@click.option("--token", envvar="BATCHGATE_GATEWAY_TOKEN", default=None,
              help="Require `Authorization: Bearer TOKEN` on /v1/* (not on /healthz and "
                   "/metrics). Env: BATCHGATE_GATEWAY_TOKEN [default: no auth].")
@click.option("--access-log/--no-access-log", default=True, show_default=True,
              help="Log one line per HTTP request.")
@click.option("--workers", envvar="BATCHGATE_GATEWAY_WORKERS", type=click.IntRange(1, 64),
              default=1, show_default=True,
              help="Serve from this many processes (uvicorn workers) sharing the port, each "
                   "with its own AsyncProducer. Env: BATCHGATE_GATEWAY_WORKERS.")
def gateway_command(redis_url: str, queue: str, host: str, port: int, token: str | None,
                    access_log: bool, workers: int) -> None:
    """Serve an HTTP API for QUEUE: submit, fetch a result, cancel, stats, health and
    Prometheus /metrics. OpenAPI spec at /openapi.json, interactive docs at /docs."""
    try:
        import uvicorn

        from producer.gateway.app import WORKER_ENV, create_app
    except ImportError as exc:
        raise click.ClickException(
            f"{exc}: the gateway needs its extra: pip install 'batchgate[gateway]'") from None
    # Fail now on a Redis too old; an unreachable one may come up later (see /healthz).
    with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):
        connect_checked(redis_url).close()
    app = create_app(redis_url, queue, token=token or None)  # validates before serving
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
    click.echo(f"batchgate gateway for queue {queue!r} on http://{host}:{port} "
               f"(auth: {'bearer token' if token else 'none'}, workers: {workers})", err=True)
    options = {"host": host, "port": port, "access_log": access_log,
               "log_level": level if level in ("debug", "info", "warning", "error") else "info"}
    if workers == 1:
        uvicorn.run(app, **options)
        return
    # Each worker process builds its own app (and AsyncProducer) from these variables.
    os.environ.update({WORKER_ENV["redis_url"]: redis_url, WORKER_ENV["queue"]: queue,
                       WORKER_ENV["token"]: token or ""})
    uvicorn.run("producer.gateway.app:app_from_env", factory=True, workers=workers, **options)
