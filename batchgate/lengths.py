"""`batchgate demo --scenario lengths`: requests of two lengths through the generator
model, one configuration of the queue after the other, measured (`python -m bench.lengths`
in a checkout runs the same scenario and sets the simulator's predictions beside it).

80% of the requests ask for 16 new tokens (cost 16), 20% for 256 (cost 256), Poisson, the
same seeded arrivals for every configuration. Each configuration gets a queue and
`consumers` real `batchgate consumer` processes of its own (started as the CLI starts
them) running `consumer.models:generator` wrapped by `probed_generator`, which adds to
each result the costs of the batch it ran in and the batch's model time: the padding
waste Σ(max − cost) / Σ max and the batch compositions come from the results.

The configurations (dynamic, max_batch_size 8, max_queue_delay_ms 20, cost_mode padded):
  one-bucket        every request in one queue order (a short one may ride with a long one)
  buckets           --cost-buckets 32: a batch holds costs <= 32 or > 32 only
  buckets+prefer    as buckets, the first consumer started with --prefer-bucket 1
  buckets+dedicated as buckets, the first consumer started with --only-bucket 1: it
                    serves short requests only, the others every bucket
  buckets+max-cost  as buckets, --max-cost 128 --over-cost truncate: the long tail capped

Before the runs, the generator is timed in this process at one request of each length;
the arrival rate is set from those times for the wanted load (load = rate × mean
t(1, cost) / consumers: the share of the consumers' time the requests would take one by
one).
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchgate.processes import ChildProcess, batchgate_argv, wait_all_ready
from batchgate.verdict import check_lines, host_load
from producer.sync import Producer
from scheduler_core.errors import RequestFailed
from scheduler_core.lifetime import die_with_parent
from scheduler_core.wire import Result

SHORT, LONG, LONG_SHARE = 16, 256, 0.2
BUCKET = 32  # --cost-buckets: short requests (<= 32) never share a batch with long ones
CAP = 128  # --max-cost of the capped configuration (over_cost=truncate)
BATCH, DELAY_MS = 8, 20
# The generator's size: a 256-token batch takes ~0.2-0.3 s on one CPU thread.
MODEL_ARGS = {"layers": 2, "dim": 128, "heads": 2, "vocab": 512, "positions": 320,
              "max_new_tokens_cap": LONG}
MODEL_SPEC = "batchgate.lengths:probed_generator"
READY_TIMEOUT_S = 120.0  # torch imports slowly on a busy 2-core machine
# The demo times one request of each length: enough for the arrival rate.
DEMO_SHAPES = [(1, SHORT), (1, LONG)]


@dataclass(frozen=True)
class Config:
    name: str
    flags: tuple[str, ...]  # policy flags, every consumer
    prefer: tuple[int, ...] = ()  # --prefer-bucket of consumer i (0 = none)
    only: tuple[int, ...] = ()  # --only-bucket of consumer i (0 = every bucket)
    policy: dict[str, Any] = field(default_factory=dict)  # the same, for the simulator


BASE = ("--strategy", "dynamic", "--max-batch-size", str(BATCH), "--max-queue-delay-ms",
        str(DELAY_MS), "--cost-mode", "padded")
BASE_POLICY = {"max_batch_size": BATCH, "max_queue_delay_ms": DELAY_MS, "cost_mode": "padded"}
BUCKETS = ("--cost-buckets", str(BUCKET))
CONFIGS = (
    Config("one-bucket", BASE, policy=BASE_POLICY),
    Config("buckets", BASE + BUCKETS, policy={**BASE_POLICY, "cost_buckets": str(BUCKET)}),
    Config("buckets+prefer", BASE + BUCKETS, prefer=(1,),
           policy={**BASE_POLICY, "cost_buckets": str(BUCKET)}),
    Config("buckets+dedicated", BASE + BUCKETS, only=(1,),
           policy={**BASE_POLICY, "cost_buckets": str(BUCKET)}),
    Config("buckets+max-cost", BASE + BUCKETS + ("--max-cost", str(CAP), "--over-cost",
                                                 "truncate"),
           policy={**BASE_POLICY, "cost_buckets": str(BUCKET), "max_cost": CAP,
                   "over_cost": "truncate"}),
)
CONFIG_NAMES = tuple(c.name for c in CONFIGS)


# -- the model the consumers run ---------------------------------------------------------
class Probed:
    """The generator, each result tagged with its batch: {"new_tokens", "batch": {"id",
    "costs", "ms"}} (the tokens themselves are dropped: meaningless, and they would only
    load the wire)."""

    accepts_costs = True

    def __init__(self, model: Callable[..., list[Any]]):
        self.model = model
        self.count = 0

    def __call__(self, payloads: list[Any], costs: list[int] | None = None) -> list[Any]:
        started = time.perf_counter()
        out = self.model(payloads, costs=costs)
        ms = (time.perf_counter() - started) * 1000
        self.count += 1
        batch = {"id": f"{os.getpid()}-{self.count}", "ms": round(ms, 3),
                 "costs": [int(c) for c in costs] if costs is not None else [1] * len(out)}
        return [{"new_tokens": r["new_tokens"], "batch": batch} for r in out]


def build_generator(**kwargs: Any) -> Any:
    """consumer.models:generator's model from the same arguments."""
    from consumer.models import generator

    return generator(**kwargs)


