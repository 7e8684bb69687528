"""Predicted against measured: `batchgate simulate` on the runs of a benchmark.

    python -m bench.run --sections grid,bursty --grid 20,100,400,900,1800 --out DIR
    python -m bench.simcheck DIR/results.json [DIR2/results.json ...]
        [--overhead-ms X] [--transport-ms Y] [--react-ms Z] [--fetch-ms A+B*b]
        [--finish-ms A+B*b] [--path-from CAL/results.json ... [--no-path-spread]]
        [--no-jitter] [--json]

For every run of results.json on the synthetic sleep model with Poisson or bursty
arrivals (the grid and bursty sections, batchgate and in-process), it simulates the same
requests (same workload and seed, same policy, consumers and t(b)) and prints measured and
predicted p50/p99 per class, throughput and mean batch, with predicted/measured ratios.
Each run's simulation is given that run's own model-time samples as `--cost-jitter` (the
sleeps the consumers measured, as a queue's {bg:q}:samples:model would hold them) unless
--no-jitter. batchgate runs get the distributed path (the options, by default simulate's);
in-process runs, which have no Redis between producer and batcher, the flat path they
were validated with (IN_PROCESS_*). `--path-from` fits the path to other runs on the
same host instead (a calibration run, e.g. `--grid 20,900`: see fit_path): transport,
fetch and finish, and the path's spread per arrival rate
(each run simulated with the spread of the nearest rate; --no-path-spread leaves it
out). It prints the terms it found, which `batchgate simulate` takes as they are
(the spread as `--path-samples`, a run's path_samples_ms). Given several results.json
(the same bench with other seeds), it adds each point's median ratio over the runs: a
p99 of a few seconds' requests under priority rests on a few long LOW waits, and moves
more between seeds than the targets allow. docs/benchmarks.md ("The simulator against
the real system") has the figures.
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path
from typing import Any, NamedTuple

import orjson

from batchgate.simulate import (
    AUTO_LEAD,
    DEFAULT_FETCH,
    DEFAULT_FINISH,
    DEFAULT_OVERHEAD_MS,
    DEFAULT_REACT_MS,
    DEFAULT_TRANSPORT_MS,
    CostModel,
    PathTime,
    SimConfig,
    jitter_ratios,
    path_offsets,
    simulate,
)
from batchgate.workload import Workload
from scheduler_core.policy import Policy

CLASSES = ("all", "high", "normal", "low")
# Issue 15 §2: at every point under 90% utilisation, p50, throughput and mean batch within
# 10%, p99 within 15%.
TOLERANCE = {"all_p50": 0.10, "throughput_rps": 0.10, "mean_batch": 0.10, "all_p99": 0.15}
MAX_BUSY = 0.9
# The in-process batcher's path: the gap between batches and the latency outside queue
# and model it was validated with (docs/benchmarks.md); no fetch or finish through Redis.
IN_PROCESS_OVERHEAD_MS = 0.14
IN_PROCESS_TRANSPORT_MS = 1.22


def samples_of(measured: dict[str, Any]) -> list[tuple[int, float]]:
    """The run's model-time samples as (batch size, ms)."""
    out = []
    for text in measured.get("model_samples") or ():
        size, _, us = text.partition(":")
        out.append((int(size), float(us) / 1000))
    return out


def compare(results: dict[str, Any], overhead_ms: float = DEFAULT_OVERHEAD_MS,
            transport_ms: float = DEFAULT_TRANSPORT_MS, fetch: PathTime = DEFAULT_FETCH,
            finish: PathTime = DEFAULT_FINISH, jitter: bool = True,
            react_ms: float = DEFAULT_REACT_MS,
            spreads: dict[float, tuple[float, ...]] | None = None) -> list[dict[str, Any]]:
    rows = []
    none = PathTime(0, 0)
    for run in results["runs"]:
        spec, measured = run["spec"], run.get("summary")
        if (spec["model"] != "synthetic" or spec["system"] not in ("batchgate", "inprocess")
                or spec["workload"]["kind"] not in ("poisson", "bursty") or not measured):
            continue
        workload = Workload(**spec["workload"])
        cost = spec["model_spec"][1]
        samples = samples_of(measured) if jitter else []
        ratios = jitter_ratios(samples) if len(samples) >= 2 else ()
        distributed = spec["system"] == "batchgate"
        config = SimConfig(Policy.from_redis(spec["policy"]),
                           CostModel(cost["base_ms"], cost["per_item_ms"]), spec["consumers"],
                           overhead_ms if distributed else IN_PROCESS_OVERHEAD_MS,
                           transport_ms if distributed else IN_PROCESS_TRANSPORT_MS,
                           fetch=fetch if distributed else none,
                           finish=finish if distributed else none,
                           jitter=ratios, jitter_seed=workload.seed,
                           lead_ms=AUTO_LEAD if distributed else 0,  # no fetch ahead
                           react_ms=react_ms,
                           path_spread=nearest(spreads, workload.rate) if distributed else ())
        predicted = simulate(config, *workload.schedule()).to_dict()
        row: dict[str, Any] = {
            "label": run["label"], "system": spec["system"], "strategy": spec["strategy"],
            "rate": workload.rate, "kind": workload.kind, "seed": workload.seed,
            "overloaded": measured.get("overloaded"), "jitter_samples": len(ratios),
            "busy": measured.get("busy_fraction"),
            "throughput_rps": (measured["throughput_rps"], predicted["throughput_rps"]),
            "mean_batch": (measured["batch_mean"], predicted["mean_batch"])}
        for cls in CLASSES:
            for q in ("p50", "p99"):
                row[f"{cls}_{q}"] = (measured["latency_ms"][cls][q],
                                     predicted["latency_ms"][cls][q])
        rows.append(row)
    return rows


