"""The in-process baseline: batchgate's rules in one asyncio process, without Redis.

The same workload (batchgate.workload.Workload, same seed) is replayed open-loop by a task of
the event loop; requests wait in three in-memory queues (one per priority level, ordered
by arrival); N worker tasks apply exactly the rules of scheduler_core/lua/pop_batch.lua
(fifo, dynamic, priority with aging) and run the model in a thread pool of N threads, so
the event loop stays free while a batch runs. "Result seen" is stamped by a callback on
the event loop after the batch ends: the hop a waiting request handler would take.

What this costs compared with batchgate is what distribution costs: no Redis round
trips, no serialisation, no second process, but also no sharing across hosts and no
surviving a crash.

    python -m batchgate.bench.inprocess --specs '[<RunSpec as JSON>, ...]' --out runs.json
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson

from batchgate.bench.spec import RunSpec, empty_record
from batchgate.workload import MODELS, Workload
from consumer.loader import load_model


class Req:
    __slots__ = ("idx", "prio", "arrival", "payload")

    def __init__(self, idx: int, prio: int, arrival: float, payload: Any):
        self.idx, self.prio, self.arrival, self.payload = idx, prio, arrival, payload

    def __lt__(self, other: Req) -> bool:
        return (self.arrival, self.idx) < (other.arrival, other.idx)


def _arrival(req: Req) -> float:
    return req.arrival


class Rules:
    """pop_batch.lua in Python. Times are time.monotonic() seconds."""

    def __init__(self, strategy: str, max_batch_size: int, max_queue_delay_ms: int,
                 aging_ms: int):
        self.strategy = strategy
        self.size = max_batch_size
        self.delay = max_queue_delay_ms / 1000
        self.aging = aging_ms / 1000
        self.levels: list[list[Req]] = [[], [], []]

    def add(self, req: Req) -> None:
        self.levels[req.prio].append(req)  # arrivals come in time order

    def total(self) -> int:
        return sum(len(level) for level in self.levels)

    def _age(self, now: float) -> None:
        """LOW waiting >= aging -> NORMAL level; NORMAL level waiting >= 2 x aging, or
        >= aging if it was NORMAL to begin with -> HIGH level (at most 2 x max_batch_size
        of each kind per call, as the script)."""
        limit = 2 * self.size
        low, normal, high = self.levels[2], self.levels[1], self.levels[0]
        cut1, cut2 = now - self.aging, now - 2 * self.aging
        k = min(limit, bisect.bisect_right(low, cut1, key=_arrival))
        for req in low[:k]:
            bisect.insort(normal, req)
        del low[:k]
        i2 = bisect.bisect_right(normal, cut2, key=_arrival)
        i1 = bisect.bisect_right(normal, cut1, key=_arrival)
        promote = normal[:min(i2, limit)] + [r for r in normal[i2:min(i1, i2 + limit)]
                                             if r.prio <= 1]
        if promote:
            gone = {id(r) for r in promote}
            normal[:] = [r for r in normal if id(r) not in gone]
            for req in promote:
                bisect.insort(high, req)

    def _take(self, levels: tuple[int, ...], n: int) -> list[Req]:
        """The n oldest of the given levels, merged by arrival."""
        chosen = sorted(((r, level) for level in levels for r in self.levels[level][:n]),
                        key=lambda c: (c[0].arrival, c[0].idx))[:n]
        for level in levels:
            del self.levels[level][:sum(1 for _, lv in chosen if lv == level)]
        return [r for r, _ in chosen]

    def collect(self, now: float) -> tuple[list[Req], float | None]:
        """(batch, None) or ([], seconds until something falls due; None if empty)."""
        if self.strategy == "priority" and self.aging > 0:
            self._age(now)
        count = [len(level) for level in self.levels]
        total = sum(count)
        if total == 0:
            return [], None
        if self.strategy == "fifo":
            return self._take((0, 1, 2), self.size), None
        if self.strategy == "dynamic":
            first = min(level[0].arrival for level in self.levels if level)
            if total < self.size and now - first < self.delay:
                return [], first + self.delay - now
            return self._take((0, 1, 2), self.size), None
        if count[0]:
            return self._take((0,), self.size), None
        if count[1]:
            first = self.levels[1][0].arrival
            if count[1] < self.size and now - first < self.delay:
                due = first + self.delay
                if self.aging > 0:
                    due = min(due, first + self.aging)
                    if count[2]:
                        due = min(due, self.levels[2][0].arrival + self.aging)
                return [], max(0.0, due - now)
            return self._take((1,), self.size), None
        return self._take((2,), self.size), None


async def run(spec: RunSpec) -> tuple[dict[str, list[Any]], float, bool]:
    loop = asyncio.get_running_loop()
    model_spec, kwargs = MODELS[spec.model]
    model = load_model(model_spec, kwargs)
    times, prios, payloads = spec.workload.arrivals()
    n = len(times)
    rec = empty_record(n)
    rec["prio"] = prios
    policy = spec.policy()
    rules = Rules(policy.strategy.value, policy.max_batch_size, policy.max_queue_delay_ms,
                  policy.aging_ms)
    changed = asyncio.Event()
    pool = ThreadPoolExecutor(max_workers=spec.consumers)
    seen = 0
    all_seen = asyncio.Event()
    cpu0 = time.process_time()

    def deliver(batch: list[Req]) -> None:
        nonlocal seen
        now = time.time()
        for req in batch:
            rec["t_seen"][req.idx] = now
        seen += len(batch)
        if seen >= n:
            all_seen.set()

    async def worker(k: int) -> None:
        while True:
            changed.clear()
            batch, wait = rules.collect(time.monotonic())
            if not batch:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(changed.wait(), 1.0 if wait is None else wait)
                continue
            if rules.total():
                changed.set()  # more waiting: let another worker look
            popped = time.time()
            t0 = time.time()
            await loop.run_in_executor(pool, model, [r.payload for r in batch])
            t1 = time.time()
            for req in batch:
                i = req.idx
                rec["t_pop"][i], rec["t0"][i], rec["t1"][i] = popped, t0, t1
                rec["batch"][i], rec["worker"][i] = len(batch), k
            loop.call_soon(deliver, batch)

    workers = [asyncio.create_task(worker(k)) for k in range(spec.consumers)]
    await asyncio.sleep(0.05)
    base = loop.time() + 0.05
    base_wall = time.time() + (base - loop.time())
    rec["t_sched"] = [base_wall + t for t in times]
    i = 0
    while i < n:
        now = loop.time() - base
        if times[i] > now:
            await asyncio.sleep(times[i] - now)
            continue
        j = i + 1
        while j < n and times[j] <= now:
            j += 1
        stamp, mono = time.time(), time.monotonic()
        for k in range(i, j):
            rec["t_submit"][k] = rec["t_enq"][k] = stamp
            rules.add(Req(k, prios[k], mono, payloads[k]))
        changed.set()
        i = j
    grace = max(spec.grace_s, 60.0) if spec.workload.kind == "backlog" else spec.grace_s
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(all_seen.wait(), grace)
    for task in workers:
        task.cancel()
    pool.shutdown(wait=False, cancel_futures=True)
    return rec, time.process_time() - cpu0, seen >= n


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--specs", required=True, help="JSON list of RunSpec")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    results = []
    for raw in orjson.loads(args.specs):
        spec = RunSpec(**{**raw, "workload": Workload(**raw["workload"])})
        rec, cpu, complete = asyncio.run(run(spec))
        del rec["prio"]
        results.append({"records": rec, "cpu": {"process": cpu}, "complete": complete})
    with open(args.out, "wb") as f:
        f.write(orjson.dumps(results))


if __name__ == "__main__":
    main()
