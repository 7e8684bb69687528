"""The seeded workload that `batchgate demo` and `python -m bench.run` replay: arrival times,
priorities and payloads, identical for every system and strategy given the same seed."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

PRIORITIES = ("high", "normal", "low")
MIX = (0.1, 0.6, 0.3)  # share of HIGH, NORMAL, LOW requests
WORDS = ("the", "a", "model", "request", "queue", "batch", "latency", "user", "server", "token",
         "time", "fast", "slow", "cat", "dog", "market", "price", "report", "answer",
         "question", "night", "city", "river", "small", "large", "new", "old", "good", "open")
# name -> (--model spec, default --model-arg values)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "noop": ("consumer.models:noop", {}),
    "synthetic": ("consumer.models:synthetic", {"base_ms": 5.0, "per_item_ms": 0.5}),
    "tiny_text": ("consumer.models:tiny_text", {}),
    "minilm": ("consumer.models:minilm", {}),  # needs the `minilm` extra
}


@dataclass(frozen=True)
class Workload:
    """Arrival process. `kind`: poisson (rate λ for duration_s), bursty (poisson plus
    `burst_size` requests spread over `burst_window_s` every `burst_every_s`), backlog
    (`count` requests, all at t=0)."""

    kind: str
    rate: float = 0.0
    duration_s: float = 0.0
    count: int = 0
    seed: int = 1
    model: str = "noop"
    burst_size: int = 50
    burst_window_s: float = 0.1
    burst_every_s: float = 2.0

    def arrivals(self) -> tuple[list[float], list[int], list[Any]]:
        """(offsets in s, priorities 0-2, payloads), sorted by offset."""
        rng = random.Random(self.seed)
        times, prios = self._schedule(rng, MIX)
        return times, prios, [self._payload(rng, i) for i in range(len(times))]

    def schedule(self, mix: Sequence[float] = MIX) -> tuple[list[float], list[int]]:
        """(offsets in s, priorities 0-2) without payloads, drawn with `mix` as the weights
        of HIGH, NORMAL, LOW: with the default mix, those of arrivals()."""
        return self._schedule(random.Random(self.seed), mix)

    def _schedule(self, rng: random.Random, mix: Sequence[float]
                  ) -> tuple[list[float], list[int]]:
        times = [0.0] * self.count if self.kind == "backlog" else self._poisson(rng)
        if self.kind == "bursty":
            start = min(self.burst_every_s / 2, self.duration_s / 3)
            while start < self.duration_s:
                times += [start + rng.random() * self.burst_window_s
                          for _ in range(self.burst_size)]
                start += self.burst_every_s
            times.sort()
        elif self.kind not in ("poisson", "backlog"):
            raise ValueError(f"unknown workload kind {self.kind!r}")
        return times, rng.choices((0, 1, 2), weights=mix, k=len(times))

    def _poisson(self, rng: random.Random) -> list[float]:
        times: list[float] = []
        at = rng.expovariate(self.rate)
        while at < self.duration_s:
            times.append(at)
            at += rng.expovariate(self.rate)
        return times

    def _payload(self, rng: random.Random, i: int) -> Any:
        if self.model == "tiny_text":
            return {"tokens": [rng.randrange(1, 1000) for _ in range(rng.randint(4, 64))]}
        if self.model == "minilm":
            return {"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40)))}
        return {"i": i}