class HostPath(NamedTuple):
    """The path around the model as fit_path measures it on one host."""

    transport_ms: float
    fetch: PathTime
    finish: PathTime
    spreads: dict[float, tuple[float, ...]]  # arrival rate -> path_offsets


def fit_path(results: dict[str, Any]) -> HostPath:
    """The path from the stage timings of a bench run's batchgate runs. Of the runs that
    kept up: transport is the median of their intended arrival → enqueue means; fetch and
    finish are least-squares A + B·b over (mean batch, the stage's mean) of pop → model
    start and model end → result seen. Means, not p50s: the path is one number per request
    in the simulation, and a sum of stages keeps the stages' means, not their p50s. The
    spread at a rate is the path samples of the runs at that rate, each as offsets from
    its own run's mean (a run's mean moves with its batch size; a loaded host's stalls
    grow with the load)."""
    points: dict[str, list[tuple[float, float]]] = {"pop_to_model": [], "model_to_seen": []}
    transport = []
    spreads: dict[float, list[float]] = {}
    for run in results["runs"]:
        measured = run.get("summary")
        if run["spec"]["system"] != "batchgate" or not measured or measured.get("overloaded"):
            continue
        stages = measured.get("stages_ms") or {}
        if not all(stages.get(k) for k in (*points, "submit_to_enqueue")):
            continue
        transport.append(stages["submit_to_enqueue"]["mean"]
                         + measured["generator_lag_ms"]["mean"])
        if len(measured.get("path_samples_ms") or ()) >= 2:
            spreads.setdefault(run["spec"]["workload"]["rate"], []).extend(
                path_offsets(measured["path_samples_ms"]))
        for stage, rows in points.items():
            rows.append((measured["batch_mean"], stages[stage]["mean"]))
    if len(transport) < 2 or len({b for b, _ in points["pop_to_model"]}) < 2:
        raise SystemExit("--path-from: need at least two batchgate runs that kept up, at two "
                         "batch sizes")

    def line(rows: list[tuple[float, float]], name: str) -> PathTime:
        n = len(rows)
        mb, my = sum(b for b, _ in rows) / n, sum(y for _, y in rows) / n
        slope = (sum((b - mb) * (y - my) for b, y in rows)
                 / sum((b - mb) ** 2 for b, _ in rows))
        slope = max(0.0, slope)
        return PathTime(round(max(0.0, my - slope * mb), 3), round(slope, 4), name)

    return HostPath(round(statistics.median(transport), 3),
                    line(points["pop_to_model"], "fetch_ms"),
                    line(points["model_to_seen"], "finish_ms"),
                    {rate: tuple(offsets) for rate, offsets in sorted(spreads.items())})


def nearest(spreads: dict[float, tuple[float, ...]] | None, rate: float) -> tuple[float, ...]:
    """The spread measured at the calibration rate nearest to `rate` (by ratio)."""
    if not spreads:
        return ()
    return spreads[min(spreads, key=lambda r: abs(math.log(r / rate)))]


def ratio(pair: tuple[float | None, float | None]) -> float | None:
    measured, predicted = pair
    return None if not measured or predicted is None else predicted / measured


def within(row: dict[str, Any]) -> bool | None:
    """Whether the prediction is within TOLERANCE on every figure; None for a run not
    held to it (overloaded, or busy at MAX_BUSY or more)."""
    if row["overloaded"] or row["busy"] is None or row["busy"] >= MAX_BUSY:
        return None
    return all((r := ratio(row[c])) is not None and abs(r - 1) <= tol
               for c, tol in TOLERANCE.items())


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
        verdict = within(row)
        if verdict is not None:
            mark += " PASS" if verdict else " MISS"
        lines.append(f"| {row['system']} {row['strategy']} {row['kind']} "
                     f"λ={row['rate']:g}{mark} | " + " | ".join(cells) + " |")
    lines.append("")
    for system in sorted({row["system"] for row in rows}):
        held = [v for row in rows if row["system"] == system
                if (v := within(row)) is not None]
        if held:
            lines.append(f"{system}: {sum(held)} of {len(held)} runs under {MAX_BUSY:.0%} busy "
                         "within 10% (p50, req/s, mean batch) and 15% (p99)")
        kept = [row for row in rows if row["system"] == system and not row["overloaded"]]
        for c in ("all_p50", "all_p99", "throughput_rps", "mean_batch"):
            rs = sorted(r for row in kept if (r := ratio(row[c])) is not None)
            if rs:
                lines.append(f"{system} {c} predicted/measured, {len(rs)} runs not overloaded:"
                             f" median {rs[len(rs) // 2]:.2f}, range {rs[0]:.2f}–{rs[-1]:.2f}")
    return "\n".join(lines)


