"""`batchgate demo`: FIFO, dynamic batching and priority compared live, on one workload
(docs/scheduling.md explains what to expect).

For each strategy the demo starts `--consumers` real `batchgate consumer` processes on a
queue of its own, replays the same seeded open-loop workload through a `Producer`
(Poisson arrivals, 10% HIGH / 60% NORMAL / 30% LOW), waits for every answer, stops the
consumers with SIGTERM and reads the queue's statistics. Latency is end to end, measured
in this process: from just before `submit` to the moment the result reached the
producer's listener thread.

The default synthetic model costs t(b) = base_ms + per_item_ms x b per batch of b, so one
request at a time (fifo) caps a consumer at 1000 / t(1) requests/s, while a batch of 32
costs barely more than a batch of 1. The default rate is above what fifo can serve and
far below what batching can: batching matters.

Without `--redis-url` the demo runs against a private redis-server it starts and kills.
With `--redis-url` it only creates queues named `demo-<random>-<strategy>` and deletes
exactly those queues' keys when it is done (`--keep-queues` leaves them for
`batchgate stats`); it never flushes anything.

`--scenario lengths` runs batchgate/lengths.py instead: short and long generation
requests through one bucket and through cost buckets.

A model or scenario whose extra is not installed is refused before anything starts, with
the pip command that installs it (exit 2). The output ends with one summary line of the
checks met; a missed one names the host's load beside it; `--strict` exits 1 on any.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import click
import orjson
import redis

from batchgate.embedded import embedded_redis
from batchgate.processes import ChildProcess, batchgate_argv, wait_all_ready
from batchgate.verdict import host_load, load_text, missed, summary
from batchgate.workload import MIX, MODELS, PRIORITIES, Workload
from consumer.loader import MODEL_EXTRAS, install_hint, not_installed
from producer.sync import Handle, Producer
from scheduler_core.compat import usable_cores
from scheduler_core.connection import connect
from scheduler_core.errors import InvalidRequest, RequestFailed
from scheduler_core.keys import QueueKeys
from scheduler_core.ops.options import FloatRange
from scheduler_core.ops.stats import queue_stats
from scheduler_core.wire import Result

STRATEGIES = ("fifo", "dynamic", "priority")
SCENARIOS = ("strategies", "lengths")
DEFAULT_RATE = 110.0
DEMO_MODELS = ("synthetic", "tiny_text", "minilm")
READY_TIMEOUT_S = 60.0  # torch consumers import slowly on small machines
Arrival = tuple[float, str, Any]  # (offset in s, priority, payload)


def demo_arrivals(model: str, rate: float, duration_s: float, seed: int) -> list[Arrival]:
    """The seeded Poisson workload, identical for every strategy."""
    times, prios, payloads = Workload("poisson", rate, duration_s, seed=seed,
                                      model=model).arrivals()
    return [(t, PRIORITIES[p], payload) for t, p, payload in zip(times, prios, payloads,
                                                                   strict=True)]


@dataclass
class Sent:
    handle: Handle
    priority: str
    submitted: float  # time.perf_counter() just before submit


def pace(producer: Producer, arrivals: list[Arrival], sent: list[Sent],
         errors: list[BaseException]) -> None:
    """Open loop: submit each request at its time, whether or not earlier ones are done."""
    try:
        start = time.perf_counter()
        for offset, priority, payload in arrivals:
            delay = start + offset - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            submitted = time.perf_counter()
            sent.append(Sent(producer.submit(payload, priority=priority), priority, submitted))
    except BaseException as exc:  # re-raised by the main thread
        errors.append(exc)


# -- consumers -----------------------------------------------------------------------
def torch_threads(consumers: int) -> int:
    """Each consumer's share of the cores: without a cap every torch consumer takes them
    all, they fight, and the measurements show the fight rather than the strategies."""
    return max(1, usable_cores() // consumers)


def start_consumers(count: int, redis_url: str, queue: str, strategy: str, model: str,
                    model_args: list[str], log_dir: Path,
                    threads: int | None = None) -> list[ChildProcess]:
    """`threads`: each one's --torch-threads (default: its share of the cores)."""
    threads = threads or torch_threads(count)
    argv = [*batchgate_argv(), "--log-level", "WARNING", "consumer", "--redis-url", redis_url,
            "--queue", queue, "--strategy", strategy, "--model", MODELS[model][0],
            "--torch-threads", str(threads), *model_args]
    procs = [ChildProcess(argv, log_dir / f"{queue}-{i}.log", b"ready on queue")
             for i in range(count)]
    wait_all_ready(procs, READY_TIMEOUT_S)
    return procs


