"""Where a request's CPU goes, stage by stage, with a no-op model (docs/benchmarks.md).

    python -m bench.profile_stages [--requests 30000] [--batch 32] [--paced 300]

On a private redis-server, in this one process (so that each stage is timed alone):

1. enqueue a backlog with `Producer.submit_many` (1,000 per call);
2. pop it with the consumer's own `pop_batch` call and parse the replies;
3. decode the payloads, run a no-op model, encode the results and complete every batch
   with the consumer's own `complete` call;
4. deliver: the producer's listener drains its inbox and resolves the handles.

Per request it prints Redis' time inside each script (`INFO commandstats`) and this
process's CPU per stage. Then, with --paced N, N single requests one every 20 ms through
a real `batchgate consumer` process, as at light load: Redis' time per request when
every process has slept in between (a cold CPU runs the same code several times slower).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from typing import Any

import redis

from batchgate.embedded import embedded_redis
from consumer.batch import Batch, Finished, Idle
from consumer.config import ConsumerConfig
from consumer.worker import Worker
from producer.sync import Producer
from scheduler_core.admin import ensure_policy
from scheduler_core.lifetime import spawn


def redis_usage(client: redis.Redis) -> tuple[float, float]:
    """(Redis CPU seconds, µs spent in EVALSHA, nested commands included) so far."""
    cpu = client.info("cpu")
    scripts = client.info("commandstats").get("cmdstat_evalsha", {}).get("usec", 0)
    return cpu["used_cpu_user"] + cpu["used_cpu_sys"], scripts


def redis_line(before: tuple[float, float], after: tuple[float, float], n: int) -> str:
    cpu, scripts = ((a - b) / n for a, b in zip(after, before, strict=True))
    return f"Redis CPU {cpu * 1e6:6.1f} µs/req (in scripts {scripts:6.1f})"


def timed(label: str, n: int, client: redis.Redis, step: Any) -> Any:
    before = redis_usage(client)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    out = step()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    print(f"{label:9s} Python CPU {cpu / n * 1e6:6.1f} µs/req, wall {wall / n * 1e6:6.1f};  "
          + redis_line(before, redis_usage(client), n))
    return out


def drain_setup(url: str, queue: str, batch: int) -> tuple[redis.Redis, Worker, Producer]:
    """A queue (dynamic, batches of `batch`), a prepared in-process Worker with a no-op
    model, and a Producer whose listener does not run (a caller drains its inbox)."""
    client = redis.Redis.from_url(url)
    ensure_policy(client, queue, {"strategy": "dynamic", "max_batch_size": batch})
    consumer = Worker(lambda payloads: payloads,
                      ConsumerConfig(redis_url=url, queue=queue, name="profiler"))
    consumer.prepare()
    producer = Producer(url, queue)
    producer._ensure_listener = lambda: None  # type: ignore[method-assign]
    return client, consumer, producer


def pop_all(consumer: Worker, n: int) -> list[Batch]:
    """Pop batches with the consumer's own call until `n` requests are out."""
    batches: list[Batch] = []
    while sum(len(b.items) for b in batches) < n:
        outcome = consumer._pop()
        if isinstance(outcome, Batch):
            batches.append(outcome)
        elif isinstance(outcome, Idle):  # a last partial batch, due after max_queue_delay
            time.sleep(max(outcome.due_in_ms or 0, 1) / 1000)
    return batches


def complete_all(consumer: Worker, batches: list[Batch]) -> None:
    """Decode, run the no-op model, encode and complete each batch as the consumer does."""
    for b in batches:
        early, runnable = consumer._prepare(b)
        results = consumer._run_isolated([payload for _, payload in runnable])
        consumer._finish(Finished(b, early, [item for item, _ in runnable], results, 1))


def drain_profile(url: str, n: int, batch: int) -> None:
    client, consumer, producer = drain_setup(url, "profile", batch)

    def enqueue() -> list[Any]:
        return [h for s in range(0, n, 1000)
                for h in producer.submit_many([{"i": i} for i in range(s, min(n, s + 1000))])]

    def deliver() -> int:
        inbox, got = producer.keys.inbox(producer.id), 0
        while got < n:
            popped = client.lmpop(1, inbox, direction="LEFT", count=512)
            for raw in popped[1] if popped else ():
                producer._deliver(raw)
                got += 1
        return got

    handles = timed("enqueue", n, client, enqueue)
    batches = timed("pop", n, client, lambda: pop_all(consumer, n))
    timed("complete", n, client, lambda: complete_all(consumer, batches))
    timed("deliver", n, client, deliver)
    assert all(h.done() for h in handles)
    print(f"{len(batches)} batches, mean size {n / len(batches):.1f}")
    producer.close()


def paced_profile(url: str, n: int) -> None:
    queue = "paced"
    consumer = spawn([sys.executable, "-m", "batchgate.cli", "consumer",
                      "--redis-url", url, "--queue", queue, "--strategy", "fifo",
                      "--model", "consumer.models:noop"],
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis.from_url(url)
    try:
        with Producer(url, queue) as producer:
            producer.submit({"warm": 1}).result(timeout=30)
            before = redis_usage(client)
            for i in range(n):
                time.sleep(0.02)
                producer.submit({"i": i}).result(timeout=10)
            print("paced    one request every 20 ms, all stages: "
                  + redis_line(before, redis_usage(client), n))
    finally:
        consumer.terminate()
        consumer.wait(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=30_000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--paced", type=int, default=300, help="0 to skip")
    args = parser.parse_args()
    with embedded_redis() as url:
        drain_profile(url, args.requests, args.batch)
        if args.paced:
            paced_profile(url, args.paced)


if __name__ == "__main__":
    main()