def across(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per point (system, strategy, arrivals, λ) of runs under MAX_BUSY: the median over
    the runs of each figure's predicted/measured ratio, and how many runs met the targets."""
    points: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in rows:
        if within(row) is not None:
            key = (row["system"], row["strategy"], row["kind"], row["rate"])
            points.setdefault(key, []).append(row)
    out = []
    for (system, strategy, kind, rate), runs in points.items():
        medians = {}
        for figure in TOLERANCE:
            ratios = [r for row in runs if (r := ratio(row[figure])) is not None]
            medians[figure] = statistics.median(ratios) if ratios else None
        out.append({"system": system, "strategy": strategy, "kind": kind, "rate": rate,
                    "runs": len(runs), "met": sum(bool(within(row)) for row in runs),
                    "median_ratio": medians,
                    "median_within": all(m is not None and abs(m - 1) <= TOLERANCE[f]
                                         for f, m in medians.items())})
    return out


def render_across(points: list[dict[str, Any]]) -> str:
    cols = list(TOLERANCE)
    lines = ["| point | runs met | " + " | ".join(f"{c} median ×" for c in cols) +
             " | medians within |", "|" + "---|" * (len(cols) + 3)]
    for p in points:
        cells = [f"{m:.2f}" if (m := p["median_ratio"][c]) is not None else "–" for c in cols]
        lines.append(f"| {p['system']} {p['strategy']} {p['kind']} λ={p['rate']:g} | "
                     f"{p['met']} of {p['runs']} | " + " | ".join(cells) +
                     f" | {'yes' if p['median_within'] else 'no'} |")
    for system in sorted({p["system"] for p in points}):
        mine = [p for p in points if p["system"] == system]
        lines.append(f"{system}: {sum(p['median_within'] for p in mine)} of {len(mine)} points "
                     "within the targets by their median ratio over the runs")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, nargs="+",
                        help="results.json of a python -m bench.run run (several: other seeds)")
    parser.add_argument("--overhead-ms", type=float, default=DEFAULT_OVERHEAD_MS)
    parser.add_argument("--transport-ms", type=float, default=DEFAULT_TRANSPORT_MS)
    parser.add_argument("--react-ms", type=float, default=DEFAULT_REACT_MS)
    parser.add_argument("--fetch-ms", default=str(DEFAULT_FETCH).removesuffix(" ms"))
    parser.add_argument("--finish-ms", default=str(DEFAULT_FINISH).removesuffix(" ms"))
    parser.add_argument("--path-from", type=Path, metavar="RESULTS", nargs="+",
                        help="fit --transport-ms, --fetch-ms, --finish-ms and the path's spread "
                             "to these bench runs' stage timings (calibration runs on the same "
                             "host)")
    parser.add_argument("--no-path-spread", action="store_true",
                        help="with --path-from: the path's means only, not its spread")
    parser.add_argument("--no-jitter", action="store_true",
                        help="simulate each run's t(b) exactly, without its model samples")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    fetch = PathTime.parse(args.fetch_ms, "fetch_ms")
    finish = PathTime.parse(args.finish_ms, "finish_ms")
    transport_ms, path, spreads = args.transport_ms, "", {}
    if args.path_from:
        runs = [run for cal in args.path_from for run in orjson.loads(cal.read_bytes())["runs"]]
        transport_ms, fetch, finish, spreads = fit_path({"runs": runs})
        if args.no_path_spread:
            spreads = {}
        path = (f"path fitted to {', '.join(map(str, args.path_from))}: --transport-ms "
                f"{transport_ms:g} --fetch-ms "
                f"{str(fetch).removesuffix(' ms')} --finish-ms "
                f"{str(finish).removesuffix(' ms')}; spread from the path samples at λ "
                + (", ".join(f"{r:g} ({len(o):,})" for r, o in spreads.items()) or "none"))
    per_file = [compare(orjson.loads(results.read_bytes()), args.overhead_ms, transport_ms,
                        fetch, finish, not args.no_jitter, args.react_ms, spreads)
                for results in args.results]
    rows = [row for rows in per_file for row in rows]
    points = across(rows) if len(per_file) > 1 else None
    if args.json:
        if path or points is not None:
            print(orjson.dumps({"path": path, "rows": rows, "across": points},
                               option=orjson.OPT_INDENT_2).decode())
        else:
            print(orjson.dumps(rows, option=orjson.OPT_INDENT_2).decode())
    else:
        if points is None:
            text = render(rows)
        else:
            text = "\n\n".join(f"{results}\n\n{render(mine)}" for results, mine
                               in zip(args.results, per_file, strict=True))
            text += f"\n\nacross the {len(per_file)} runs\n\n{render_across(points)}"
        print(text + (f"\n{path}" if path else ""))


if __name__ == "__main__":
    main()
