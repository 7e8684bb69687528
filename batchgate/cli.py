"""The `batchgate` command. Subcommands live next to what they drive and load lazily, so
`batchgate submit` on a web host never imports the consumer (or torch)."""

from __future__ import annotations

import importlib
import logging
import sys
from typing import Any

import click
import orjson

from scheduler_core.connection import connect
from scheduler_core.errors import BatchgateError, InvalidRequest
from scheduler_core.options import policy_options, policy_values, queue_option, redis_url_option
from scheduler_core.policy import Policy

LAZY_COMMANDS = {
    "consumer": "consumer.cli:consumer_command",
    "submit": "producer.cli:submit_command",
    "demo": "batchgate.demo:demo_command",
    "bench": "batchgate.bench.run:bench_command",
    "bulk": "producer.bulk.cli:bulk_group",
    "dead-letter": "batchgate.deadletter_cli:dead_letter_group",
    "gateway": "producer.gateway.cli:gateway_command",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *LAZY_COMMANDS])

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in LAZY_COMMANDS:
            module, attr = LAZY_COMMANDS[name].split(":")
            return getattr(importlib.import_module(module), attr)
        return super().get_command(ctx, name)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except InvalidRequest as exc:
            raise click.UsageError(str(exc)) from None
        except BatchgateError as exc:
            raise click.ClickException(str(exc)) from None


@click.group(cls=LazyGroup)
@click.option("--log-level", default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
def main(log_level: str) -> None:
    """batchgate: a Redis-backed request scheduler for model inference."""
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@main.command("stats")
@redis_url_option
@queue_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def stats_command(redis_url: str, queue: str, as_json: bool) -> None:
    """Depth per priority, in-flight, consumers alive, throughput counters, latencies."""
    from scheduler_core.admin import queue_stats

    stats = queue_stats(connect(redis_url), queue).to_dict()
    if as_json:
        click.echo(orjson.dumps(stats, option=orjson.OPT_INDENT_2).decode())
        return
    for key, value in stats.items():
        click.echo(f"{key:>20}: {value}")


@main.group("policy")
def policy_group() -> None:
    """Show or change a queue's scheduling policy (shared by all its consumers)."""


@policy_group.command("show")
@redis_url_option
@queue_option
def policy_show(redis_url: str, queue: str) -> None:
    from scheduler_core.admin import read_policy

    policy = read_policy(connect(redis_url), queue)
    if policy is None:
        raise click.ClickException(f"queue {queue!r} has no policy yet (no consumer started)")
    click.echo(orjson.dumps(policy.to_redis(), option=orjson.OPT_INDENT_2).decode())


@policy_group.command("set")
@redis_url_option
@queue_option
@policy_options
def policy_set(redis_url: str, queue: str, **kwargs: Any) -> None:
    """Replace the policy: given values override the stored ones. Consumers apply it from
    their next batch on."""
    from scheduler_core.admin import read_policy, store_policy

    client = connect(redis_url)
    values = {k: v for k, v in policy_values(kwargs).items() if v is not None}
    current = read_policy(client, queue)
    base = current.to_redis() if current else {}
    merged: dict[str, Any] = {k: (v if k == "strategy" else int(v)) for k, v in base.items()}
    merged.update(values)
    stored = store_policy(client, queue, Policy.build(**merged), replace=True)
    click.echo(orjson.dumps(stored.to_redis(), option=orjson.OPT_INDENT_2).decode())


if __name__ == "__main__":
    main()