# -- one strategy --------------------------------------------------------------------
def percentiles(values: list[float]) -> dict[str, float | int | None]:
    """Exact nearest-rank p50/p99 of latencies in ms."""
    ordered = sorted(values)
    if not ordered:
        return {"n": 0, "p50": None, "p99": None}

    def rank(q: float) -> float:
        return round(ordered[max(0, min(len(ordered) - 1, int(q * len(ordered) + 0.5) - 1))], 1)
    return {"n": len(ordered), "p50": rank(0.50), "p99": rank(0.99)}


def run_strategy(client: redis.Redis, redis_url: str, queue: str,
                 arrivals: list[Arrival], consumers: list[ChildProcess],
                 drain_timeout_s: float) -> dict[str, Any]:
    """Replay `arrivals` on `queue`, wait for every answer (until none has come for
    `drain_timeout_s`), stop the consumers, measure."""
    sent: list[Sent] = []
    errors: list[BaseException] = []
    arrived: dict[str, float] = {}  # request id -> when its result reached the listener

    def stamp(result: Result) -> None:
        arrived[result.id] = time.perf_counter()

    with Producer(redis_url, queue, on_result=stamp).connect() as producer:
        pacer = threading.Thread(target=pace, args=(producer, arrivals, sent, errors),
                                 name="batchgate-demo-pacer", daemon=True)
        pacer.start()
        pacer.join()
        if errors:
            raise errors[0]
        deadline = time.perf_counter() + drain_timeout_s
        latencies: dict[str, list[float]] = {p: [] for p in PRIORITIES}
        unanswered = failed = 0
        last = sent[0].submitted if sent else 0.0
        for s in sent:
            try:
                s.handle.result(timeout=max(0.0, deadline - time.perf_counter()))
            except TimeoutError:
                unanswered += 1
                continue
            except RequestFailed:
                failed += 1
            # An overloaded strategy (fifo) drains its backlog after the arrivals end:
            # wait as long as answers keep coming, give up after drain_timeout_s without one.
            deadline = time.perf_counter() + drain_timeout_s
            done = arrived.get(s.handle.id, time.perf_counter())
            latencies[s.priority].append((done - s.submitted) * 1000)
            last = max(last, done)
    for c in consumers:
        c.terminate()  # they finish the batch in hand and exit; reaped later
    stats = queue_stats(client, queue)
    batches = [sample.decode().split(":") for sample in
               client.lrange(QueueKeys(queue).model_samples, 0, -1)]
    model_ms = sum(int(us) for _, us in batches) / 1000
    elapsed = (last - sent[0].submitted) if sent else 0.0
    span = (sent[-1].submitted - sent[0].submitted) if sent else 0.0
    answered = len(sent) - unanswered
    all_latencies = [x for values in latencies.values() for x in values]
    return {
        "queue": queue,
        "policy": stats.policy,
        "submitted": len(sent),
        "answered": answered,
        "failed": failed,
        "unanswered": unanswered,
        "elapsed_s": round(elapsed, 3),
        "offered_rps": round(len(sent) / span, 1) if span > 0 else None,
        "throughput_rps": round(answered / elapsed, 1) if elapsed > 0 else None,
        "batches": stats.batches,
        "mean_batch_size": (round(stats.mean_batch_size, 2)
                            if stats.mean_batch_size is not None else None),
        "mean_model_ms": round(model_ms / len(batches), 2) if batches else None,
        "busy": round(model_ms / 1000 / (len(consumers) * elapsed), 3) if elapsed else None,
        "latency_ms": {**{p: percentiles(v) for p, v in latencies.items()},
                       "all": percentiles(all_latencies)},
    }


