"""Gateway throughput against AsyncProducer direct, side by side in one run:

    python -m batchgate.bench.gateway_load                     # 32 and 1,000 connections
    python -m batchgate.bench.gateway_load --connections 32 --workers 1,2 --duration 10

One private `redis-server`, one `batchgate consumer` with the no-op model behind it, then
for each concurrency N: N asyncio tasks of one AsyncProducer (a child process) submitting
and awaiting one request after another, and `wrk` with N connections POSTing
`{"payload": ..., "wait": true}` to `batchgate gateway --workers W` for each W. Answers
other than 2xx and socket errors are counted, never folded into the rate; CPU per request
is the AsyncProducer process's, or the gateway's with all its workers. Needs `wrk` on
PATH (Debian: apt-get install wrk) and the gateway extra.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

WRK_SCRIPT = """
wrk.method = "POST"
wrk.body = '{"payload": {"text": "hello", "n": 1}, "wait": true, "timeout_s": 60}'
wrk.headers["Content-Type"] = "application/json"
"""
CONSUMER = ["--model", "consumer.models:noop", "--strategy", "dynamic",
            "--max-batch-size", "256", "--max-queue-delay-ms", "1"]


def direct(url: str, queue: str, concurrency: int, duration: float) -> dict:
    """Closed loop through AsyncProducer: submit, await the result, again."""
    from producer import AsyncProducer

    latencies: list[float] = []
    errors = 0

    async def run() -> float:
        nonlocal errors
        async with AsyncProducer(url, queue) as p:
            await (await p.submit({"warm": 1})).result(timeout=30)
            stop = time.monotonic() + duration

            async def worker() -> None:
                nonlocal errors
                while time.monotonic() < stop:
                    start = time.monotonic()
                    try:
                        handle = await p.submit({"text": "hello", "n": 1})
                        await handle.result(timeout=60)
                        latencies.append(time.monotonic() - start)
                    except Exception:
                        errors += 1

            start = time.monotonic()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            return time.monotonic() - start

    cpu = time.process_time()
    elapsed = asyncio.run(run())
    cpu = time.process_time() - cpu
    latencies.sort()
    return {"rate": len(latencies) / elapsed, "errors": errors,
            "p50_ms": _pct(latencies, 0.5) * 1000, "p99_ms": _pct(latencies, 0.99) * 1000,
            "cpu_us": cpu / max(1, len(latencies)) * 1e6}


def _pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of a process and its children (Linux /proc)."""
    total = 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except (OSError, IndexError, ValueError):
        return total
    return total + sum(tree_cpu_s(int(child)) for child in children)


def wrk(url: str, script: Path, connections: int, duration: float, pid: int) -> dict:
    cpu = tree_cpu_s(pid)
    out = subprocess.run(["wrk", "-t2", f"-c{connections}", f"-d{duration:g}s", "--latency",
                          "--timeout", "60s", "-s", str(script), url + "/v1/requests"],
                         capture_output=True, text=True, check=True).stdout
    cpu = tree_cpu_s(pid) - cpu
    total = int(re.search(r"(\d+) requests in", out).group(1))
    seconds = float(re.search(r"requests in ([\d.]+)s", out).group(1))
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    non2xx = int(bad.group(1)) if bad else 0
    return {"rate": (total - non2xx) / seconds, "errors": non2xx + (
        sum(int(x) for x in sock.groups()) if sock else 0),
        "p50_ms": _latency(out, "50%"), "p99_ms": _latency(out, "99%"),
        "cpu_us": cpu / max(1, total) * 1e6}


