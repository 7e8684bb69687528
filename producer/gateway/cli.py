"""`batchgate gateway`: serve the HTTP gateway (producer.gateway.app) with uvicorn.

Imports FastAPI and uvicorn only when run, so `batchgate --help` works without them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os

import click
import redis

from producer.gateway.guard import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_REQUEST_TIMEOUT_S,
    REQUEST_TIMEOUT_ENV,
)
from scheduler_core.compat import connect_checked
from scheduler_core.lifetime import mark_parent
from scheduler_core.ops.options import FloatRange, redis_url_option, wait_replicas_options

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
PROTOCOL = "producer.gateway.protocol:HeaderTimeoutProtocol"


@click.command("gateway")
@redis_url_option
@click.option("--queue", "queues", envvar="BATCHGATE_QUEUE", multiple=True,
              default=("default",), show_default=True,
              help="Queue to serve (1-128 of A-Z a-z 0-9 _ . : -); repeat for several: the "
                   "first is served on /v1/requests, each on /v1/queues/QUEUE/requests and "
                   "as a model of the OpenAI and OIP routes. A glob pattern (`llm-*`, `*`) "
                   "is every queue registered when the gateway starts that it matches. "
                   "Env: BATCHGATE_QUEUE (names separated by spaces).")
@click.option("--host", envvar="BATCHGATE_GATEWAY_HOST", default=DEFAULT_HOST,
              show_default=True,
              help="Address to listen on (0.0.0.0 in a container). Env: BATCHGATE_GATEWAY_HOST.")
@click.option("--port", envvar="BATCHGATE_GATEWAY_PORT", type=click.IntRange(0, 65535),
              default=DEFAULT_PORT, show_default=True,
              help="Port to listen on. Env: BATCHGATE_GATEWAY_PORT.")
@click.option("--token", envvar="BATCHGATE_GATEWAY_TOKEN", default=None,
              help="Require `Authorization: Bearer TOKEN` on /v1/* (not on /healthz and "
                   "/metrics), checked before the body is read. Env: "
                   "BATCHGATE_GATEWAY_TOKEN [default: no auth].")
@click.option("--max-body-bytes", envvar="BATCHGATE_GATEWAY_MAX_BODY_BYTES",
              type=click.IntRange(1024, 1 << 30), default=DEFAULT_MAX_BODY_BYTES,
              show_default=True,
              help="Largest request body, in bytes: a larger one is "
                   "answered 413 as soon as it is known (Content-Length) or crosses the "
                   "limit (chunked), and its connection closed. The default is twice the "
                   "1 MiB payload limit plus 64 KiB. Env: BATCHGATE_GATEWAY_MAX_BODY_BYTES.")
@click.option("--request-timeout-s", envvar=REQUEST_TIMEOUT_ENV,
              type=FloatRange(0.1, 3600), default=DEFAULT_REQUEST_TIMEOUT_S,
              show_default=True,
              help="Seconds a client has to send a request's headers (from "
                   "connecting, or from their first byte on a kept-alive connection) and "
                   "again its body (from the headers); past either the request is "
                   "answered 408 and its connection closed. Env: "
                   "BATCHGATE_GATEWAY_REQUEST_TIMEOUT_S.")
@click.option("--access-log/--no-access-log", default=True, show_default=True,
              help="Log one line per HTTP request.")
@click.option("--workers", envvar="BATCHGATE_GATEWAY_WORKERS", type=click.IntRange(1, 64),
              default=1, show_default=True,
              help="Serve from this many processes (uvicorn workers) sharing the port, each "
                   "with its own AsyncProducer. Env: BATCHGATE_GATEWAY_WORKERS.")
@wait_replicas_options("Accept a submitted request (202, or 200 with wait)")
def gateway_command(redis_url: str, queues: tuple[str, ...], host: str, port: int,
                    token: str | None,
                    max_body_bytes: int, request_timeout_s: float, access_log: bool,
                    workers: int, wait_replicas: int, wait_timeout_ms: int) -> None:
    """Serve an HTTP API for QUEUE (or several): submit, fetch a result, cancel, stats, health and
    Prometheus /metrics; OpenAI-compatible and Open Inference Protocol v2 routes. OpenAPI
    spec at /openapi.json, interactive docs at /docs."""
    try:
        import uvicorn

        from producer.gateway.app import WORKER_ENV, create_app
    except ImportError as exc:
        raise click.ClickException(
            f"{exc}: the gateway needs its extra: pip install 'batchgate[gateway]'") from None
    # Fail now on a Redis too old; an unreachable one may come up later (see /healthz).
    with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):
        connect_checked(redis_url).close()
    queue_list = resolve_queues(redis_url, queues)
    queue = ",".join(queue_list)  # as the worker processes read it (app_from_env)
    app = create_app(redis_url, queue_list, token=token or None, max_body_bytes=max_body_bytes,
                     request_timeout_s=request_timeout_s, wait_replicas=wait_replicas,
                     wait_timeout_ms=wait_timeout_ms, tune_gc=True)  # validates first
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
    # uvloop (part of the gateway extra) where it installs; HTTP parsing is httptools'
    # (PROTOCOL builds on uvicorn's httptools protocol).
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    click.echo(f"batchgate gateway for queue {', '.join(map(repr, queue_list))} on "
               f"http://{host}:{port} "
               f"(auth: {'bearer token' if token else 'none'}, workers: {workers}, "
               f"loop: {loop})", err=True)
    options = {"host": host, "port": port, "access_log": access_log, "http": PROTOCOL,
               "loop": loop,
               "log_level": level if level in ("debug", "info", "warning", "error") else "info"}
    # The protocol (slow headers) reads its timeout here, in every process.
    os.environ[REQUEST_TIMEOUT_ENV] = repr(request_timeout_s)
    if workers == 1:
        uvicorn.run(app, **options)
        return
    # Each worker process builds its own app (and AsyncProducer) from these variables, and
    # dies with this process (app_from_env), as multiprocessing's resource tracker then
    # does (its pipe closes).
    mark_parent()
    os.environ.update({WORKER_ENV["redis_url"]: redis_url, WORKER_ENV["queue"]: queue,
                       WORKER_ENV["token"]: token or "",
                       WORKER_ENV["max_body_bytes"]: str(max_body_bytes),
                       WORKER_ENV["request_timeout_s"]: repr(request_timeout_s),
                       WORKER_ENV["wait_replicas"]: str(wait_replicas),
                       WORKER_ENV["wait_timeout_ms"]: str(wait_timeout_ms)})
    uvicorn.run("producer.gateway.app:app_from_env", factory=True, workers=workers, **options)


def resolve_queues(redis_url: str, names: tuple[str, ...]) -> list[str]:
    """The queues of the --queue values (queues.expand); patterns read the registry."""
    from producer.gateway.queues import PATTERN_CHARS, expand

    registered: list[str] = []
    if any(PATTERN_CHARS & set(name) for name in names):
        from scheduler_core.registry import known_queues

        try:
            client = connect_checked(redis_url)
            registered = known_queues(client, prune=False)
            client.close()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise click.ClickException(f"--queue patterns read the registered queues, and "
                                       f"Redis is unreachable: {exc}") from None
    try:
        return expand(names, registered)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--queue") from None