def probed_generator(**kwargs: Any) -> Probed:
    """`--model batchgate.lengths:probed_generator`: consumer.models:generator (same
    --model-arg) whose results name their batch."""
    return Probed(build_generator(**kwargs))


# -- the workload ------------------------------------------------------------------------
def arrivals(rate: float, duration_s: float, seed: int) -> tuple[list[float], list[int]]:
    """Poisson offsets (s) and costs: LONG with probability LONG_SHARE, else SHORT."""
    rng = random.Random(f"lengths-{seed}")
    times: list[float] = []
    at = rng.expovariate(rate)
    while at < duration_s:
        times.append(at)
        at += rng.expovariate(rate)
    return times, [LONG if rng.random() < LONG_SHARE else SHORT for _ in times]


# -- t(b, c) measured here, before the runs ----------------------------------------------
def _time_shapes(repeats: int, threads: int, shapes: list[tuple[int, int]]
                 ) -> list[float]:
    """ms of each shape, the median of `repeats`, in this process."""
    import torch

    torch.set_num_threads(threads)
    model = build_generator(**MODEL_ARGS)
    out = []
    for b, c in shapes:
        runs = []
        for _ in range(repeats):
            started = time.perf_counter()
            model([{"prompt": "lengths profile"}] * b, costs=[c] * b)
            runs.append((time.perf_counter() - started) * 1000)
        out.append(statistics.median(runs))
    return out


def profile(repeats: int = 2, threads: int = 1, parallel: int = 1,
            shapes: list[tuple[int, int]] | None = None) -> dict[str, Any]:
    """Time the generator (MODEL_ARGS, `threads` torch threads) at each (batch size, new
    tokens) shape in `parallel` processes at once, as the consumers will share the
    machine (one alone runs faster than two side by side); the mean over the processes
    of each one's median of `repeats`."""
    shapes = shapes or DEMO_SHAPES
    if parallel > 1:
        # fork: this process has not run torch yet (its model is built in the children)
        ctx = multiprocessing.get_context("fork")
        with concurrent.futures.ProcessPoolExecutor(
                parallel, mp_context=ctx, initializer=die_with_parent,
                initargs=(os.getpid(),)) as pool:
            runs = list(pool.map(_time_shapes, [repeats] * parallel, [threads] * parallel,
                                 [shapes] * parallel))
        times = [sum(col) / len(col) for col in zip(*runs, strict=True)]
    else:
        times = _time_shapes(repeats, threads, shapes)
    return {"points": [{"b": b, "cost": c, "ms": round(ms, 2)}
                       for (b, c), ms in zip(shapes, times, strict=True)],
            "parallel": parallel}