# -- the strategies' claims (docs/scheduling.md), checked against what was measured ----
def _n(value: float | None, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def keeps_up(r: dict[str, Any]) -> bool:
    """Served at least 90% of the offered rate (the drain after the last arrival costs a
    little, so never exactly 100%)."""
    return (r["throughput_rps"] or 0) >= 0.9 * (r["offered_rps"] or 0)


def per_request_ms(r: dict[str, Any]) -> float | None:
    """Model time per request: what batching saves."""
    if not r["mean_model_ms"] or not r["mean_batch_size"]:
        return None
    return r["mean_model_ms"] / r["mean_batch_size"]


def claims(results: dict[str, dict[str, Any]], rate: float, consumers: int
           ) -> dict[str, dict[str, Any]]:
    """One line per strategy relating the measurements to the scheduling model
    (docs/scheduling.md). `holds` is True only when every part of the line was seen in
    this run; `missed` lists the parts that were not."""
    fifo, dyn, prio = (results[s] for s in STRATEGIES)
    out: dict[str, dict[str, Any]] = {}

    t1 = fifo["mean_model_ms"]
    capacity = consumers * 1000 / t1 if t1 else None
    missed = []
    if fifo["mean_batch_size"] is None or any(
            r["mean_batch_size"] is not None and fifo["mean_batch_size"] > r["mean_batch_size"]
            for r in (dyn, prio)):
        missed.append("fifo's mean batch is not the lowest")
    f_lat = fifo["latency_ms"]
    high, low = f_lat["high"]["p50"], f_lat["low"]["p50"]
    if high is not None and low is not None and high < 0.5 * low:
        missed.append(f"HIGH p50 {high:.0f} ms is well below LOW's {low:.0f} ms")
    if keeps_up(fifo):
        load = (f"it keeps up with {fifo['offered_rps']:g} req/s: predictable latency at low "
                "utilisation")
    else:
        load = (f"it cannot keep up with {fifo['offered_rps']:g} req/s: the queue grows; busy "
                f"{_n(fifo['busy'], '.0%')} yet p99 {_n(f_lat['all']['p99'])} ms "
                "(utilisation high, P99 high)")
    out["fifo"] = {"holds": not missed, "missed": missed,
                   "capacity_rps": capacity and round(capacity, 1), "text": (
        f"lowest mean batch ({_n(fifo['mean_batch_size'], '.2f')}): one request per model "
        f"call caps {consumers} consumer(s) at ~{_n(capacity)} req/s of model time, so {load}; "
        "HIGH waits like LOW.")}

    policy = dyn["policy"] or {}
    delay, size = int(policy.get("max_queue_delay_ms", 50)), int(policy.get("max_batch_size", 32))
    t_b = dyn["mean_model_ms"] or 0.0
    bound = delay + t_b
    p99, mean = dyn["latency_ms"]["all"]["p99"], dyn["mean_batch_size"]
    fill_ms = size / rate * 1000
    missed = []
    if fill_ms < delay:  # batches fill before the window closes
        if mean is None or mean < size / 2:
            missed.append(f"mean batch {_n(mean, '.1f')} is under half of {size}")
        text = (f"a full batch forms in {fill_ms:.0f} ms < max_queue_delay {delay} ms, so "
                f"batches fill up (mean {_n(mean, '.1f')} of {size}) and p99 is {_n(p99)} ms")
    else:  # light load: most requests wait out the window
        if not keeps_up(dyn):
            missed.append(f"it served {_n(dyn['throughput_rps'], '.1f')} of "
                          f"{dyn['offered_rps']:g} req/s: the backlog, not the window, "
                          "makes P99")
        elif p99 is None or p99 < 0.9 * bound:
            missed.append(f"p99 {_n(p99)} ms is under the window + t(b) {bound:.0f} ms")
        elif p99 > 2 * bound:
            missed.append(f"p99 {p99:.0f} ms is over twice the window + t(b): queueing "
                          "behind busy consumers, not the window, dominates")
        text = (f"p99 {_n(p99)} ms >= max_queue_delay {delay} ms + t({_n(mean, '.1f')}) "
                f"{t_b:.0f} ms = {bound:.0f} ms: below {size} requests per {delay} ms the "
                "window, not the model, is the main term of P99")
    fifo_cost, dyn_cost = per_request_ms(fifo), per_request_ms(dyn)
    if fifo_cost is None or dyn_cost is None or dyn_cost >= fifo_cost:
        missed.append(f"model time per request {_n(dyn_cost, '.1f')} ms is not below "
                      f"fifo's {_n(fifo_cost, '.1f')} ms")
    gain = (f"; batches of {_n(mean, '.1f')} instead of 1 cost {_n(dyn_cost, '.1f')} ms of "
            f"model time per request instead of {_n(fifo_cost, '.1f')} ms")
    if not keeps_up(fifo):
        gain += (f", so it serves {_n(dyn['throughput_rps'], '.1f')} req/s where fifo "
                 f"serves {_n(fifo['throughput_rps'], '.1f')}")
        if (dyn["throughput_rps"] or 0) <= (fifo["throughput_rps"] or 0):
            missed.append("it serves no more req/s than fifo")
    out["dynamic"] = {"holds": not missed, "missed": missed,
                      "expected_p99_ms": round(bound, 1), "text": text + gain + "."}

    lat = prio["latency_ms"]
    high, normal, low = (lat[p]["p50"] for p in PRIORITIES)
    p_policy = prio["policy"] or {}
    aging = int(p_policy.get("aging_ms", 0))
    p_delay = int(p_policy.get("max_queue_delay_ms", 50))
    t_p = prio["mean_model_ms"] or 0.0
    missed = []
    if None in (high, normal, low) or not (high < normal and high < low):
        missed.append("HIGH's p50 is not the lowest")
    elif high > p_delay + t_p:
        missed.append(f"HIGH p50 {high:.0f} ms is over max_queue_delay {p_delay} ms + one "
                      f"batch {t_p:.0f} ms: HIGH waited behind a backlog")
    out["priority"] = {"holds": not missed, "missed": missed, "text": (
        f"HIGH p50 {_n(high)} ms < NORMAL {_n(normal)} ms, LOW {_n(low)} ms: HIGH goes to the "
        "head and never waits for a batch to fill; LOW runs only when no NORMAL waits (p99 "
        f"{_n(lat['low']['p99'])} ms; aging promotes any request waiting over {aging} ms).")}
    return out


# -- output --------------------------------------------------------------------------
def _ms(entry: dict[str, Any]) -> str:
    if not entry["n"]:
        return "-"
    return f"{entry['p50']:.0f}/{entry['p99']:.0f}"


def render(report: dict[str, Any]) -> str:
    w = report["workload"]
    lines = [
        f"batchgate demo: {w['requests']} requests per strategy, Poisson {w['rate']:g} req/s "
        f"for {w['duration_s']:g} s (HIGH/NORMAL/LOW = 10/60/30%)",
        f"model {w['model']}"
        + (f" t(b) = {w['base_ms']:g} + {w['per_item_ms']:g} x b ms" if w["model"] ==
           "synthetic" else "")
        + f", {report['consumers']} consumer(s) per strategy ({report['torch_threads']} "
        "torch thread(s) each)",
        "",
        f"{'strategy':<9} {'req/s':>7} {'batch':>6} {'busy':>5} {'answered':>9}   "
        f"{'HIGH':>11} {'NORMAL':>11} {'LOW':>11}   (p50/p99 ms)",
    ]
    for name in STRATEGIES:
        r = report["strategies"][name]
        lat = r["latency_ms"]
        lines.append(
            f"{name:<9} {r['throughput_rps'] or 0:>7.1f} {r['mean_batch_size'] or 0:>6.2f} "
            f"{r['busy'] or 0:>5.0%} {r['answered']:>4}/{r['submitted']:<4}   "
            f"{_ms(lat['high']):>11} {_ms(lat['normal']):>11} {_ms(lat['low']):>11}")
    lines.append("")
    for name in STRATEGIES:
        claim = report["claims"][name]
        line = f"[{'ok ' if claim['holds'] else '!! '}] {name}: {claim['text']}"
        if not claim["holds"]:  # say which part of the claim this run did not show
            line += (" NOT MEASURED: " + "; ".join(claim["missed"])
                     + f" ({load_text(report['host'])}).")
        lines.append(line)
    lines.append(summary(report["checks"], report["host"]))
    lines.append(f"\n({report['redis']}; finished in {report['wall_s']:.1f} s)")
    return "\n".join(lines)


def require_extra(option: str, what: str, extra: str | None) -> None:
    """Exit 2 naming `extra` when `what` (the value of `option`) needs it and it is not
    installed; nothing has started yet."""
    missing = not_installed(extra) if extra else []
    if missing:
        raise InvalidRequest(option, f"{what} needs the `{extra}` extra ({', '.join(missing)} "
                                     f"not installed): {install_hint(extra)}")


def claim_checks(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"check": name, "ok": claim["holds"]} for name, claim in report["claims"].items()]


