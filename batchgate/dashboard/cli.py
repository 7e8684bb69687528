"""`batchgate dashboard`: serve the dashboard (batchgate/dashboard/app.py) with uvicorn.
FastAPI and uvicorn are imported only when it runs."""

from __future__ import annotations

import click

from scheduler_core.compat import connect_checked
from scheduler_core.keys import validate_queue_name
from scheduler_core.ops.options import FloatRange, env_option, redis_url_option
from scheduler_core.registry import DEFAULT_MAX_QUEUES


@click.command("dashboard")
@redis_url_option
@env_option("--queue", "queues", envvar="BATCHGATE_QUEUE", multiple=True,
            help="Show only this queue (repeat for more) [default: the most active queues "
                 "found, up to --max-queues].")
@env_option("--host", envvar="BATCHGATE_DASHBOARD_HOST", default="127.0.0.1",
            show_default=True, help="Address to listen on (0.0.0.0 in a container).")
@env_option("--port", envvar="BATCHGATE_DASHBOARD_PORT", type=click.IntRange(0, 65535),
            default=8050, show_default=True, help="Port to listen on.")
@env_option("--token", envvar="BATCHGATE_DASHBOARD_TOKEN", default=None,
            help="Allow the actions (policy change, dead-letter retry and purge) to a page "
                 "that sends this token (Authorization: Bearer TOKEN) [default: none: "
                 "read-only].")
@env_option("--root-path", envvar="BATCHGATE_DASHBOARD_ROOT_PATH", default="",
            help="Path prefix the dashboard is served under by a proxy that does not strip "
                 "it, e.g. /batchgate (X-Forwarded-Prefix does the same per request) "
                 "[default: none].")
@click.option("--interval", type=FloatRange(0.1, 60), default=0.5, show_default=True,
              help="Seconds between updates of the page, 0.1-60.")
@click.option("--access-log/--no-access-log", default=False, show_default=True,
              help="Log one line per HTTP request.")
@env_option("--max-queues", envvar="BATCHGATE_DASHBOARD_MAX_QUEUES",
            default=DEFAULT_MAX_QUEUES, show_default=True, type=click.IntRange(1, 10_000),
            help="Most queues shown without --queue: the most active (requests waiting or "
                 "running, then consumers, then last seen); the page counts the others.")
def dashboard_command(redis_url: str, queues: tuple[str, ...], host: str, port: int,
                      token: str | None, root_path: str, interval: float,
                      access_log: bool, max_queues: int) -> None:
    """Serve a live web page of every queue (depth, rates, latencies, batch sizes,
    consumers, dead letters, failures). Read-only unless --token is given."""
    try:
        import uvicorn

        from batchgate.dashboard.app import create_app
    except ImportError as exc:
        raise click.ClickException("batchgate dashboard needs FastAPI and uvicorn: pip "
                                   "install 'batchgate[dashboard]'") from exc
    if token is not None and len(token) < 8:
        raise click.UsageError("--token: use at least 8 characters")
    if root_path and (not root_path.startswith("/") or root_path.endswith("/")):
        raise click.UsageError(f"--root-path {root_path!r}: start with '/', no trailing '/'")
    for queue in queues:
        validate_queue_name(queue, "--queue")
    client = connect_checked(redis_url)
    app = create_app(client, token=token, interval_s=interval, only=list(queues) or None,
                     root_path=root_path, max_queues=max_queues)
    click.echo(f"batchgate dashboard on http://{host}:{port}{root_path}/ "
               f"({'actions allowed with the token' if token else 'read-only'})", err=True)
    uvicorn.run(app, host=host, port=port, access_log=access_log, log_level="warning")
