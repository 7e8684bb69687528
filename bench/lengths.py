"""Requests of two lengths (issue 16 §6): one bucket against cost buckets, --prefer-bucket
and --max-cost, on the generator model, measured and simulated side by side in one run.

    python -m bench.lengths                      # 4 configurations x 60 s
    python -m bench.lengths --quick --out /tmp/lengths
    python -m bench.lengths --quick --shapes 1x16,1x256,2x256   # fewer profiled shapes

The scenario (batchgate/lengths.py): 80% of the requests ask for 16 new tokens, 20% for
256, Poisson at --load (0.6: the requests would take 60% of the consumers' time one by
one, from t(1, cost) measured at startup), through --consumers `batchgate consumer`
processes per configuration on a private redis-server. Per configuration it prints the
short and long requests' p50/p99, the throughput, the batches and the padding waste
Σ(max − cost)/Σ max, and the simulator's prediction on the same arrivals with two
cost models fitted to the profile and one to the run's own model-time samples, with
their variation as jitter (and each one's error); then the issue's targets as PASS/MISS. --out gets
results.json, results.md and lengths.png. docs/benchmarks.md ("Requests of two
lengths") has a run's figures.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from batchgate import lengths
from batchgate.embedded import embedded_redis
from batchgate.lengths import CONFIG_NAMES, LONG, SHORT, Config, fmt, run_scenario
from batchgate.verdict import missed
from scheduler_core.cost_model import fit
from scheduler_core.ops.simulation import ModelTime, SimConfig, simulate
from scheduler_core.policy import Policy

PROFILE_SHAPES = [(b, c) for b in (1, 2, 4, 8) for c in (SHORT, 128, LONG)]


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """--shapes "1x16,2x256": (batch size, new tokens) pairs; the step fit has three terms,
    so at least three shapes, of two batch sizes and two lengths."""
    try:
        shapes = [(int(b), int(c)) for b, c in (s.split("x") for s in text.split(",") if s)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shapes: {text!r} is not BxC,BxC,...") from None
    if (len(shapes) < 3 or len({b for b, _ in shapes}) < 2 or len({c for _, c in shapes}) < 2
            or min(min(s) for s in shapes) < 1):
        raise argparse.ArgumentTypeError(
            "--shapes: at least 3 shapes of 2 batch sizes and 2 lengths, each >= 1")
    return shapes


@dataclass(frozen=True)
class StepTime(ModelTime):
    """t = base + per_step_ms × max cost + per_cost_ms × b × max cost (cost_mode padded
    hands `us` the units b × max cost)."""

    per_step_ms: float = 0.0

    def us(self, batch: int, cost_units: int = 0) -> int:
        top = cost_units / batch if batch else 0.0
        return round((self.base_ms + self.per_step_ms * top + self.per_cost_ms * cost_units)
                     * 1000)

    def __str__(self) -> str:
        return (f"{self.base_ms:.3g}+{self.per_step_ms:.3g}*max+{self.per_cost_ms:.3g}*b*max "
                "ms")


def add_fits(prof: dict[str, Any]) -> None:
    """prof["padded"] (A + B·b·max) and prof["step"] (A + S·max + B·b·max), fitted to the
    profile's points (once)."""
    if "step" in prof:
        return
    points = [(p["b"], p["cost"], p["ms"]) for p in prof["points"]]
    line = fit([(b * c, ms) for b, c, ms in points])
    prof["padded"] = {"base_ms": round(max(0.0, line.base_ms), 4),
                      "per_cost_ms": round(max(1e-6, line.per_item_ms), 6),
                      "r2": round(line.r2, 4)}
    prof["step"] = fit_step(points)


KINDS = ("padded", "step", "live")
# The live prediction is the median over this many jitter seeds: with a few hundred
# requests, p99 is made of a handful of batches, and one draw of their times swings it
# by ±50% (the spread is reported beside it).
LIVE_DRAWS = 21


def fit_step(samples: list[tuple[int, int, float]]) -> dict[str, float]:
    """StepTime's terms (A + S·max + B·b·max ms) by least squares through (batch size,
    largest cost, ms) samples; negative terms clamped to 0."""
    import numpy as np

    rows = np.array([[1.0, c, b * c] for b, c, _ in samples])
    coef = np.linalg.lstsq(rows, np.array([ms for *_, ms in samples]), rcond=None)[0]
    a, step, per = (max(0.0, float(x)) for x in coef)
    return {"base_ms": round(a, 4), "per_step_ms": round(step, 6),
            "per_cost_ms": round(max(1e-6, per), 6)}


