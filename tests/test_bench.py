"""`python -m bench.run`: the harness works end to end (not the numbers), plus the pieces that
can be checked without timing: the workload generator and the in-process batcher's rules.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.support import HEAVY

pytest.importorskip("hdrh")

from batchgate.workload import Workload  # noqa: E402
from bench import inprocess  # noqa: E402


# -- workload -------------------------------------------------------------------------
def test_workload_is_reproducible_and_mixed():
    w = Workload("poisson", rate=500, duration_s=4, seed=7)
    times, prios, payloads = w.arrivals()
    assert (times, prios, payloads) == w.arrivals()
    assert times == sorted(times) and times[0] >= 0 and times[-1] < 4
    assert 1700 < len(times) < 2300  # Poisson, λ=500 for 4 s
    shares = [prios.count(p) / len(prios) for p in range(3)]
    assert shares[0] == pytest.approx(0.1, abs=0.03)
    assert shares[1] == pytest.approx(0.6, abs=0.04)
    assert shares[2] == pytest.approx(0.3, abs=0.04)
    assert Workload("poisson", rate=500, duration_s=4, seed=8).arrivals()[0] != times


def test_bursty_adds_50_requests_within_100_ms():
    base = Workload("poisson", rate=10, duration_s=5, seed=1)
    bursty = Workload("bursty", rate=10, duration_s=5, seed=1, burst_every_s=2.0)
    times = bursty.arrivals()[0]
    assert len(times) >= len(base.arrivals()[0]) + 100  # bursts at 1 s and 3 s
    in_burst = [t for t in times if 1.0 <= t <= 1.1]
    assert len(in_burst) >= 50


def test_backlog_arrives_at_once():
    times, _, payloads = Workload("backlog", count=300, model="tiny_text").arrivals()
    assert times == [0.0] * 300
    assert all(1 <= len(p["tokens"]) <= 64 for p in payloads)


# -- the in-process batcher applies pop_batch.lua's rules -----------------------------
def _rules(strategy, size=4, delay_ms=50, aging_ms=0):
    return inprocess.Rules(strategy, size, delay_ms, aging_ms)


def _add(rules, idx, prio, at):
    rules.add(inprocess.Req(idx, prio, at, None))


def test_strategies_narrow_the_grid_and_bursty_sections_only():
    import click

    from bench.run import build_plan, keep_strategies

    plan = build_plan(False, 1.0, 2, ("grid", "bursty", "saturation"), (400.0,), 1)
    kept = keep_strategies(plan, "priority")
    assert {(s.section, s.system, s.strategy) for s in kept} == {
        ("grid", "batchgate", "priority"), ("grid", "inprocess", "priority"),
        ("bursty", "batchgate", "priority"), ("saturation", "batchgate", "dynamic")}
    with pytest.raises(click.BadParameter, match="subset of fifo, dynamic, priority"):
        keep_strategies(plan, "priority,lifo")


def test_fifo_takes_oldest_across_priorities_without_waiting():
    rules = _rules("fifo", size=2)
    for i, prio in enumerate((2, 0, 1)):
        _add(rules, i, prio, at=float(i))
    batch, wait = rules.collect(now=3.0)
    assert [r.idx for r in batch] == [0, 1] and wait is None


def test_dynamic_waits_for_the_delay_or_a_full_batch():
    rules = _rules("dynamic", size=3, delay_ms=50)
    _add(rules, 0, 1, at=10.0)
    batch, wait = rules.collect(now=10.02)
    assert batch == [] and wait == pytest.approx(0.03)
    batch, _ = rules.collect(now=10.051)
    assert [r.idx for r in batch] == [0]
    for i in range(3):
        _add(rules, i, 1, at=11.0)
    batch, _ = rules.collect(now=11.0)
    assert len(batch) == 3


def test_priority_serves_high_at_once_normal_by_window_low_when_idle():
    rules = _rules("priority", size=4, delay_ms=50)
    _add(rules, 0, 2, at=0.0)
    _add(rules, 1, 1, at=0.0)
    batch, wait = rules.collect(now=0.01)  # NORMAL waits its window; LOW waits behind it
    assert batch == [] and wait == pytest.approx(0.04)
    _add(rules, 2, 0, at=0.02)
    assert [r.idx for r in rules.collect(now=0.02)[0]] == [2]  # HIGH at once
    assert [r.idx for r in rules.collect(now=0.06)[0]] == [1]  # NORMAL when due
    assert [r.idx for r in rules.collect(now=0.06)[0]] == [0]  # then LOW


def test_priority_aging_promotes_waiting_requests():
    rules = _rules("priority", size=4, delay_ms=50, aging_ms=1000)
    _add(rules, 0, 2, at=0.0)  # LOW
    for i in range(1, 4):
        _add(rules, i, 1, at=2.5)  # a NORMAL window that is not due yet
    batch, _ = rules.collect(now=2.51)
    assert [r.idx for r in batch] == [0]  # waited 2 x aging: served at HIGH level


# -- the command, end to end, tiny ----------------------------------------------------
@HEAVY
@pytest.mark.skipif(not shutil.which("redis-server"), reason="redis-server is not on PATH")
@pytest.mark.skipif(importlib.util.find_spec("rq") is None, reason="rq is not installed")
def test_bench_quick_smoke(tmp_path: Path):
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.run", "--quick", "--scale", "0.1",
         "--consumers", "1", "--grid", "100", "--sections", "light,throughput,grid",
         "--out", str(out), "--strict"],
        capture_output=True, text=True, timeout=110)
    results = json.loads((out / "results.json").read_text())
    targets = [t for t in results["analysis"]["targets"] if t["need"] and t["met"] is not None]
    missed = [t for t in targets if not t["met"]]
    assert proc.returncode == (1 if missed else 0), proc.stderr[-3000:]  # --strict
    lines = proc.stdout.splitlines()
    assert f"summary: {len(targets) - len(missed)} of {len(targets)} checks met" in (
        lines[-2].split(" (host load")[0])
    assert sum(line.startswith("- MISS: ") for line in lines) == len(missed)
    assert all("host load" in line for line in lines if line.startswith("- MISS: "))
    systems = {(r["spec"]["section"], r["spec"]["system"]) for r in results["runs"]}
    for section in ("light", "throughput"):
        for system in ("batchgate", "raw", "rq", "inprocess"):
            assert (section, system) in systems
    strategies = {r["spec"]["strategy"] for r in results["runs"]
                  if r["spec"]["section"] == "grid" and r["spec"]["system"] == "batchgate"}
    assert strategies == {"fifo", "dynamic", "priority"}
    for run in results["runs"]:
        s = run["summary"]
        assert s["completed"] > 0, run["label"]
        assert s["latency_ms"]["all"]["p99"] is not None
        assert s["throughput_rps"] > 0
    assert results["analysis"]["targets"]
    assert results["meta"]["ping_us"]["p50"] > 0
    md = (out / "results.md").read_text()
    assert "## Targets" in md and "raw" in md
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "latency_vs_throughput.png").stat().st_size > 1000
        assert (out / "systems.png").exists()


def test_profile_stages_smoke():
    """bench/profile_stages.py (the per-stage CPU figures in docs/benchmarks.md) runs and
    reports every stage; a small backlog, a few paced requests."""
    proc = subprocess.run(
        [sys.executable, "-m", "bench.profile_stages", "--requests", "300",
         "--paced", "3"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    for stage in ("enqueue", "pop", "complete", "deliver", "paced"):
        assert any(line.startswith(stage) and "Redis CPU" in line for line in lines), stage
    assert "10 batches, mean size 30.0" in proc.stdout  # 9 full, the last one of 12


@pytest.mark.skipif(not shutil.which("redis-server"), reason="redis-server is not on PATH")
def test_pop_cost_smoke():
    """bench/pop_cost.py (the pop with cost buckets against one without, in
    docs/benchmarks.md) runs every queue kind and prints a checked row for each and the
    summary; 3 pops per side, the small shape, 1 KB."""
    proc = subprocess.run(
        [sys.executable, "-m", "bench.pop_cost", "--pops", "3", "--batch", "64", "--kb", "1"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if "KB |" in line]
    assert [row.split()[0] for row in rows] == ["fifo", "mixed", "aging"], proc.stdout
    assert all("| ok (<= 1.2)" in row or "| OVER (<= 1.2)" in row for row in rows), rows
    assert "summary: " in proc.stdout and " of 3 checks met" in proc.stdout


# Not HEAVY: a few paced requests and two small loads, the time mostly process start-up.
def test_latency_smoke():
    """bench/latency.py (the hop-by-hop figures in docs/benchmarks.md) runs both paths
    and prints every hop, the ratios and the Redis CPU lines; a few requests."""
    proc = subprocess.run(
        [sys.executable, "-m", "bench.latency", "--requests", "5", "--rate", "200",
         "--load", "64"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "5 batchgate and 5 raw requests" in out
    for hop in ("submit -> enqueued in Redis", "listener receive -> handle resolved",
                "total: LPUSH -> reply in hand", "ratio batchgate/raw: p50"):
        assert hop in out, hop
    for row in ("batchgate, batch 1", "batchgate, batch 32", "raw path"):
        assert any(line.startswith(row) and "Redis CPU" in line
                   for line in out.splitlines()), row


# Not HEAVY: its time is the paced phases (20 and 200 req/s on a sleep model), not the CPU,
# and it asserts the harness, not the checks' outcome.
@pytest.mark.skipif(not shutil.which("redis-server"), reason="redis-server is not on PATH")
def test_load_step_smoke(tmp_path: Path):
    """bench/load_step.py (the load step in docs/benchmarks.md) runs its three
    modes, answers every request and writes its table, checks and plot; tiny phases (it
    checks the harness, not the numbers)."""
    proc = subprocess.run(
        [sys.executable, "-m", "bench.load_step", "--phase-s", "1", "--rates",
         "20,200", "--out", str(tmp_path), "--strict"], capture_output=True, text=True,
        timeout=120)
    results = json.loads((tmp_path / "results.json").read_text())
    met = sum(c["ok"] for c in results["checks"])
    assert proc.returncode == (0 if met == len(results["checks"]) else 1), proc.stderr[-3000:]
    assert f"summary: {met} of {len(results['checks'])} checks met" in proc.stdout
    assert set(results["table"]) == {"fixed-5", "fixed-50", "auto"}
    for rows in results["table"].values():
        assert [r["rate"] for r in rows] == [20, 200]
        assert all(r["unanswered"] == 0 and r["p99_ms"] > 0 for r in rows)
    assert results["checks"] and "auto" in (tmp_path / "results.md").read_text()
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "load_step.png").stat().st_size > 1000


@pytest.mark.skipif(not shutil.which("redis-server"), reason="redis-server is not on PATH")
def test_shard_scaling_smoke(tmp_path: Path):
    """bench/shard_scaling.py (docs/scaling.md's capacity figures) drains a
    queue of 1 and of 2 shards on a real 3-primary cluster, each shard on its own primary,
    and charges every primary its CPU per request; a small backlog (it checks the
    harness, not the numbers)."""
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.shard_scaling", "--shards", "1,2",
         "--per-shard", "300", "--json", str(out)], capture_output=True, text=True,
        timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["shards"], r["requests"]) for r in rows] == [(1, 300), (2, 600)]
    assert len(rows[1]["redis_cpu_us_per_request"]) == 2  # two primaries, one shard each
    assert all(v > 0 for r in rows for v in r["redis_cpu_us_per_request"].values())
    assert "| 2 | 600 |" in proc.stdout


@HEAVY
def test_drain_pinned_smoke(tmp_path: Path):
    """bench/drain_pinned.py (docs/benchmarks.md's capacity per shard with Redis
    on a core of its own) drains a small no-op backlog with a CLI consumer and the raw
    ceiling's worker, Redis pinned to one CPU and the clients to the other; it checks the
    harness, not the numbers."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("drain_pinned needs two CPUs")
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.drain_pinned", "--requests", "2000",
         "--rounds", "1", "--json", str(out)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert row["batchgate"]["req_per_s"] > 0 and row["raw"]["req_per_s"] > 0
    assert row["ratio"] == round(row["batchgate"]["req_per_s"] / row["raw"]["req_per_s"], 3)
    assert "| 1 |" in proc.stdout and "median ratio" in proc.stdout
