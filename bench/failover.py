"""What a failover costs: accepted requests lost, results delivered twice.

    python -m bench.failover --mode cluster|sentinel [--wait-replicas 1]

Starts a throw-away 6-node Redis Cluster (or 1 primary, 2 replicas, 3 sentinels), two
`batchgate consumer` processes and one Producer submitting --requests requests at
--rate per second. Once half are accepted, the primary serving the queue's slot is
SIGKILLed; a replica is promoted (cluster failover, or Sentinel's vote) and every client
reconnects on its own. A submit that fails meanwhile was not accepted: it is submitted
again (a new request). Then every accepted request is awaited:

  lost:            accepted (submit returned), never answered, or answered RequestLost
  delivered twice: results the producer's inbox delivered more than once for one id
                   (a result popped from the old primary, the pop not yet replicated)
  re-run:          requests the model ran more than once (not an error: at-least-once
                   execution, exactly-once delivery)

With --lag-ms L the victim's replicas are paused (SIGSTOP) and cut off from it (CLIENT
KILL TYPE replica) L ms before the kill, and resumed as it dies: replicas that lag behind,
as they do under load or across a slow link. Writes the primary acknowledged in that
window are what asynchronous replication loses.

With --wait-replicas N the producer (wait_replicas=N) and the consumers
(--wait-replicas N) acknowledge only after WAIT N confirmed the write on the replicas.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import redis

from batchgate.processes import ChildProcess, batchgate_argv
from bench.topology import EmbeddedCluster, EmbeddedSentinel
from producer import Producer, RequestFailed
from scheduler_core.errors import BatchgateError
from scheduler_core.keys import QueueKeys

QUEUE = "failover"
# A model module that logs the ids it runs (to count re-runs) and echoes.
MODEL_SOURCE = '''
import os


class Echo:
    def __init__(self, out):
        self.path = os.path.join(out, "%d.ids" % os.getpid())

    def __call__(self, payloads):
        with open(self.path, "a") as f:
            f.write("".join("%s\\n" % p["n"] for p in payloads))
        return payloads
'''


def run(mode: str, requests: int, rate: float, wait_replicas: int, consumers: int = 2,
        lease_ms: int = 2000, drain_s: float = 60.0, log: Any = print,
        lag_ms: int = 0) -> dict[str, Any]:
    """One failover run; returns its figures."""
    servers: Any = EmbeddedCluster() if mode == "cluster" else EmbeddedSentinel()
    work = Path(tempfile.mkdtemp(prefix="batchgate-failover-"))
    children: list[ChildProcess] = []
    try:
        (work / "bg_failover_model.py").write_text(MODEL_SOURCE)
        (work / "ids").mkdir()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(work), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        for i in range(consumers):
            argv = [*batchgate_argv(), "consumer", "--redis-url", servers.url, "--queue", QUEUE,
                    "--model", "bg_failover_model:Echo", "--model-arg",
                    f"out={work / 'ids'}", "--lease-ms", str(lease_ms), "--strategy",
                    "dynamic", "--max-batch-size", "32", "--max-queue-delay-ms", "2",
                    "--wait-replicas", str(wait_replicas), "--name", f"c{i}"]
            children.append(ChildProcess(argv, work / f"consumer{i}.log",
                                         b"ready on queue", env=env))
        deadline = time.monotonic() + 60
        while not all(c.ready() for c in children):
            if time.monotonic() > deadline:
                raise RuntimeError("consumers not ready")
            time.sleep(0.05)
        return _drive(servers, mode, requests, rate, wait_replicas, work, drain_s, log, lag_ms)
    finally:
        for child in children:
            child.kill()
        servers.close()
        shutil.rmtree(work, ignore_errors=True)


def _drive(servers: Any, mode: str, requests: int, rate: float, wait_replicas: int,
           work: Path, drain_s: float, log: Any, lag_ms: int) -> dict[str, Any]:
    deliveries: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()

    def on_result(result: Any) -> None:
        with lock:
            deliveries[result.id] += 1

    tag_key = QueueKeys(QUEUE).jobs
    victim = servers.primary_of(tag_key) if mode == "cluster" else servers.current_primary()
    handles: list[Any] = []
    refused = 0
    killed_at = recovered_at = None
    failing: threading.Thread | None = None
    died: list[float] = []  # when the victim was killed
    chunk = 10
    with Producer(servers.url, QUEUE, on_result=on_result, wait_replicas=wait_replicas) as p:
        started = time.monotonic()
        n = 0
        while n < requests:
            if failing is None and n >= requests // 2:
                failing = threading.Thread(target=_fail, args=(
                    servers, mode, victim, tag_key, lag_ms, n, died, log), daemon=True)
                failing.start()
            payloads = [{"n": n + i} for i in range(min(chunk, requests - n))]
            try:
                handles += p.submit_many(payloads)
            except (redis.RedisError, BatchgateError, OSError) as exc:
                if not refused:
                    log(f"submit refused ({type(exc).__name__}: {exc}); submitting again")
                refused += len(payloads)
                time.sleep(0.1)
                continue
            if died and recovered_at is None:
                recovered_at, killed_at = time.monotonic(), died[0]
                log(f"accepting again {recovered_at - killed_at:.2f}s after the kill")
            n += len(payloads)
            ahead = started + n / rate - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)
        submitted_s = time.monotonic() - started
        lost = answered = 0
        end = time.monotonic() + drain_s
        for handle in handles:
            try:
                handle.result(timeout=max(0.1, end - time.monotonic()))
                answered += 1
            except (RequestFailed, TimeoutError):
                lost += 1
        time.sleep(1.5)  # a duplicate popped after the last result still arrives
    runs: collections.Counter[str] = collections.Counter()
    for path in (work / "ids").glob("*.ids"):
        runs.update(path.read_text().split())
    with lock:
        twice = sum(1 for count in deliveries.values() if count > 1)
    return {"mode": mode, "wait_replicas": wait_replicas, "lag_ms": lag_ms,
            "accepted": len(handles),
            "answered": answered, "lost": lost, "delivered_twice": twice,
            "re_run": sum(1 for count in runs.values() if count > 1),
            "refused_during_failover": refused,
            "unavailable_s": round((recovered_at or killed_at or 0) - (killed_at or 0), 2),
            "submit_s": round(submitted_s, 2)}


def _fail(servers: Any, mode: str, victim: int, key: str, lag_ms: int, accepted: int,
          died: list[float], log: Any) -> None:
    """Pause the victim's replicas for lag_ms (if any), SIGKILL it, resume them."""
    replicas = servers.replicas_of(victim) if lag_ms else []
    for port in replicas:
        servers.pause(port)
    if replicas:  # what the primary already sent stays in the replicas' socket buffers
        servers.client(victim).client_kill_filter(_type="replica")
    time.sleep(lag_ms / 1000)
    servers.kill(victim)
    died.append(time.monotonic())
    for port in replicas:
        servers.resume(port)
    log(f"SIGKILLed primary :{victim} (after {accepted} accepted requests"
        + (f", its replicas paused {lag_ms} ms before)" if lag_ms else ")"))
    if mode == "cluster":
        _rejoin(servers, victim, key, log)


def _rejoin(servers: Any, victim: int, key: str, log: Any) -> None:
    """Once a replica serves the slot, restart the killed node, as a supervisor (systemd)
    would: it rejoins as a replica of the promoted one. Until then the shard has no
    replica, so a WAIT 1 cannot be confirmed (each primary has one replica here)."""
    while True:
        try:
            if servers.primary_of(key) != victim:
                break
        except BatchgateError:
            pass
        time.sleep(0.1)
    servers.start_again(victim)
    log(f"restarted :{victim}; it rejoins as a replica")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["cluster", "sentinel"], default="cluster")
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--rate", type=float, default=1000.0,
                        help="requests submitted per second (default 1000)")
    parser.add_argument("--wait-replicas", type=int, default=0)
    parser.add_argument("--consumers", type=int, default=2)
    parser.add_argument("--lag-ms", type=int, default=0,
                        help="pause the victim's replicas this long before the kill")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    figures = run(args.mode, args.requests, args.rate, args.wait_replicas, args.consumers,
                  log=lambda line: print(line, file=sys.stderr, flush=True),
                  lag_ms=args.lag_ms)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
