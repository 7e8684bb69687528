"""PNG plots of a `python -m bench.run` run (matplotlib, Agg backend).

`python -m bench.run` calls make_all() at the end of a run; it can also be run by itself to
re-plot a results.json:

    python -m bench.plots bench/results/<run>/results.json [OUT_DIR]
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from bench.common import save_figure  # noqa: E402

COLORS = {"fifo": "tab:blue", "dynamic": "tab:orange", "priority": "tab:green",
          "rq": "black", "raw": "tab:gray", "inprocess": "tab:purple"}
PRIORITIES = ("high", "normal", "low")
DPI = 80


def _runs(results: dict[str, Any], **want: Any) -> list[dict[str, Any]]:
    out = []
    for run in results["runs"]:
        spec = run["spec"]
        if all(spec.get(k) == v for k, v in want.items()):
            out.append(run)
    return sorted(out, key=lambda r: r["spec"]["workload"]["rate"])


def latency_curves(results: dict[str, Any], out: Path) -> str | None:
    """p50 and p99 latency vs achieved throughput, per priority, per strategy."""
    grid = [r for r in results["runs"] if r["spec"]["section"] == "grid"]
    if not grid:
        return None
    fig, axes = plt.subplots(2, 3, figsize=(12, 6.5), sharex=True)
    series = []
    for strategy in ("fifo", "dynamic", "priority"):
        series.append((f"batchgate {strategy}", _runs(results, section="grid",
                       system="batchgate", strategy=strategy), COLORS[strategy], "-", "o"))
        series.append((f"in-process {strategy}", _runs(results, section="grid",
                       system="inprocess", strategy=strategy), COLORS[strategy], ":", "."))
    series.append(("RQ", _runs(results, section="grid", system="rq"), "black", "--", "s"))
    for row, pct in enumerate(("p50", "p99")):
        for col, prio in enumerate(PRIORITIES):
            ax = axes[row][col]
            for label, runs, color, style, marker in series:
                pts = [(r["summary"]["throughput_rps"], r["summary"]["latency_ms"][prio][pct],
                        r["summary"]["overloaded"]) for r in runs
                       if r["summary"]["latency_ms"][prio][pct] is not None]
                if not pts:
                    continue
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=color,
                        marker=marker, markersize=4, label=label, linewidth=1.2)
                over = [p for p in pts if p[2]]
                if over:
                    ax.plot([p[0] for p in over], [p[1] for p in over], "x", color="red",
                            markersize=7)
            ax.set_yscale("log")
            ax.set_xscale("log")
            ax.set_title(f"{prio.upper()} {pct}")
            ax.grid(True, which="both", alpha=0.3)
            if col == 0:
                ax.set_ylabel("latency, ms (from intended arrival)")
            if row == 1:
                ax.set_xlabel("achieved throughput, req/s")
    axes[0][0].legend(fontsize=7, loc="upper left")
    fig.suptitle("Latency vs throughput, t(b) = 5 + 0.5·b ms (red x: overloaded)", fontsize=11)
    return save_figure(fig, out, "latency_vs_throughput.png")


def batch_histograms(results: dict[str, Any], out: Path) -> str | None:
    rows = [s for s in ("dynamic", "priority")
            if _runs(results, section="grid", system="batchgate", strategy=s)]
    if not rows:
        return None
    rates = sorted({r["spec"]["workload"]["rate"] for s in rows
                    for r in _runs(results, section="grid", system="batchgate", strategy=s)})
    if len(rates) > 4:
        picks = [rates[0], rates[len(rates) // 3], rates[(2 * len(rates)) // 3], rates[-1]]
        rates = sorted(set(picks))
    fig, axes = plt.subplots(len(rows), len(rates), figsize=(3 * len(rates), 2.4 * len(rows)),
                             squeeze=False)
    for i, strategy in enumerate(rows):
        by_rate = {r["spec"]["workload"]["rate"]: r for r in
                   _runs(results, section="grid", system="batchgate", strategy=strategy)}
        for j, rate in enumerate(rates):
            ax = axes[i][j]
            run = by_rate.get(rate)
            if run is None:
                ax.axis("off")
                continue
            hist = {int(k): v for k, v in run["summary"]["batch_hist"].items()}
            ax.bar(list(hist), list(hist.values()), color=COLORS[strategy], width=0.9)
            ax.set_title(f"{strategy}, λ={rate:g}: mean {run['summary']['batch_mean']}",
                         fontsize=9)
            ax.set_xlim(0, run["spec"]["max_batch_size"] + 1)
            ax.tick_params(labelsize=7)
            if j == 0:
                ax.set_ylabel("batches")
            if i == len(rows) - 1:
                ax.set_xlabel("batch size")
    return save_figure(fig, out, "batch_sizes.png")


def systems(results: dict[str, Any], out: Path) -> str | None:
    """batchgate vs RQ vs in-process vs raw Redis: capacity, light load, curves."""
    tput = [r for r in results["runs"] if r["spec"]["section"] == "throughput"]
    light = [r for r in results["runs"] if r["spec"]["section"] == "light"]
    dyn = _runs(results, section="grid", system="batchgate", strategy="dynamic")
    if not (tput or light or dyn):
        return None
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    ax = axes[0]
    if tput:
        n = max(r["spec"]["consumers"] for r in tput)
        chosen = [r for r in tput if r["spec"]["consumers"] == n]
        labels = [_name(r["spec"]) for r in chosen]
        values = [r["summary"]["throughput_rps"] for r in chosen]
        colors = [COLORS.get(r["spec"]["system"] if r["spec"]["system"] != "batchgate"
                             else r["spec"]["strategy"], "tab:blue") for r in chosen]
        ax.barh(labels, values, color=colors)
        ax.set_xscale("log")
        ax.set_xlabel("req/s (log)")
        ax.set_title(f"no-op capacity, N={n}", fontsize=10)
        ax.tick_params(axis="y", labelsize=7)
        for y, v in enumerate(values):
            ax.text(v, y, f" {v:,.0f}", va="center", fontsize=7)
    else:
        ax.axis("off")
    ax = axes[1]
    if light:
        labels = [_name(r["spec"]) for r in light]
        for k, pct in enumerate(("p50", "p99")):
            vals = [r["summary"]["service_ms"]["all"][pct] or 0 for r in light]
            ax.bar([i + 0.4 * k for i in range(len(light))], vals, width=0.4, label=pct)
        ax.set_xticks([i + 0.2 for i in range(len(light))], labels, fontsize=7, rotation=15)
        ax.axhline(4 * results["meta"]["ping_us"]["p50"] / 1000, color="red", linestyle="--",
                   linewidth=1, label="4× PING (back to back)")
        paced = results["meta"].get("ping_paced_us")
        if paced:
            ax.axhline(4 * paced["p50"] / 1000, color="red", linestyle=":", linewidth=1,
                       label="4× PING (one per 20 ms)")
        ax.set_yscale("log")
        ax.set_ylabel("ms")
        ax.set_title("light load (fifo, no-op, λ=50)", fontsize=10)
        ax.legend(fontsize=7)
    else:
        ax.axis("off")
    ax = axes[2]
    curves = [("batchgate dynamic", dyn, COLORS["dynamic"], "-"),
              ("in-process dynamic", _runs(results, section="grid", system="inprocess",
                                           strategy="dynamic"), COLORS["inprocess"], ":"),
              ("batchgate fifo", _runs(results, section="grid", system="batchgate",
                                       strategy="fifo"), COLORS["fifo"], "-"),
              ("RQ", _runs(results, section="grid", system="rq"), "black", "--")]
    for label, runs, color, style in curves:
        pts = [(r["summary"]["throughput_rps"], r["summary"]["latency_ms"]["all"]["p99"])
               for r in runs if r["summary"]["latency_ms"]["all"]["p99"] is not None]
        if pts:
            ax.plot(*zip(*pts, strict=True), style, marker="o", markersize=3, color=color,
                    label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("achieved throughput, req/s")
    ax.set_ylabel("p99 ms")
    ax.set_title("sleep model t(b)=5+0.5b ms, all priorities", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(fig, out, "systems.png")


def dynamic_formula(results: dict[str, Any], out: Path) -> str | None:
    formula = results.get("analysis", {}).get("formula") or {}
    rows = formula.get("rows") or []
    if not rows:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    ax = axes[0]
    for system, style in (("batchgate", "-o"), ("inprocess", ":.")):
        pts = [(r["rate"], r["mean_batch"]) for r in rows if r["system"] == system
               and r["mean_batch"] is not None]
        if pts:
            ax.plot(*zip(*pts, strict=True), style, label=f"{system}: mean batch")
    pts = [(r["rate"], r["expected_batch"]) for r in rows if r["system"] == "batchgate"]
    if pts:
        ax.plot(*zip(*pts, strict=True), "k--", linewidth=1,
                label="predicted min(B, 1 + λ·delay)")
    ax.axvline(formula["fill_rate_predicted"], color="red", linestyle="--", linewidth=1,
               label=f"predicted fill λ = {formula['fill_rate_predicted']:g}")
    if formula.get("fill_rate_measured"):
        ax.axvline(formula["fill_rate_measured"], color="green", linestyle=":", linewidth=1,
                   label=f"measured fill λ ≈ {formula['fill_rate_measured']:g}")
    ax.set_xscale("log")
    ax.set_xlabel("λ, req/s")
    ax.set_ylabel("batch size")
    ax.set_title("dynamic: when do batches fill?", fontsize=10)
    ax.legend(fontsize=7)
    ax = axes[1]
    light = [r for r in rows if r["light"] and r["system"] == "batchgate"]
    if light:
        ax.plot([r["rate"] for r in light], [r["predicted_p99_ms"] for r in light], "k--o",
                label="predicted: delay + t(b)")
        ax.plot([r["rate"] for r in light], [r["measured_p99_ms"] for r in light], "-o",
                color=COLORS["dynamic"], label="measured p99 (batchgate)")
        inproc = [r for r in rows if r["light"] and r["system"] == "inprocess"]
        if inproc:
            ax.plot([r["rate"] for r in inproc], [r["measured_p99_ms"] for r in inproc], ":.",
                    color=COLORS["inprocess"], label="measured p99 (in-process)")
        ax.set_xlabel("λ, req/s (light load: batches do not fill)")
        ax.set_ylabel("p99 ms")
        ax.set_title("light-load p99 ≈ max_queue_delay + t(b)", fontsize=10)
        ax.legend(fontsize=7)
    else:
        ax.axis("off")
    return save_figure(fig, out, "dynamic_formula.png")


def _name(spec: dict[str, Any]) -> str:
    if spec["system"] == "batchgate":
        return f"batchgate {spec['strategy']} b≤{spec['max_batch_size']}"
    if spec["system"] == "inprocess":
        return f"in-process {spec['strategy']}"
    return {"rq": "RQ SimpleWorker", "raw": "raw Redis ceiling"}[spec["system"]]


def make_all(results: dict[str, Any], out: Path) -> list[str]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    made = [latency_curves(results, out), batch_histograms(results, out),
            systems(results, out), dynamic_formula(results, out)]
    return [name for name in made if name]


if __name__ == "__main__":
    import orjson

    path = Path(sys.argv[1])
    target = Path(sys.argv[2]) if len(sys.argv) > 2 else path.parent
    for name in make_all(orjson.loads(path.read_bytes()), target):
        print(target / name)
