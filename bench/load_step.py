"""A load step: max_queue_delay_ms=auto against fixed delays, side by side in one run.

    python -m bench.load_step                      # 4 phases of 30 s per mode
    python -m bench.load_step --phase-s 8 --out /tmp/step

The arrival rate steps through --rates (default 20 -> 300 -> 1,200 -> 20 requests/s,
Poisson, --phase-s each, the same seeded arrivals for every mode). One `batchgate
consumer` serves a dynamic queue (max_batch_size 32) on the sleep model t(b) = 5 + 0.5·b
ms (consumer.models:synthetic), against a private redis-server; each mode gets a queue and
a consumer of its own, one mode after the other: fixed delays of 5 and 50 ms, and `auto`
with --slo-p99-ms (default 60). Latency runs from a request's scheduled arrival (open
loop) to its result at the producer.

Per phase and mode it prints p50/p99 latency, throughput (results per second within the
phase) and mean batch, then the checks: auto meets the SLO in every phase where a fixed
delay does; its light-phase p99 is at most t(1) + 10 ms; its heavy-phase throughput is at
least 95% of the better fixed delay. --out gets results.json and load_step.png (the
delay in use and the p99 per second over time). docs/benchmarks.md ("A load step") has a
run's figures.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import redis

from batchgate.embedded import embedded_redis
from batchgate.processes import ChildProcess, wait_all_ready
from batchgate.verdict import check_lines, host_load, missed
from producer import Producer
from scheduler_core.admin import store_policy
from scheduler_core.auto_delay import STATS_DELAY_US
from scheduler_core.keys import QueueKeys
from scheduler_core.load import arrival_rate
from scheduler_core.policy import Policy
from scheduler_core.wire import Result

BASE_MS, PER_ITEM_MS, BATCH = 5.0, 0.5, 32
MODES = ("fixed-5", "fixed-50", "auto")
SAMPLE_S = 0.25  # how often the delay in use and the rate are read
DRAIN_S = 30.0


def arrivals(rates: list[float], phase_s: float, seed: int) -> list[float]:
    """Poisson arrival times (s from the start), rate rates[k] during phase k."""
    rng, times = random.Random(seed), []
    for k, rate in enumerate(rates):
        t, end = k * phase_s, (k + 1) * phase_s
        while True:
            t += rng.expovariate(rate)
            if t >= end:
                break
            times.append(t)
    return times


def policy_of(mode: str, slo_ms: int) -> Policy:
    if mode == "auto":
        return Policy.build("dynamic", max_batch_size=BATCH, max_queue_delay_ms="auto",
                            slo_p99_ms=slo_ms)
    return Policy.build("dynamic", max_batch_size=BATCH,
                        max_queue_delay_ms=int(mode.split("-")[1]))


def run_mode(url: str, mode: str, times: list[float], slo_ms: int, out: Path) -> dict[str, Any]:
    queue = f"step-{mode}"
    client = redis.Redis.from_url(url)
    policy = policy_of(mode, slo_ms)
    store_policy(client, queue, policy, replace=True)
    consumer = ChildProcess(
        [sys.executable, "-m", "batchgate.cli", "consumer", "--redis-url", url, "--queue",
         queue, "--model", "consumer.models:synthetic", "--model-arg", f"base_ms={BASE_MS}",
         "--model-arg", f"per_item_ms={PER_ITEM_MS}"], out / f"consumer-{mode}.log",
        b"ready on queue")
    wait_all_ready([consumer], 60)
    n = len(times)
    seen = [0.0] * n
    index: dict[str, int] = {}
    lock = threading.Lock()
    pending: list[Result] = []

    def on_result(result: Result) -> None:
        now = time.perf_counter()
        with lock:
            i = index.get(result.id)
            if i is None:
                pending.append(result)  # its submit has not returned yet
            else:
                seen[i] = now

    samples: list[tuple[float, float, float]] = []  # (t, delay ms in use, rate)
    stop = threading.Event()
    keys = QueueKeys(queue)

    def sample(base: float) -> None:
        reader = redis.Redis.from_url(url)
        while not stop.wait(SAMPLE_S):
            if policy.auto_delay:
                raw = reader.hget(keys.stats, STATS_DELAY_US)
                delay = int(raw) / 1000 if raw is not None else 0.0
            else:
                delay = float(policy.max_queue_delay_ms)
            samples.append((time.perf_counter() - base, delay,
                            arrival_rate(reader, keys, window_s=2)))
        reader.close()

    producer = Producer(url, queue, on_result=on_result).connect()
    base = time.perf_counter() + 0.2
    sampler = threading.Thread(target=sample, args=(base,), daemon=True)
    sampler.start()
    i = 0
    try:
        while i < n:
            now = time.perf_counter() - base
            if times[i] > now:
                time.sleep(min(times[i] - now, 0.002))
                continue
            j = i + 1
            while j < n and times[j] <= now:
                j += 1
            handles = producer.submit_many([{"i": k} for k in range(i, j)])
            with lock:
                for k, h in zip(range(i, j), handles, strict=True):
                    index[h.id] = k
                for r in pending:
                    if r.id in index:
                        seen[index[r.id]] = time.perf_counter()
                pending[:] = [r for r in pending if r.id not in index]
            i = j
        deadline = time.monotonic() + DRAIN_S
        while sum(1 for s in seen if s) < n and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        sampler.join()
        producer.close()
        consumer.terminate()
        consumer.reap()
        stats = client.hgetall(keys.stats)
        client.close()
    counters = {k.decode(): int(v) for k, v in stats.items()}
    latency = [(seen[k] - base - times[k]) * 1000 if seen[k] else None for k in range(n)]
    done = [seen[k] - base if seen[k] else None for k in range(n)]
    return {"mode": mode, "latency_ms": latency, "done_s": done, "samples": samples,
            "batches": counters.get("batches", 0),
            "batched_requests": counters.get("batched_requests", 0)}


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, int(q * len(values) + 0.5) - 1))]


def phase_table(run: dict[str, Any], times: list[float], rates: list[float],
                phase_s: float) -> list[dict[str, Any]]:
    rows = []
    for k, rate in enumerate(rates):
        lo, hi = k * phase_s, (k + 1) * phase_s
        members = [i for i, t in enumerate(times) if lo <= t < hi]
        lat = [run["latency_ms"][i] for i in members]
        answered = [x for x in lat if x is not None]
        # a request never answered counts as infinitely late
        p99 = pct(answered, 0.99) if len(answered) == len(lat) else float("inf")
        finished = sum(1 for d in run["done_s"] if d is not None and lo <= d < hi)
        delays = [d for t, d, _ in run["samples"] if lo <= t < hi]
        rows.append({"phase": k + 1, "rate": rate, "requests": len(members),
                     "p50_ms": pct(answered, 0.5), "p99_ms": p99,
                     "throughput_rps": finished / phase_s,
                     "delay_ms_mean": sum(delays) / len(delays) if delays else None,
                     "unanswered": len(lat) - len(answered)})
    return rows


def checks(table: dict[str, list[dict[str, Any]]], rates: list[float], slo_ms: float
           ) -> list[tuple[str, bool, str]]:
    out = []
    auto = table["auto"]
    for k in range(len(rates)):
        fixed_ok = [m for m in ("fixed-5", "fixed-50") if table[m][k]["p99_ms"] <= slo_ms]
        if fixed_ok:
            ok = auto[k]["p99_ms"] <= slo_ms
            out.append((f"phase {k + 1} ({rates[k]:g}/s): auto p99 <= SLO {slo_ms:g} ms "
                        f"(met by {', '.join(fixed_ok)})", ok, f"{auto[k]['p99_ms']:.1f} ms"))
    light = min(rates)
    bound = BASE_MS + PER_ITEM_MS + 10
    for k, rate in enumerate(rates):
        if rate == light:
            p99 = auto[k]["p99_ms"]
            out.append((f"phase {k + 1} ({rate:g}/s): auto p99 <= t(1) + 10 ms = {bound:g} ms",
                        p99 <= bound, f"{p99:.1f} ms"))
    heavy = rates.index(max(rates))
    best = max(table[m][heavy]["throughput_rps"] for m in ("fixed-5", "fixed-50"))
    got = auto[heavy]["throughput_rps"]
    out.append((f"phase {heavy + 1} ({rates[heavy]:g}/s): auto throughput >= 95% of the "
                "better fixed delay", got >= 0.95 * best, f"{got:.1f} vs {best:.1f} req/s"))
    return out


def plot(runs: list[dict[str, Any]], rates: list[float], phase_s: float, slo_ms: float,
         path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"fixed-5": "tab:blue", "fixed-50": "tab:orange", "auto": "tab:green"}
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    span = phase_s * len(rates)
    for run in runs:
        xs = [t for t, _, _ in run["samples"]]
        top.step(xs, [d for _, d, _ in run["samples"]], where="post",
                 color=colors[run["mode"]], label=run["mode"])
        # p99 of the requests scheduled in each second
        per_s: dict[int, list[float]] = {}
        for t, lat in zip(run["times"], run["latency_ms"], strict=True):
            if lat is not None:
                per_s.setdefault(int(t), []).append(lat)
        secs = sorted(per_s)
        bottom.plot(secs, [pct(per_s[s], 0.99) for s in secs], color=colors[run["mode"]],
                    label=run["mode"], linewidth=1.2)
    auto = next(r for r in runs if r["mode"] == "auto")
    rate_ax = top.twinx()
    rate_ax.plot([t for t, _, _ in auto["samples"]], [r for _, _, r in auto["samples"]],
                 ":", color="gray", label="measured rate (req/s)")
    rate_ax.set_ylabel("measured arrival rate, req/s")
    bottom.axhline(slo_ms, color="red", linestyle="--", linewidth=1, label=f"SLO {slo_ms:g} ms")
    for ax in (top, bottom):
        for k in range(1, len(rates)):
            ax.axvline(k * phase_s, color="lightgray", linewidth=0.8)
        ax.set_xlim(0, span)
    top.set_ylabel("max_queue_delay in use, ms")
    top.set_title("load step " + " -> ".join(f"{r:g}" for r in rates) + " req/s, "
                  f"{phase_s:g} s each; t(b) = {BASE_MS:g} + {PER_ITEM_MS:g}·b ms, 1 consumer")
    top.legend(loc="upper left", fontsize=8)
    rate_ax.legend(loc="upper right", fontsize=8)
    bottom.set_yscale("log")
    bottom.set_ylabel("p99 latency per second, ms")
    bottom.set_xlabel("seconds")
    bottom.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def render(table: dict[str, list[dict[str, Any]]], checks: list[dict[str, Any]],
           host: dict[str, Any]) -> str:
    lines = ["| phase | rate/s | mode | p50 ms | p99 ms | throughput/s | delay in use ms "
             "(mean) |", "|---|---|---|---|---|---|---|"]
    phases = len(next(iter(table.values())))
    for k in range(phases):
        for mode in MODES:
            row = table[mode][k]
            delay = "—" if row["delay_ms_mean"] is None else f"{row['delay_ms_mean']:.1f}"
            p50 = "—" if row["p50_ms"] is None else f"{row['p50_ms']:.1f}"
            lines.append(f"| {k + 1} | {row['rate']:g} | {mode} | {p50} | "
                         f"{row['p99_ms']:.1f} | {row['throughput_rps']:.1f} | {delay} |")
    return "\n".join([*lines, "", *check_lines(checks, host)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phase-s", type=float, default=30.0, help="seconds per phase")
    parser.add_argument("--rates", default="20,300,1200,20", help="requests/s per phase")
    parser.add_argument("--slo-p99-ms", type=int, default=60, help="the auto mode's target")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 when any check is missed")
    parser.add_argument("--out", type=Path, default=Path("bench/results/load-step"))
    args = parser.parse_args(argv)
    rates = [float(x) for x in args.rates.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    times = arrivals(rates, args.phase_s, args.seed)
    runs = []
    with embedded_redis() as url:
        for mode in MODES:
            print(f"{mode}: {len(times)} requests over {args.phase_s * len(rates):g} s ...",
                  flush=True)
            run = run_mode(url, mode, times, args.slo_p99_ms, args.out)
            run["times"] = times
            runs.append(run)
    table = {run["mode"]: phase_table(run, times, rates, args.phase_s) for run in runs}
    results = [{"check": t, "ok": ok, "value": v}
               for t, ok, v in checks(table, rates, args.slo_p99_ms)]
    host = host_load()
    text = render(table, results, host)
    print(text)
    plot(runs, rates, args.phase_s, args.slo_p99_ms, args.out / "load_step.png")
    summary = {"rates": rates, "phase_s": args.phase_s, "slo_p99_ms": args.slo_p99_ms,
               "seed": args.seed, "table": table,
               "mean_batch": {r["mode"]: (r["batched_requests"] / r["batches"]
                                          if r["batches"] else None) for r in runs},
               "checks": results, "host": host,
               "samples": {r["mode"]: r["samples"] for r in runs}}
    (args.out / "results.json").write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    (args.out / "results.md").write_text(text + "\n")
    print(f"wrote {args.out}/results.json, results.md, load_step.png")
    return 1 if args.strict and missed(results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
