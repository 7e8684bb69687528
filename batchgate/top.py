"""`batchgate top`: every queue's figures, live in the terminal (rich), like
`rq info --interval`. The figures come from scheduler_core/ops/snapshot.py, as the
dashboard's do."""

from __future__ import annotations

import signal
import threading
from typing import Any

import click

from batchgate.present import NONE, WIDTH, ago, busy_first, delay_text, ms, sparkline
from scheduler_core.compat import connect_checked
from scheduler_core.ops.options import FloatRange, env_option, redis_url_option
from scheduler_core.ops.snapshot import Rates, snapshot_all
from scheduler_core.registry import DEFAULT_MAX_QUEUES, QueueFinder

TEXT_COLUMNS = {"strategy", "delay in use", "batch sizes (newest 1,000)", "consumer", "host",
                "device", "batch"}
QUEUE_WIDTH = 20


def _count(value: int) -> str:
    return f"{value:,}"


def _rate(rates: dict[str, Any] | None, name: str) -> str:
    return NONE if not rates else f"{rates[name]:.1f}"


def _table(queue_width: int, *columns: str) -> Any:
    from rich.table import Table

    table = Table(box=None, padding=(0, 1), header_style="bold", pad_edge=False)
    table.add_column("queue", no_wrap=True, overflow="ellipsis", min_width=queue_width,
                     max_width=QUEUE_WIDTH)
    for name in columns:
        table.add_column(name, justify="left" if name in TEXT_COLUMNS else "right",
                         no_wrap=True, overflow="ellipsis")
    return table


def render(snaps: list[dict[str, Any]], height: int | None = None) -> Any:
    """A rich renderable of the snapshots, busy queues first: one row per queue (figures),
    one per queue (policy, delay in use, batch sizes), then the consumers and the newest
    failures as far as `height` lines allow (None: all of them)."""
    from rich.console import Group
    from rich.text import Text

    if not snaps:
        return Text("no queues registered yet (a consumer, a producer's first submit or "
                    "`batchgate policy set` registers one)")
    snaps = busy_first(snaps)
    names = min(QUEUE_WIDTH, max(len(s["queue"]) for s in snaps))
    figures = _table(names, "waiting h/n/l", "in flight", "arrived/s", "done/s",
                     "wait p99", "e2e p99", "consumers", "dead")
    policies = _table(names, "strategy", "max batch", "delay in use",
                      "batch sizes (newest 1,000)")
    for s in snaps:
        depth = s["depth"]
        figures.add_row(s["queue"], f"{depth['high']}/{depth['normal']}/{depth['low']}",
                        _count(s["in_flight_requests"]), _rate(s["rates"], "arrived_per_s"),
                        _rate(s["rates"], "completed_per_s"), ms(s["queue_wait_ms"]["p99"]),
                        ms(s["end_to_end_ms"]["p99"]), _count(s["consumers_alive"]),
                        _count(s["dead_letters"]))
        policy = s["policy"] or {}
        policies.add_row(s["queue"], str(policy.get("strategy", "no policy")),
                         str(policy.get("max_batch_size", NONE)), delay_text(s),
                         sparkline(s["batch_sizes"]))
    parts: list[Any] = [figures, Text(""), policies]
    used = 2 * (len(snaps) + 1) + 1
    rows = [(s["queue"], c) for s in snaps for c in s["consumers"]]
    room = len(rows) if height is None else height - used - 2  # a blank line, the header
    shown = rows if len(rows) <= room else rows[:max(0, room - 1)]  # and "... more"
    if shown:
        consumers = _table(names, "consumer", "host", "device", "heartbeat", "batch",
                           "batches/s")
        for queue, c in shown:
            per_s = c.get("batches_per_s")
            consumers.add_row(queue, c["name"], c["host"], c["device"] or NONE,
                              ago(c["heartbeat_age_s"]), c["batch"] or "idle",
                              NONE if per_s is None else f"{per_s:.1f}")
        parts += [Text(""), consumers]
        used += 2 + len(shown)
    if len(shown) < len(rows):
        parts.append(Text(f"... and {len(rows) - len(shown)} more consumers (a taller "
                          "terminal lists them)", style="dim"))
        used += 1
    failures = sorted(((f.get("at_ms", 0), s["queue"], f) for s in snaps
                       for f in s["recent_failures"][:3]), key=lambda x: x[0], reverse=True)
    room = 3 if height is None else min(3, height - used - 1)
    if failures and room > 0:
        parts.append(Text(""))
        for _, queue, f in failures[:room]:
            parts.append(Text(f"failed {queue} {f.get('id')}: {f.get('type')}: "
                              f"{f.get('message')}", style="red", no_wrap=True,
                              overflow="ellipsis"))
    return Group(*parts)


@click.command("top")
@redis_url_option
@env_option("--queue", "queues", envvar="BATCHGATE_QUEUE", multiple=True,
            help="Show only this queue (repeat for more) [default: the most active queues "
                 "found, up to --max-queues].")
@click.option("--interval", type=FloatRange(0.1, 3600), default=1.0, show_default=True,
              help="Seconds between refreshes, 0.1-3600.")
@click.option("--iterations", type=click.IntRange(1), default=None,
              help="Print this many refreshes, one after another, then exit [default: run "
                   "until Ctrl-C].")
@click.option("--once", is_flag=True, help="Print one refresh and exit (--iterations 1).")
@click.option("--max-queues", type=click.IntRange(1, 10_000), default=DEFAULT_MAX_QUEUES,
              show_default=True, help="Most queues shown without --queue: the most active "
                                      "(requests waiting or running, then consumers).")
def top_command(redis_url: str, queues: tuple[str, ...], interval: float,
                iterations: int | None, once: bool, max_queues: int) -> None:
    """Every queue's depth, rates, latencies, batch sizes and consumers, refreshed in place
    until Ctrl-C. Rates need two refreshes: the first shows "-"."""
    try:
        from rich.console import Console
        from rich.live import Live
    except ImportError as exc:
        raise click.ClickException("batchgate top needs rich: pip install "
                                   "'batchgate[dashboard]'") from exc
    client = connect_checked(redis_url)
    rates = Rates()
    only = list(queues) or None
    finder = QueueFinder(client)

    console = Console()
    if not console.is_terminal:  # to a file or a pipe: as wide as a terminal's WIDTH
        console = Console(width=max(WIDTH, console.width))

    def frame() -> Any:  # in place: as many lines as the terminal has
        return render([rates.update(s) for s in snapshot_all(client, only, max_queues, finder)],
                      console.height if console.is_terminal else None)

    if once:
        iterations = 1
    # Ctrl-C / SIGTERM set a flag that the loop checks between refreshes: a
    # KeyboardInterrupt raised inside redis-py could leave its pool's lock held, and the
    # client's cleanup at exit would then wait on it for ever.
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    try:
        if iterations is not None:
            for i in range(iterations):
                if i and stop.wait(interval):
                    return
                console.print(frame())
            return
        with Live(frame(), console=console, auto_refresh=False, screen=False) as live:
            while not stop.wait(interval):
                live.update(frame(), refresh=True)
    except KeyboardInterrupt:  # a signal that arrived before the handlers were set
        pass
