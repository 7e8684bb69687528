"""Requests of two lengths (issue 16 §6): one bucket against cost buckets, --prefer-bucket
and --max-cost, on the generator model, measured and simulated side by side in one run.

    python -m bench.lengths                      # 4 configurations x 60 s
    python -m bench.lengths --quick --out /tmp/lengths

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
from pathlib import Path
from typing import Any

import orjson

from batchgate.embedded import embedded_redis
from batchgate.lengths import CONFIG_NAMES, LONG, SHORT, render, run_scenario


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.plots import _save

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
    _save(fig, path.parent, path.name)


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
    parser.add_argument("--out", type=Path, default=Path("bench/results/lengths"))
    args = parser.parse_args(argv)
    configs = tuple(c for c in args.configs.split(",") if c)
    unknown = sorted(set(configs) - set(CONFIG_NAMES))
    if unknown:
        parser.error(f"--configs: unknown {', '.join(unknown)}; use {', '.join(CONFIG_NAMES)}")
    duration = args.duration_s or (6.0 if args.quick else 60.0)
    args.out.mkdir(parents=True, exist_ok=True)
    with embedded_redis() as url:
        report = run_scenario(url, duration, args.consumers, args.seed, load=args.load,
                              rate=args.rate, configs=configs,
                              repeats=1 if args.quick else args.repeats)
    text = render(report)
    print(text)
    (args.out / "results.json").write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    (args.out / "results.md").write_text(text + "\n")
    plot(report, args.out / "lengths.png")
    print(f"wrote {args.out}/results.json, results.md, lengths.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
