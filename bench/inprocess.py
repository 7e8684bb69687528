"""The in-process baseline: batchgate's rules in one asyncio process, without Redis.

The same workload (batchgate.workload.Workload, same seed) is replayed open-loop by a task of
the event loop; requests wait in three in-memory queues (one per priority level, ordered
by arrival); N worker tasks decide batches with scheduler_core.rules.decide, the Python
twin of scheduler_core/lua/pop_batch.lua (fifo, dynamic, priority with aging), and run
the model in a thread pool of N threads, so the event loop stays free while a batch runs.
"Result seen" is stamped by a callback on the event loop after the batch ends: the hop a
waiting request handler would take.

What this costs compared with batchgate is what distribution costs: no Redis round
trips, no serialisation, no second process, but also no sharing across hosts and no
surviving a crash.

    python -m bench.inprocess --specs '[<RunSpec as JSON>, ...]' --out runs.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson

from batchgate.workload import MODELS, Workload
from bench.spec import RunSpec, empty_record
from consumer.loader import load_model
from scheduler_core.policy import Policy, Strategy
from scheduler_core.rules import Batch, Request, Wait, apply, decide


class Req:
    __slots__ = ("idx", "prio", "arrival", "payload")

    def __init__(self, idx: int, prio: int, arrival: float, payload: Any):
        self.idx, self.prio, self.arrival, self.payload = idx, prio, arrival, payload


class Rules:
    """The in-process queue: three levels in memory; scheduler_core.rules.decide (the
    Python twin of pop_batch.lua) decides each batch. Times are time.monotonic() seconds."""

    def __init__(self, strategy: str, max_batch_size: int, max_queue_delay_ms: int,
                 aging_ms: int):
        self.policy = Policy(strategy=Strategy(strategy), max_batch_size=max_batch_size,
                             max_queue_delay_ms=max_queue_delay_ms, aging_ms=aging_ms)
        self.levels: list[list[Request]] = [[], [], []]
        self.waiting: dict[str | int, Req] = {}

    def add(self, req: Req) -> None:
        self.waiting[req.idx] = req
        # Arrivals come in time order, so appending keeps each level sorted.
        self.levels[req.prio].append(Request(round(req.arrival * 1e6), req.idx, req.prio))

    def total(self) -> int:
        return len(self.waiting)

    def collect(self, now: float) -> tuple[list[Req], float | None]:
        """(batch, None) or ([], seconds until something falls due; None if empty)."""
        decision = decide(self.levels, round(now * 1e6), self.policy,
                          first_deadline_us=0)  # no request has a deadline here
        apply(self.levels, decision)
        if isinstance(decision, Batch):
            return [self.waiting.pop(p.request.id) for p in decision.picked], None
        return [], decision.wait_us / 1e6 if isinstance(decision, Wait) else None


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
