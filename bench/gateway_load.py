"""Gateway throughput against AsyncProducer direct, side by side in one run:

    python -m bench.gateway_load                     # 32 and 1,000 connections
    python -m bench.gateway_load --connections 32 --workers 1,2 --repeat 5

One private `redis-server`, one `batchgate consumer` with the no-op model behind it, then
for each concurrency N, `--repeat` rounds of: N asyncio tasks of one AsyncProducer (a
child process) submitting and awaiting one request after another, and `wrk` with N
connections POSTing `{"payload": ..., "wait": true}` to `batchgate gateway --workers W`
for each W, each for `--duration` seconds. The clients take turns (their order rotates
from round to round), so that the machine's other load falls on all of them alike; each
round's gateway rate is divided by the same round's direct rate, and the table gives
the median of those ratios (and their range), with the median of each other column.
Answers other than 2xx and socket errors are counted, never folded into the rate; CPU
per request is the AsyncProducer process's, or the gateway's with all its workers (and
how it split between them: an uneven split is connections spread unevenly). The 1-minute
load average is printed with each trial. Needs `wrk` on PATH (Debian: apt-get install
wrk) and the gateway extra.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import NOOP_CONSUMER, http_healthy, tree_cpu_s, wait_until

WRK_SCRIPT = """
wrk.method = "POST"
wrk.body = '{"payload": {"text": "hello", "n": 1}, "wait": true, "timeout_s": 60}'
wrk.headers["Content-Type"] = "application/json"
"""
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


def wrk(url: str, script: Path, connections: int, duration: float, pid: int) -> dict:
    workers = _children(pid) or [pid]
    split = [tree_cpu_s(w) for w in workers]
    cpu = tree_cpu_s(pid)
    out = subprocess.run(["wrk", "-t2", f"-c{connections}", f"-d{duration:g}s", "--latency",
                          "--timeout", "60s", "-s", str(script), url + "/v1/requests"],
                         capture_output=True, text=True, check=True).stdout
    cpu = tree_cpu_s(pid) - cpu
    split = [tree_cpu_s(w) - before for w, before in zip(workers, split, strict=True)]
    total = int(re.search(r"(\d+) requests in", out).group(1))
    seconds = float(re.search(r"requests in ([\d.]+)s", out).group(1))
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    non2xx = int(bad.group(1)) if bad else 0
    return {"rate": (total - non2xx) / seconds, "errors": non2xx + (
        sum(int(x) for x in sock.groups()) if sock else 0),
        "p50_ms": _latency(out, "50%"), "p99_ms": _latency(out, "99%"),
        "cpu_us": cpu / max(1, total) * 1e6,
        "cpu_split": [round(100 * x / max(1e-9, sum(split))) for x in split if x > 0.01]}


def _children(pid: int) -> list[int]:
    """The gateway's worker processes (none with --workers 1: it serves itself)."""
    try:
        children = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text()
                    .split()]
    except OSError:
        return []
    # uvicorn's workers, not multiprocessing's resource tracker (which serves nothing)
    return [c for c in children if b"resource_tracker" not in _cmdline(c)]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _latency(out: str, label: str) -> float:
    m = re.search(rf"{label}\s+([\d.]+)(us|ms|s)\b", out)
    if not m:
        return float("nan")
    return float(m.group(1)) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[m.group(2)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", default="32,1000")
    parser.add_argument("--workers", default="1,2", help="gateway --workers values")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per trial")
    parser.add_argument("--repeat", type=int, default=3,
                        help="rounds of trials, the clients taking turns in each")
    parser.add_argument("--json", type=Path, help="also write the cells here")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat: {args.repeat} is under 1")
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
                                 *NOOP_CONSUMER], Path(tmp) / "consumer.log", b"ready on queue")
        children = [consumer]
        try:
            wait_until(consumer.ready, "consumer")
            gateways = {}
            for w in workers:
                port = free_port()
                gateway = ChildProcess([*cli, "gateway", "--redis-url", url, "--queue", queue,
                                        "--port", str(port), "--no-access-log",
                                        "--workers", str(w)], Path(tmp) / f"gw{w}.log", b"")
                children.append(gateway)
                gateways[w] = (f"http://127.0.0.1:{port}", gateway.proc.pid)
                wait_until(lambda b=gateways[w][0], g=gateway: g.ready() and http_healthy(b),
                      f"gateway --workers {w}")
            time.sleep(1)  # every worker up, not only the first
            clients = ["AsyncProducer direct", *(f"gateway --workers {w}" for w in gateways)]
            for n in levels:
                for rnd in range(args.repeat):
                    turn = clients[rnd % len(clients):] + clients[:rnd % len(clients)]
                    for what in turn:
                        load = os.getloadavg()[0]
                        if what.startswith("AsyncProducer"):
                            row = run_direct(url, queue, n, args.duration)
                        else:
                            base, pid = gateways[int(what.rsplit(" ", 1)[1])]
                            row = wrk(base, script, n, args.duration, pid)
                        cells.append({"what": what, "connections": n, "round": rnd,
                                      "load": load, **row})
                        _progress(cells[-1])
        finally:
            for child in children:
                child.terminate()
            for child in children:
                child.reap()
    print(table(cells, levels, clients))
    if args.json:
        args.json.write_text(json.dumps(cells, indent=1))


