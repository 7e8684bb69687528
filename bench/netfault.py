"""How round-trip time between consumer hosts and Redis moves latency and throughput,
measured beside `batchgate simulate` given the same RTT.

    sudo python -m bench.netfault [--rtt-ms 0,1,10] [--loss-pct 1,5]
                                            [--requests 4000]

Two consumers (`consumers.models:synthetic`, 5 + 0.5·b ms per batch; dynamic, batches of
up to 32, no queue delay) run each in a network namespace of its own, joined to Redis by
a veth pair; the producer runs beside Redis. The delay is `tc netem` on both ends of
each pair, or, where the kernel has no netem, a user-space relay on the host end that
holds each chunk RTT/2 per direction (the figures say which, and the RTT measured from
inside a namespace: PING, median of 50). Loss is netem's too, or iptables' `statistic`
match inside each namespace where the kernel has no netem; each --loss-pct runs with no
added delay. For each RTT and each loss:

  light load: 100 requests one after another, submit to result (p50, p99)
  saturation: --requests submitted at once, requests/s until the last result

and `batchgate simulate` on the same policy, cost and consumers, with the RTT added to
its per-batch overhead (--overhead-ms: a completion and the next pop are one round trip)
and to its transport latency (--transport-ms: a wake-up reaches the consumer, a result
reaches Redis). The simulator has no notion of loss (TCP's retransmission timers), so a
loss row has no simulated figures. Every run also counts the requests answered: all of
them, once each, or the run fails.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from batchgate.embedded import EmbeddedRedis
from batchgate.processes import ChildProcess, batchgate_argv
from bench.netns import ConsumerHost, DelayProxy, NetemUnavailable, unavailable_reason
from producer import Producer
from scheduler_core.lifetime import preexec

POLICY = ["--strategy", "dynamic", "--max-batch-size", "32", "--max-queue-delay-ms", "0"]
COST_MS = "5+0.5*b"  # the synthetic model's default
BASE_OVERHEAD_MS, BASE_TRANSPORT_MS = 0.14, 1.22  # simulate's defaults (loopback)
PING_SOURCE = ("import redis, statistics, sys, time\n"
               "c = redis.Redis(host=sys.argv[1], port=int(sys.argv[2]))\n"
               "c.ping(); t = []\n"
               "for _ in range(50):\n"
               "    s = time.perf_counter(); c.ping(); t.append(time.perf_counter() - s)\n"
               "print(statistics.median(t) * 1000)\n")


def measure(rtt_ms: float, requests: int, log: Any = print,
            loss_pct: float = 0.0) -> dict[str, Any]:
    hosts = [ConsumerHost(), ConsumerHost()]
    proxies: list[DelayProxy] = []
    children: list[ChildProcess] = []
    work = Path(tempfile.mkdtemp(prefix="batchgate-netfault-"))
    server = None
    try:
        server = EmbeddedRedis("--bind", "127.0.0.1", *(h.host_ip for h in hosts),
                               "--protected-mode", "no")
        how = "netem"
        endpoints = []
        for host in hosts:
            try:
                host.netem(delay_ms=rtt_ms / 2)
                endpoints.append((host.host_ip, server.port))
            except NetemUnavailable:
                how = "relay" if rtt_ms else "none"
                if rtt_ms:
                    proxy = DelayProxy(host.host_ip, "127.0.0.1", server.port, rtt_ms)
                    proxies.append(proxy)
                    endpoints.append((host.host_ip, proxy.port))
                else:
                    endpoints.append((host.host_ip, server.port))
        lost_by = hosts[0].drop(loss_pct) if loss_pct else "none"
        if loss_pct:
            hosts[1].drop(loss_pct)
        measured = float(subprocess.run(
            hosts[0].argv([sys.executable, "-c", PING_SOURCE, *map(str, endpoints[0])]),
            capture_output=True, text=True, check=True).stdout)
        queue = f"rtt-{int(rtt_ms * 1000)}-loss-{int(loss_pct * 100)}"
        for i, (host, (ip, port)) in enumerate(zip(hosts, endpoints, strict=True)):
            argv = host.argv([*batchgate_argv(), "consumer", "--redis-url",
                              f"redis://{ip}:{port}/0", "--queue", queue, "--model",
                              "consumer.models:synthetic", *POLICY, "--name", f"h{i}"])
            children.append(ChildProcess(argv, work / f"c{i}.log", b"ready on queue"))
        deadline = time.monotonic() + 60
        while not all(c.ready() for c in children):
            if time.monotonic() > deadline:
                raise RuntimeError("consumers not ready")
            time.sleep(0.05)
        answered: collections.Counter[str] = collections.Counter()
        with Producer(server.url, queue, on_result=lambda r: answered.update([r.id])) as p:
            p.submit({"warm": 1}).result(timeout=30)
            e2e = []
            for i in range(100):
                started = time.perf_counter()
                p.submit({"i": i}).result(timeout=30)
                e2e.append((time.perf_counter() - started) * 1000)
            started = time.perf_counter()
            handles = []
            for first in range(0, requests, 500):
                handles += p.submit_many([{"i": i} for i in range(first,
                                                                 min(requests, first + 500))])
            for handle in handles:
                handle.result(timeout=120)
            rate = requests / (time.perf_counter() - started)
            wanted = {h.id for h in handles}
            twice = [i for i in wanted if answered[i] > 1]
            if twice or not wanted <= set(answered):
                raise RuntimeError(f"{len(wanted - set(answered))} requests unanswered, "
                                   f"{len(twice)} answered twice")
        e2e.sort()
        figures = {"rtt_ms": rtt_ms, "delay_by": how, "loss_pct": loss_pct,
                   "loss_by": lost_by, "rtt_measured_ms": round(measured, 2),
                   "light_p50_ms": round(statistics.median(e2e), 2),
                   "light_p99_ms": round(e2e[98], 2), "saturated_rps": round(rate)}
        if not loss_pct:
            figures.update(simulated(measured if rtt_ms else 0.0))
        log(json.dumps(figures))
        return figures
    finally:
        for child in children:
            child.kill()
        for proxy in proxies:
            proxy.close()
        if server is not None:
            server.close()
        for host in hosts:
            host.close()
        shutil.rmtree(work, ignore_errors=True)


def simulated(rtt_ms: float) -> dict[str, Any]:
    """`batchgate simulate` with the RTT added to its per-batch overhead and transport."""
    def sim(*args: str) -> dict[str, Any]:
        out = subprocess.run([*batchgate_argv(), "simulate", *POLICY, "--consumers", "2",
                              "--cost-ms", COST_MS, "--overhead-ms",
                              f"{BASE_OVERHEAD_MS + rtt_ms:.3f}", "--transport-ms",
                              f"{BASE_TRANSPORT_MS + rtt_ms:.3f}", "--json", *args],
                             capture_output=True, text=True, check=True,
                             preexec_fn=preexec()).stdout
        return json.loads(out)
    light = sim("--rate", "10", "--duration-s", "60")
    heavy = sim("--rate", "20000", "--duration-s", "0.2")
    return {"sim_light_p50_ms": light["latency_ms"]["all"]["p50"],
            "sim_saturated_rps": heavy["throughput_rps"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rtt-ms", default="0,1,10",
                        help="comma-separated round-trip times to add, ms")
    parser.add_argument("--loss-pct", default="",
                        help="comma-separated packet loss, %% each way (no added delay)")
    parser.add_argument("--requests", type=int, default=4000)
    args = parser.parse_args(argv)
    reason = unavailable_reason()
    if reason is not None:
        raise SystemExit(f"cannot make consumer hosts here: {reason}")
    runs = [(float(x), 0.0) for x in args.rtt_ms.split(",") if x]
    runs += [(0.0, float(x)) for x in args.loss_pct.split(",") if x]
    rows = []
    for rtt, loss in runs:
        with contextlib.suppress(KeyboardInterrupt):
            rows.append(measure(rtt, args.requests, loss_pct=loss,
                                log=lambda line: print(line, file=sys.stderr, flush=True)))
    base = rows[0] if rows else None
    print("| RTT added | loss each way | delay / loss by | RTT measured | light p50 (sim) | "
          "light p99 | saturated req/s (sim) |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        rel = f" ({row['saturated_rps'] / base['saturated_rps']:.2f}x)" if base else ""
        sim_p50 = f" ({row['sim_light_p50_ms']:.2f})" if "sim_light_p50_ms" in row else ""
        sim_rps = f" ({row['sim_saturated_rps']:.0f})" if "sim_saturated_rps" in row else ""
        print(f"| {row['rtt_ms']:g} ms | {row['loss_pct']:g}% | {row['delay_by']} / "
              f"{row['loss_by']} | {row['rtt_measured_ms']} ms | "
              f"{row['light_p50_ms']} ms{sim_p50} | {row['light_p99_ms']} ms | "
              f"{row['saturated_rps']}{rel}{sim_rps} |")


if __name__ == "__main__":
    main()
