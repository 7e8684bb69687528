"""The lengths scenario (issue 16 §6) that `batchgate demo --scenario lengths` and
`python -m batchgate.bench.lengths` run: requests of two lengths through the generator
model, one configuration of the queue after the other, measured and simulated.

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

Before the runs, the generator is timed in this process at a few (batch size, new tokens)
shapes; the arrival rate is set from those times for the wanted load (load = rate ×
mean t(1, cost) / consumers: the share of the consumers' time the requests would take
one by one), and two cost models are fitted for the simulator
(scheduler_core.simulation): t = A + B·b·max cost (what `batchgate simulate --cost-ms
A+B*c` takes under cost_mode padded) and t = A + S·max cost + B·b·max cost (a per-step
term: each generated token is one forward pass whatever the batch size). Each
configuration is simulated on the same arrivals with both, and with a third, "live",
made of the run's own model-time samples (the batches the consumers timed, as a queue's
model samples and live refit would give them to a user): the step model fitted to them,
and each simulated batch's time multiplied by one of their ratios measured / fitted
(the simulator's jitter). The error of each prediction is reported next to the
measurement.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
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

from batchgate.processes import ChildProcess, wait_all_ready
from producer.sync import Producer
from scheduler_core.cost_model import fit
from scheduler_core.errors import RequestFailed
from scheduler_core.lifetime import die_with_parent
from scheduler_core.policy import Policy
from scheduler_core.simulation import ModelTime, SimConfig, simulate
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
PROFILE_SHAPES = [(b, c) for b in (1, 2, 4, 8) for c in (SHORT, 128, LONG)]


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
@dataclass(frozen=True)
class StepTime(ModelTime):
    """t = base + per_step_ms × max cost + per_cost_ms × b × max cost (cost_mode padded
    hands `us` the units b × max cost)."""

    per_step_ms: float = 0.0

    def us(self, batch: int, cost_units: int = 0) -> int:
        top = cost_units / batch if batch else 0.0
        return round((self.base_ms + self.per_step_ms * top + self.per_cost_ms * cost_units)
                     * 1000)

    def __str__(self) -> str:
        return (f"{self.base_ms:.3g}+{self.per_step_ms:.3g}*max+{self.per_cost_ms:.3g}*b*max "
                "ms")


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
    of each one's median of `repeats`. Fit both cost models."""
    shapes = shapes or PROFILE_SHAPES
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
    points = [(b, c, ms) for (b, c), ms in zip(shapes, times, strict=True)]
    line = fit([(b * c, ms) for b, c, ms in points])
    return {"points": [{"b": b, "cost": c, "ms": round(ms, 2)} for b, c, ms in points],
            "parallel": parallel,
            "padded": {"base_ms": round(max(0.0, line.base_ms), 4),
                       "per_cost_ms": round(max(1e-6, line.per_item_ms), 6),
                       "r2": round(line.r2, 4)},
            "step": fit_step(points)}


def t1(prof: dict[str, Any], cost: int) -> float:
    """Measured t(1, cost) ms (interpolated by the step fit where not a profiled shape)."""
    for p in prof["points"]:
        if p["b"] == 1 and p["cost"] == cost:
            return float(p["ms"])
    s = prof["step"]
    return s["base_ms"] + (s["per_step_ms"] + s["per_cost_ms"]) * cost


def rate_for(load: float, consumers: int, prof: dict[str, Any]) -> float:
    mean_t = (1 - LONG_SHARE) * t1(prof, SHORT) + LONG_SHARE * t1(prof, LONG)
    return load * consumers * 1000 / mean_t


# -- one configuration on the real system ------------------------------------------------
def consumer_argv(url: str, queue: str, config: Config, index: int,
                  threads: int) -> list[str]:
    from batchgate.demo import batchgate_argv

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


KINDS = ("padded", "step", "live")
# The live prediction is the median over this many jitter seeds: with a few hundred
# requests, p99 is made of a handful of batches, and one draw of their times swings it
# by ±50% (the spread is reported beside it).
LIVE_DRAWS = 21


def fit_step(samples: list[tuple[int, int, float]]) -> dict[str, float]:
    """StepTime's terms (A + S·max + B·b·max ms) by least squares through (batch size,
    largest cost, ms) samples; negative terms clamped to 0."""
    import numpy as np

    rows = np.array([[1.0, c, b * c] for b, c, _ in samples])
    coef = np.linalg.lstsq(rows, np.array([ms for *_, ms in samples]), rcond=None)[0]
    a, step, per = (max(0.0, float(x)) for x in coef)
    return {"base_ms": round(a, 4), "per_step_ms": round(step, 6),
            "per_cost_ms": round(max(1e-6, per), 6)}