def finish(report: dict[str, Any], text: str, as_json: bool, strict: bool) -> None:
    """Print the report; with `strict`, exit 1 when a check was missed."""
    click.echo(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode() if as_json
               else text)
    if strict and missed(report["checks"]):
        raise SystemExit(1)


@contextlib.contextmanager
def redis_for_demo(redis_url: str | None) -> Iterator[tuple[str, str]]:
    if redis_url:
        shown, parts = redis_url, urlsplit(redis_url)  # shown without its password
        if "@" in parts.netloc:
            shown = parts._replace(netloc=f"***@{parts.netloc.rpartition('@')[2]}").geturl()
        yield redis_url, f"Redis at {shown}"
    else:
        with embedded_redis() as url:
            yield url, "embedded redis-server"


def delete_queues(client: redis.Redis, prefix: str) -> int:
    """Remove every key of the demo's queues (`{bg:<prefix>-...}`, their marks for the
    dashboard too), nothing else."""
    deleted = 0
    for key in client.scan_iter(match=f"{{bg:{prefix}-*", count=500):
        deleted += client.unlink(key)
    return deleted


@click.command("demo")
@click.option("--redis-url", default=None,
              help="Use this Redis instead of a private embedded one (only demo-* queues are "
                   "created there, and removed afterwards).")
