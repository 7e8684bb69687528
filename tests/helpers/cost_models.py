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
    ({"t", "costs", "requested", "truncated"}) to `out`/<pid>.jsonl."""

    accepts_costs = True

    def __init__(self, out: str, delay_ms: float = 0.0):
        self.path = Path(out) / f"{os.getpid()}.jsonl"
        self.delay_s = float(delay_ms) / 1000

    def __call__(self, payloads: list[Any], costs: list[Any]) -> list[Any]:
        if self.delay_s:
            time.sleep(self.delay_s)
        record = {"t": time.time(), "payloads": payloads, "costs": [int(c) for c in costs],
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
