"""`batchgate top`: every queue's figures, live in the terminal (rich), like
`rq info --interval`. The figures come from scheduler_core/snapshot.py, as the
dashboard's do."""

from __future__ import annotations

import signal
import threading
from typing import Any

import click

from scheduler_core.compat import connect_checked
from scheduler_core.options import env_option, redis_url_option
from scheduler_core.registry import DEFAULT_MAX_QUEUES, QueueFinder
from scheduler_core.snapshot import Rates, snapshot_all


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _rate(rates: dict[str, Any] | None, name: str) -> str:
    return "-" if not rates else f"{rates[name]:.1f}"


def render(snaps: list[dict[str, Any]]) -> Any:
    """A rich renderable of the snapshots (one panel per queue)."""
    from rich.console import Group
    from rich.markup import escape
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    if not snaps:
        return Text("no queues registered yet (a consumer, a producer's first submit or "
                    "`batchgate policy set` registers one)")
    panels = []
    for s in snaps:
        policy = s["policy"] or {}
        head = Table.grid(padding=(0, 2))
        for _ in range(8):
            head.add_column(justify="right")
        depth = s["depth"]
        head.add_row("high", str(depth["high"]), "normal", str(depth["normal"]),
                     "low", str(depth["low"]), "in flight", str(s["in_flight_requests"]))
        head.add_row("arrived/s", _rate(s["rates"], "arrived_per_s"),
                     "completed/s", _rate(s["rates"], "completed_per_s"),
                     "batches/s", _rate(s["rates"], "batches_per_s"),
                     "dead", str(s["dead_letters"]))
        head.add_row("wait p50", _ms(s["queue_wait_ms"]["p50"]),
                     "wait p99", _ms(s["queue_wait_ms"]["p99"]),
                     "e2e p50", _ms(s["end_to_end_ms"]["p50"]),
                     "e2e p99", _ms(s["end_to_end_ms"]["p99"]))
        parts: list[Any] = [head]
        if s["batch_sizes"]:
            most = max(s["batch_sizes"].values())
            bars = Table.grid(padding=(0, 1))
            bars.add_column(justify="right")
            bars.add_column()
            bars.add_column(justify="right")
            for size, n in s["batch_sizes"].items():
                bars.add_row(f"size {size}", "#" * max(1, round(30 * n / most)), str(n))
            parts += [Text("batch sizes (newest batches)", style="bold"), bars]
        if s["consumers"]:
            table = Table("consumer", "host", "device", "heartbeat", "batch", "batches/s",
                          expand=False, box=None, header_style="bold")
            for c in s["consumers"]:
                per_s = c.get("batches_per_s")
                table.add_row(c["name"], c["host"], c["device"] or "-",
                              f"{c['heartbeat_age_s']:.1f}s ago", c["batch"] or "-",
                              "-" if per_s is None else f"{per_s:.1f}")
            parts.append(table)
        else:
            parts.append(Text("no consumers", style="yellow"))
        for failure in s["recent_failures"][:3]:
            parts.append(Text(f"failed {failure.get('id')}: {failure.get('type')}: "
                              f"{failure.get('message')}", style="red"))
        title = (f"{s['queue']}  [{policy.get('strategy', 'no policy')}"
                 + (f", batch<={policy['max_batch_size']}, delay "
                    f"{policy['max_queue_delay_ms']} ms" if policy else "") + "]")
        if s["adaptive_delay"]:
            title += "  adaptive " + ", ".join(f"{k}={v}" for k, v in
                                               s["adaptive_delay"].items())
        panels.append(Panel(Group(*parts), title=escape(title), title_align="left"))
    return Group(*panels)


@click.command("top")
@redis_url_option
@env_option("--queue", "queues", envvar="BATCHGATE_QUEUE", multiple=True,
            help="Show only this queue (repeat for more) [default: the most active queues "
                 "found, up to --max-queues].")
@click.option("--interval", type=click.FloatRange(0.1, 3600), default=1.0, show_default=True,
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

    def frame() -> Any:
        return render([rates.update(s) for s in snapshot_all(client, only, max_queues, finder)])

    console = Console()
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