@click.option("--model", type=click.Choice(DEMO_MODELS), default="synthetic",
              show_default=True, help="synthetic cost model, the small torch model, or the "
              "real MiniLM embedding model (extra `minilm`; try --rate 40).")
@click.option("--duration", type=FloatRange(0.5, 600), default=8.0, show_default=True,
              help="Seconds of arrivals per strategy.")
@click.option("--scenario", type=click.Choice(SCENARIOS), default="strategies",
              show_default=True,
              help="strategies: fifo, dynamic and priority on one workload; lengths: 80% "
                   "short (16 tokens) and 20% long (256) requests on the generator model, "
                   "one bucket vs --cost-buckets 32, --prefer-bucket, --only-bucket and "
                   "--max-cost (extra `generate`).")
@click.option("--rate", type=FloatRange(1, 5000), default=None,
              help="Mean arrival rate, requests/s (Poisson). Default: 110 (strategies); "
                   "lengths: 60% load from the generator's measured t(1, cost).")
@click.option("--consumers", type=click.IntRange(1, 32), default=2, show_default=True,
              help="Consumer processes per strategy.")
@click.option("--base-ms", type=FloatRange(0), default=20.0, show_default=True,
              help="synthetic: fixed cost of one model call, ms.")
@click.option("--per-item-ms", type=FloatRange(0), default=2.0, show_default=True,
              help="synthetic: extra cost per request in the batch, ms.")
@click.option("--device", default=None,
              help="tiny_text/minilm: torch device (cpu, cuda:0, ...).")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Random seed of the workload (arrival times, priorities, payloads).")
@click.option("--keep-queues", is_flag=True,
              help="With --redis-url: leave the demo's queues for `batchgate stats`.")
@click.option("--configs", default=None,
              help="lengths only: comma-separated configurations to run, of one-bucket, "
                   "buckets, buckets+prefer, buckets+dedicated, buckets+max-cost "
                   "[default: all five].")
@click.option("--profile-repeats", type=click.IntRange(1, 20), default=2, show_default=True,
              help="lengths only: timings of each profiled (batch size, new tokens) shape "
                   "before the runs (the median is used).")
@click.option("--torch-threads", "threads", type=click.IntRange(1, 1024), default=None,
              help="torch threads of each consumer (and of the lengths profile) [default: "
                   "the cores / --consumers].")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
@click.option("--strict", is_flag=True,
              help="Exit 1 when any check is missed (the summary line counts them).")
