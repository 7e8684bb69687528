"""A model that opts into the requests' costs (`accepts_costs`), for tests/test_costs.py.
`batchgate consumer` imports it from this directory (`--model cost_models:CostRecorder`,
cwd = this directory)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


class CostRecorder:
    """Answers each payload with the cost it was given, and appends one line per batch
    ({"t", "started", "costs", "requested", "truncated"}) to `out`/<pid>.jsonl. A batch
    takes delay_ms; one holding a cost above slow_over (if > 0) takes slow_ms instead."""

    accepts_costs = True

    def __init__(self, out: str, delay_ms: float = 0.0, slow_over: int = 0,
                 slow_ms: float = 0.0):
        self.path = Path(out) / f"{os.getpid()}.jsonl"
        self.delay_s = float(delay_ms) / 1000
        self.slow_over, self.slow_s = int(slow_over), float(slow_ms) / 1000

    def __call__(self, payloads: list[Any], costs: list[Any]) -> list[Any]:
        started = time.time()
        slow = self.slow_over and max(int(c) for c in costs) > self.slow_over
        if slow or self.delay_s:
            time.sleep(self.slow_s if slow else self.delay_s)
        record = {"t": time.time(), "started": started, "payloads": payloads,
                  "costs": [int(c) for c in costs],
                  "requested": [c.requested for c in costs],
                  "truncated": [c.truncated for c in costs]}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        return [{"payload": p, "cost": int(c), "requested": c.requested,
                 "truncated": c.truncated} for p, c in zip(payloads, costs, strict=True)]


def batches(out: Path) -> list[dict[str, Any]]:
    """Every batch recorded under `out`, by wall-clock time."""
    records = [json.loads(line) for path in sorted(out.glob("*.jsonl"))
               for line in path.read_text().splitlines(keepends=True) if line.endswith("\n")]
    return sorted(records, key=lambda r: r["t"])
