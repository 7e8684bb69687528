"""A model that streams (`streams = True`), for tests/test_streaming.py. `batchgate
consumer` imports it from this directory (`--model stream_models:Steps`, cwd = here)."""

from __future__ import annotations

import time
from typing import Any


class Steps:
    """Payload {"i": any}: `parts` steps, `sleep_ms` apart; step s emits {"i", "step": s}
    for every request of the batch. Result: {"i", "parts": parts}. A payload with
    "raise": true makes the batch raise after its first step."""

    streams = True

    def __init__(self, parts: int = 5, sleep_ms: int = 100):
        self.parts, self.sleep_s = parts, sleep_ms / 1000

    def __call__(self, payloads: list[Any], emit: Any) -> list[Any]:
        for step in range(self.parts):
            time.sleep(self.sleep_s)
            emit({r: {"i": p["i"], "step": step} for r, p in enumerate(payloads)})
            if any(p.get("raise") for p in payloads):
                raise ValueError("poison payload")
        return [{"i": p["i"], "parts": self.parts} for p in payloads]