def demo_command(redis_url: str | None, scenario: str, model: str, duration: float,
                 rate: float | None, consumers: int, base_ms: float, per_item_ms: float,
                 device: str | None, seed: int, keep_queues: bool, configs: str | None,
                 profile_repeats: int, threads: int | None, as_json: bool,
                 strict: bool) -> None:
    """Run one mixed HIGH/NORMAL/LOW workload through fifo, dynamic and priority and
    compare throughput, p50/p99 latency per priority and batch size (under a minute);
    or, with --scenario lengths, short and long generation requests through one bucket
    and through cost buckets (about two minutes)."""
    started = time.perf_counter()
    if threading.current_thread() is threading.main_thread():
        # Stopped from outside: unwind like Ctrl-C, so consumers and redis-server go too.
        signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    if scenario == "lengths":
        require_extra("--scenario", scenario, "generate")
    else:
        require_extra("--model", model, MODEL_EXTRAS.get(MODELS[model][0]))
    if scenario == "lengths":
        lengths_demo(redis_url, duration, rate, consumers, seed, keep_queues, as_json,
                     started, configs, profile_repeats, threads, strict)
        return
    if configs is not None:
        raise click.UsageError("--configs applies to --scenario lengths only")
    rate = DEFAULT_RATE if rate is None else rate
    arrivals = demo_arrivals(model, rate, duration, seed)
    if not arrivals:
        raise click.UsageError("the workload is empty: raise --rate or --duration")
    if model == "synthetic":
        model_args = ["--model-arg", f"base_ms={base_ms}", "--model-arg",
                      f"per_item_ms={per_item_ms}"]
    else:
        model_args = ["--device", device] if device else []
    prefix = f"demo-{uuid.uuid4().hex[:8]}"
    results: dict[str, dict[str, Any]] = {}
    started_procs: list[ChildProcess] = []
    log_dir = Path(tempfile.mkdtemp(prefix="batchgate-demo-"))
    with redis_for_demo(redis_url) as (url, where):
        client = connect(url)
        try:
            for strategy in STRATEGIES:
                queue = f"{prefix}-{strategy}"
                click.echo(f"{strategy}: starting {consumers} consumer(s) on {queue!r} ...",
                           err=True)
                procs = start_consumers(consumers, url, queue, strategy, model, model_args,
                                        log_dir, threads)
                started_procs += procs
                click.echo(f"{strategy}: {len(arrivals)} requests over {duration:g} s ...",
                           err=True)
                results[strategy] = run_strategy(client, url, queue, arrivals, procs,
                                                 drain_timeout_s=max(10.0, duration))
        finally:
            for p in started_procs:
                p.terminate()
            for p in started_procs:
                p.reap()
            shutil.rmtree(log_dir, ignore_errors=True)
            if redis_url and not keep_queues:
                delete_queues(client, prefix)
            client.close()
    report = {
        "redis": where,
        "consumers": consumers,
        "torch_threads": threads or torch_threads(consumers),
        "workload": {"model": model, "rate": rate, "duration_s": duration, "seed": seed,
                     "requests": len(arrivals), "mix": dict(zip(PRIORITIES, MIX, strict=True)),
                     **({"base_ms": base_ms, "per_item_ms": per_item_ms}
                        if model == "synthetic" else {})},
        "queues_kept": bool(redis_url and keep_queues),
        "strategies": results,
        "claims": claims(results, rate, consumers),
        "host": host_load(),
        "wall_s": round(time.perf_counter() - started, 2),
    }
    report["checks"] = claim_checks(report)
    finish(report, render(report), as_json, strict)


def lengths_demo(redis_url: str | None, duration: float, rate: float | None, consumers: int,
                 seed: int, keep_queues: bool, as_json: bool, started: float,
                 configs: str | None = None, profile_repeats: int = 2,
                 threads: int | None = None, strict: bool = False) -> None:
    """--scenario lengths (batchgate/lengths.py): every configuration (or those of
    `configs`, comma-separated) on a queue `demo-<random>-<config>`, the report with each
    batch's costs."""
    from batchgate import lengths

    chosen = lengths.CONFIG_NAMES
    if configs is not None:
        chosen = tuple(c.strip() for c in configs.split(",") if c.strip())
        unknown = sorted(set(chosen) - set(lengths.CONFIG_NAMES))
        if unknown or not chosen:
            what = f"unknown {', '.join(unknown)}" if unknown else "no configuration given"
            raise click.BadParameter(f"{what}; use {', '.join(lengths.CONFIG_NAMES)}",
                                     param_hint="--configs")
    prefix = f"demo-{uuid.uuid4().hex[:8]}"
    with redis_for_demo(redis_url) as (url, where):
        client = connect(url)
        try:
            report = lengths.run_scenario(url, duration, consumers, seed, rate=rate,
                                          configs=chosen, prefix=prefix,
                                          repeats=profile_repeats, threads=threads,
                                          say=lambda s: click.echo(s, err=True))
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
        finally:
            if redis_url and not keep_queues:
                delete_queues(client, prefix)
            client.close()
    report = {"scenario": "lengths", "redis": where,
              "queues_kept": bool(redis_url and keep_queues), **report,
              "wall_s": round(time.perf_counter() - started, 2)}
    finish(report, "batchgate demo --scenario lengths\n" + lengths.render(report)
           + f"\n\n({where}; finished in {report['wall_s']:.1f} s)", as_json, strict)
