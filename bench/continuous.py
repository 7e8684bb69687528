"""Static against continuous batching (issue 36) on the generator, side by side in one run.

    python -m bench.continuous                   # 3 configurations x 20 s
    python -m bench.continuous --duration-s 8    # a couple of minutes on 2 shared cores

The workload of bench.lengths (batchgate/lengths.py): 80% of the requests ask for 16 new
tokens, 20% for 256, Poisson at --load (0.6: the requests would take 60% of the
consumers' time one by one, t(1, cost) measured here at startup), the same seeded
arrivals for every configuration, through --consumers real `batchgate consumer`
processes per configuration (`consumer.models:generator`, bench.lengths' model size) on
a private redis-server. The configurations:

  static            dynamic, max_batch_size 8, max_queue_delay_ms 20, cost_mode padded:
                    one queue order, a short request may ride with a long one
  static+dedicated  as static, --cost-buckets 32 and the first consumer --only-bucket 1
                    (the best static configuration for short requests in bench.lengths)
  continuous        --batching continuous, fifo, max_batch_size 8: requests join and
                    leave the running batch at every step

Then, unless --no-crash, a continuous consumer SIGKILLed mid-generation with another
taking over: each request answered once, with its solo output.

Per configuration: the short and long requests' p50/p99 (from the scheduled arrival to
the result at the producer), requests/s and generated tokens/s; then the issue's targets
as PASS/MISS. --out gets results.json and results.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import orjson

from batchgate.embedded import embedded_redis
from batchgate.lengths import (
    LONG,
    LONG_SHARE,
    MODEL_ARGS,
    READY_TIMEOUT_S,
    SHORT,
    arrivals,
    pct,
    profile,
    rate_for,
    t1,
)
from batchgate.processes import ChildProcess, batchgate_argv, wait_all_ready
from batchgate.verdict import check_lines, host_load, missed
from producer.sync import Producer
from scheduler_core.errors import RequestFailed
from scheduler_core.wire import Result

STATIC = ("--strategy", "dynamic", "--max-batch-size", "8", "--max-queue-delay-ms", "20",
          "--cost-mode", "padded")
CONFIGS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # name: (flags of every consumer, extra flags of the first)
    "static": (STATIC, ()),
    "static+dedicated": (STATIC + ("--cost-buckets", "32"), ("--only-bucket", "1")),
    "continuous": (("--strategy", "fifo", "--max-batch-size", "8", "--batching",
                    "continuous"), ()),
}


def consumer_argv(url: str, queue: str, name: str, index: int, threads: int) -> list[str]:
    flags, first = CONFIGS[name]
    model_args = [a for k, v in MODEL_ARGS.items() for a in ("--model-arg", f"{k}={v}")]
    return [*batchgate_argv(), "--log-level", "WARNING", "consumer", "--redis-url", url,
            "--queue", queue, "--model", "consumer.models:generator", *model_args,
            "--torch-threads", str(threads), "--device", "cpu", *flags,
            *(first if index == 0 else ())]


def run_config(url: str, name: str, times: list[float], costs: list[int], consumers: int,
               threads: int, log_dir: Path) -> dict[str, Any]:
    queue = f"continuous-{name.replace('+', '-')}"
    with contextlib.ExitStack() as children:  # on leaving: all terminated, then reaped
        procs = [ChildProcess(consumer_argv(url, queue, name, i, threads),
                              log_dir / f"{queue}-{i}.log", b"ready on queue")
                 for i in range(consumers)]
        for p in procs:
            children.callback(p.reap)
        for p in procs:
            children.callback(p.terminate)
        wait_all_ready(procs, READY_TIMEOUT_S)
        return replay(url, queue, times, costs) | {"config": name}


def replay(url: str, queue: str, times: list[float], costs: list[int],
           drain_timeout_s: float = 60.0) -> dict[str, Any]:
    """Open loop: each request submitted at its offset; latency from that offset to its
    result at the producer."""
    arrived: dict[str, float] = {}

    def stamp(result: Result) -> None:
        arrived[result.id] = time.perf_counter()

    with Producer(url, queue, on_result=stamp).connect() as producer:
        start = time.perf_counter() + 0.1
        handles = []
        for k, offset in enumerate(times):  # open loop, each at its scheduled time
            time.sleep(max(0.0, start + offset - time.perf_counter()))
            handles.append(producer.submit({"prompt": f"request {k}"}, cost=costs[k]))
        values = []
        for h in handles:
            values.append(_value(h, drain_timeout_s))
            arrived.setdefault(h.id, time.perf_counter())  # the listener's stamp, else now
    latency: dict[int, list[float]] = {SHORT: [], LONG: []}
    last, tokens = start, 0
    for k, (h, value) in enumerate(zip(handles, values, strict=True)):
        if isinstance(value, dict):
            done = arrived[h.id]
            last = max(last, done)
            tokens += value["new_tokens"]
            latency[costs[k]].append((done - start - times[k]) * 1000)
    failed, unanswered = values.count("failed"), values.count("unanswered")
    elapsed = last - start
    answered = len(handles) - failed - unanswered
    return {"submitted": len(handles), "answered": answered, "failed": failed,
            "unanswered": unanswered, "elapsed_s": round(elapsed, 3),
            "throughput_rps": round(answered / elapsed, 2) if elapsed > 0 else None,
            "tokens_per_s": round(tokens / elapsed, 1) if elapsed > 0 else None,
            "latency_ms": {str(c): {"n": len(v), "p50": _r(pct(v, 0.5)),
                                    "p99": _r(pct(v, 0.99))} for c, v in latency.items()}}


def high_first_token(url: str, preempt: bool, threads: int, log_dir: Path,
                     samples: int = 5, slots: int = 4) -> dict[str, Any]:
    """A HIGH request (16 tokens) arriving while every slot of one continuous consumer
    runs LOW generation (256 tokens): its time to first token, `samples` times, with or
    without --preempt."""
    name = "preempt" if preempt else "no-preempt"
    queue = f"continuous-high-{name}"
    model_args = [a for k, v in MODEL_ARGS.items() for a in ("--model-arg", f"{k}={v}")]
    argv = [*batchgate_argv(), "--log-level", "WARNING", "consumer", "--redis-url", url,
            "--queue", queue, "--model", "consumer.models:generator", *model_args,
            "--model-arg", "stream=true", "--torch-threads", str(threads), "--device", "cpu",
            "--batching", "continuous", "--strategy", "priority", "--max-batch-size",
            str(slots), "--aging-ms", "0", *(("--preempt",) if preempt else ())]
    proc = ChildProcess(argv, log_dir / f"{queue}.log", b"ready on queue")
    ttft = []
    try:
        wait_all_ready([proc], READY_TIMEOUT_S)
        with Producer(url, queue).connect() as producer:
            for k in range(samples):
                lows = producer.submit_many([{"prompt": f"low {k} {j}"} for j in range(slots)],
                                            priority="LOW", cost=LONG)
                for low in lows:  # every slot runs
                    next(low.stream(timeout=120))
                started = time.perf_counter()
                high = producer.submit({"prompt": f"high {k}"}, priority="HIGH", cost=SHORT)
                next(high.stream(timeout=120))
                ttft.append((time.perf_counter() - started) * 1000)
                high.result(timeout=120)
                for low in lows:
                    low.result(timeout=300)
    finally:
        proc.terminate()
        proc.reap()
    return {"config": name, "slots": slots, "ttft_ms": [round(t, 1) for t in ttft],
            "p99": _r(pct(ttft, 0.99)), "p50": _r(pct(ttft, 0.5))}


def crash_rerun(url: str, threads: int, log_dir: Path, requests: int = 6) -> dict[str, Any]:
    """A continuous consumer (4 slots) SIGKILLed three tokens into the first of
    `requests` generations; another takes over: each request answered once (results
    delivered per id, counted at the producer), its output equal to its solo output (the
    same seeded generator in this process)."""
    from batchgate.lengths import build_generator

    queue = "continuous-crash"
    model_args = [a for k, v in MODEL_ARGS.items() for a in ("--model-arg", f"{k}={v}")]
    argv = [*batchgate_argv(), "--log-level", "WARNING", "consumer", "--redis-url", url,
            "--queue", queue, "--model", "consumer.models:generator", *model_args,
            "--model-arg", "stream=true", "--torch-threads", str(threads), "--device", "cpu",
            "--batching", "continuous", "--strategy", "fifo", "--max-batch-size", "4",
            "--lease-ms", "1000"]
    payloads = [{"prompt": f"crash {i}", "max_new_tokens": 64 + 32 * i}
                for i in range(requests)]
    deliveries: Counter[str] = Counter()
    procs = [ChildProcess(argv, log_dir / f"{queue}-{i}.log", b"ready on queue")
             for i in range(2)]
    try:
        wait_all_ready(procs[:1], READY_TIMEOUT_S)
        with Producer(url, queue, on_result=lambda r: deliveries.update([r.id])) \
                .connect() as producer:
            handles = producer.submit_many(payloads)
            tokens = handles[0].stream(timeout=120)
            for _ in range(3):
                next(tokens)
            procs[0].kill()
            wait_all_ready(procs[1:], READY_TIMEOUT_S)
            results = [_value(h, 120) for h in handles]
            time.sleep(0.5)  # a second delivery would land by now
    finally:
        for proc in procs:
            proc.terminate()
            proc.reap()
    solo = build_generator(**MODEL_ARGS)
    expected = [solo([payload])[0] for payload in payloads]
    return {"requests": requests,
            "answered_once": sum(deliveries[h.id] == 1 for h in handles),
            "equal_to_solo": sum(r == e for r, e in zip(results, expected, strict=True))}


def _value(handle: Any, timeout: float) -> Any:
    """The request's result, or "failed" / "unanswered"."""
    try:
        return handle.result(timeout=timeout)
    except TimeoutError:
        return "unanswered"
    except RequestFailed:
        return "failed"


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def checks(results: dict[str, Any], solo_short_ms: float,
           crash: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The issue's targets: continuous short p99 <= 1/2 the best static one and within
    2x a short request's own time alone; tokens/s >= 0.95x the best static; after a
    SIGKILL mid-generation every request answered once with its solo output."""
    out = []
    if crash is not None:
        n = crash["requests"]
        out.append({"check": "SIGKILL mid-generation: each request answered once, output "
                             "equal to its solo output",
                    "ok": crash["answered_once"] == crash["equal_to_solo"] == n,
                    "value": f"{crash['answered_once']} of {n} once, "
                             f"{crash['equal_to_solo']} of {n} equal"})
    cont = results.get("continuous")
    statics = {n: r for n, r in results.items() if n != "continuous"}
    if cont is None or not statics:
        return out
    short = {n: r["latency_ms"][str(SHORT)]["p99"] for n, r in results.items()}
    best = min((n for n in statics if short[n] is not None), key=lambda n: short[n],
               default=None)
    fastest = max(statics, key=lambda n: statics[n]["tokens_per_s"] or 0)
    if best is not None and short["continuous"] is not None:
        out.append({"check": f"continuous short p99 <= 1/2 of the best static ({best})",
                    "ok": short["continuous"] <= short[best] / 2,
                    "value": f"{short['continuous']} ms vs {short[best]} ms"})
        out.append({"check": "continuous short p99 within 2x a short request alone",
                    "ok": short["continuous"] <= 2 * solo_short_ms,
                    "value": f"{short['continuous']} ms vs {solo_short_ms:.0f} ms alone"})
    a, b = statics[fastest]["tokens_per_s"], cont["tokens_per_s"]
    out.append({"check": f"continuous tokens/s >= 0.95x the best static ({fastest})",
                "ok": bool(a and b and b >= 0.95 * a), "value": f"{b} vs {a} tokens/s"})
    return out


def render(report: dict[str, Any]) -> str:
    w = report["workload"]
    lines = [f"{w['requests']} requests ({w['short']} x {SHORT} tokens, {w['long']} x {LONG}),"
             f" Poisson {w['rate']:.2f} req/s for {w['duration_s']:g} s, load {w['load']:g};"
             f" {report['consumers']} consumers x {report['torch_threads']} torch thread(s);"
             f" t(1, {SHORT}) = {w['solo_short_ms']:.0f} ms, t(1, {LONG}) = "
             f"{w['solo_long_ms']:.0f} ms alone",
             "",
             "| configuration | short p50 | short p99 | long p50 | long p99 | req/s | tokens/s |",
             "|---|---|---|---|---|---|---|"]
    for name, r in report["configs"].items():
        s, long = r["latency_ms"][str(SHORT)], r["latency_ms"][str(LONG)]
        lines.append(f"| {name} | {s['p50']} | {s['p99']} | {long['p50']} | {long['p99']} | "
                     f"{r['throughput_rps']} | {r['tokens_per_s']} |")
    step_ms = w["solo_long_ms"] / LONG
    for h in report["high"]:
        lines.append(f"\nHIGH while {h['slots']} LOW slots run, {h['config']}: time to first token "
                     f"p50 {h['p50']} ms, p99 {h['p99']} ms (one step alone ~{step_ms:.0f} "
                     f"ms, a short prefill ~{w['solo_short_ms'] / SHORT:.0f} ms)")
    missing = {n: r["unanswered"] + r["failed"] for n, r in report["configs"].items()
               if r["unanswered"] or r["failed"]}
    if missing:
        lines.append(f"\nNOT ANSWERED: {missing}")
    return "\n".join([*lines, "", *check_lines(report["checks"], report["host"])])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=20.0,
                        help="seconds of arrivals per configuration")
    parser.add_argument("--load", type=float, default=0.6,
                        help="offered load (rate x mean t(1, cost) / consumers), from the "
                             "generator timed at startup")
    parser.add_argument("--rate", type=float, default=None,
                        help="requests/s instead of --load (a shared host's startup timing "
                             "may be far off)")
    parser.add_argument("--consumers", type=int, default=2)
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help="comma-separated, of " + ", ".join(CONFIGS))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--high-samples", type=int, default=5,
                        help="HIGH requests timed against full LOW slots, with and without "
                             "--preempt (0: skip)")
    parser.add_argument("--crash", action=argparse.BooleanOptionalAction, default=True,
                        help="a continuous consumer SIGKILLed mid-generation, another "
                             "taking over: each request answered once, output equal to solo")
    parser.add_argument("--strict", action="store_true", help="exit 1 on any MISS")
    parser.add_argument("--out", type=Path, default=Path("bench/results/continuous"))
    args = parser.parse_args(argv)
    names = [c for c in args.configs.split(",") if c]
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        parser.error(f"--configs: unknown {', '.join(unknown)}; use {', '.join(CONFIGS)}")
    threads = max(1, (os.cpu_count() or 1) // args.consumers)
    prof = profile(repeats=2, threads=threads, parallel=args.consumers)
    rate = args.rate or rate_for(args.load, args.consumers, prof)
    load = rate * ((1 - LONG_SHARE) * t1(prof, SHORT) + LONG_SHARE * t1(prof, LONG)) / 1000 \
        / args.consumers
    times, costs = arrivals(rate, args.duration_s, args.seed)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-continuous-"))
    results = {}
    with embedded_redis() as url:
        for name in names:
            print(f"{name}: {len(times)} requests over {args.duration_s:g} s ...", flush=True)
            results[name] = run_config(url, name, times, costs, args.consumers, threads,
                                       log_dir)
        high = [high_first_token(url, preempt, threads, log_dir, args.high_samples)
                for preempt in (False, True)] if args.high_samples else []
        crash = crash_rerun(url, threads, log_dir) if args.crash else None
    report = {"workload": {"rate": rate, "duration_s": args.duration_s, "load": round(load, 2),
                           "seed": args.seed, "requests": len(times),
                           "short": costs.count(SHORT), "long": costs.count(LONG),
                           "solo_short_ms": t1(prof, SHORT), "solo_long_ms": t1(prof, LONG)},
              "consumers": args.consumers, "torch_threads": threads, "model_args": MODEL_ARGS,
              "profile": prof, "configs": results, "high": high, "crash": crash,
              "host": host_load()}
    report["checks"] = checks(results, t1(prof, SHORT), crash)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    text = render(report)
    (args.out / "results.md").write_text(text + "\n")
    print(text)
    return 1 if args.strict and missed(report["checks"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
