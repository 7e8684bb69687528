"""One batchgate consumer process for `python -m bench.run`.

It runs `consumer.worker.Worker` (the loop) exactly as `batchgate consumer` does (same loop, same
scripts, the queue's stored policy), with one addition: the model is wrapped so that each
result carries the timestamps of its batch, which the benchmark reads back at the
producer. Per request it returns {"r": <model result>, "s": "enqueue_us,pop_us,model_start_us,
model_end_us,batch_size,pid"} (one string, so that the stamps add little to result
encoding); enqueue and pop are Redis TIME from the batch in hand (`Worker._current`),
the model times come from time.time(). All clocks are
the same host clock, so the stamps compare across processes.

Prints "ready" on stdout once the model is loaded, waits for the start signal (bench/
_gate.py), runs; the benchmark SIGKILLs it when the run is over (its queue is deleted).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import orjson

from bench.workers.gate import guard_parent, ready_then_wait
from consumer.cli import freeze_startup_heap
from consumer.config import ConsumerConfig
from consumer.loader import load_model
from consumer.worker import Worker


class Stamped:
    def __init__(self, inner: Any, consumer: Worker | None = None):
        self.inner = inner
        self.consumer = consumer
        self.pid = os.getpid()

    def __call__(self, payloads: list[Any]) -> list[Any]:
        batch = getattr(self.consumer, "_current", None)
        t0 = time.time()
        out = self.inner(payloads)
        t1 = time.time()
        n = len(payloads)
        items = [it for it in batch.items if it.state == "run"] if batch is not None else []
        if len(items) != n:  # not expected in a benchmark: no expired or malformed items
            enq, popped = [0] * n, 0
        else:
            enq, popped = [it.arrival_us for it in items], batch.popped_us
        tail = f",{popped},{int(t0 * 1e6)},{int(t1 * 1e6)},{n},{self.pid}"
        return [{"r": r, "s": f"{e}{tail}"} for r, e in zip(out, enq, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--queue", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--model-args", default="{}", help="JSON object of factory kwargs")
    parser.add_argument("--name", default="")
    parser.add_argument("--go", required=True, help="start-gate list key")
    args = parser.parse_args()
    guard_parent()
    model = Stamped(load_model(args.model, orjson.loads(args.model_args)))
    consumer = Worker(model, ConsumerConfig(redis_url=args.redis_url, queue=args.queue,
                                            name=args.name))
    model.consumer = consumer  # whose batch in hand the stamps read
    consumer.prepare()  # adopts the policy the benchmark stored for this queue
    freeze_startup_heap()  # as `batchgate consumer` does
    ready_then_wait(args.redis_url, args.go)
    consumer.run()


if __name__ == "__main__":
    main()
