"""The gateway's CPU per request on its hot paths, this tree against a baseline commit,
side by side in one run:

    python -m bench.gateway_cpu                       # baseline main
    python -m bench.gateway_cpu --baseline HEAD~3 --workers 2 --repeat 3

For each tree, one `batchgate gateway --workers W` (its `producer` and `scheduler_core`
from that tree: the baseline from `git archive BASELINE`) serves, in turn, wrk with
`--connections` connections for `--duration` seconds of each kind of request:

    submit    POST /v1/requests {"payload": ...}                 202 at once
    wait      POST /v1/requests {"payload": ..., "wait": true}   200 with the result
    get       GET /v1/requests/{id} of a done request            200 with the result

CPU per request is the user + system time of the gateway's processes (all its workers,
from /proc) over the requests answered, so other load on the machine changes it little
(unlike req/s); wrk's own CPU per request is given beside it. One private
`redis-server` and one consumer with the no-op model serve both trees; the trees
alternate, `--repeat` times, and the median is reported. Needs `wrk` on PATH (Debian:
apt-get install wrk) and the gateway extra.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.common import (
    NOOP_CONSUMER,
    ROOT,
    baseline_tree,
    http_healthy,
    tree_cpu_s,
    wait_until,
)

KINDS = {  # as gateway_load.py's wrk script
    "submit": ("POST", '{"payload": {"text": "hello", "n": 1}}'),
    "wait": ("POST", '{"payload": {"text": "hello", "n": 1}, "wait": true, "timeout_s": 60}'),
    "get": ("GET", None),
}
# `python -c` puts the working directory first on sys.path: drop it, so that the gateway
# (and its uvicorn workers, which inherit sys.path) import the tree from PYTHONPATH.
SERVE = ("import sys; sys.path[:] = [p for p in sys.path if p not in ('', '.')]; "
         "from producer.gateway.cli import gateway_command; "
         "gateway_command(sys.argv[1:], prog_name='batchgate gateway')")


def wrk_script(method: str, body: str | None) -> str:
    lines = [f'wrk.method = "{method}"', 'wrk.headers["Content-Type"] = "application/json"']
    if body is not None:
        lines.append(f"wrk.body = '{body}'")
    return "\n".join(lines) + "\n"


def measure(base: str, path: str, script: Path, connections: int, duration: float,
            pid: int) -> dict:
    cpu = tree_cpu_s(pid)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(["wrk", "-t1", f"-c{connections}", f"-d{duration:g}s",
                          "--timeout", "60s", "-s", str(script), base + path],
                         capture_output=True, text=True, check=True).stdout
    cpu = tree_cpu_s(pid) - cpu
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    wrk_cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    total = max(1, int(out.split(" requests in ")[0].split()[-1]))
    bad = out.split("Non-2xx or 3xx responses: ")
    non2xx = int(bad[1].split()[0]) if len(bad) > 1 else 0
    return {"requests": total, "non2xx": non2xx, "cpu_us": cpu / total * 1e6,
            "wrk_cpu_us": wrk_cpu / total * 1e6}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="main",
                        help="git ref to compare with ('' for none) [%(default)s]")
    parser.add_argument("--workers", type=int, default=1, help="gateway --workers")
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per cell")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--repeat", type=int, default=2,
                        help="runs per cell, alternating trees; the median is reported")
    parser.add_argument("--json", type=Path, help="also write the cells here")
    args = parser.parse_args(argv)
    if not shutil.which("wrk"):
        sys.exit("wrk is not on PATH (Debian: apt-get install wrk)")

    from batchgate.embedded import embedded_redis, free_port
    from batchgate.processes import ChildProcess

    kinds = args.kinds.split(",")
    with tempfile.TemporaryDirectory(prefix="bg-gwcpu-") as tmp, embedded_redis() as url:
        trees = {"this tree": ROOT}
        if args.baseline:
            trees = {f"baseline {args.baseline}": baseline_tree(args.baseline,
                                                                Path(tmp) / "baseline"),
                     **trees}
        queue = "gwcpu"
        consumer = ChildProcess([sys.executable, "-m", "batchgate.cli", "consumer",
                                 "--redis-url", url, "--queue", queue, *NOOP_CONSUMER],
                                Path(tmp) / "consumer.log", b"ready on queue")
        children = [consumer]
        gateways: dict[str, tuple[str, int]] = {}
        try:
            wait_until(consumer.ready, "consumer")
            for i, (name, tree) in enumerate(trees.items()):
                port = free_port()
                env = {**os.environ, "PYTHONPATH": os.pathsep.join(
                    [str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])}
                gateway = ChildProcess(
                    [sys.executable, "-c", SERVE, "--redis-url", url, "--queue", queue,
                     "--port", str(port), "--no-access-log", "--workers", str(args.workers)],
                    Path(tmp) / f"gw{i}.log", b"", env=env)
                children.append(gateway)
                base = f"http://127.0.0.1:{port}"
                gateways[name] = (base, gateway.proc.pid)
                wait_until(lambda b=base, g=gateway: g.ready() and http_healthy(b),
                           f"gateway {name}")
            time.sleep(1)  # every worker up, not only the first
            scripts = {}
            for kind, (method, body) in KINDS.items():
                scripts[kind] = Path(tmp) / f"{kind}.lua"
                scripts[kind].write_text(wrk_script(method, body))
            paths = {}
            for name, (base, _) in gateways.items():  # a done request to GET, per tree
                request = urllib.request.Request(
                    base + "/v1/requests", data=KINDS["wait"][1].encode(),
                    headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=30) as answer:
                    paths[name] = f"/v1/requests/{json.loads(answer.read())['id']}"
            cells = []
            for kind in kinds:
                tries: dict[str, list[dict]] = {name: [] for name in trees}
                for _ in range(args.repeat):
                    for name, (base, pid) in gateways.items():  # alternating
                        path = paths[name] if kind == "get" else "/v1/requests"
                        run = measure(base, path, scripts[kind], args.connections,
                                      args.duration, pid)
                        tries[name].append(run)
                        print(f"  {kind:6} {name:18} {run['cpu_us']:>7,.0f} µs CPU/request "
                              f"(wrk {run['wrk_cpu_us']:,.0f}; {run['requests']:,} requests, "
                              f"{run['non2xx']} not 2xx)",
                              file=sys.stderr, flush=True)
                for name, runs in tries.items():
                    median = sorted(runs, key=lambda r: r["cpu_us"])[len(runs) // 2]
                    cells.append({**median, "kind": kind, "tree": name,
                                  "all_cpu_us": [r["cpu_us"] for r in runs]})
        finally:
            for child in children:
                child.terminate()
            for child in children:
                child.reap()
    print(table(cells, list(trees), kinds, args))
    if args.json:
        args.json.write_text(json.dumps(cells, indent=1))


def table(cells: list[dict], trees: list[str], kinds: list[str],
          args: argparse.Namespace) -> str:
    by = {(c["kind"], c["tree"]): c for c in cells}
    head = ["request"] + [f"{t} µs CPU/request (wrk's)" for t in trees]
    if len(trees) == 2:
        head.append("after / before")
    lines = [f"gateway --workers {args.workers}, wrk -c{args.connections}, "
             f"{args.duration:g} s per cell, median of {args.repeat}", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for kind in kinds:
        row = [kind]
        for t in trees:
            c = by[(kind, t)]
            row.append(f"{c['cpu_us']:,.0f} ({c['wrk_cpu_us']:,.0f})" + (
                f", {c['non2xx']:,} not 2xx" if c["non2xx"] else ""))
        if len(trees) == 2:
            before, after = (by[(kind, t)]["cpu_us"] for t in trees)
            row.append(f"{after / before:.2f}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
