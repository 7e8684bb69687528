"""One benchmark run's description, shared by the harness and the in-process batcher."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchgate.workload import Workload
from scheduler_core.policy import Policy


@dataclass(frozen=True)
class RunSpec:
    section: str
    system: str  # batchgate | rq | raw | inprocess
    model: str  # key of MODELS
    workload: Workload
    consumers: int
    strategy: str = "dynamic"
    max_batch_size: int = 32
    max_queue_delay_ms: int = 50
    aging_ms: int = 1000
    grace_s: float = 3.0  # after the last arrival, how long to wait for stragglers

    def policy(self) -> Policy:
        return Policy.build(self.strategy, max_batch_size=self.max_batch_size,
                            max_queue_delay_ms=self.max_queue_delay_ms,
                            aging_ms=self.aging_ms)

    def label(self) -> str:
        w = self.workload
        load = f"backlog {w.count}" if w.kind == "backlog" else f"{w.kind} λ={w.rate:g}"
        strat = "" if self.system in ("rq", "raw") else \
            f" {self.strategy}(b≤{self.max_batch_size})"
        return f"{self.system}{strat} {self.model} {load} N={self.consumers}"


def empty_record(n: int) -> dict[str, list[Any]]:
    return {k: [None] * n for k in ("t_sched", "t_submit", "t_enq", "t_pop", "t0", "t1",
                                    "batch", "worker", "t_seen")}
