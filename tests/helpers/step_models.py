"""A step-wise model (consumer/stepwise.py) for tests/test_continuous.py: no torch, each
step a fixed sleep, so that scheduling is what the tests see."""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

from consumer.stepwise import Step


class Counter:
    """Payload {"i": any, "n": steps}: n steps, part {"i", "step": s} at step s, result
    {"i", "steps": n}. {"boom": true} makes the step that runs it raise; {"garbage": true}
    makes it return what no step returns; {"hang": true} makes it sleep for an hour.
    Records the most sequences that ran at once and the sequences each step ran."""

    steps = True
    streams = True

    def __init__(self, sleep_ms: float = 20):
        self.sleep_s = sleep_ms / 1000
        self.seqs: dict[int, list[Any]] = {}  # handle -> [payload, steps done]
        self.ids = itertools.count(1)
        self.most = 0
        self.ran: list[list[Any]] = []  # per step: the ids of the sequences it ran
        self.lock = threading.Lock()

    def add(self, payload: Any, cost: Any = None) -> int:
        if not isinstance(payload, dict) or not isinstance(payload.get("n"), int) \
                or payload["n"] < 1:
            raise ValueError("payload: 'n' must be an integer >= 1")
        handle = next(self.ids)
        self.seqs[handle] = [payload, 0]
        self.most = max(self.most, len(self.seqs))
        return handle

    def step(self) -> list[Step]:
        time.sleep(self.sleep_s)
        if any(p.get("hang") for p, _ in self.seqs.values()):
            time.sleep(3600)
        if any(p.get("boom") for p, _ in self.seqs.values()):
            self.seqs.clear()
            raise RuntimeError("boom")
        if any(p.get("garbage") for p, _ in self.seqs.values()):
            self.seqs.clear()
            return [[1, 2]]  # type: ignore[list-item]
        out = []
        with self.lock:
            self.ran.append([p["i"] for p, _ in self.seqs.values()])
        for handle, seq in list(self.seqs.items()):
            payload, done = seq
            seq[1] = done + 1
            result = None
            if seq[1] == payload["n"]:
                result = {"i": payload["i"], "steps": payload["n"]}
                del self.seqs[handle]
            out.append(Step(handle, {"i": payload["i"], "step": done}, result))
        return out

    def remove(self, handle: Any) -> None:
        self.seqs.pop(handle, None)

    def running(self) -> int:
        return len(self.seqs)
