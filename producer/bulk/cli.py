"""`batchgate bulk`: offline JSONL jobs at LOW priority (submit to RQ, run, status, resume)."""

from __future__ import annotations

import contextlib
import datetime
import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any

import click
import orjson

from producer.bulk.engine import (
    DEFAULT_WINDOW,
    MAX_WINDOW,
    BulkSpec,
    check_paths,
    create_state,
    default_job_id,
    run_bulk,
)
from producer.bulk.state import BulkState, StateStore
from scheduler_core.compat import connect_checked
from scheduler_core.ops.options import FloatRange, env_option, queue_option, redis_url_option

WORKER_HINT = "rq worker -w rq.worker.SimpleWorker --url {url} {queue}"


def job_options(func: Any) -> Any:
    options = [
        click.argument("input_path", metavar="INPUT.jsonl",
                       type=click.Path(exists=True, dir_okay=False)),
        click.option("--output", "-o", "output_path", required=True, metavar="OUT.jsonl",
                     type=click.Path(dir_okay=False),
                     help="Where records go, one per input line, in input order."),
        redis_url_option,
        queue_option,
        click.option("--priority", default="low", show_default=True,
                     type=click.Choice(["high", "normal", "low"], case_sensitive=False),
                     help="Priority of the job's requests (low: online traffic first)."),
        click.option("--window", type=click.IntRange(1, MAX_WINDOW), default=DEFAULT_WINDOW,
                     show_default=True,
                     help="Most requests outstanding at once (keep it near 2 x max batch "
                          "size: the queue is never flooded)."),
        click.option("--job-id", default=None, help="Job id (letters, digits, _ . -)."),
        click.option("--lease-s", type=FloatRange(1, 3600), default=10.0,
                     show_default=True,
                     help="A run that died releases the job after this long."),
        click.option("--overwrite", is_flag=True, help="Replace an existing output file."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def make_spec(input_path: str, output_path: str, redis_url: str, queue: str, priority: str,
              window: int, job_id: str, lease_s: float) -> BulkSpec:
    return BulkSpec(job_id=job_id, input=input_path, output=output_path, redis_url=redis_url,
                    queue=queue, priority=priority, window=window, lease_s=lease_s)


@click.group("bulk")
def bulk_group() -> None:
    """Offline jobs: a JSONL file of payloads through a queue at LOW priority.

    Each input line is one payload; OUT.jsonl gets one record per line, in input order:
    {"line": N, "ok": true, "result": ...} or {"line": N, "ok": false, "error": {...}}.
    A job that dies resumes from its checkpoint without running a line twice.
    """


@bulk_group.command("submit")
@job_options
@env_option("--rq-queue", envvar="BATCHGATE_BULK_RQ_QUEUE", default="batchgate-bulk",
            show_default=True, help="RQ queue the job goes to.")
@click.option("--job-timeout", type=click.IntRange(60), default=86_400, show_default=True,
              help="RQ job timeout, seconds.")
@click.option("--retries", type=click.IntRange(0, 100), default=3, show_default=True,
              help="Times RQ re-runs a failed or abandoned job (each run resumes).")
def submit_command(input_path: str, output_path: str, redis_url: str, queue: str,
                   priority: str, window: int, job_id: str | None, lease_s: float,
                   overwrite: bool, rq_queue: str, job_timeout: int, retries: int) -> None:
    """Enqueue a bulk job on RQ; an RQ worker runs it:

    \b
      rq worker -w rq.worker.SimpleWorker --url REDIS_URL batchgate-bulk
    """
    from producer.bulk.rq_jobs import submit_job

    spec = make_spec(input_path, output_path, redis_url, queue, priority, window,
                     job_id or uuid.uuid4().hex, lease_s)
    store = StateStore(connect_checked(redis_url), spec.job_id)
    if store.load() is not None:
        if not overwrite:
            raise click.ClickException(f"job {spec.job_id} exists; resume it with `batchgate "
                                       "bulk resume`, or pass --overwrite to start it anew")
        forget(store)
    check_paths(spec, store, overwrite)
    state = create_state(store, spec)
    job = submit_job(spec, rq_queue, job_timeout, retries, total=state.total)
    click.echo(job.id)
    click.echo(f"queued {state.total} lines on RQ queue {rq_queue!r}; run a worker with:\n"
               f"  {WORKER_HINT.format(url=redis_url, queue=rq_queue)}\n"
               f"follow it with:\n  batchgate bulk status --follow {job.id}", err=True)


@bulk_group.command("run")
@job_options
@click.option("--restart", is_flag=True,
              help="Forget this job's checkpoint and start from line 1.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def run_command(input_path: str, output_path: str, redis_url: str, queue: str, priority: str,
                window: int, job_id: str | None, lease_s: float, overwrite: bool,
                restart: bool, quiet: bool) -> None:
    """Run a bulk job in the foreground (no RQ). Run it again to resume: the job id
    defaults to one derived from INPUT and OUT paths."""
    spec = make_spec(input_path, output_path, redis_url, queue, priority, window,
                     job_id or default_job_id(input_path, output_path), lease_s)
    store = StateStore(connect_checked(redis_url), spec.job_id)
    if restart:
        forget(store)
    check_paths(spec, store, overwrite or restart)
    if quiet:
        state = run_bulk(spec)
    else:
        with progress_bar(f"bulk job {spec.job_id}", stderr=True) as bar:
            task = add_task(bar)
            state = run_bulk(spec, report=lambda s: update_task(bar, task, s))
    click.echo(f"{spec.job_id}: {state.done}/{state.total} lines, {state.errors} errors, "
               f"output {state.output}", err=True)


@bulk_group.command("status")
@click.argument("job_id")
@redis_url_option
@click.option("--follow", "-f", is_flag=True, help="Keep updating until the job ends.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--interval", type=FloatRange(0.1, 60), default=0.5, show_default=True,
              help="With --follow: seconds between updates, 0.1-60.")
def status_command(job_id: str, redis_url: str, follow: bool, as_json: bool,
                   interval: float) -> None:
    """A job's progress: lines done, errors, rate, ETA (bar drawn with rich)."""
    store = StateStore(connect_checked(redis_url), job_id)
    snapshot = read_status(store, redis_url)
    if as_json:
        click.echo(orjson.dumps(snapshot, option=orjson.OPT_INDENT_2).decode())
        return
    with progress_bar(f"bulk job {job_id}") as bar:
        task = add_task(bar)
        while True:
            state = store.load()
            if state is None:
                raise click.ClickException(f"bulk job {job_id!r} vanished (expired?)")
            update_task(bar, task, state)
            if not follow or snapshot["state"] in ("done", "failed") or snapshot["stalled"]:
                break
            time.sleep(interval)
            snapshot = read_status(store, redis_url)
    click.echo(describe(snapshot))


@bulk_group.command("resume")
@click.argument("job_id")
@redis_url_option
def resume_command(job_id: str, redis_url: str) -> None:
    """Put a bulk job whose RQ worker died (or that failed) back on its RQ queue; it goes
    on from its checkpoint. (A `bulk run` job resumes by running it again.)"""
    from producer.bulk.rq_jobs import resume_job

    click.echo(f"{job_id}: {resume_job(redis_url, job_id)}")


def forget(store: StateStore) -> None:
    if store.running():
        raise click.ClickException(f"job {store.job_id} is running; stop it first")
    store.delete()


def read_status(store: StateStore, redis_url: str) -> dict[str, Any]:
    state = store.load()
    rq_status = None
    try:
        from producer.bulk.rq_jobs import fetch_job

        job = fetch_job(redis_url, store.job_id)
        rq_status = job.get_status().value if job is not None else None
    except ImportError:  # rq not installed: `bulk run` jobs only
        pass
    if state is None:
        raise click.ClickException(f"unknown bulk job {store.job_id!r}")
    running = store.running()
    return {"job_id": store.job_id, **state.progress(), "rq_status": rq_status,
            "running": running, "stalled": state.state == "running" and not running}


def describe(snapshot: dict[str, Any]) -> str:
    text = snapshot["state"]
    if snapshot["rq_status"]:
        text += f" (rq: {snapshot['rq_status']})"
    if snapshot["errors"]:
        text += f", {snapshot['errors']} errors"
    if snapshot["stalled"]:
        text += f"; stalled, its run died: batchgate bulk resume {snapshot['job_id']}"
    elif snapshot["state"] == "failed":
        text += f": {snapshot['error']}"
    return text


class _ConsoleLog(logging.Handler):
    """A log handler that prints through a rich console: while a progress bar is live, a
    log line then lands above the bar instead of in the middle of it."""

    def __init__(self, console: Any, like: logging.Handler):
        super().__init__(like.level)
        self.setFormatter(like.formatter)
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        from rich.text import Text

        try:
            self.console.print(Text(self.format(record)), soft_wrap=True)
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


@contextlib.contextmanager
def progress_bar(title: str, stderr: bool = False) -> Iterator[Any]:
    """A live progress bar (records done/total, %, rate, ETA) under a `title` line. The
    columns fit an 80-column terminal whatever the totals: the bar takes what is left.
    Log lines go through the bar's console meanwhile."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn
    from rich.table import Column

    def fixed(width: int) -> Column:
        return Column(no_wrap=True, min_width=width)

    console = Console(stderr=stderr)
    console.print(title, markup=False, highlight=False)
    bar = Progress(BarColumn(bar_width=None, table_column=Column(ratio=1, min_width=4)),
                   TextColumn("{task.completed}/{task.fields[shown_total]}",
                              table_column=fixed(15)),
                   TextColumn("{task.percentage:>3.0f}%", table_column=fixed(4)),
                   TextColumn("{task.fields[rate]:.1f} lines/s", table_column=fixed(13)),
                   TextColumn("ETA {task.fields[eta]}", table_column=fixed(11)),
                   console=console, expand=True)
    root = logging.getLogger()
    saved = list(root.handlers)
    root.handlers = [_ConsoleLog(console, h) if type(h) is logging.StreamHandler else h
                     for h in saved]
    try:
        with bar:
            yield bar
    finally:
        root.handlers = saved


def add_task(bar: Any) -> Any:
    return bar.add_task("", total=None, rate=0.0, eta="?", shown_total="?")


def update_task(bar: Any, task: Any, state: BulkState) -> None:
    eta = state.eta_s
    bar.update(task, total=max(state.total, 1), completed=state.done, rate=state.rate,
               shown_total=state.total,
               eta="?" if eta is None else str(datetime.timedelta(seconds=round(eta))))
    bar.refresh()