def live_model(run: dict[str, Any]) -> tuple[dict[str, float], tuple[float, ...]]:
    """What the consumers measured during the run, as a user would get it from the queue's
    model samples and live refit: the step model fitted to the run's own batches, and
    each batch's model time over that fit (the simulator's jitter ratios)."""
    samples = [(len(c), max(c), ms) for c, ms in
               zip(run["batch_costs"], run.get("batch_ms", ()), strict=False) if ms > 0]
    if len(samples) < 3:
        raise ValueError("fewer than 3 timed batches")
    m = fit_step(samples)
    fitted = [m["base_ms"] + c * (m["per_step_ms"] + m["per_cost_ms"] * b)
              for b, c, _ in samples]
    return m, tuple(ms / f for (*_, ms), f in zip(samples, fitted, strict=True) if f > 0)


def predict(config: Config, prof: dict[str, Any], kind: str, times: list[float],
            costs: list[int], consumers: int, run: dict[str, Any] | None = None,
            seed: int = 1) -> dict[str, Any]:
    """The simulator on the same arrivals, with the `kind` model time: "padded" (the
    profile's A + B·b·max), "step" (the profile's A + S·max + B·b·max), or "live": the
    step model fitted to the run's own batches (`run`), each simulated batch's time
    multiplied by one of their ratios measured / fitted, drawn with seeds `seed` ..
    `seed` + LIVE_DRAWS - 1: the median of each figure over the draws, and their range
    (the profile's step fit, exactly, if the run timed fewer than 3 batches)."""
    jitter: tuple[float, ...] = ()
    m = prof["padded" if kind == "padded" else "step"]
    if kind == "live" and run is not None:
        with contextlib.suppress(ValueError):  # too few batches: the profile's fit
            m, jitter = live_model(run)
    cost = (ModelTime(m["base_ms"], 0.0, m["per_cost_ms"]) if kind == "padded" else
            StepTime(m["base_ms"], 0.0, m["per_cost_ms"], m["per_step_ms"]))
    def per_consumer(buckets: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(buckets[i] if i < len(buckets) else 0
                     for i in range(consumers)) if buckets else ()

    draws = []
    for k in range(LIVE_DRAWS if jitter else 1):
        sim = SimConfig(policy=Policy.build("dynamic", **config.policy), cost=cost,
                        consumers=consumers, prefer_buckets=per_consumer(config.prefer),
                        jitter=jitter, jitter_seed=seed + k,
                        only_buckets=per_consumer(config.only))
        draws.append(simulate(sim, times, [1] * len(times), costs))

    def median(get: Callable[[Any], float | None]) -> float | None:
        values = [v for r in draws if (v := get(r)) is not None]
        return statistics.median(values) if values else None

    out: dict[str, Any] = {
        "cost_model": str(cost), "jitter_samples": len(jitter), "draws": len(draws),
        "throughput_rps": median(lambda r: r.throughput_rps),
        "padding_waste": median(lambda r: r.padding_waste),
        "mean_batch": median(lambda r: r.mean_batch),
        "latency_ms": {str(c): {q: median(lambda r, c=c, q=q: r.latency_by_cost.get(c, {})
                                          .get(q))
                                for q in ("p50", "p99")}
                       for c in sorted({c for r in draws for c in r.latency_by_cost})}}
    if len(draws) > 1:
        out["p99_range_ms"] = {
            str(c): [min(v), max(v)] for c in (SHORT, LONG)
            if (v := [r.latency_by_cost[c]["p99"] for r in draws
                      if r.latency_by_cost.get(c, {}).get("p99") is not None])}
    return out


def add_predictions(run: dict[str, Any], config: Config, prof: dict[str, Any],
                    times: list[float], costs: list[int], consumers: int,
                    seed: int = 1) -> None:
    """run["model_time_vs_fit"] and run["predicted"][kind] for every KINDS, with errors."""
    # The consumers' model time against the step fit's, on the batches they ran: over 1
    # when the machine ran the model slower than at the profile (other load).
    step = prof["step"]
    fitted_s = sum(step["base_ms"] + max(c) * (step["per_step_ms"] + step["per_cost_ms"]
                                                * len(c))
                   for c in run["batch_costs"]) / 1000
    run["model_time_vs_fit"] = round(run["model_s"] / fitted_s, 3) if fitted_s else None
    run["predicted"] = {kind: predict(config, prof, kind, times, costs, consumers, run, seed)
                        for kind in KINDS}
    for pred in run["predicted"].values():
        pred["error_pct"] = {
            "short_p99": error_pct(pred["latency_ms"].get(str(SHORT), {}).get("p99"),
                                   run["latency_ms"][str(SHORT)]["p99"]),
            "long_p99": error_pct(pred["latency_ms"].get(str(LONG), {}).get("p99"),
                                  run["latency_ms"][str(LONG)]["p99"]),
            "throughput": error_pct(pred["throughput_rps"], run["throughput_rps"])}


def error_pct(sim: float | None, real: float | None) -> float | None:
    if sim is None or not real:
        return None
    return round((sim - real) / real * 100, 1)


def sim_checks(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each prediction within 15% of the measurement (p99 short, long, throughput)."""
    out: list[dict[str, Any]] = []
    for name, run in results.items():
        for kind, pred in run["predicted"].items():
            errs = [abs(e) for e in pred["error_pct"].values() if e is not None]
            out.append({"check": f"{name}: simulator ({kind} fit) within 15% (p99 short, "
                                 "long, throughput)",
                        "ok": bool(errs) and max(errs) <= 15,
                        "value": ", ".join(f"{k} {v:+.1f}%" for k, v in
                                           pred["error_pct"].items() if v is not None)})
    return out




def render(report: dict[str, Any]) -> str:
    """results.md: a markdown table per configuration (the measurements and each
    prediction beside them), the fits, and the checks."""
    prof = report["profile"]
    lines = [
        *lengths.describe(report),
        f"fits: t = {prof['padded']['base_ms']:.3g} + {prof['padded']['per_cost_ms']:.3g}"
        f"·b·max ms (r² {prof['padded']['r2']:.2f}); t = {prof['step']['base_ms']:.3g} + "
        f"{prof['step']['per_step_ms']:.3g}·max + {prof['step']['per_cost_ms']:.3g}·b·max ms",
        "",
        "| config | short p50/p99 ms | long p50/p99 ms | req/s | batches (mean) | padding "
        "waste | model time / fit | sim b·max: short/long p99 ms (err) | sim step: "
        "short/long p99 ms (err) | sim live (the run's own model samples; median of "
        f"{LIVE_DRAWS} jitter draws): short/long p99 ms (err; the draws' range) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in report["configs"].items():
        s, lg = r["latency_ms"][str(SHORT)], r["latency_ms"][str(LONG)]
        sims = []
        for kind in KINDS:
            p = r["predicted"][kind]
            e = p["error_pct"]
            sims.append(
                f"{fmt(p['latency_ms'].get(str(SHORT), {}).get('p99'))}/"
                f"{fmt(p['latency_ms'].get(str(LONG), {}).get('p99'))} "
                f"({fmt(e['short_p99'], '+.0f')}%/{fmt(e['long_p99'], '+.0f')}%)"
                + "".join(f"; {name} {lo:.0f}–{hi:.0f}" for name, (lo, hi) in zip(
                    ("draws: short", "long"), (p.get("p99_range_ms") or {}).values(),
                    strict=False)))
        lines.append(
            f"| {name} | {fmt(s['p50'])}/{fmt(s['p99'])} | {fmt(lg['p50'])}/{fmt(lg['p99'])} | "
            f"{fmt(r['throughput_rps'], '.1f')} | {r['batches']} ({fmt(r['mean_batch'], '.2f')})"
            f" | {r['padding_waste']:.1%} | {fmt(r['model_time_vs_fit'], '.2f')} | "
            + " | ".join(sims) + " |")
    return "\n".join([*lines, *lengths.verdicts(report)])



def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.common import save_figure

    names = list(report["configs"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    x = range(len(names))
    width = 0.27
    for k, (cost, color) in enumerate(((SHORT, "tab:blue"), (LONG, "tab:orange"))):
        real = [report["configs"][n]["latency_ms"][str(cost)]["p99"] or 0 for n in names]
        sim = [report["configs"][n]["predicted"]["step"]["latency_ms"].get(str(cost), {})
               .get("p99") or 0 for n in names]
        offs = [i + (k - 0.5) * width * 2 for i in x]
        left.bar([o - width / 2 for o in offs], real, width, color=color,
                 label=f"cost {cost}: measured")
        left.bar([o + width / 2 for o in offs], sim, width, color=color, alpha=0.45,
                 hatch="//", label=f"cost {cost}: simulated (step fit)")
    left.set_xticks(list(x), names, fontsize=7, rotation=12)
    left.set_yscale("log")
    left.set_ylabel("p99 latency, ms")
    left.legend(fontsize=7)
    left.set_title("p99 by request length")
    waste = [report["configs"][n]["padding_waste"] * 100 for n in names]
    rps = [report["configs"][n]["throughput_rps"] or 0 for n in names]
    right.bar(list(x), waste, 0.5, color="tab:gray", label="padding waste %")
    right.set_xticks(list(x), names, fontsize=7, rotation=12)
    right.set_ylabel("padding waste, % of padded tokens")
    twin = right.twinx()
    twin.plot(list(x), rps, "o-", color="tab:green", label="throughput req/s")
    twin.set_ylabel("throughput, req/s")
    twin.set_ylim(0, max(rps or [1]) * 1.3)
    right.legend(loc="upper left", fontsize=7)
    twin.legend(loc="upper right", fontsize=7)
    w = report["workload"]
    right.set_title(f"{w['rate']:g} req/s, load {w['load']:.2f}, {report['consumers']} "
                    "consumers")
    save_figure(fig, path.parent, path.name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=None,
                        help="seconds of arrivals per configuration (default 60, --quick 6)")
    parser.add_argument("--quick", action="store_true",
                        help="a short run: 6 s per configuration, one repeat per profiled "
                             "shape (the harness, not the numbers)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timings per profiled shape (the median is used)")
    parser.add_argument("--load", type=float, default=0.6,
                        help="offered load (rate x mean t(1, cost) / consumers)")
    parser.add_argument("--rate", type=float, default=None,
                        help="requests/s instead of --load")
    parser.add_argument("--consumers", type=int, default=2)
    parser.add_argument("--configs", default=",".join(CONFIG_NAMES),
                        help="comma-separated, of " + ", ".join(CONFIG_NAMES))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--shapes", type=parse_shapes, default=PROFILE_SHAPES,
                        help="(batch size)x(new tokens) shapes profiled for the simulator's "
                             "fits, comma-separated (default: batch 1, 2, 4, 8 x 16, 128, "
                             "256 tokens)")
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 when any check is missed")
    parser.add_argument("--out", type=Path, default=Path("bench/results/lengths"))
    args = parser.parse_args(argv)
    configs = tuple(c for c in args.configs.split(",") if c)
    unknown = sorted(set(configs) - set(CONFIG_NAMES))
    if unknown:
        parser.error(f"--configs: unknown {', '.join(unknown)}; use {', '.join(CONFIG_NAMES)}")
    duration = args.duration_s or (6.0 if args.quick else 60.0)
    args.out.mkdir(parents=True, exist_ok=True)

    def predictions(run: dict[str, Any], config: Config, prof: dict[str, Any],
                    times: list[float], costs: list[int]) -> None:
        add_fits(prof)
        add_predictions(run, config, prof, times, costs, args.consumers, args.seed)

    with embedded_redis() as url:
        report = run_scenario(url, duration, args.consumers, args.seed, load=args.load,
                              rate=args.rate, configs=configs,
                              repeats=1 if args.quick else args.repeats,
                              shapes=args.shapes, after_run=predictions)
    report["checks"] += sim_checks(report["configs"])
    (args.out / "results.json").write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    (args.out / "results.md").write_text(render(report) + "\n")
    plot(report, args.out / "lengths.png")
    print(lengths.render(report))  # under 100 columns; the predictions are in results.md
    print(f"wrote {args.out}/results.json, results.md (with the predictions), lengths.png")
    return 1 if args.strict and missed(report["checks"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
