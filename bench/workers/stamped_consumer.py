"""A batchgate consumer for `python -m bench.latency` that notes when each request
passed each hop of the consumer's loop.

It is `consumer.worker.Worker` as `batchgate consumer` runs it (the queue's stored policy,
the same loop and scripts), with clock readings (time.time(), the host clock every process
and Redis' TIME share) taken where the loop already is: the pop's reply parsed, the model
called and returned, the completion's reply read. On SIGTERM it finishes, then writes one
JSON line per request to --out: [id, arrival_us, popped_us, pop_reply, model_start,
model_end, complete_reply] (the first two are Redis' own, from the pop's reply).
"""

from __future__ import annotations

import argparse
import signal
import time
from typing import Any

import orjson

from bench.workers.gate import guard_parent
from consumer.config import ConsumerConfig
from consumer.models import noop
from consumer.worker import Worker


class StampedWorker(Worker):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.rows: dict[str, list[Any]] = {}
        self._ids: list[str] = []

    def _parse(self, reply: list[Any]) -> Any:
        at = time.time()
        step = super()._parse(reply)
        items = getattr(step, "items", None)
        if items:
            self._ids = [item.id for item in items]
            for item in items:
                self.rows[item.id] = [item.id, item.arrival_us, step.popped_us, at]
        return step

    def _run_isolated(self, payloads: list[Any], *args: Any) -> Any:
        start = time.time()
        out = super()._run_isolated(payloads, *args)
        end = time.time()
        for rid in self._ids:
            self.rows[rid] += [start, end]
        return out

    def _write(self, job: Any, pop_next: bool) -> Any:
        reply = super()._write(job, pop_next)
        at = time.time()
        for item in job.batch.items:
            self.rows[item.id].append(at)
        return reply


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--queue", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    guard_parent()
    worker = StampedWorker(noop(), ConsumerConfig(redis_url=args.redis_url, queue=args.queue,
                                                  name=f"stamped-{args.queue}"))
    worker.prepare()
    signal.signal(signal.SIGTERM, lambda *_: worker.stop())
    print("ready", flush=True)
    worker.run()
    with open(args.out, "wb") as out:
        for row in worker.rows.values():
            out.write(orjson.dumps(row) + b"\n")


if __name__ == "__main__":
    main()
