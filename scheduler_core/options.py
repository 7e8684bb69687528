"""Click options shared by every `batchgate` subcommand that talks to a queue."""

from __future__ import annotations

from typing import Any

import click

from scheduler_core.connection import DEFAULT_REDIS_URL
from scheduler_core.policy import LIMITS, Strategy

redis_url_option = click.option(
    "--redis-url", envvar="BATCHGATE_REDIS_URL", default=DEFAULT_REDIS_URL, show_default=True,
    help="Redis to use (redis://, rediss:// for TLS, unix://). Env: BATCHGATE_REDIS_URL.")
queue_option = click.option(
    "--queue", envvar="BATCHGATE_QUEUE", default="default", show_default=True,
    help="Queue name. Env: BATCHGATE_QUEUE.")


def policy_options(func: Any) -> Any:
    """--strategy and the policy knobs; unset ones stay None (= keep stored/default)."""
    knobs = [
        click.option("--strategy", type=click.Choice([s.value for s in Strategy]),
                     help="Scheduling strategy [default: priority]."),
        click.option("--max-batch-size", type=int,
                     help="Most requests per batch [default: 32; fifo: 1]."),
        click.option("--max-queue-delay-ms", type=int,
                     help="dynamic/priority: longest a partial batch waits, ms [default: 50]."),
        click.option("--aging-ms", type=int,
                     help="priority: wait that promotes a request one level, ms; 0 = off "
                          "[default: 5000]."),
        click.option("--max-queue-size", type=int,
                     help="Pending requests before enqueue fails with QueueFull; 0 = "
                          "unbounded [default: 0]."),
        click.option("--max-attempts", type=int,
                     help="Deliveries before a request is dead-lettered [default: 3]."),
        click.option("--result-ttl-s", type=int,
                     help="Seconds results stay fetchable by id [default: 600]."),
    ]
    for option in reversed(knobs):
        func = option(func)
    return func


def policy_values(kwargs: dict[str, Any]) -> dict[str, Any]:
    names = ["strategy", *LIMITS]
    return {name: kwargs.pop(name, None) for name in names}