def _latency(out: str, label: str) -> float:
    m = re.search(rf"{label}\s+([\d.]+)(us|ms|s)\b", out)
    if not m:
        return float("nan")
    return float(m.group(1)) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[m.group(2)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", default="32,1000")
    parser.add_argument("--workers", default="1,2", help="gateway --workers values")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per cell")
    parser.add_argument("--json", type=Path, help="also write the cells here")
    args = parser.parse_args(argv)
    if not shutil.which("wrk"):
        sys.exit("wrk is not on PATH (Debian: apt-get install wrk)")

    from batchgate.embedded import embedded_redis, free_port
    from batchgate.processes import ChildProcess

    levels = [int(x) for x in args.connections.split(",")]
    workers = [int(x) for x in args.workers.split(",")]
    cells: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bg-gwload-") as tmp, embedded_redis() as url:
        script = Path(tmp) / "post.lua"
        script.write_text(WRK_SCRIPT)
        queue = "gwload"
        cli = [sys.executable, "-m", "batchgate.cli"]
        consumer = ChildProcess([*cli, "consumer", "--redis-url", url, "--queue", queue,
                                 *CONSUMER], Path(tmp) / "consumer.log", b"ready on queue")
        children = [consumer]
        try:
            _wait(consumer.ready, "consumer")
            gateways = {}
            for w in workers:
                port = free_port()
                gateway = ChildProcess([*cli, "gateway", "--redis-url", url, "--queue", queue,
                                        "--port", str(port), "--no-access-log",
                                        "--workers", str(w)], Path(tmp) / f"gw{w}.log", b"")
                children.append(gateway)
                gateways[w] = (f"http://127.0.0.1:{port}", gateway.proc.pid)
                _wait(lambda b=gateways[w][0], g=gateway: g.ready() and _healthy(b),
                      f"gateway --workers {w}")
            time.sleep(1)  # every worker up, not only the first
            for n in levels:
                row = run_direct(url, queue, n, args.duration)
                cells.append({"what": "AsyncProducer direct", "connections": n, **row})
                _progress(cells[-1])
                for w, (base, pid) in gateways.items():
                    cells.append({"what": f"gateway --workers {w}", "connections": n,
                                  **wrk(base, script, n, args.duration, pid)})
                    _progress(cells[-1])
        finally:
            for child in children:
                child.terminate()
            for child in children:
                child.reap()
    print(table(cells, levels))
    if args.json:
        args.json.write_text(json.dumps(cells, indent=1))


def run_direct(url: str, queue: str, n: int, duration: float) -> dict:
    out = subprocess.run([sys.executable, "-m", "batchgate.bench.gateway_load", "--direct",
                          url, queue, str(n), str(duration)], capture_output=True, text=True,
                         check=True, timeout=duration * 10 + 60)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _healthy(base: str) -> bool:
    try:
        with urllib.request.urlopen(base + "/healthz", timeout=1) as answer:
            return answer.status == 200
    except OSError:
        return False


def _wait(ready, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready after {timeout}s")
        time.sleep(0.05)


def _progress(cell: dict) -> None:
    print(f"  N={cell['connections']:<5} {cell['what']:22} {cell['rate']:>8,.0f} req/s  "
          f"p50 {cell['p50_ms']:.1f} ms  p99 {cell['p99_ms']:.1f} ms  "
          f"CPU {cell['cpu_us']:.0f} µs/req  errors {cell['errors']}",
          file=sys.stderr, flush=True)


def table(cells: list[dict], levels: list[int]) -> str:
    lines = ["| N (connections / tasks) | client | req/s | p50 ms | p99 ms | not 2xx or "
             "errors | client process CPU µs/req | vs direct |",
             "|---|---|---|---|---|---|---|---|"]
    for n in levels:
        row = [c for c in cells if c["connections"] == n]
        base = next(c["rate"] for c in row if c["what"].startswith("AsyncProducer"))
        for c in row:
            lines.append(f"| {n:,} | {c['what']} | {c['rate']:,.0f} | {c['p50_ms']:.1f} | "
                         f"{c['p99_ms']:.1f} | {c['errors']:,} | {c['cpu_us']:,.0f} | "
                         f"{c['rate'] / base:.2f}× |")
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--direct"]:
        url, queue, n, duration = sys.argv[2:6]
        print(json.dumps(direct(url, queue, int(n), float(duration))))
    else:
        main()