def live_model(run: dict[str, Any]) -> tuple[dict[str, float], tuple[float, ...]]:
    """What the consumers measured during the run, as a user would get it from the queue's
    model samples and live refit: the step model fitted to the run's own batches, and
    each batch's model time over that fit (the simulator's jitter ratios)."""
    samples = [(len(c), max(c), ms) for c, ms in
               zip(run["batch_costs"], run.get("batch_ms", ()), strict=False) if ms > 0]
    if len(samples) < 3:
        raise ValueError("fewer than 3 timed batches")
    m = fit_step(samples)
    fitted = [m["base_ms"] + c * (m["per_step_ms"] + m["per_cost_ms"] * b)
              for b, c, _ in samples]
    return m, tuple(ms / f for (*_, ms), f in zip(samples, fitted, strict=True) if f > 0)


def predict(config: Config, prof: dict[str, Any], kind: str, times: list[float],
            costs: list[int], consumers: int, run: dict[str, Any] | None = None,
            seed: int = 1) -> dict[str, Any]:
    """The simulator on the same arrivals, with the `kind` model time: "padded" (the
    profile's A + B·b·max), "step" (the profile's A + S·max + B·b·max), or "live": the
    step model fitted to the run's own batches (`run`), each simulated batch's time
    multiplied by one of their ratios measured / fitted, drawn with seeds `seed` ..
    `seed` + LIVE_DRAWS - 1: the median of each figure over the draws, and their range
    (the profile's step fit, exactly, if the run timed fewer than 3 batches)."""
    jitter: tuple[float, ...] = ()
    m = prof["padded" if kind == "padded" else "step"]
    if kind == "live" and run is not None:
        with contextlib.suppress(ValueError):  # too few batches: the profile's fit
            m, jitter = live_model(run)
    cost = (ModelTime(m["base_ms"], 0.0, m["per_cost_ms"]) if kind == "padded" else
            StepTime(m["base_ms"], 0.0, m["per_cost_ms"], m["per_step_ms"]))
    def per_consumer(buckets: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(buckets[i] if i < len(buckets) else 0
                     for i in range(consumers)) if buckets else ()

    draws = []
    for k in range(LIVE_DRAWS if jitter else 1):
        sim = SimConfig(policy=Policy.build("dynamic", **config.policy), cost=cost,
                        consumers=consumers, prefer_buckets=per_consumer(config.prefer),
                        jitter=jitter, jitter_seed=seed + k,
                        only_buckets=per_consumer(config.only))
        draws.append(simulate(sim, times, [1] * len(times), costs))

    def median(get: Callable[[Any], float | None]) -> float | None:
        values = [v for r in draws if (v := get(r)) is not None]
        return statistics.median(values) if values else None

    out: dict[str, Any] = {
        "cost_model": str(cost), "jitter_samples": len(jitter), "draws": len(draws),
        "throughput_rps": median(lambda r: r.throughput_rps),
        "padding_waste": median(lambda r: r.padding_waste),
        "mean_batch": median(lambda r: r.mean_batch),
        "latency_ms": {str(c): {q: median(lambda r, c=c, q=q: r.latency_by_cost.get(c, {})
                                          .get(q))
                                for q in ("p50", "p99")}
                       for c in sorted({c for r in draws for c in r.latency_by_cost})}}
    if len(draws) > 1:
        out["p99_range_ms"] = {
            str(c): [min(v), max(v)] for c in (SHORT, LONG)
            if (v := [r.latency_by_cost[c]["p99"] for r in draws
                      if r.latency_by_cost.get(c, {}).get("p99") is not None])}
    return out


def add_predictions(run: dict[str, Any], config: Config, prof: dict[str, Any],
                    times: list[float], costs: list[int], consumers: int,
                    seed: int = 1) -> None:
    """run["model_time_vs_fit"] and run["predicted"][kind] for every KINDS, with errors."""
    # The consumers' model time against the step fit's, on the batches they ran: over 1
    # when the machine ran the model slower than at the profile (other load).
    step = prof["step"]
    fitted_s = sum(step["base_ms"] + max(c) * (step["per_step_ms"] + step["per_cost_ms"]
                                                * len(c))
                   for c in run["batch_costs"]) / 1000
    run["model_time_vs_fit"] = round(run["model_s"] / fitted_s, 3) if fitted_s else None
    run["predicted"] = {kind: predict(config, prof, kind, times, costs, consumers, run, seed)
                        for kind in KINDS}
    for pred in run["predicted"].values():
        pred["error_pct"] = {
            "short_p99": error_pct(pred["latency_ms"].get(str(SHORT), {}).get("p99"),
                                   run["latency_ms"][str(SHORT)]["p99"]),
            "long_p99": error_pct(pred["latency_ms"].get(str(LONG), {}).get("p99"),
                                  run["latency_ms"][str(LONG)]["p99"]),
            "throughput": error_pct(pred["throughput_rps"], run["throughput_rps"])}


def error_pct(sim: float | None, real: float | None) -> float | None:
    if sim is None or not real:
        return None
    return round((sim - real) / real * 100, 1)


# -- the whole scenario ------------------------------------------------------------------
def run_scenario(url: str, duration_s: float, consumers: int, seed: int, load: float = 0.6,
                 rate: float | None = None, configs: tuple[str, ...] = CONFIG_NAMES,
                 prefix: str = "lengths", repeats: int = 2, threads: int | None = None,
                 say: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)
                 ) -> dict[str, Any]:
    """`threads`: torch threads of each consumer and profiling process (default: the
    cores / consumers)."""
    threads = threads or max(1, (os.cpu_count() or 1) // consumers)
    say(f"timing the generator at (batch size, new tokens) shapes, {consumers} process(es) "
        "at once ...")
    prof = profile(repeats=repeats, threads=threads, parallel=consumers)
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
        add_predictions(run, config, prof, times, costs, consumers, seed)
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
    return report


def checks(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, each with what was measured (ok is None where a configuration
    needed for it did not run)."""
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
    for name, run in results.items():
        for kind, pred in run["predicted"].items():
            errs = [abs(e) for e in pred["error_pct"].values() if e is not None]
            out.append({"check": f"{name}: simulator ({kind} fit) within 15% (p99 short, "
                                 "long, throughput)",
                        "ok": bool(errs) and max(errs) <= 15,
                        "value": ", ".join(f"{k} {v:+.1f}%" for k, v in
                                           pred["error_pct"].items() if v is not None)})
    return out


def _f(value: float | None, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def render(report: dict[str, Any]) -> str:
    """A markdown table per configuration, the fits, and the checks."""
    w, prof = report["workload"], report["profile"]
    lines = [
        f"{w['requests']} requests ({w['short']} x {w['short_cost']} tokens, {w['long']} x "
        f"{w['long_cost']}), Poisson {w['rate']:g} req/s for {w['duration_s']:g} s = load "
        f"{w['load']:.2f}; {report['consumers']} consumer(s), {report['torch_threads']} "
        f"torch thread(s) each; generator "
        + " ".join(f"{k}={v}" for k, v in report["model_args"].items()),
        f"fits: t = {prof['padded']['base_ms']:.3g} + {prof['padded']['per_cost_ms']:.3g}"
        f"·b·max ms (r² {prof['padded']['r2']:.2f}); t = {prof['step']['base_ms']:.3g} + "
        f"{prof['step']['per_step_ms']:.3g}·max + {prof['step']['per_cost_ms']:.3g}·b·max ms",
        "",
        "| config | short p50/p99 ms | long p50/p99 ms | req/s | batches (mean) | padding "
        "waste | model time / fit | sim b·max: short/long p99 ms (err) | sim step: "
        "short/long p99 ms (err) | sim live (the run's own model samples; median of "
        f"{LIVE_DRAWS} jitter draws): short/long p99 ms (err; the draws' range) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in report["configs"].items():
        s, lg = r["latency_ms"][str(SHORT)], r["latency_ms"][str(LONG)]
        sims = []
        for kind in KINDS:
            p = r["predicted"][kind]
            e = p["error_pct"]
            sims.append(
                f"{_f(p['latency_ms'].get(str(SHORT), {}).get('p99'))}/"
                f"{_f(p['latency_ms'].get(str(LONG), {}).get('p99'))} "
                f"({_f(e['short_p99'], '+.0f')}%/{_f(e['long_p99'], '+.0f')}%)"
                + "".join(f"; {name} {lo:.0f}–{hi:.0f}" for name, (lo, hi) in zip(
                    ("draws: short", "long"), (p.get("p99_range_ms") or {}).values(),
                    strict=False)))
        lines.append(
            f"| {name} | {_f(s['p50'])}/{_f(s['p99'])} | {_f(lg['p50'])}/{_f(lg['p99'])} | "
            f"{_f(r['throughput_rps'], '.1f')} | {r['batches']} ({_f(r['mean_batch'], '.2f')})"
            f" | {r['padding_waste']:.1%} | {_f(r['model_time_vs_fit'], '.2f')} | "
            + " | ".join(sims) + " |")
    missing = {n: r["unanswered"] + r["failed"] for n, r in report["configs"].items()
               if r["unanswered"] or r["failed"]}
    if missing:
        lines.append(f"\nNOT ANSWERED: {missing}")
    lines.append("")
    for c in report["checks"]:
        lines.append(f"- {'PASS' if c['ok'] else 'MISS'}: {c['check']}: {c['value']}")
    return "\n".join(lines)

