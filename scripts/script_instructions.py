"""Redis' instructions per request in each stage of a no-op backlog, counted by valgrind.

    python scripts/script_instructions.py [--requests 4000] [--batch 32] [--singles 200]
    python scripts/script_instructions.py --batch 1 --against ../main   # before/after

Wall and CPU times on a shared VM swing by a third between runs of the same code; the
instructions redis-server executes while it processes commands do not, so this is the
measure to compare two versions of the Lua scripts by. It starts `valgrind
--tool=callgrind redis-server` on a free port, counting command processing only (the
server's timers run per wall-clock second, and a run that lasts longer on a busy host
would count more of them), then runs the stages of `bench.profile_stages` in this
process: enqueue a backlog (priorities mixed 10/60/30, as the benchmark's), pop it with
the consumer's own calls, complete every batch. Between stages it zeroes and dumps
callgrind's counters (`callgrind_control`), and prints each stage's total over the
requests. Before the backlog: the cost of a call itself (EVALSHA of `return 1` without
and with a queue's shared keys, an LPUSH) and of enqueue.lua at one request per call.
With --against DIR (another checkout, e.g. main's) the same counts are made there too,
in a process of its own with that checkout's code, and printed side by side: before (DIR),
after (this checkout) and their ratio, per stage and for a request end to end (enqueue +
pop + complete; with --singles, the single submit's enqueue in place of the backlog's).
Needs valgrind (Debian: apt-get install valgrind).
"""

from __future__ import annotations

import argparse
import glob
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

# bench/ is the checkout's, not installed: found from the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.profile_stages import complete_all, drain_setup, pop_all  # noqa: E402
from producer.sync import Producer  # noqa: E402
from scheduler_core.keys import QueueKeys  # noqa: E402

