"""`batchgate dead-letter list | retry | purge`."""

from __future__ import annotations

from typing import Any

import click
import orjson

from scheduler_core.compat import connect_checked
from scheduler_core.deadletter import list_dead, purge, retry
from scheduler_core.ops.options import queue_option, redis_url_option


def _options(func: Any) -> Any:
    return redis_url_option(queue_option(func))


def _targets(ids: tuple[str, ...], all_: bool) -> list[str] | None:
    if bool(ids) == all_:
        raise click.UsageError("give request IDs or --all (not both)")
    return None if all_ else list(ids)


@click.group("dead-letter")
def dead_letter_group() -> None:
    """Inspect, retry or purge requests that were given up on (dead-lettered)."""


@dead_letter_group.command("list")
@_options
@click.option("--limit", type=click.IntRange(1, 10_000), default=50, show_default=True,
              help="Most entries to list, 1-10000.")
@click.option("--offset", type=click.IntRange(0), default=0, show_default=True,
              help="Skip this many of the oldest entries first (to page through).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def list_command(redis_url: str, queue: str, limit: int, offset: int, as_json: bool) -> None:
    """The oldest dead-lettered requests, with why they were given up on."""
    total, entries = list_dead(connect_checked(redis_url), queue, limit, offset)
    if as_json:
        click.echo(orjson.dumps({"total": total, "entries": [e.to_dict() for e in entries]},
                                option=orjson.OPT_INDENT_2).decode())
        return
    click.echo(f"{total} dead-lettered request(s) in queue {queue!r}")
    for e in entries:
        click.echo(f"{e.id}  deliveries={e.attempts}  {e.error_type}: {e.message}")
        for run in e.runs or ():  # a request whose retries ran out: each failed run
            click.echo(f"    run {run.get('attempt')}: {run.get('type')}: "
                       f"{run.get('message')}")


@dead_letter_group.command("retry")
@_options
@click.option("--all", "all_", is_flag=True, help="Retry every dead-lettered request.")
@click.argument("ids", nargs=-1)
def retry_command(redis_url: str, queue: str, all_: bool, ids: tuple[str, ...]) -> None:
    """Enqueue dead-lettered requests again (new arrival, attempts reset, no deadline);
    fetch each one's result by id with `batchgate result ID [--wait]`."""
    done, skipped = retry(connect_checked(redis_url), queue, _targets(ids, all_))
    click.echo(f"retried {done}, skipped {skipped}")


@dead_letter_group.command("purge")
@_options
@click.option("--all", "all_", is_flag=True, help="Purge every dead-lettered request.")
@click.argument("ids", nargs=-1)
def purge_command(redis_url: str, queue: str, all_: bool, ids: tuple[str, ...]) -> None:
    """Delete dead-lettered requests for good."""
    done, skipped = purge(connect_checked(redis_url), queue, _targets(ids, all_))
    click.echo(f"purged {done}, skipped {skipped}")
