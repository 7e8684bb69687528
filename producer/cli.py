"""`batchgate submit`: enqueue one request from the shell."""

from __future__ import annotations

import click
import orjson

from producer.sharded import ShardedProducer
from scheduler_core.errors import InvalidRequest, RequestFailed
from scheduler_core.ops.options import queue_option, redis_url_option, wait_replicas_options


@click.command("submit")
@redis_url_option
@queue_option
@click.option("--priority", default="normal", show_default=True,
              type=click.Choice(["high", "normal", "low"], case_sensitive=False),
              help="high: served at once; normal: may wait to fill a batch; low: runs when "
                   "nothing else waits.")
@click.option("--deadline-ms", type=int, default=None,
              help="Do not run the request after this many ms, 1-86400000 [default: no "
                   "deadline].")
@click.option("--idempotency-key", default=None,
              help="Resubmitting with the same key returns the first request's id.")
@click.option("--cost", type=int, default=1, show_default=True,
              help="The request's cost, 1-1000000000, in the queue's unit (tokens, length): "
                   "what max_cost, max_batch_cost and cost_buckets count.")
@click.option("--tenant", default=None,
              help="Who the request is for, 1-64 characters from letters, digits, '_', '.', "
                   "':' and '-': the queue's tenant quotas apply (docs/tenants.md) "
                   "[default: the default tenant].")
@click.option("--wait/--no-wait", default=False, show_default=True,
              help="Wait for the result and print it as JSON.")
@click.option("--timeout", type=float, default=30.0, show_default=True,
              help="With --wait: seconds to wait for the result.")
@wait_replicas_options("Accept the request")
@click.argument("payload")
def submit_command(redis_url: str, queue: str, priority: str, deadline_ms: int | None,
                   idempotency_key: str | None, cost: int, tenant: str | None, wait: bool,
                   timeout: float,
                   wait_replicas: int, wait_timeout_ms: int, payload: str) -> None:
    """Enqueue PAYLOAD (a JSON value); print its id, or with --wait its result.

    On a sharded queue (docs/scaling.md) the request goes to the shard with the fewest
    waiting requests (or, with --idempotency-key, to its key's shard); `batchgate result
    ID` finds it in any shard."""
    try:
        value = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest("payload", f"is not valid JSON: {exc}") from None
    # least_depth: one request per process, so round robin would always pick shard 0.
    with ShardedProducer(redis_url, queue, placement="least_depth",
                         wait_replicas=wait_replicas,
                         wait_timeout_ms=wait_timeout_ms) as producer:
        handle = producer.submit(value, priority=priority, deadline_ms=deadline_ms,
                                 idempotency_key=idempotency_key, cost=cost,
                                 store_result=not wait,  # its id is printed: fetchable
                                 tenant=tenant)
        if not wait:
            click.echo(handle.id)
            return
        try:
            result = handle.result(timeout=timeout)
        except TimeoutError as exc:
            raise click.ClickException(f"{exc} (request {handle.id} stays queued)") from None
        except RequestFailed as exc:
            raise click.ClickException(str(exc)) from None
        click.echo(orjson.dumps(result).decode())
