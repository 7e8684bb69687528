"""The `batchgate` command. Subcommands live next to what they drive and load lazily, so
`batchgate submit` on a web host never imports the consumer (or torch)."""

from __future__ import annotations

import importlib
import logging
import sys
import time
from typing import Any

import click
import orjson
import redis

from scheduler_core import __version__
from scheduler_core.compat import connect_checked
from scheduler_core.errors import BatchgateError, InvalidRequest
from scheduler_core.ops.options import (
    FloatRange,
    env_option,
    policy_options,
    policy_values,
    queue_option,
    redis_url_option,
)
from scheduler_core.policy import Policy

LAZY_COMMANDS = {
    "consumer": "consumer.cli:consumer_command",
    "submit": "producer.cli:submit_command",
    "demo": "batchgate.demo:demo_command",
    "bulk": "producer.bulk.cli:bulk_group",
    "dead-letter": "batchgate.deadletter_cli:dead_letter_group",
    "gateway": "producer.gateway.cli:gateway_command",
    "simulate": "batchgate.simulate:simulate_command",
    "profile": "batchgate.profile_model:profile_command",
    "plan": "batchgate.plan:plan_command",
    "exporter": "batchgate.exporter:exporter_command",
    "top": "batchgate.top:top_command",
    "dashboard": "batchgate.dashboard.cli:dashboard_command",
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
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise click.ClickException(f"cannot reach Redis: {exc}") from None


@click.group(cls=LazyGroup)
@click.version_option(__version__, prog_name="batchgate")
@env_option("--log-level", envvar="BATCHGATE_LOG_LEVEL", default="INFO", show_default=True,
            type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
            help="Log messages of this level and above, to stderr.")
def main(log_level: str) -> None:
    """batchgate: a Redis-backed request scheduler for model inference."""
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@main.command("bench", hidden=True,
              context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
def bench_moved() -> None:
    """Not installed: the developer benchmark runs from a checkout as `python -m
    bench.run` (docs/benchmarks.md). Says so and exits 2."""
    click.echo(
        "Error: `batchgate bench` (batchgate against RQ and raw Redis on synthetic models, a "
        "developer benchmark) is not installed with the package: from a checkout, run "
        "`python -m bench.run` (docs/benchmarks.md). To time your own model: "
        "`batchgate profile --model MODULE:ATTR`.", err=True)
    sys.exit(2)


@main.command("stats")
@redis_url_option
@queue_option
@click.option("--slo-p99-ms", type=FloatRange(0, 86_400_000, min_open=True),
              default=None,
              help="Target p99 latency, ms, for recommended_consumers [default: the "
                   "policy's slo_p99_ms].")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def stats_command(redis_url: str, queue: str, slo_p99_ms: float | None, as_json: bool) -> None:
    """Depth per priority, in-flight, consumers alive, throughput counters, latencies, and
    recommended_consumers (the planner's count for the measured arrival rate)."""
    from scheduler_core.ops.scaling import scaling_signal
    from scheduler_core.ops.stats import queue_stats

    client = connect_checked(redis_url)
    stats = queue_stats(client, queue).to_dict()
    stats.update(scaling_signal(client, queue, slo_p99_ms))
    if as_json:
        click.echo(orjson.dumps(stats, option=orjson.OPT_INDENT_2).decode())
        return
    from batchgate.present import stats_table

    click.echo("\n".join(stats_table(stats)))


@main.group("policy")
def policy_group() -> None:
    """Show or change a queue's scheduling policy (shared by all its consumers)."""


def _print_policy(policy: Policy) -> None:
    click.echo(orjson.dumps(policy.to_dict(), option=orjson.OPT_INDENT_2).decode())


@policy_group.command("show")
@redis_url_option
@queue_option
def policy_show(redis_url: str, queue: str) -> None:
    """Print the queue's stored policy as JSON (numbers as numbers, as `stats --json`)."""
    from scheduler_core.admin import read_policy

    policy = read_policy(connect_checked(redis_url), queue)
    if policy is None:
        raise click.ClickException(f"queue {queue!r} has no policy yet (no consumer started)")
    _print_policy(policy)


@policy_group.command("set")
@redis_url_option
@queue_option
@policy_options
def policy_set(redis_url: str, queue: str, **kwargs: Any) -> None:
    """Replace the policy: given values override the stored ones. Consumers apply it from
    their next batch on. Switching --strategy without --max-batch-size also resets
    max_batch_size to the new strategy's default (fifo: 1, others: 32)."""
    from scheduler_core.admin import change_policy

    values = {k: v for k, v in policy_values(kwargs).items() if v is not None}
    current, stored = change_policy(connect_checked(redis_url), queue, values)
    if current is not None and stored.max_batch_size != current.max_batch_size \
            and "max_batch_size" not in values:
        click.echo(f"max_batch_size: {current.max_batch_size} -> {stored.max_batch_size}, "
                   f"the default of {stored.strategy} (give --max-batch-size to choose)",
                   err=True)
    _print_policy(stored)


class NotFound(click.ClickException):
    """No result to show: unknown id, not finished yet, or --wait timed out."""

    exit_code = 3


@main.command("result")
@redis_url_option
@queue_option
@click.option("--wait", is_flag=True, help="Wait until the request has a result.")
@click.option("--timeout", type=FloatRange(0, 86_400), default=30.0, show_default=True,
              help="With --wait: seconds to wait, 0-86400.")
@click.option("--json", "as_json", is_flag=True,
              help='Print the state as JSON: {"id", "status", "result" | "error"}.')
@click.argument("request_id", metavar="ID")
def result_command(redis_url: str, queue: str, wait: bool, timeout: float, as_json: bool,
                   request_id: str) -> None:
    """Print the stored result of request ID (from `submit` without --wait, the gateway,
    `dead-letter retry`, or a Producer's submit with store_result=True or an idempotency
    key), from any process, while it is kept (result_ttl_s). Other requests' results go
    only to their producer: for those, ID is unknown once they have finished.

    Exit status: 0 done (the result is printed as JSON); 1 the request failed, expired
    or was cancelled (the error goes to stderr); 2 bad usage; 3 no result: the id is
    unknown or its result expired, the request is still queued or running, or --wait
    timed out.
    """
    from scheduler_core.admin import request_state

    client = connect_checked(redis_url)
    end = time.monotonic() + timeout
    step = 0.02
    while True:
        found = request_state(client, queue, request_id)
        if found is None:
            raise NotFound(f"no request {request_id!r} in queue {queue!r} (unknown, its "
                           "result expired after result_ttl_s, or it was submitted "
                           "without store_result)")
        if found.result is not None or not wait or time.monotonic() >= end:
            break
        time.sleep(min(step, max(0.0, end - time.monotonic())))
        step = min(0.5, step * 2)  # quick for fast models, gentle on Redis for slow ones
    result = found.result
    if as_json:
        body: dict[str, Any] = {"id": found.id, "status": found.status}
        if result is not None:
            body.update({"result": result.value} if result.ok else
                        {"error": {"type": result.error_type, "message": result.message}})
        click.echo(orjson.dumps(body).decode())
    if result is None:
        raise NotFound(f"request {request_id} is {found.status}: no result "
                       + (f"within {timeout:g}s" if wait else "yet (--wait waits for it)"))
    if not result.ok:
        raise click.ClickException(f"request {request_id} {found.status}: "
                                   f"{result.error_type}: {result.message}")
    if not as_json:
        click.echo(orjson.dumps(result.value).decode())


if __name__ == "__main__":
    main()