def t1(prof: dict[str, Any], cost: int) -> float:
    """Measured t(1, cost) ms (DEMO_SHAPES are among every profile's shapes)."""
    return next(float(p["ms"]) for p in prof["points"] if p["b"] == 1 and p["cost"] == cost)


def rate_for(load: float, consumers: int, prof: dict[str, Any]) -> float:
    mean_t = (1 - LONG_SHARE) * t1(prof, SHORT) + LONG_SHARE * t1(prof, LONG)
    return load * consumers * 1000 / mean_t


# -- one configuration on the real system ------------------------------------------------
def consumer_argv(url: str, queue: str, config: Config, index: int,
                  threads: int) -> list[str]:
    model_args = [a for k, v in MODEL_ARGS.items() for a in ("--model-arg", f"{k}={v}")]
    prefer = config.prefer[index] if index < len(config.prefer) else 0
    only = config.only[index] if index < len(config.only) else 0
    return [*batchgate_argv(), "--log-level", "WARNING", "consumer", "--redis-url", url,
            "--queue", queue, "--model", MODEL_SPEC, *model_args, "--torch-threads",
            str(threads), "--device", "cpu", *config.flags,
            *(("--prefer-bucket", str(prefer)) if prefer else ()),
            *(("--only-bucket", str(only)) if only else ())]