def run_direct(url: str, queue: str, n: int, duration: float) -> dict:
    from scheduler_core.lifetime import preexec  # here: the children may run older trees

    out = subprocess.run([sys.executable, "-m", "bench.gateway_load", "--direct",
                          url, queue, str(n), str(duration)], capture_output=True, text=True,
                         check=True, timeout=duration * 10 + 60, preexec_fn=preexec())
    return json.loads(out.stdout.strip().splitlines()[-1])


def _progress(cell: dict) -> None:
    split = "/".join(map(str, cell.get("cpu_split", [])))
    print(f"  N={cell['connections']:<5} round {cell['round'] + 1} {cell['what']:22} "
          f"{cell['rate']:>8,.0f} req/s  p50 {cell['p50_ms']:.1f} ms  "
          f"p99 {cell['p99_ms']:.1f} ms  CPU {cell['cpu_us']:.0f} µs/req"
          f"{f' (workers {split} %)' if '/' in split else ''}  errors {cell['errors']}  "
          f"load {cell['load']:.1f}", file=sys.stderr, flush=True)


def table(cells: list[dict], levels: list[int], clients: list[str]) -> str:
    """Medians over the rounds; the ratio is each round's gateway rate over the same
    round's direct rate, its median and range."""
    lines = ["| N (connections / tasks) | client | req/s | p50 ms | p99 ms | not 2xx or "
             "errors | client process CPU µs/req | vs direct: median (range) |",
             "|---|---|---|---|---|---|---|---|"]
    for n in levels:
        direct = {c["round"]: c["rate"] for c in cells if c["connections"] == n
                  and c["what"] == clients[0]}
        for what in clients:
            row = [c for c in cells if c["connections"] == n and c["what"] == what]
            ratios = sorted(c["rate"] / direct[c["round"]] for c in row)
            med = {k: statistics.median(c[k] for c in row)
                   for k in ("rate", "p50_ms", "p99_ms", "cpu_us")}
            versus = "1.00×" if what == clients[0] else \
                f"{statistics.median(ratios):.2f}× ({ratios[0]:.2f}–{ratios[-1]:.2f})"
            lines.append(f"| {n:,} | {what} | {med['rate']:,.0f} | {med['p50_ms']:.1f} | "
                         f"{med['p99_ms']:.1f} | {sum(c['errors'] for c in row):,} | "
                         f"{med['cpu_us']:,.0f} | {versus} |")
    loads = [c["load"] for c in cells]
    lines.append(f"\n1-minute load average during the run: {min(loads):.1f}–{max(loads):.1f} "
                 f"({os.cpu_count()} CPUs)")
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--direct"]:
        url, queue, n, duration = sys.argv[2:6]
        print(json.dumps(direct(url, queue, int(n), float(duration))))
    else:
        main()
