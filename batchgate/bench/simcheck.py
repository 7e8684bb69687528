"""Predicted against measured: `batchgate simulate` on the runs of a benchmark.

    batchgate bench --sections grid,bursty --grid 20,100,400,900,1800 --out DIR
    python -m batchgate.bench.simcheck DIR/results.json [--overhead-ms X] [--transport-ms Y]
        [--json]

For every run of results.json on the synthetic sleep model with Poisson or bursty
arrivals (the grid and bursty sections, batchgate and in-process), it simulates the same
requests (same workload and seed, same policy, consumers and t(b)) and prints measured and
predicted p50/p99 per class, throughput and mean batch, with predicted/measured ratios.
docs/benchmarks.md ("The simulator against the real system") has one run's figures.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import orjson

from batchgate.simulate import (
    DEFAULT_OVERHEAD_MS,
    DEFAULT_TRANSPORT_MS,
    CostModel,
    SimConfig,
    simulate,
)
from batchgate.workload import Workload
from scheduler_core.policy import Policy

CLASSES = ("all", "high", "normal", "low")


def compare(results: dict[str, Any], overhead_ms: float = DEFAULT_OVERHEAD_MS,
            transport_ms: float = DEFAULT_TRANSPORT_MS) -> list[dict[str, Any]]:
    rows = []
    for run in results["runs"]:
        spec, measured = run["spec"], run.get("summary")
        if (spec["model"] != "synthetic" or spec["system"] not in ("batchgate", "inprocess")
                or spec["workload"]["kind"] not in ("poisson", "bursty") or not measured):
            continue
        workload = Workload(**spec["workload"])
        cost = spec["model_spec"][1]
        config = SimConfig(Policy.from_redis(spec["policy"]),
                           CostModel(cost["base_ms"], cost["per_item_ms"]),
                           spec["consumers"], overhead_ms, transport_ms)
        predicted = simulate(config, *workload.schedule()).to_dict()
        row: dict[str, Any] = {
            "label": run["label"], "system": spec["system"], "strategy": spec["strategy"],
            "rate": workload.rate, "kind": workload.kind,
            "overloaded": measured.get("overloaded"),
            "throughput_rps": (measured["throughput_rps"], predicted["throughput_rps"]),
            "mean_batch": (measured["batch_mean"], predicted["mean_batch"])}
        for cls in CLASSES:
            for q in ("p50", "p99"):
                row[f"{cls}_{q}"] = (measured["latency_ms"][cls][q],
                                     predicted["latency_ms"][cls][q])
        rows.append(row)
    return rows


def ratio(pair: tuple[float | None, float | None]) -> float | None:
    measured, predicted = pair
    return None if not measured or predicted is None else predicted / measured


def render(rows: list[dict[str, Any]]) -> str:
    cols = ["all_p50", "all_p99", "high_p99", "normal_p99", "low_p99", "throughput_rps",
            "mean_batch"]
    head = "| run | " + " | ".join(f"{c} meas / pred (×)" for c in cols) + " |"
    lines = [head, "|" + "---|" * (len(cols) + 1)]
    for row in rows:
        cells = []
        for c in cols:
            m, p = row[c]
            r = ratio(row[c])
            cells.append("–" if m is None else
                         f"{m:.4g} / {p:.4g} ({r:.2f})" if r is not None else f"{m} / {p}")
        mark = " (overloaded)" if row["overloaded"] else ""
        lines.append(f"| {row['system']} {row['strategy']} {row['kind']} "
                     f"λ={row['rate']:g}{mark} | " + " | ".join(cells) + " |")
    ratios = [r for row in rows if not row["overloaded"]
              for c in ("all_p50", "all_p99") if (r := ratio(row[c])) is not None]
    if ratios:
        ratios.sort()
        lines.append(f"\npredicted/measured p50 and p99, runs not overloaded: median "
                     f"{ratios[len(ratios) // 2]:.2f}, range {ratios[0]:.2f}–{ratios[-1]:.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="results.json of a batchgate bench run")
    parser.add_argument("--overhead-ms", type=float, default=DEFAULT_OVERHEAD_MS)
    parser.add_argument("--transport-ms", type=float, default=DEFAULT_TRANSPORT_MS)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = compare(orjson.loads(args.results.read_bytes()), args.overhead_ms,
                   args.transport_ms)
    if args.json:
        print(orjson.dumps(rows, option=orjson.OPT_INDENT_2).decode())
    else:
        print(render(rows))


if __name__ == "__main__":
    main()
