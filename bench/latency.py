"""Where one request's time goes at light load, hop by hop, beside the raw Redis path.

    python -m bench.latency [--requests 400] [--rate 50] [--load 4000]
    python -m bench.latency --against ../main --gateway   # the issue's whole set, one run

Two private redis-servers (one per path, so that each one's CPU is its path's own):

- batchgate: a fifo queue of batch 1, a no-op model, one consumer process
  (bench/workers/stamped_consumer.py: `consumer.worker.Worker` with clock readings at its
  hops), a `Producer` in this process;
- raw: the 4-hop path, LPUSH -> BLPOP in a consumer (bench/workers/raw_echo.py) -> LPUSH
  of the reply -> BLPOP here, in the submitting thread.

Requests arrive open loop (exponential gaps at --rate per second), alternating between the
two paths, one thread submitting and waiting, so that each request finds both systems
idle. Printed: the median and p99 of each hop, of the whole path, the ratios
batchgate/raw, and each Redis' CPU per request over the run (`INFO cpu`).

With --load N (0 to skip): Redis CPU per request under load, N requests from 8 threads
at batch 1 (fifo, one submit per request) and N through `submit_many` at batch 32
(dynamic), against the raw path's 8 threads; with the commands per request inside the
scripts (`INFO commandstats`).

With --against DIR (another checkout, e.g. main's; needs valgrind): Redis' instructions
per request before (DIR) and after (this checkout) at batch 1 and batch 32
(scripts/script_instructions.py --against). With --gateway: `bench.gateway_load` at 32
and 1,000 connections, `--workers 2`, against the AsyncProducer direct. Ends with
`summary: N of M checks met` (light-load p50 and p99 within 1.3x the raw path; with
--against, a request's instructions end to end at most half DIR's at batch 1 and 32;
with --gateway, the gateway at least 0.5x direct with no non-2xx answer at each
concurrency); --strict exits 1 unless all are met.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import orjson
import redis

from batchgate.embedded import embedded_redis
from bench.common import redis_cpu_s, worker_env
from producer.sync import Producer
from scheduler_core.admin import ensure_policy
from scheduler_core.lifetime import spawn

THREADS = 8  # submitting threads of the load section

# (label, start stamp, end stamp) of batchgate's hops, in path order; the stamps are named
# in `bg_stamps`. Two side hops (the producer's enqueue reply, the consumer's completion
# reply) run beside the path and are printed after it.
BG_HOPS = [
    ("submit -> enqueued in Redis", "submit", "enqueued"),
    ("enqueued -> popped in Redis (wake-up)", "enqueued", "popped"),
    ("popped -> pop reply parsed", "popped", "pop_reply"),
    ("pop reply -> model start (decode)", "pop_reply", "model_start"),
    ("model (no-op)", "model_start", "model_end"),
    ("model end -> listener receive", "model_end", "received"),
    ("listener receive -> handle resolved", "received", "resolved"),
    ("total: submit -> handle resolved", "submit", "resolved"),
    ("side: submit -> submit() returns", "submit", "submitted"),
    ("side: model end -> complete reply", "model_end", "complete_reply"),
]
RAW_HOPS = [
    ("LPUSH -> consumer BLPOP returns", "submit", "popped"),
    ("consumer: pop -> reply sent", "popped", "replied"),
    ("reply LPUSH -> producer BLPOP returns", "replied", "resolved"),
    ("total: LPUSH -> reply in hand", "submit", "resolved"),
]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def start_worker(module: str, *args: str) -> subprocess.Popen[bytes]:
    child = spawn([sys.executable, "-m", f"bench.workers.{module}", *args],
                  stdout=subprocess.PIPE, env=worker_env())
    assert child.stdout is not None
    if child.stdout.readline().strip() != b"ready":
        raise RuntimeError(f"bench.workers.{module} did not start")
    return child


def stop_worker(child: subprocess.Popen[bytes]) -> None:
    child.terminate()
    try:
        child.wait(timeout=15)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


class Light:
    """The light-load run: one request at a time on each path."""

    def __init__(self, bg_url: str, raw_url: str, out_dir: Path):
        self.bg_url, self.raw_url = bg_url, raw_url
        self.stamps_file = out_dir / "consumer.jsonl"
        ensure_policy(redis.Redis.from_url(bg_url), "light",
                      {"strategy": "fifo", "max_batch_size": 1})
        self.received: dict[str, float] = {}
        self.consumer = start_worker("stamped_consumer", "--redis-url", bg_url, "--queue",
                                     "light", "--out", str(self.stamps_file))
        self.raw_consumer = start_worker("raw_echo", "--redis-url", raw_url, "--queue", "raw")
        self.producer = Producer(bg_url, "light",
                                 on_result=lambda r: self.received.setdefault(r.id, time.time())
                                 ).connect()
        self.raw = redis.Redis.from_url(raw_url)
        self.bg_rows: dict[str, dict[str, float]] = {}
        self.raw_rows: list[dict[str, float]] = []

    def one_bg(self, i: int) -> None:
        submit = time.time()
        handle = self.producer.submit({"i": i})
        submitted = time.time()
        handle.result(timeout=30)
        self.bg_rows[handle.id] = {"submit": submit, "submitted": submitted,
                                   "resolved": time.time()}

    def one_raw(self, i: int) -> None:
        reply = f"raw:reply:{i}"
        submit = time.time()
        self.raw.lpush("raw", reply)
        got = self.raw.blpop([reply], timeout=30)
        resolved = time.time()
        assert got is not None
        popped, replied = (float(x) for x in got[1].split(b":"))
        self.raw_rows.append({"submit": submit, "popped": popped, "replied": replied,
                              "resolved": resolved})

    def run(self, n: int, rate: float) -> tuple[float, float]:
        """n requests per path; returns each Redis' CPU µs per request."""
        for i in range(20):  # warm both paths (connections, scripts, first allocations)
            self.one_bg(-i)
            self.one_raw(-i)
        self.bg_rows.clear()
        self.raw_rows.clear()
        bg_redis, raw_redis = redis.Redis.from_url(self.bg_url), self.raw
        cpu0 = redis_cpu_s(bg_redis), redis_cpu_s(raw_redis)
        gaps = random.Random(7)
        at = time.monotonic()
        for i in range(2 * n):
            at += gaps.expovariate(rate)
            time.sleep(max(0.0, at - time.monotonic()))
            (self.one_bg if i % 2 == 0 else self.one_raw)(i)
        cpu = ((redis_cpu_s(bg_redis) - cpu0[0]) / n * 1e6,
               (redis_cpu_s(raw_redis) - cpu0[1]) / n * 1e6)
        self.producer.close()
        stop_worker(self.consumer)
        stop_worker(self.raw_consumer)
        for line in self.stamps_file.read_bytes().splitlines():
            rid, arrival_us, popped_us, pop_reply, start, end, complete = orjson.loads(line)
            row = self.bg_rows.get(rid)
            if row is not None:
                row.update(enqueued=arrival_us / 1e6, popped=popped_us / 1e6,
                           pop_reply=pop_reply, model_start=start, model_end=end,
                           complete_reply=complete, received=self.received[rid])
        return cpu

    def report(self, cpu: tuple[float, float]) -> list[tuple[str, bool]]:
        bg = [row for row in self.bg_rows.values() if "received" in row]
        print(f"light load: fifo, batch 1, no-op model; {len(bg)} batchgate and "
              f"{len(self.raw_rows)} raw requests, alternating, open loop")
        print(f"{'hop':42s} {'p50 ms':>8s} {'p99 ms':>8s}")

        def hops(rows: list[dict[str, float]], spec: list[tuple[str, str, str]]
                 ) -> dict[str, tuple[float, float]]:
            out = {}
            for label, a, b in spec:
                values = [(row[b] - row[a]) * 1000 for row in rows]
                out[label] = (statistics.median(values), pct(values, 0.99))
                print(f"  {label:40s} {out[label][0]:8.3f} {out[label][1]:8.3f}")
            return out

        print("batchgate")
        got = hops(bg, BG_HOPS)
        print("raw 4-hop path")
        raw = hops(self.raw_rows, RAW_HOPS)
        (b50, b99), (r50, r99) = got[BG_HOPS[7][0]], raw[RAW_HOPS[3][0]]
        print(f"ratio batchgate/raw: p50 {b50 / r50:.2f}x, p99 {b99 / r99:.2f}x")
        print(f"Redis CPU per request (INFO cpu, idle time between requests included): "
              f"batchgate {cpu[0]:.1f} µs, raw {cpu[1]:.1f} µs")
        return [(f"light-load p50 within 1.3x the raw path ({b50 / r50:.2f}x)", b50 / r50 <= 1.3),
                (f"light-load p99 within 1.3x the raw path ({b99 / r99:.2f}x)", b99 / r99 <= 1.3)]