def pct(values: list[float], q: float) -> float | None:
    """Nearest rank, as the simulator's."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, int(q * len(ordered) + 0.999999) - 1))]


def run_config(url: str, queue: str, config: Config, times: list[float], costs: list[int],
               consumers: int, threads: int, log_dir: Path,
               drain_timeout_s: float = 60.0) -> dict[str, Any]:
    """Start the consumers, replay the arrivals open loop, wait for every answer, stop
    the consumers; latency from each request's scheduled arrival to its result at the
    producer."""
    procs = [ChildProcess(consumer_argv(url, queue, config, i, threads),
                          log_dir / f"{queue}-{i}.log", b"ready on queue")
             for i in range(consumers)]
    try:
        wait_all_ready(procs, READY_TIMEOUT_S)
        run = _replay(url, queue, times, costs, drain_timeout_s)
        busy = run["model_s"] / (consumers * run["elapsed_s"]) if run["elapsed_s"] else None
        return run | {"config": config.name, "queue": queue, "consumers": consumers,
                      "busy": None if busy is None else round(busy, 3)}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.reap()


def _replay(url: str, queue: str, times: list[float], costs: list[int],
            drain_timeout_s: float) -> dict[str, Any]:
    arrived: dict[str, float] = {}
    handles: list[Any] = []
    errors: list[BaseException] = []

    def stamp(result: Result) -> None:
        arrived[result.id] = time.perf_counter()

    with Producer(url, queue, on_result=stamp).connect() as producer:
        start = time.perf_counter() + 0.1

        def pace() -> None:
            try:
                for k, (offset, cost) in enumerate(zip(times, costs, strict=True)):
                    delay = start + offset - time.perf_counter()
                    if delay > 0:
                        time.sleep(delay)
                    handles.append(producer.submit({"prompt": f"request {k}"}, cost=cost))
            except BaseException as exc:  # re-raised below
                errors.append(exc)

        pacer = threading.Thread(target=pace, name="batchgate-lengths-pacer", daemon=True)
        pacer.start()
        pacer.join()
        if errors:
            raise errors[0]
        latency: dict[int, list[float]] = {SHORT: [], LONG: []}
        batches: dict[str, dict[str, Any]] = {}
        unanswered = failed = 0
        last = start
        deadline = time.perf_counter() + drain_timeout_s
        for k, h in enumerate(handles):
            try:
                value = h.result(timeout=max(0.0, deadline - time.perf_counter()))
            except TimeoutError:
                unanswered += 1
                continue
            except RequestFailed:
                failed += 1
                continue
            deadline = time.perf_counter() + drain_timeout_s
            done = arrived.get(h.id, time.perf_counter())
            last = max(last, done)
            latency[costs[k]].append((done - start - times[k]) * 1000)
            batches[value["batch"]["id"]] = value["batch"]
    pad_total = sum(len(b["costs"]) * max(b["costs"]) for b in batches.values())
    pad_waste = sum(len(b["costs"]) * max(b["costs"]) - sum(b["costs"])
                    for b in batches.values())
    answered = len(handles) - unanswered - failed
    elapsed = last - start
    model_s = sum(b["ms"] for b in batches.values()) / 1000
    return {
        "submitted": len(handles), "answered": answered, "failed": failed,
        "unanswered": unanswered, "elapsed_s": round(elapsed, 3),
        "throughput_rps": round(answered / elapsed, 2) if elapsed > 0 else None,
        "batches": len(batches),
        "mean_batch": round(answered / len(batches), 2) if batches else None,
        "model_s": round(model_s, 3),
        "padding_waste": round(pad_waste / pad_total, 4) if pad_total else 0.0,
        "latency_ms": {str(c): {"n": len(v), "p50": _r(pct(v, 0.5)), "p99": _r(pct(v, 0.99))}
                       for c, v in latency.items()},
        "batch_costs": [b["costs"] for b in batches.values()],
        "batch_ms": [b["ms"] for b in batches.values()],
    }


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


# -- the whole scenario ------------------------------------------------------------------
def run_scenario(url: str, duration_s: float, consumers: int, seed: int, load: float = 0.6,
                 rate: float | None = None, configs: tuple[str, ...] = CONFIG_NAMES,
                 prefix: str = "lengths", repeats: int = 2, threads: int | None = None,
                 say: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
                 shapes: list[tuple[int, int]] | None = None,
                 after_run: Callable[..., None] | None = None) -> dict[str, Any]:
    """`threads`: torch threads of each consumer and profiling process (default: the
    cores / consumers). `shapes`: the (batch size, new tokens) shapes profiled (default
    DEMO_SHAPES). `after_run(run, config, prof, times, costs)` is called on each
    configuration's measurements (the benchmark adds its predictions there)."""
    threads = threads or max(1, (os.cpu_count() or 1) // consumers)
    say(f"timing the generator at (batch size, new tokens) shapes, {consumers} process(es) "
        "at once ...")
    prof = profile(repeats=repeats, threads=threads, parallel=consumers, shapes=shapes)
    if rate is None:
        rate = rate_for(load, consumers, prof)
    times, costs = arrivals(rate, duration_s, seed)
    if not times:
        raise ValueError("the workload is empty: raise the rate or the duration")
    results: dict[str, Any] = {}
    log_dir = Path(tempfile.mkdtemp(prefix="batchgate-lengths-"))
    for config in (c for c in CONFIGS if c.name in configs):
        queue = f"{prefix}-{config.name.replace('+', '-')}"
        say(f"{config.name}: {consumers} consumer(s), {len(times)} requests over "
            f"{duration_s:g} s ...")
        run = run_config(url, queue, config, times, costs, consumers, threads, log_dir,
                         drain_timeout_s=max(30.0, duration_s))
        if after_run is not None:
            after_run(run, config, prof, times, costs)
        results[config.name] = run
    measured_t = (1 - LONG_SHARE) * t1(prof, SHORT) + LONG_SHARE * t1(prof, LONG)
    report = {"workload": {"rate": round(rate, 2), "rate_exact": rate,
                           "duration_s": duration_s, "seed": seed,
                           "requests": len(times), "long": costs.count(LONG),
                           "short": costs.count(SHORT), "short_cost": SHORT,
                           "long_cost": LONG, "long_share": LONG_SHARE,
                           "load": round(rate * measured_t / 1000 / consumers, 3)},
              "consumers": consumers, "torch_threads": threads, "model_args": MODEL_ARGS,
              "policy": {"batch": BATCH, "delay_ms": DELAY_MS, "bucket": BUCKET, "cap": CAP},
              "profile": prof, "configs": results}
    report["checks"] = checks(results)
    report["host"] = host_load()
    return report


def checks(results: dict[str, Any]) -> list[dict[str, Any]]:
    """What cost buckets and --max-cost promise, each with what was measured (a check
    whose configurations did not run is left out)."""
    out: list[dict[str, Any]] = []

    def p99(name: str, cost: int) -> float | None:
        return results[name]["latency_ms"][str(cost)]["p99"] if name in results else None

    one = results.get("one-bucket")
    for name in ("buckets", "buckets+prefer", "buckets+dedicated"):
        if one is None or name not in results:
            continue
        a, b = p99("one-bucket", SHORT), p99(name, SHORT)
        ratio = a / b if a and b else None
        out.append({"check": f"{name}: short p99 >= 3x lower than one-bucket",
                    "ok": ratio is not None and ratio >= 3,
                    "value": f"{a} ms vs {b} ms ({ratio:.2f}x)" if ratio else "-"})
        ta, tb = one["throughput_rps"], results[name]["throughput_rps"]
        out.append({"check": f"{name}: throughput >= 95% of one-bucket",
                    "ok": bool(ta and tb and tb >= 0.95 * ta),
                    "value": f"{tb} vs {ta} req/s"})
    if "buckets+max-cost" in results and "buckets" in results:
        a, b = p99("buckets", LONG), p99("buckets+max-cost", LONG)
        out.append({"check": f"buckets+max-cost: long p99 below buckets' (cost capped at "
                             f"{CAP})", "ok": bool(a and b and b < a),
                    "value": f"{b} ms vs {a} ms"})
    return out


def fmt(value: float | None, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def describe(report: dict[str, Any]) -> list[str]:
    """The workload, the consumers and the model, in a few lines."""
    w = report["workload"]
    return [
        f"{w['requests']} requests ({w['short']} x {w['short_cost']} tokens, {w['long']} x "
        f"{w['long_cost']}), Poisson {w['rate']:g} req/s for {w['duration_s']:g} s = load "
        f"{w['load']:.2f}",
        f"{report['consumers']} consumer(s) per configuration, {report['torch_threads']} torch "
        "thread(s) each",
        "generator " + " ".join(f"{k}={v}" for k, v in report["model_args"].items())]


def verdicts(report: dict[str, Any]) -> list[str]:
    """Any request not answered, each check, and the summary line."""
    missing = {n: r["unanswered"] + r["failed"] for n, r in report["configs"].items()
               if r["unanswered"] or r["failed"]}
    lines = [f"\nNOT ANSWERED: {missing}"] if missing else []
    return [*lines, "", *check_lines(report["checks"], report["host"])]


def render(report: dict[str, Any]) -> str:
    """The workload, one table row per configuration (under 100 columns: the batches'
    costs and the profile are in --json), the checks and their summary."""
    lines = [
        *describe(report),
        "",
        f"{'config':<18} {'short p50/p99':>14} {'long p50/p99':>14} {'req/s':>7} "
        f"{'batches':>7} {'mean':>5} {'padding':>8}",
    ]
    for name, r in report["configs"].items():
        s, lg = r["latency_ms"][str(SHORT)], r["latency_ms"][str(LONG)]
        lines.append(
            f"{name:<18} {fmt(s['p50']) + '/' + fmt(s['p99']):>14} "
            f"{fmt(lg['p50']) + '/' + fmt(lg['p99']):>14} {fmt(r['throughput_rps'], '.1f'):>7} "
            f"{r['batches']:>7} {fmt(r['mean_batch'], '.2f'):>5} {r['padding_waste']:>8.1%}")
    lines.append(f"{'':<18} {'(ms)':>14} {'(ms)':>14}")
    return "\n".join([*lines, *verdicts(report)])
