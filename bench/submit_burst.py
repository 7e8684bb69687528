"""Submits per second from ONE producer at growing concurrency, this tree against a
baseline commit, side by side in one run:

    python -m bench.submit_burst                      # baseline 4212324
    python -m bench.submit_burst --baseline HEAD~3 --concurrency 1,10,100

For each producer (`AsyncProducer`: tasks; `Producer`: threads) and each concurrency N,
N workers submit one small request after another for `--duration` seconds; the table
gives accepted submits per second and the submits that raised. The baseline runs from
`git archive BASELINE` of this checkout, each measurement in a fresh child process (this
file run by path with the tree under test first on PYTHONPATH), against one private
`redis-server` with no consumer: what is measured is the enqueue path alone. Each run
uses a queue of its own, deleted afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_BASELINE = "4212324"


# -- the measurement (runs in a child, importing the tree under test) ------------------
def measure(api: str, url: str, queue: str, concurrency: int, duration: float) -> dict:
    from producer import AsyncProducer, Producer

    errors: Counter[str] = Counter()
    ok = 0
    if api == "async":
        async def run() -> float:
            nonlocal ok
            async with AsyncProducer(url, queue) as p:
                await p.submit({"warm": 1})
                stop = time.monotonic() + duration

                async def worker(w: int) -> None:
                    nonlocal ok
                    i = 0
                    while time.monotonic() < stop:
                        try:
                            await p.submit({"w": w, "i": i})
                            ok += 1
                        except Exception as exc:
                            errors[type(exc).__name__] += 1
                            await asyncio.sleep(0.001)
                        i += 1

                start = time.monotonic()
                await asyncio.gather(*(worker(w) for w in range(concurrency)))
                return time.monotonic() - start

        elapsed = asyncio.run(run())
    else:
        lock = threading.Lock()
        with Producer(url, queue) as p:
            p.submit({"warm": 1})
            go = threading.Event()
            stop = [0.0]

            def worker(w: int) -> None:
                nonlocal ok
                mine, failed, i = 0, Counter[str](), 0
                go.wait()
                while time.monotonic() < stop[0]:
                    try:
                        p.submit({"w": w, "i": i})
                        mine += 1
                    except Exception as exc:
                        failed[type(exc).__name__] += 1
                        time.sleep(0.001)
                    i += 1
                with lock:
                    ok += mine
                    errors.update(failed)

            threads = [threading.Thread(target=worker, args=(w,)) for w in range(concurrency)]
            for t in threads:
                t.start()
            start = time.monotonic()
            stop[0] = start + duration
            go.set()
            for t in threads:
                t.join()
            elapsed = time.monotonic() - start
    return {"ok": ok, "errors": dict(errors), "elapsed": elapsed}


# -- the driver ------------------------------------------------------------------------
def run_child(tree: Path, api: str, url: str, queue: str, concurrency: int,
              duration: float) -> dict:
    from scheduler_core.lifetime import preexec  # here: the children may run older trees

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])}
    out = subprocess.run([sys.executable, __file__, "--child", api, url, queue,
                          str(concurrency), str(duration)], env=env, check=True,
                         capture_output=True, text=True, timeout=duration * 10 + 120,
                         preexec_fn=preexec())
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default=DEFAULT_BASELINE,
                        help="git ref to compare with ('' for none) [%(default)s]")
    parser.add_argument("--concurrency", default="1,10,100,1000")
    parser.add_argument("--duration", type=float, default=2.0, help="seconds per cell")
    parser.add_argument("--api", default="async,sync")
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs per cell, alternating trees; the median is reported")
    parser.add_argument("--json", type=Path, help="also write the cells here")
    args = parser.parse_args(argv)

    from batchgate.embedded import embedded_redis
    from bench.common import ROOT, baseline_tree  # here: the --child run has no bench/

    levels = [int(x) for x in args.concurrency.split(",")]
    apis = args.api.split(",")
    with tempfile.TemporaryDirectory(prefix="bg-burst-") as tmp, embedded_redis() as url:
        import redis

        admin = redis.Redis.from_url(url)
        trees = {"this tree": ROOT}
        if args.baseline:
            trees = {f"baseline {args.baseline}": baseline_tree(args.baseline, Path(tmp)),
                     **trees}
        cells, runs = [], 0
        for api in apis:
            for n in levels:
                tries: dict[str, list[dict]] = {name: [] for name in trees}
                for _ in range(args.repeat):
                    for name, tree in trees.items():  # side by side, alternating
                        runs += 1
                        queue = f"burst-{os.getpid()}-{runs}"
                        run = run_child(tree, api, url, queue, n, args.duration)
                        run["rate"] = run["ok"] / run["elapsed"]
                        tries[name].append(run)
                        for key in admin.scan_iter(match=f"{{bg:{queue}}}*", count=1000):
                            admin.unlink(key)
                        print(f"  {api:5} N={n:<5} {name:18} {run['rate']:>9,.0f} submits/s"
                              f"  errors {run['errors'] or 0}", file=sys.stderr, flush=True)
                for name, runs_of in tries.items():
                    median = sorted(runs_of, key=lambda r: r["rate"])[len(runs_of) // 2]
                    cells.append({**median, "api": api, "concurrency": n, "tree": name,
                                  "rates": [r["rate"] for r in runs_of]})
        admin.close()
    print(table(cells, list(trees), apis, levels))
    if args.json:
        args.json.write_text(json.dumps(cells, indent=1))


def table(cells: list[dict], trees: list[str], apis: list[str], levels: list[int]) -> str:
    by = {(c["api"], c["concurrency"], c["tree"]): c for c in cells}
    head = ["producer", "N"] + [f"{t} submits/s (errors)" for t in trees]
    if len(trees) == 2:
        head.append("ratio")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for api in apis:
        for n in levels:
            row = [{"async": "AsyncProducer", "sync": "Producer"}[api], f"{n:,}"]
            for t in trees:
                c = by[(api, n, t)]
                failed = sum(c["errors"].values())
                row.append(f"{c['rate']:,.0f} ({failed:,})")
            if len(trees) == 2:
                before, after = (by[(api, n, t)]["rate"] for t in trees)
                row.append(f"{after / before:.1f}×" if before else "∞ (none before)")
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        # Run by path: import the producer from PYTHONPATH, not from beside this file.
        sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
        api, url, queue, n, duration = sys.argv[2:7]
        print(json.dumps(measure(api, url, queue, int(n), float(duration))))
    else:
        main()
