"""Gateway throughput on the OpenAI route against the native route, in the same run:

    python -m bench.openai_load                        # 32 connections, 3 rounds of 5 s
    python -m bench.openai_load --connections 64 --duration 10 --rounds 5

One private `redis-server`, one `batchgate consumer` serving `bench.openai_load:text_echo`
(a model that answers {"text": ...} at once, so that the gateway is what is measured),
one `batchgate gateway --no-access-log`. Each round runs, in turns that rotate from
round to round, N keep-alive connections in a closed loop against

- native: `POST /v1/requests` {"payload": {"prompt": ...}, "wait": true}
- openai: `POST /v1/completions` {"model": queue, "prompt": ..., "max_tokens": 8}

for `--duration` seconds. The client is a small raw HTTP/1.1 loop (asyncio streams, a
prepared request), cheap next to the gateway. The table gives each route's median rate,
its gateway CPU per request, and the median over rounds of openai/native (the target is
at least 0.8). Answers other than 200 are counted as errors, never in the rate.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

QUEUE = "oaiload"
PROMPT = "hello, batchgate"


def text_echo(device: str | None = None) -> Any:
    """The benchmark's model: each payload's prompt (or text) back as {"text": ...}."""
    def run(payloads: list[Any]) -> list[Any]:
        return [{"text": p.get("prompt", p.get("text", "")) if isinstance(p, dict) else ""}
                for p in payloads]
    return run


def request_bytes(path: str, body: dict[str, Any]) -> bytes:
    data = orjson.dumps(body)
    return (f"POST {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


ROUTES = {
    "native": request_bytes("/v1/requests", {"payload": {"prompt": PROMPT}, "wait": True}),
    "openai": request_bytes("/v1/completions", {"model": QUEUE, "prompt": PROMPT,
                                                "max_tokens": 8}),
}


async def connection(port: int, request: bytes, stop: float, counts: dict[str, int]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.monotonic() < stop:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            length = 0
            for line in head.split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            await reader.readexactly(length)
            counts["ok" if status == 200 else "errors"] += 1
    finally:
        writer.close()


async def trial(port: int, request: bytes, connections: int, duration: float
                ) -> dict[str, int]:
    counts = {"ok": 0, "errors": 0}
    stop = time.monotonic() + duration
    await asyncio.gather(*(connection(port, request, stop, counts)
                           for _ in range(connections)))
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per trial")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.connections < 1 or args.duration <= 0:
        parser.error("--rounds and --connections must be >= 1, --duration > 0")

    from batchgate.bench.gateway_load import _healthy, _wait, tree_cpu_s

    from batchgate.embedded import embedded_redis, free_port
    from batchgate.processes import ChildProcess

    cli = [sys.executable, "-m", "batchgate.cli"]
    env_path = str(Path(__file__).resolve().parent.parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (env_path, os.environ.get("PYTHONPATH")) if p)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bg-oaiload-") as tmp, embedded_redis() as url:
        consumer = ChildProcess([*cli, "consumer", "--redis-url", url, "--queue", QUEUE,
                                 "--model", "bench.openai_load:text_echo", "--strategy",
                                 "dynamic", "--max-batch-size", "256",
                                 "--max-queue-delay-ms", "1"],
                                Path(tmp) / "consumer.log", b"ready on queue")
        port = free_port()
        gateway = ChildProcess([*cli, "gateway", "--redis-url", url, "--queue", QUEUE,
                                "--port", str(port), "--no-access-log"],
                               Path(tmp) / "gateway.log", b"")
        try:
            _wait(consumer.ready, "consumer")
            _wait(lambda: gateway.ready() and _healthy(f"http://127.0.0.1:{port}"),
                  "gateway")
            asyncio.run(trial(port, ROUTES["openai"], 4, 1.0))  # warm both paths up
            asyncio.run(trial(port, ROUTES["native"], 4, 1.0))
            names = list(ROUTES)
            for rnd in range(args.rounds):
                for name in names[rnd % 2:] + names[:rnd % 2]:
                    cpu = tree_cpu_s(gateway.proc.pid)
                    counts = asyncio.run(trial(port, ROUTES[name], args.connections,
                                               args.duration))
                    cpu = tree_cpu_s(gateway.proc.pid) - cpu
                    row = {"route": name, "round": rnd, "rate": counts["ok"] / args.duration,
                           "errors": counts["errors"],
                           "cpu_us": cpu / max(1, counts["ok"]) * 1e6,
                           "load": os.getloadavg()[0]}
                    rows.append(row)
                    print(f"  round {rnd + 1} {name:7} {row['rate']:>8,.0f} req/s  "
                          f"gateway CPU {row['cpu_us']:.0f} µs/req  errors {row['errors']}  "
                          f"load {row['load']:.1f}", file=sys.stderr, flush=True)
        finally:
            for child in (gateway, consumer):
                child.terminate()
            for child in (gateway, consumer):
                child.reap()
    print(table(rows, args))


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    def median(route: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["route"] == route)

    ratios = []
    for rnd in range(args.rounds):
        rate = {r["route"]: r["rate"] for r in rows if r["round"] == rnd}
        if rate.get("native"):
            ratios.append(rate["openai"] / rate["native"])
    lines = [f"{args.connections} connections, {args.rounds} rounds of {args.duration:g} s",
             "| route | req/s (median) | gateway CPU µs/req | errors |", "|---|---|---|---|"]
    for route in ROUTES:
        errors = sum(r["errors"] for r in rows if r["route"] == route)
        lines.append(f"| {route} | {median(route, 'rate'):,.0f} | "
                     f"{median(route, 'cpu_us'):.0f} | {errors} |")
    if ratios:
        lines.append(f"openai/native: {statistics.median(ratios):.2f} (median of rounds; "
                     f"range {min(ratios):.2f}-{max(ratios):.2f}; target >= 0.8)")
        lines.append(f"native/openai gateway CPU per request: "
                     f"{median('native', 'cpu_us') / median('openai', 'cpu_us'):.2f} (the "
                     "throughput one core of gateway would give, less sensitive to the "
                     "host's other load)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