MIX = {0: 10, 1: 60, 2: 30}  # HIGH / NORMAL / LOW, as the benchmark's workloads


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Counter:
    """callgrind's counters of one valgrind'ed redis-server."""

    def __init__(self, pid: int, out_dir: str):
        self.pid, self.out_dir = pid, out_dir

    def _control(self, flag: str) -> None:
        subprocess.run(["callgrind_control", flag, str(self.pid)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def zero(self) -> None:
        self._control("-z")

    def since_zero(self) -> int:
        """Instructions since the last zero (then zeroed again)."""
        before = set(glob.glob(f"{self.out_dir}/cg.*"))
        self._control("-d")
        deadline = time.monotonic() + 30
        while not (new := set(glob.glob(f"{self.out_dir}/cg.*")) - before):
            if time.monotonic() > deadline:
                raise RuntimeError("callgrind wrote no dump")
            time.sleep(0.05)
        dump = max(new, key=os.path.getmtime)
        text = Path(dump).read_text(errors="replace")
        found = re.search(r"^(?:summary|totals):\s+(\d+)", text, re.M)
        if found is None:
            raise RuntimeError(f"no totals in {dump}")
        self.zero()
        return int(found.group(1))


def run_stages(url: str, counter: Counter, n: int, batch: int) -> None:
    _, consumer, producer = drain_setup(url, "instructions", batch)
    prios = random.Random(1).choices(list(MIX), list(MIX.values()), k=n)

    def report(stage: str) -> None:
        print(f"{stage:31s} {counter.since_zero() / n / 1000:7.1f} k instructions per request",
              flush=True)

    counter.zero()
    for first in range(0, n, 1000):
        for level in MIX:
            chunk = [i for i in range(first, min(n, first + 1000)) if prios[i] == level]
            if chunk:
                producer.submit_many([{"i": i} for i in chunk], priority=level)
    report("enqueue")
    batches = pop_all(consumer, n)
    report("pop")
    complete_all(consumer, batches)
    report("complete")
    producer.close()


def call_costs(url: str, counter: Counter, singles: int) -> None:
    """What any call costs before a script's own work: EVALSHA of `return 1` without keys
    and with a queue's shared keys (every batchgate script is passed them), an LPUSH for
    scale; then enqueue.lua at one request per call, as `submit()` sends it."""
    client = redis.Redis.from_url(url)
    sha = client.script_load("return 1")
    shared = list(QueueKeys("calls").shared)
    calls = [("EVALSHA 'return 1', no keys", lambda: client.evalsha(sha, 0)),
             (f"EVALSHA 'return 1', {len(shared)} keys",
              lambda: client.evalsha(sha, len(shared), *shared)),
             ("LPUSH", lambda: client.lpush("calls", b"x"))]
    for label, call in calls:
        call()
        counter.zero()
        for _ in range(100):
            call()
        print(f"{label:31s} {counter.since_zero() / 100 / 1000:7.1f} k instructions per call")
    if singles:
        producer = Producer(url, "singles")  # no consumer: enqueue.lua alone is counted
        producer._ensure_listener = lambda: None  # type: ignore[method-assign]
        producer.submit({"i": -1})  # loads the script
        counter.zero()
        for i in range(singles):
            producer.submit({"i": i})
        print(f"{'enqueue, one request per call':31s} "
              f"{counter.since_zero() / singles / 1000:7.1f} k instructions per request")
        producer.close()


COUNT_LINE = re.compile(r"^(.+?)\s+([\d.]+) k instructions per (?:request|call)$", re.M)


def counts(output: str) -> dict[str, float]:
    return {label.strip(): float(k) for label, k in COUNT_LINE.findall(output)}


def side_by_side(before: dict[str, float], after: dict[str, float]) -> None:
    """The two checkouts' counts, per stage and end to end, with after/before."""
    single = "enqueue, one request per call"
    ends = [("a request end to end (backlog)", ("enqueue", "pop", "complete"))]
    if single in before and single in after:
        ends.append(("a single submit end to end", (single, "pop", "complete")))
    rows = [(label, before[label], after[label]) for label in after if label in before]
    for label, parts in ends:
        if all(p in before and p in after for p in parts):
            rows.append((label, sum(before[p] for p in parts), sum(after[p] for p in parts)))
    print(f"\n{'k instructions per request':34s} {'before':>8s} {'after':>8s} "
          f"{'after/before':>13s}")
    for label, b, a in rows:
        print(f"{label:34s} {b:8.1f} {a:8.1f} {a / b:12.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--singles", type=int, default=200,
                        help="single submits counted before the backlog (0 to skip)")
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--against", type=Path,
                        help="another checkout to count too (before), side by side")
    args = parser.parse_args()
    if args.against is not None:
        here = Path(__file__).resolve()
        runs = {}
        for name, root in (("before", args.against.resolve()), ("after", here.parents[1])):
            command = [sys.executable, str(root / "scripts" / here.name), "--singles",
                       str(args.singles), "--requests", str(args.requests), "--batch",
                       str(args.batch)]
            print(f"{name}: {root}", flush=True)
            done = subprocess.run(command, capture_output=True, text=True, check=True,
                                  cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
            print(done.stdout, end="", flush=True)
            runs[name] = counts(done.stdout)
        side_by_side(runs["before"], runs["after"])
        return
    for tool in ("valgrind", "callgrind_control", "redis-server"):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} is not on PATH (Debian: apt-get install valgrind)")
    port = free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        server = subprocess.Popen(
            # Command processing only: see the module docstring.
            ["valgrind", "--tool=callgrind", "--toggle-collect=processInputBuffer",
             f"--callgrind-out-file={out_dir}/cg.%p",
             "redis-server", "--port", str(port), "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            url = f"redis://127.0.0.1:{port}/0"
            probe = redis.Redis.from_url(url)
            for _ in range(600):  # redis-server starts slowly under valgrind
                try:
                    probe.ping()
                    break
                except redis.ConnectionError:
                    time.sleep(0.1)
            counter = Counter(server.pid, out_dir)
            call_costs(url, counter, args.singles)
            run_stages(url, counter, args.requests, args.batch)
        finally:
            server.terminate()
            server.wait(timeout=60)


if __name__ == "__main__":
    main()