def commandstats(client: redis.Redis) -> dict[str, tuple[int, int]]:
    return {name[len("cmdstat_"):]: (v["calls"], v["usec"])
            for name, v in client.info("commandstats").items()}


def load_cpu(bg_url: str, raw_url: str, n: int, out_dir: Path) -> None:
    """Redis CPU per request under load, batch 1 and batch 32, and the raw path's."""
    client = redis.Redis.from_url(bg_url)
    ensure_policy(client, "load1", {"strategy": "fifo", "max_batch_size": 1})
    ensure_policy(client, "load32", {"strategy": "dynamic", "max_batch_size": 32,
                                     "max_queue_delay_ms": 2})
    consumers = [start_worker("stamped_consumer", "--redis-url", bg_url, "--queue", q,
                              "--out", str(out_dir / f"{q}.jsonl")) for q in ("load1", "load32")]
    raw_consumer = start_worker("raw_echo", "--redis-url", raw_url, "--queue", "rawload")
    try:
        with Producer(bg_url, "load1").connect() as one, \
                Producer(bg_url, "load32").connect() as many:
            def batch1() -> None:
                handles = [one.submit({"i": i}) for i in range(n // THREADS)]
                for h in handles[-1:]:
                    h.result(timeout=60)

            def batch32() -> None:
                handles = [h for s in range(0, n, 1000) for h in
                           many.submit_many([{"i": i} for i in range(s, min(n, s + 1000))])]
                for h in handles:
                    h.result(timeout=60)

            def raw() -> None:
                conn = redis.Redis.from_url(raw_url)
                me = f"rawload:reply:{threading.get_ident()}"
                for _ in range(n // THREADS):
                    conn.lpush("rawload", me)
                    conn.blpop([me], timeout=30)

            rows = [("batchgate, batch 1 (8 threads)", client, batch1, THREADS),
                    ("batchgate, batch 32 (submit_many)", client, batch32, 1),
                    ("raw path (8 threads)", redis.Redis.from_url(raw_url), raw, THREADS)]
            for label, server, work, threads in rows:
                time.sleep(0.5)
                cpu0, stats0 = redis_cpu_s(server), commandstats(server)
                pool = [threading.Thread(target=work) for _ in range(threads)]
                for t in pool:
                    t.start()
                for t in pool:
                    t.join()
                time.sleep(0.2)  # the last completions' listener pops
                cpu = (redis_cpu_s(server) - cpu0) / n * 1e6
                stats1 = commandstats(server)
                calls = {k: (v[0] - stats0.get(k, (0, 0))[0]) / n for k, v in stats1.items()}
                top = ", ".join(f"{k} {v:.2f}" for k, v in
                                sorted(calls.items(), key=lambda kv: -kv[1])[:8] if v >= 0.05
                                and k not in ("info",))
                print(f"{label:36s} Redis CPU {cpu:6.1f} µs/request; calls/request: {top}")
    finally:
        for child in (*consumers, raw_consumer):
            stop_worker(child)


ROOT = Path(__file__).resolve().parents[1]
END_TO_END = re.compile(r"^(a single submit end to end|a request end to end \(backlog\))"
                        r"\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x$", re.M)


def instructions(against: Path) -> list[tuple[str, bool]]:
    """scripts/script_instructions.py --against at batch 1 and batch 32: its output, and
    whether a request's instructions end to end are at most half the other checkout's."""
    checks = []
    for batch, requests, which in ((1, 2000, "a single submit end to end"),
                                   (32, 4000, "a request end to end (backlog)")):
        print(f"\ninstructions per request, batch {batch} (callgrind; before = {against})")
        done = subprocess.run([sys.executable, str(ROOT / "scripts" / "script_instructions.py"),
                               "--batch", str(batch), "--requests", str(requests),
                               "--against", str(against)],
                              capture_output=True, text=True, check=True)
        table = done.stdout[done.stdout.rindex("k instructions per request"):]
        print(table, end="")
        ratio = {m[0]: float(m[3]) for m in END_TO_END.findall(table)}.get(which)
        checks.append((f"batch {batch}: {which} at most 0.5x before "
                       f"({ratio if ratio is not None else '?'}x)",
                       ratio is not None and ratio <= 0.5))
    return checks


def gateway(repeat: int, duration: float) -> list[tuple[str, bool]]:
    """bench.gateway_load --workers 2 at 32 and 1,000 connections: its table, and whether
    the gateway reached 0.5x the AsyncProducer direct (median of rounds), all 2xx."""
    with tempfile.TemporaryDirectory() as tmp:
        cells_file = Path(tmp) / "cells.json"
        print("\ngateway, --workers 2 (bench.gateway_load)", flush=True)
        subprocess.run([sys.executable, "-m", "bench.gateway_load", "--workers", "2",
                        "--repeat", str(repeat), "--duration", str(duration),
                        "--json", str(cells_file)], check=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
        cells = json.loads(cells_file.read_text())
    cells = cells if isinstance(cells, list) else cells.get("cells", [])
    checks = []
    for n in (32, 1000):
        row = [c for c in cells if c["connections"] == n]
        direct = {c["round"]: c["rate"] for c in row if "direct" in c["what"]}
        ratios = [c["rate"] / direct[c["round"]] for c in row if "gateway" in c["what"]]
        errors = sum(c["errors"] for c in row if "gateway" in c["what"])
        med = statistics.median(ratios) if ratios else 0.0
        checks.append((f"gateway at {n} connections at least 0.5x direct ({med:.2f}x, "
                       f"{errors} non-2xx)", med >= 0.5 and errors == 0))
    return checks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=400, help="per path")
    parser.add_argument("--rate", type=float, default=50.0, help="arrivals per second")
    parser.add_argument("--load", type=int, default=4000, help="0 to skip")
    parser.add_argument("--against", type=Path,
                        help="another checkout: instructions per request before/after")
    parser.add_argument("--gateway", action="store_true", help="run bench.gateway_load too")
    parser.add_argument("--gateway-repeat", type=int, default=3)
    parser.add_argument("--gateway-duration", type=float, default=5.0)
    parser.add_argument("--strict", action="store_true", help="exit 1 unless all checks met")
    args = parser.parse_args()
    with ExitStack() as stack:
        bg_url = stack.enter_context(embedded_redis())
        raw_url = stack.enter_context(embedded_redis())
        out_dir = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        light = Light(bg_url, raw_url, out_dir)
        checks = light.report(light.run(args.requests, args.rate))
        if args.load:
            load_cpu(bg_url, raw_url, args.load, out_dir)
    if args.against is not None:
        checks += instructions(args.against.resolve())
    if args.gateway:
        checks += gateway(args.gateway_repeat, args.gateway_duration)
    print()
    for label, ok in checks:
        print(f"{'met' if ok else 'NOT met'}: {label}")
    met = sum(ok for _, ok in checks)
    print(f"summary: {met} of {len(checks)} checks met")
    if args.strict and met < len(checks):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
