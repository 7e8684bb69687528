"""Summaries, targets, rule checks and the markdown report of `python -m bench.run`.

Percentiles come from HdrHistogram (3 significant digits, values in µs), never from
hand-rolled code. A run's records (producer/bench.py) hold per request: intended arrival
(t_sched), submit, enqueue (Redis TIME for batchgate), pop (Redis TIME), batch start and
end (t0, t1), batch size, worker and result seen, all as host-clock seconds.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from hdrh.histogram import HdrHistogram

PRIORITIES = ("high", "normal", "low")
RULE_SLACK_MS = 5.0


def new_hist() -> HdrHistogram:
    return HdrHistogram(1, 3_600_000_000, 3)  # 1 µs .. 1 h


def hdr_summary(hist: HdrHistogram, unit: float = 1.0,
                mean_us: float | None = None) -> dict[str, Any]:
    """p50/p95/p99/max/mean of a histogram of µs values, divided by `unit`. The mean is
    `mean_us` when the caller has it exactly (HdrHistogram's walks every bucket)."""
    if hist.get_total_count() == 0:
        return {"count": 0, "p50": None, "p95": None, "p99": None, "max": None, "mean": None}

    def v(x: float) -> float:
        return round(x / unit, 3)

    return {"count": hist.get_total_count(),
            "p50": v(hist.get_value_at_percentile(50)),
            "p95": v(hist.get_value_at_percentile(95)),
            "p99": v(hist.get_value_at_percentile(99)),
            "max": v(hist.get_max_value()),
            "mean": v(hist.get_mean_value() if mean_us is None else mean_us)}


def _hist(values: list[float]) -> HdrHistogram:
    hist = new_hist()
    for seconds in values:
        hist.record_value(min(3_600_000_000, max(1, int(seconds * 1e6))))
    return hist


def _ms(values: list[float]) -> dict[str, Any]:
    mean = sum(values) / len(values) * 1e6 if values else None
    return hdr_summary(_hist(values), 1000.0, mean)


def model_cost_ms(spec: dict[str, Any], batch: float) -> float | None:
    """t(b) of the synthetic cost model (and 0 for noop); None for real models."""
    name = spec["model"]
    if name == "noop":
        return 0.0
    if name == "synthetic":
        kw = spec["model_spec"][1]
        return kw["base_ms"] + kw["per_item_ms"] * batch
    return None


def summarize(rec: dict[str, list[Any]], spec: Any, cpu: dict[str, float]) -> dict[str, Any]:
    n = len(rec["t_sched"])
    seen = rec["t_seen"]
    done = [i for i in range(n) if seen[i] is not None]
    prio = rec["prio"]
    wl = spec.workload
    out: dict[str, Any] = {"requests": n, "completed": len(done)}

    def pick(expr: Any, members: list[int]) -> list[float]:
        vals = []
        for i in members:
            v = expr(i)
            if v is not None:
                vals.append(v)
        return vals

    by_prio = {p: [i for i in done if prio[i] == k] for k, p in enumerate(PRIORITIES)}

    def lat(i: int) -> float:
        return seen[i] - rec["t_sched"][i]

    def svc(i: int) -> float:
        return seen[i] - rec["t_submit"][i]

    def wait(i: int) -> float | None:
        enq = rec["t_enq"][i]
        end = rec["t_pop"][i] if rec["t_pop"][i] is not None else rec["t0"][i]
        return None if enq is None or end is None else end - enq

    out["latency_ms"] = {"all": _ms(pick(lat, done)),
                         **{p: _ms(pick(lat, m)) for p, m in by_prio.items()}}
    out["service_ms"] = {"all": _ms(pick(svc, done)),
                         **{p: _ms(pick(svc, m)) for p, m in by_prio.items()}}
    out["queue_wait_ms"] = {"all": _ms(pick(wait, done)),
                            **{p: _ms(pick(wait, m)) for p, m in by_prio.items()}}

    def diff(a: str, b: str) -> Any:
        return lambda i: None if rec[a][i] is None or rec[b][i] is None \
            else rec[b][i] - rec[a][i]

    out["stages_ms"] = {
        "submit_to_enqueue": _ms(pick(diff("t_submit", "t_enq"), done)),
        "enqueue_to_pop": _ms(pick(diff("t_enq", "t_pop"), done)),
        "pop_to_model": _ms(pick(diff("t_pop", "t0"), done)),
        "model": _ms(pick(diff("t0", "t1"), done)),
        "model_to_seen": _ms(pick(diff("t1", "t_seen"), done)),
    }
    out["generator_lag_ms"] = _ms([rec["t_submit"][i] - rec["t_sched"][i] for i in range(n)
                                   if rec["t_submit"][i] is not None])
    # Per request, the path outside the queue and the model that no consumer waits on:
    # intended arrival -> enqueue plus model end -> result seen, ms (every k-th, at most
    # 10,000): what simcheck --path-from gives the simulator as its path's spread.
    path = [round((rec["t_enq"][i] - rec["t_sched"][i] + seen[i] - rec["t1"][i]) * 1000, 3)
            for i in done if rec["t_enq"][i] is not None and rec["t1"][i] is not None]
    out["path_samples_ms"] = path[::-(-len(path) // 10_000)] if path else []

    batches: dict[tuple[Any, Any], tuple[int, float]] = {}
    for i in done:
        if rec["t0"][i] is not None:
            batches[(rec["worker"][i], rec["t0"][i])] = (rec["batch"][i] or 1,
                                                         (rec["t1"][i] or rec["t0"][i])
                                                         - rec["t0"][i])
    sizes = Counter(size for size, _ in batches.values())
    # Each batch's model time as the queue's {bg:q}:samples:model holds it ("size:model_us",
    # its newest 10,000): what simcheck feeds the simulator's --cost-jitter.
    out["model_samples"] = [f"{size}:{round(dur * 1e6)}" for _, (size, dur) in
                            sorted(batches.items(), key=lambda kv: kv[0][1] or 0)][-10_000:]
    # The scheduler's cost between two batches of one worker: model end -> next pop
    # (Redis clock: encode results, complete + pop round trip) -> next model start.
    pops = {(rec["worker"][i], rec["t0"][i]): rec["t_pop"][i] for i in done
            if rec["t0"][i] is not None}
    gaps, to_pop, from_pop = [], [], []
    by_worker: dict[Any, list[tuple[float, float]]] = {}
    for (worker, t0), (_, dur) in batches.items():
        by_worker.setdefault(worker, []).append((t0, t0 + dur))
    for worker, spans in by_worker.items():
        spans.sort()
        for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
            gaps.append(start - end)
            popped = pops.get((worker, start))
            if popped is not None and popped >= end - 0.001:
                to_pop.append(popped - end)
                from_pop.append(start - popped)
    out["inter_batch_gap_ms"] = {"gap": _ms(gaps), "model_end_to_pop": _ms(to_pop),
                                 "pop_to_model_start": _ms(from_pop)}
    busy = sum(d for _, d in batches.values())
    if done:
        if wl.kind == "backlog":
            start = min(rec["t0"][i] for i in done if rec["t0"][i] is not None)
        else:
            start = min(rec["t_sched"])
        window = max(seen[i] for i in done) - start
    else:
        window = 0.0
    out["window_s"] = round(window, 4)
    out["throughput_rps"] = round(len(done) / window, 1) if window > 0 else 0.0
    out["offered_rps"] = round(n / wl.duration_s, 1) if wl.kind != "backlog" else None
    out["busy_fraction"] = round(busy / (spec.consumers * window), 4) if window > 0 else None
    out["batches"] = len(batches)
    out["batch_mean"] = round(sum(s * c for s, c in sizes.items()) / len(batches), 3) \
        if batches else None
    out["batch_max"] = max(sizes) if sizes else None
    out["batch_hist"] = {str(k): sizes[k] for k in sorted(sizes)}
    cap = spec.max_batch_size if spec.system in ("batchgate", "inprocess", "raw") else 1
    out["full_batch_fraction"] = round(sizes.get(cap, 0) / len(batches), 4) \
        if batches else None
    out["cpu_s"] = {k: round(v, 3) for k, v in cpu.items()}
    out["cpu_us_per_request"] = {k: round(v * 1e6 / len(done), 1) for k, v in cpu.items()} \
        if done else {}
    offered = out["offered_rps"]
    out["overloaded"] = len(done) < n or (
        offered is not None and out["throughput_rps"] < 0.9 * offered)
    return out


# -- analysis -------------------------------------------------------------------------
def _find(runs: list[dict[str, Any]], **want: Any) -> list[dict[str, Any]]:
    found = []
    for run in runs:
        spec = run["spec"]
        ok = True
        for key, value in want.items():
            have = spec["workload"][key[3:]] if key.startswith("wl_") else spec.get(key)
            if have != value:
                ok = False
                break
        if ok:
            found.append(run)
    return found


def _one(runs: list[dict[str, Any]], **want: Any) -> dict[str, Any] | None:
    found = _find(runs, **want)
    return found[0] if found else None


def _target(name: str, goal: str, measured: str, ratio: float | None, need: float,
            higher_is_better: bool = True, note: str = "") -> dict[str, Any]:
    if ratio is None or (isinstance(ratio, float) and math.isnan(ratio)):
        met = None
    else:
        met = ratio >= need if higher_is_better else ratio <= need
    return {"target": name, "goal": goal, "measured": measured,
            "ratio": None if ratio is None else round(ratio, 3), "need": need,
            "met": met, "note": note}


def analyse(results: dict[str, Any]) -> dict[str, Any]:
    runs = results["runs"]
    meta = results["meta"]
    n = meta["consumers"]
    ping = meta["ping_us"]["p50"]
    targets: list[dict[str, Any]] = []

    # 1. no-op capacity: batchgate vs RQ and vs the raw ceiling, per N
    for k in sorted({r["spec"]["consumers"] for r in _find(runs, section="throughput")}):
        baselines = [(_one(runs, section="throughput", system=system, consumers=k), label,
                      goal) for system, label, goal in (("rq", "RQ SimpleWorker", 50),
                                                        ("raw", "raw-Redis ceiling", 0.5))]
        for strategy in ("dynamic", "priority", "fifo"):
            bg = _one(runs, section="throughput", system="batchgate", consumers=k,
                      strategy=strategy)
            if not bg:
                continue
            tput = bg["summary"]["throughput_rps"]
            b = bg["spec"]["max_batch_size"]
            head = strategy == "dynamic"
            for base, label, goal in baselines:
                if not base:
                    continue
                base_t = base["summary"]["throughput_rps"]
                targets.append(_target(
                    f"no-op throughput, {strategy}(b≤{b}), N={k} vs {label} N={k}",
                    f"≥ {goal:g}×" if head else "(for reference)",
                    f"{tput:,.0f} vs {base_t:,.0f} req/s", tput / base_t if base_t else None,
                    goal if head else 0))

    # 2. light load, fifo, no-op
    light = _one(runs, section="light", system="batchgate")
    light_rq = _one(runs, section="light", system="rq")
    if light:
        p50 = light["summary"]["service_ms"]["all"]["p50"]
        targets.append(_target(
            "light load (fifo, no-op, λ=50): p50 end to end vs Redis PING RTT (back to back)",
            "≤ 4× PING", f"{p50 * 1000:.0f} µs vs PING {ping:.0f} µs",
            p50 * 1000 / ping if ping else None, 4.0, higher_is_better=False,
            note="from the submit call to the result reaching the producer's listener"))
        paced = (meta.get("ping_paced_us") or {}).get("p50")
        if paced:
            targets.append(_target(
                "  … vs PING RTT paced like the workload (one per 20 ms, both sides idle "
                "between)", "≤ 4× PING", f"{p50 * 1000:.0f} µs vs PING {paced:.0f} µs",
                p50 * 1000 / paced, 4.0, higher_is_better=False))
        if light_rq:
            mine = light["summary"]["service_ms"]["all"]["p99"]
            theirs = light_rq["summary"]["service_ms"]["all"]["p99"]
            targets.append(_target(
                "light load (fifo, no-op, λ=50): p99 vs RQ SimpleWorker p99",
                "≤ 1/5 of RQ's", f"{mine:.2f} ms vs RQ {theirs:.2f} ms",
                theirs / mine if mine else None, 5.0,
                note="ratio = RQ p99 / batchgate p99"))

    # 3. saturation with the sleep model: fraction of the ideal 32 / t(32) per consumer
    sat = {r["spec"]["consumers"]: r for r in _find(runs, section="saturation",
                                                      system="batchgate")}
    for k, run in sorted(sat.items()):
        b = run["spec"]["max_batch_size"]
        ideal = b / (model_cost_ms(run["spec"], b) / 1000)
        per = run["summary"]["throughput_rps"] / k
        targets.append(_target(
            f"saturation, t(b)=5+0.5b ms, b≤{b}, N={k}: throughput per consumer vs ideal "
            f"{b}/t({b})", "≥ 95%", f"{per:,.0f} vs {ideal:,.0f} req/s", per / ideal, 0.95))
    if 1 in sat and len(sat) > 1:
        k = max(sat)
        one, many = sat[1]["summary"]["throughput_rps"], sat[k]["summary"]["throughput_rps"]
        targets.append(_target(
            f"scaling, sleep model at saturation: 1 → {k} consumer processes",
            f"≥ {0.9 * k:.1f}×", f"{one:,.0f} → {many:,.0f} req/s", many / one,
            0.9 * k))

    rules = check_rules(runs)
    mine = [r for r in rules if r["system"] == "batchgate"]
    if mine:
        passed = sum(1 for r in mine if r["met"] is True)
        failed = sum(1 for r in mine if r["met"] is False)
        targets.append(_target(
            "scheduling rules at every grid point (light-load p99, HIGH p99 at saturation, LOW "
            "max wait)", "all hold", f"{passed} hold, {failed} fail, "
            f"{len(mine) - passed - failed} not applicable",
            1.0 if failed == 0 else passed / max(1, passed + failed), 1.0))
    return {"targets": targets, "rules": rules, "formula": dynamic_formula(runs),
            "ping_p50_us": ping, "consumers": n}


def check_rules(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The scheduling rules (docs/scheduling.md) at every grid point, for batchgate and
    (to tell the rule from the cost of distribution) for the in-process batcher on the
    same workload.

    - light load (not overloaded, model busy < 50%, and for dynamic/priority λ below the
      fill rate max_batch_size / max_queue_delay): p99 ≤ max_queue_delay + t(b) + 5 ms,
      b = the largest batch at that point; for priority, HIGH and NORMAL (LOW has its own
      rule);
    - saturation (model busy ≥ 60% or overloaded), priority only: HIGH p99 ≤ t(max_batch)
      + t(1) + 5 ms;
    - priority, every point that is not overloaded: LOW max queue wait ≤ 2 × aging_ms +
      t(max_batch) + 5 ms (after 2 × aging_ms a LOW request is at HIGH level).
    """
    out = []
    for run in _find(runs, section="grid"):
        spec, s = run["spec"], run["summary"]
        if spec["system"] not in ("batchgate", "inprocess"):
            continue
        strategy = spec["strategy"]
        size = spec["max_batch_size"]
        delay = spec["max_queue_delay_ms"]
        aging = spec["aging_ms"]

        def t(b: float, spec: dict[str, Any] = spec) -> float:
            return model_cost_ms(spec, b) or 0.0
        rate = spec["workload"]["rate"]
        point = {"system": spec["system"], "strategy": strategy, "rate": rate,
                 "busy": s["busy_fraction"], "overloaded": s["overloaded"]}
        bmax = s["batch_max"] or 1
        fills = rate * delay / 1000 >= size  # batches fill from this rate on (docs/scheduling.md)
        busy = s["busy_fraction"] or 0
        light = not s["overloaded"] and busy < 0.5 and (strategy == "fifo" or not fills)
        bound1 = delay + t(bmax) + RULE_SLACK_MS
        classes = ["all"] if strategy != "priority" else ["high", "normal"]
        for cls in classes:
            p99 = s["latency_ms"][cls]["p99"]
            out.append({**point, "rule": f"light-load p99 ({cls}) ≤ max_queue_delay + t(b) "
                        "+ 5 ms", "bound_ms": round(bound1, 2), "measured_ms": p99,
                        "met": (p99 <= bound1) if light and p99 is not None else None})
        if strategy == "priority":
            saturated = busy >= 0.6 or s["overloaded"]
            bound2 = t(size) + t(1) + RULE_SLACK_MS
            p99h = s["latency_ms"]["high"]["p99"]
            out.append({**point, "rule": "saturation: HIGH p99 ≤ t(max_batch) + t(1) + 5 ms",
                        "bound_ms": round(bound2, 2), "measured_ms": p99h,
                        "met": (p99h <= bound2) if saturated and p99h is not None else None})
            bound3 = 2 * aging + t(size) + RULE_SLACK_MS
            low_max = s["queue_wait_ms"]["low"]["max"]
            out.append({**point, "rule": "LOW max queue wait ≤ 2 × aging_ms + t(max_batch) "
                        "+ 5 ms", "bound_ms": round(bound3, 2), "measured_ms": low_max,
                        "met": (low_max <= bound3) if not s["overloaded"]
                        and low_max is not None else None})
    return out


def dynamic_formula(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The dynamic-batching formula (docs/scheduling.md), predicted vs measured, on the
    dynamic grid."""
    rows = []
    points = []
    spec0 = None
    for system in ("batchgate", "inprocess"):
        for run in sorted(_find(runs, section="grid", system=system, strategy="dynamic"),
                          key=lambda r: r["spec"]["workload"]["rate"]):
            spec, s = run["spec"], run["summary"]
            spec0 = spec0 or spec
            size, delay = spec["max_batch_size"], spec["max_queue_delay_ms"]
            rate = spec["workload"]["rate"]
            if system == "batchgate":
                points.append((rate, s["full_batch_fraction"] or 0.0, s["batch_mean"]))
            expected_b = min(size, 1 + rate * delay / 1000)
            predicted = delay + model_cost_ms(spec, expected_b)
            light = rate * delay / 1000 < size
            rows.append({"system": system, "rate": rate, "light": light,
                         "expected_batch": round(expected_b, 1),
                         "mean_batch": s["batch_mean"],
                         "full_batches": s["full_batch_fraction"],
                         "predicted_p99_ms": round(predicted, 2) if light else None,
                         "measured_p99_ms": s["latency_ms"]["all"]["p99"],
                         "overloaded": s["overloaded"]})
    if spec0 is None:
        return {}
    predicted_fill = spec0["max_batch_size"] / (spec0["max_queue_delay_ms"] / 1000)
    measured_fill = None
    for (r0, f0, _), (r1, f1, _) in zip(points, points[1:], strict=False):
        if f0 < 0.5 <= f1:
            measured_fill = r0 + (0.5 - f0) * (r1 - r0) / (f1 - f0) if f1 != f0 else r1
            break
    return {"rows": rows, "fill_rate_predicted": round(predicted_fill, 1),
            "fill_rate_measured": None if measured_fill is None else round(measured_fill, 1),
            "fill_rule": "λ where half of the batches are full (linear between grid points)"}


# -- markdown -------------------------------------------------------------------------
def _f(x: Any, digits: int = 2) -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        if abs(x) >= 1000:
            return f"{x:,.0f}"
        return f"{x:.{digits}f}"
    return str(x)


def _met(x: bool | None) -> str:
    return {True: "**met**", False: "**missed**", None: "n/a"}[x]


def _table(head: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_f(c) if not isinstance(c, str) else c for c in row) + " |"
              for row in rows]
    return lines + [""]


def render_markdown(results: dict[str, Any], images: list[str]) -> str:
    meta, runs, an = results["meta"], results["runs"], results["analysis"]
    m = meta["machine"]
    lines = [f"# python -m bench.run — {meta['started']}", "",
             f"Command: `{meta['command']}` ({meta['elapsed_s']} s)", "",
             f"Machine: {m['cpu']}, {m['cores']} cores, {m['mem_gib']} GiB, {m['os']}, "
             f"Python {m['python']}, Redis {m['redis_server']} (hz {m['redis_hz']}"
             f"{', private server' if meta['private_redis'] else ''}); "
             f"load average (1 min) {meta['load_before'][0]:.2f} before, "
             f"{_f(meta['loadavg_1m_during']['min'])}–"
             f"{_f(meta['loadavg_1m_during']['max'])} during the runs, "
             f"{meta['load_after'][0]:.2f} after.", "",
             f"Redis PING round trip from the producer (redis-py): back to back p50 "
             f"{meta['ping_us']['p50']:.0f} µs, p99 {meta['ping_us']['p99']:.0f} µs "
             f"(after the runs: p50 {meta['ping_us_after']['p50']:.0f} µs); one every "
             f"20 ms: p50 {meta['ping_paced_us']['p50']:.0f} µs, p99 "
             f"{meta['ping_paced_us']['p99']:.0f} µs.", "",
             "## Targets", ""]
    lines += _table(["target", "goal", "measured", "ratio", "result"],
                    [[t["target"], t["goal"], t["measured"], _f(t["ratio"], 3),
                      _met(t["met"]) if t["need"] else "–"] for t in an["targets"]])

    lines += ["## Capacity with a no-op model (backlog drained)", ""]
    rows = []
    for r in _find(runs, section="throughput"):
        s, spec = r["summary"], r["spec"]
        cpu = s["cpu_us_per_request"]
        rows.append([_sys(spec), spec["consumers"], s["throughput_rps"],
                     s["throughput_rps"] / spec["consumers"], s["batch_mean"],
                     cpu.get("redis"), cpu.get("workers", cpu.get("process")),
                     cpu.get("producer")])
    lines += _table(["system", "N", "req/s", "req/s per worker", "mean batch",
                     "Redis CPU µs/req", "worker CPU µs/req", "producer CPU µs/req"], rows)

    lines += ["## Light load (fifo, no-op, Poisson λ=50)", ""]
    rows = []
    for r in _find(runs, section="light"):
        s = r["summary"]
        rows.append([_sys(r["spec"]), s["service_ms"]["all"]["p50"],
                     s["service_ms"]["all"]["p95"], s["service_ms"]["all"]["p99"],
                     s["service_ms"]["all"]["max"], s["latency_ms"]["all"]["p99"]])
    lines += _table(["system", "p50 ms", "p95 ms", "p99 ms", "max ms",
                     "p99 from intended arrival"], rows)

    lines += ["## Saturation, t(b) = 5 + 0.5·b ms, max_batch_size 32 (backlog drained)", ""]
    rows = []
    for r in _find(runs, section="saturation"):
        s, spec = r["summary"], r["spec"]
        ideal = spec["max_batch_size"] / (model_cost_ms(spec, spec["max_batch_size"]) / 1000)
        gap = s["inter_batch_gap_ms"]
        rows.append([spec["consumers"], s["throughput_rps"],
                     s["throughput_rps"] / spec["consumers"], ideal,
                     s["throughput_rps"] / spec["consumers"] / ideal, s["batch_mean"],
                     s["busy_fraction"], gap["gap"]["p50"], gap["model_end_to_pop"]["p50"],
                     gap["pop_to_model_start"]["p50"]])
    lines += _table(["N", "req/s", "per consumer", "ideal per consumer", "fraction",
                     "mean batch", "model busy", "gap between batches p50 ms",
                     "model end→next pop", "pop→model start"], rows)

    lines += ["## Strategies over λ (t(b) = 5 + 0.5·b ms; fifo b=1, others b≤32, "
              "max_queue_delay 50 ms, aging 1 s)", "",
              "Latencies in ms from the intended arrival; `busy` is the model busy "
              "fraction; * marks an overloaded point (backlog grew).", ""]
    rows = []
    for r in sorted(_find(runs, section="grid"), key=lambda r: (
            r["spec"]["system"], r["spec"]["strategy"] if r["spec"]["system"] not in
            ("rq",) else "", r["spec"]["workload"]["rate"])):
        s, spec = r["summary"], r["spec"]
        lat = s["latency_ms"]
        rows.append([_sys(spec), _f(spec["workload"]["rate"], 0)
                     + ("*" if s["overloaded"] else ""), s["throughput_rps"],
                     lat["all"]["p50"], lat["all"]["p99"], lat["high"]["p99"],
                     lat["normal"]["p99"], lat["low"]["p99"], lat["all"]["max"],
                     s["batch_mean"], s["full_batch_fraction"], s["busy_fraction"]])
    lines += _table(["system", "λ", "req/s", "p50", "p99", "p99 HIGH", "p99 NORMAL",
                     "p99 LOW", "max", "mean batch", "full", "busy"], rows)

    if an["rules"]:
        lines += ["## The scheduling rules at every grid point", "",
                  "Applicable points only (see check_rules in bench/stats.py); the "
                  "in-process batcher runs the same rules on the same workload without Redis.",
                  ""]
        other = {(r["strategy"], r["rate"], r["rule"]): r for r in an["rules"]
                 if r["system"] == "inprocess"}
        rows = []
        for r in an["rules"]:
            twin = other.get((r["strategy"], r["rate"], r["rule"]))
            if r["system"] != "batchgate" or (r["met"] is None and
                                               (twin is None or twin["met"] is None)):
                continue
            rows.append([r["strategy"], _f(r["rate"], 0) + ("*" if r["overloaded"] else ""),
                         r["rule"], r["bound_ms"], r["measured_ms"], _met(r["met"]),
                         twin["measured_ms"] if twin else None,
                         _met(twin["met"]) if twin else "–"])
        lines += _table(["strategy", "λ", "rule", "bound ms", "batchgate ms", "batchgate",
                         "in-process ms", "in-process"], rows)
    f = an.get("formula") or {}
    if f:
        lines += ["## The dynamic-batching formula", "",
                  f"Batches fill when max_batch_size / λ < max_queue_delay: predicted "
                  f"λ = {f['fill_rate_predicted']} req/s; measured "
                  f"{_f(f['fill_rate_measured'], 0)} req/s ({f['fill_rule']}).", ""]
        lines += _table(["system", "λ", "expected batch", "mean batch", "full",
                         "predicted p99 ms", "measured p99 ms"],
                        [[r["system"], _f(r["rate"], 0), r["expected_batch"],
                          r["mean_batch"], r["full_batches"], r["predicted_p99_ms"],
                          r["measured_p99_ms"]] for r in f["rows"]])
    for section, title in (("bursty", "Bursty arrivals (λ=10 + 50 requests within 100 ms "
                                      "every 2 s)"), ("torch", "The tiny torch model"),
                           ("minilm", "all-MiniLM-L6-v2 sentence embeddings")):
        found = _find(runs, section=section)
        if not found:
            continue
        lines += [f"## {title}", ""]
        lines += _table(["system", "λ", "req/s", "p50", "p99", "p99 HIGH", "max",
                         "mean batch"],
                        [[_sys(r["spec"]), _f(r["spec"]["workload"]["rate"], 0),
                          r["summary"]["throughput_rps"],
                          r["summary"]["latency_ms"]["all"]["p50"],
                          r["summary"]["latency_ms"]["all"]["p99"],
                          r["summary"]["latency_ms"]["high"]["p99"],
                          r["summary"]["latency_ms"]["all"]["max"],
                          r["summary"]["batch_mean"]] for r in found])
    lines += ["## Where a request's time goes (batchgate, open-loop runs, p50 / p99 ms)", "",
              "Host clock throughout (Redis TIME for enqueue and pop). Backlog runs are left "
              "out: there the waiting is the backlog; see the gaps between batches above.",
              ""]
    rows = []
    for r in _find(runs, system="batchgate"):
        if r["spec"]["workload"]["kind"] == "backlog" or r["summary"]["overloaded"]:
            continue
        if r["spec"]["section"] == "grid" and r["spec"]["workload"]["rate"] not in (
                20, 50, 100, 400, 1300):
            continue
        st = r["summary"]["stages_ms"]
        rows.append([r["label"]] + [f"{_f(st[k]['p50'], 3)} / {_f(st[k]['p99'], 3)}"
                                    for k in ("submit_to_enqueue", "enqueue_to_pop",
                                              "pop_to_model", "model", "model_to_seen")])
    lines += _table(["run", "submit→enqueue", "enqueue→pop (queue wait)", "pop→model start",
                     "model", "model end→result seen"], rows)
    if results.get("failed"):
        lines += ["## Failed runs", ""] + [f"- {f['label']}: `{f['error'][:300]}`"
                                           for f in results["failed"]] + [""]
    if images:
        lines += ["## Plots", ""] + [f"![{name}]({name})" for name in images] + [""]
    return "\n".join(lines)


def _sys(spec: dict[str, Any]) -> str:
    if spec["system"] in ("batchgate", "inprocess"):
        return f"{spec['system']} {spec['strategy']}(b≤{spec['max_batch_size']})"
    return spec["system"]
