"""PROTOTYPE, not used by default: a consumer that overlaps the scheduler's work with the
model, to size the fix proposed in docs/benchmarks.md for the saturation target.

Measure it with the harness:

    batchgate bench --sections saturation --consumer-script prototype_overlap_consumer.py

Compared with consumer.worker.Consumer (complete + next pop in one round trip *after* the
model), it
- prefetches: when the batch in hand is full (the queue is saturated), a helper thread
  pops, parses and decodes the next batch while the model runs;
- completes asynchronously: the previous batch's results are handed to a completer
  thread just before the next model call, so their encoding and the complete script run
  while the model runs.

What it leaves out, and why it is not in batchgate yet: no flush of pending completions
on shutdown, no handling of expired/exhausted/malformed items, no failure isolation on the
prefetch path, and a prefetched batch is leased while it waits (at most one batch time),
which under the priority strategy can delay a HIGH request behind it when there is a
single consumer. It subclasses Consumer's private methods, so it may break when they change.
"""

from __future__ import annotations

import argparse
import queue
import threading
from typing import Any

import orjson
from _gate import guard_parent, ready_then_wait
from bg_consumer import Stamped

from consumer.loader import load_model
from consumer.worker import Batch, Consumer, ConsumerConfig
from scheduler_core.scripts import pop_keys
from scheduler_core.wire import decode_request


class OverlapConsumer(Consumer):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._completions: queue.Queue[Any] = queue.Queue()
        self._pending: Any = None
        threading.Thread(target=self._completer, daemon=True, name="completer").start()

    def _completer(self) -> None:
        while True:
            batch, runnable, results = self._completions.get()
            outcomes = {item.id: self._encode(item.id, ok, value)
                        for (item, _), (ok, value) in zip(runnable, results, strict=True)}
            self._complete(batch, outcomes)

    def _fetch(self, box: dict[str, Any]) -> None:
        nxt = self._parse(self.scripts.pop_batch(
            keys=pop_keys(self.keys), args=[self.config.name, self.config.lease_ms]))
        if isinstance(nxt, Batch):
            nxt.decoded = [(item, decode_request(item.envelope or b""))  # type: ignore[attr-defined]
                           for item in nxt.items]
        box["next"] = nxt

    def _process(self, batch: Batch) -> Batch | int | None:
        self._current, self._lease_lost = batch, False
        runnable = getattr(batch, "decoded", None) or \
            [(item, decode_request(item.envelope or b"")) for item in batch.items]
        box: dict[str, Any] = {}
        prefetch = None
        if self.policy is not None and len(batch.items) >= self.policy.max_batch_size:
            prefetch = threading.Thread(target=self._fetch, args=(box,), daemon=True)
            prefetch.start()
        if self._pending is not None:  # encode + complete the last batch during this model
            self._completions.put(self._pending)
            self._pending = None
        results = self._run_isolated([payload for _, payload in runnable])
        self.batches_done += 1
        self.requests_done += len(batch.items)
        if prefetch is None:
            self._completions.put((batch, runnable, results))
            self._current = None
            return self._pop()
        self._pending = (batch, runnable, results)
        self._current = None
        prefetch.join()
        if not isinstance(box["next"], Batch):  # nothing to overlap with: complete now
            self._completions.put(self._pending)
            self._pending = None
        return box["next"]


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("--redis-url", "--queue", "--model", "--go"):
        parser.add_argument(name, required=True)
    parser.add_argument("--model-args", default="{}")
    parser.add_argument("--name", default="")
    args = parser.parse_args()
    guard_parent()
    consumer = OverlapConsumer(model=lambda payloads: payloads, config=ConsumerConfig(
        redis_url=args.redis_url, queue=args.queue, name=args.name))
    consumer.start()
    consumer.model = Stamped(load_model(args.model, orjson.loads(args.model_args)), consumer)
    ready_then_wait(args.redis_url, args.go)
    consumer.run()


if __name__ == "__main__":
    main()
