"""The lengths scenario (issue 16 §6): `batchgate demo --scenario lengths` and
`python -m bench.lengths`, end to end at a tiny size with real consumer
processes and a real redis-server. They check what the scenario promises structurally
(buckets never mixed, the cap applied, every request answered, the report written), not
the timing figures: those are in docs/benchmarks.md."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from helpers.support import HEAVY

from batchgate import lengths  # noqa: E402
from bench import lengths as bench_lengths  # noqa: E402 (the checkout's lab: tests run from it)

BATCHGATE = shutil.which("batchgate", path=os.path.dirname(sys.executable)) or shutil.which(
    "batchgate")
needs_redis = pytest.mark.skipif(not shutil.which("redis-server"),
                                 reason="redis-server is not on PATH")


def test_arrivals_are_seeded_and_mixed() -> None:
    times, costs = lengths.arrivals(200, 10, seed=3)
    assert (times, costs) == lengths.arrivals(200, 10, seed=3)
    assert times == sorted(times) and times[0] > 0 and times[-1] < 10
    assert set(costs) == {lengths.SHORT, lengths.LONG}
    assert costs.count(lengths.LONG) / len(costs) == pytest.approx(lengths.LONG_SHARE,
                                                                   abs=0.03)


def test_step_time_counts_steps_and_padded_rows() -> None:
    model = bench_lengths.StepTime(1.0, 0.0, 0.01, 0.5)  # 1 + 0.5·max + 0.01·b·max ms
    assert model.us(4, 4 * 256) == round((1 + 0.5 * 256 + 0.01 * 1024) * 1000)


def test_live_model_is_fitted_to_the_runs_own_batches_and_predicted_over_draws() -> None:
    truth = bench_lengths.StepTime(5.0, 0.0, 0.01, 0.5)
    batch_costs = [[c] * b for b in (1, 2, 4, 8) for c in (16, 128, 256)]
    batch_ms = [truth.us(len(c), len(c) * c[0]) / 1000 for c in batch_costs]
    batch_ms[-1] *= 2  # one batch stalled
    run = {"batch_costs": batch_costs, "batch_ms": batch_ms}
    fitted, ratios = bench_lengths.live_model(run)
    assert len(ratios) == len(batch_costs) and max(ratios) > 1.5
    assert sorted(ratios)[len(ratios) // 2] == pytest.approx(1.0, abs=0.2)
    assert fitted["per_step_ms"] > 0 and fitted["per_cost_ms"] > 0
    times, costs = lengths.arrivals(4, 30, seed=2)
    config = lengths.CONFIGS[1]  # buckets
    prof = {"step": fitted, "padded": {"base_ms": 1.0, "per_cost_ms": 0.1}}
    live = bench_lengths.predict(config, prof, "live", times, costs, 2, run, seed=1)
    assert live == bench_lengths.predict(config, prof, "live", times, costs, 2, run, seed=1)
    assert live["draws"] == bench_lengths.LIVE_DRAWS and live["jitter_samples"] == len(ratios)
    low, high = live["p99_range_ms"][str(lengths.LONG)]
    assert low <= live["latency_ms"][str(lengths.LONG)]["p99"] <= high
    exact = bench_lengths.predict(config, prof, "step", times, costs, 2, run)
    assert exact["draws"] == 1 and "p99_range_ms" not in exact
    few = bench_lengths.predict(config, prof, "live", times, costs, 2,
                          {"batch_costs": [[16]], "batch_ms": [5.0]})
    assert few["jitter_samples"] == 0 and few["cost_model"] == exact["cost_model"]


def test_probed_model_names_each_batch_and_its_costs() -> None:
    from consumer.batch import Cost

    probed = lengths.probed_generator(layers=1, dim=32, heads=2, vocab=512, positions=64,
                                      max_new_tokens_cap=40)
    out = probed([{"prompt": "a"}, {"prompt": "bc"}], costs=[Cost(3), Cost(7)])
    assert [r["new_tokens"] for r in out] == [3, 7]
    assert out[0]["batch"] == out[1]["batch"]
    assert out[0]["batch"]["costs"] == [3, 7] and out[0]["batch"]["ms"] > 0
    assert probed([{"prompt": "d"}], costs=[Cost(2)])[0]["batch"]["id"] != \
        out[0]["batch"]["id"]


# A fixed rate, not the default 60% load from the profile: the seeded arrivals are then the
# same on any machine (11 requests, 2 of them long; at 5 req/s there would be none).
RATE, SEED = "6", "0"


def check_structure(report: dict, configs: tuple[str, ...]) -> None:
    w = report["workload"]
    assert w["requests"] == w["short"] + w["long"]
    assert w["short"] > 0 and w["long"] > 0  # both lengths, or the cap checks say nothing
    assert set(report["configs"]) == set(configs)
    for name, run in report["configs"].items():
        assert run["answered"] == run["submitted"] == w["requests"], name
        assert run["failed"] == run["unanswered"] == 0, name
        assert run["latency_ms"][str(lengths.SHORT)]["n"] == w["short"], name  # all answered
        assert run["latency_ms"][str(lengths.LONG)]["n"] == w["long"], name
        assert sum(map(len, run["batch_costs"])) == w["requests"], name
        assert all(len(c) <= lengths.BATCH for c in run["batch_costs"]), name
        if name != "one-bucket":  # a batch holds one bucket only
            for costs in run["batch_costs"]:
                assert len({c <= lengths.BUCKET for c in costs}) == 1, (name, costs)
            assert run["padding_waste"] == 0.0, name  # two lengths, one per bucket
        cap = lengths.CAP if name == "buckets+max-cost" else lengths.LONG
        assert max(max(c) for c in run["batch_costs"]) <= cap, name
    assert report["checks"]


def check_output(text: str, report: dict, configs: tuple[str, ...]) -> None:
    """The printed table (every line of it within 100 columns), each check and the
    summary line; a MISS names the host's load."""
    lines = text.splitlines()
    rows = [line for line in lines if line.startswith(("config ", *configs))]
    assert [r.split()[0] for r in rows] == ["config", *configs]
    assert max(map(len, rows)) <= 100
    met = sum(c["ok"] for c in report["checks"])
    assert any(line.startswith(f"summary: {met} of {len(report['checks'])} checks met")
               for line in lines)
    for line in lines:
        if line.startswith("- MISS: "):
            assert line.endswith(f"(host load {report['host']['load_1m']:.1f} on "
                                 f"{report['host']['cores']} core(s))")


def exit_status_of(report: dict) -> int:
    """What --strict exits with."""
    return 1 if any(not c["ok"] for c in report["checks"]) else 0


# Each configuration costs a consumer start (torch + transformers, ~5 s of CPU) per
# consumer: the demo runs two configurations with one consumer of one torch thread
# (profiled in its own process), the bench smoke one with two (profiled two at once).
# The other configurations differ in the consumers' flags only (--prefer-bucket,
# --only-bucket: tested in test_costs.py); the checks comparing them, below on made-up
# runs.
DEMO_CONFIGS = ("one-bucket", "buckets+prefer")
BENCH_CONFIGS = ("buckets+max-cost",)
assert set(DEMO_CONFIGS + BENCH_CONFIGS) < set(lengths.CONFIG_NAMES)
# The fewest shapes the simulator's step fit (three terms) takes: two batch sizes, two
# lengths.
BENCH_SHAPES = "1x16,1x256,2x256"


def check_names(report: dict) -> list[str]:
    return [c["check"] for c in report["checks"]]


@HEAVY
@needs_redis
@pytest.mark.timeout(150)
def test_demo_scenario_lengths(tmp_path: Path) -> None:
    assert BATCHGATE, "the batchgate command is not installed (pip install -e .)"
    proc = subprocess.run([BATCHGATE, "demo", "--scenario", "lengths", "--duration", "1.5",
                           "--configs", ",".join(DEMO_CONFIGS), "--profile-repeats", "1",
                           "--rate", RATE, "--seed", SEED, "--consumers", "1",
                           "--torch-threads", "1", "--json", "--strict"],
                          capture_output=True, text=True, timeout=140)
    report = orjson.loads(proc.stdout)
    assert proc.returncode == exit_status_of(report), proc.stderr[-3000:]
    assert report["scenario"] == "lengths" and report["redis"] == "embedded redis-server"
    check_structure(report, DEMO_CONFIGS)
    assert (report["consumers"], report["torch_threads"]) == (1, 1)
    assert report["profile"]["parallel"] == 1  # the bench smoke profiles two at once
    assert len(report["profile"]["points"]) == len(lengths.DEMO_SHAPES)
    assert all("predicted" not in run for run in report["configs"].values())  # bench's
    # one bucket pads short requests to long ones when they share a batch
    one = report["configs"]["one-bucket"]
    mixed = [c for c in one["batch_costs"] if len(set(c)) > 1]
    assert (one["padding_waste"] > 0) == bool(mixed)
    assert "buckets+prefer: short p99 >= 3x lower than one-bucket" in check_names(report)
    check_output(lengths.render(report), report, DEMO_CONFIGS)  # printed without --json


@needs_redis
def test_demo_lengths_refuses_an_unknown_config() -> None:
    assert BATCHGATE, "the batchgate command is not installed (pip install -e .)"
    proc = subprocess.run([BATCHGATE, "demo", "--scenario", "lengths", "--configs",
                           "buckets,two-buckets"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2
    assert "--configs" in proc.stderr and "two-buckets" in proc.stderr
    assert "timing the generator" not in proc.stderr  # nothing ran


@HEAVY
@needs_redis
@pytest.mark.timeout(150)
def test_bench_lengths_smoke(tmp_path: Path) -> None:
    """The harness, not the numbers: one configuration for 1.5 s, three shapes
    profiled."""
    proc = subprocess.run(
        [sys.executable, "-m", "bench.lengths", "--quick", "--duration-s", "1.5",
         "--configs", ",".join(BENCH_CONFIGS), "--rate", RATE, "--seed", SEED,
         "--shapes", BENCH_SHAPES, "--out", str(tmp_path), "--strict"],
        # a hang guard: beside the rest of the suite on 2 cores this takes up to ~2 min
        capture_output=True, text=True, timeout=300)
    report = json.loads((tmp_path / "results.json").read_text())
    assert proc.returncode == exit_status_of(report), proc.stderr[-3000:]
    check_structure(report, BENCH_CONFIGS)
    check_output(proc.stdout, report, BENCH_CONFIGS)
    for run in report["configs"].values():
        for pred in run["predicted"].values():
            assert pred["throughput_rps"] > 0
            assert set(pred["error_pct"]) == {"short_p99", "long_p99", "throughput"}
    assert report["profile"]["parallel"] == 2
    assert [(p["b"], p["cost"]) for p in report["profile"]["points"]] == \
        bench_lengths.parse_shapes(BENCH_SHAPES)
    assert {"padded", "step"} <= set(report["profile"])
    md = (tmp_path / "results.md").read_text()
    assert all(f"| {name} |" in md for name in BENCH_CONFIGS)
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "lengths.png").stat().st_size > 1000


def test_bench_lengths_shapes_are_checked() -> None:
    assert bench_lengths.parse_shapes("1x16,2x256,1x256") == [(1, 16), (2, 256), (1, 256)]
    for bad in ("1x16,2x16,4x16", "1x16", "1x16,2xabc,1x256", "0x16,2x256,1x256"):
        with pytest.raises(Exception, match="--shapes"):
            bench_lengths.parse_shapes(bad)


def made_up_run(short_p99: float, long_p99: float, rps: float) -> dict:
    return {"latency_ms": {str(lengths.SHORT): {"p99": short_p99},
                           str(lengths.LONG): {"p99": long_p99}}, "throughput_rps": rps}


def test_the_checks_compare_the_configurations_that_ran() -> None:
    runs = {"one-bucket": made_up_run(300.0, 900.0, 10.0),
            "buckets": made_up_run(90.0, 800.0, 9.8),
            "buckets+max-cost": made_up_run(95.0, 700.0, 9.0)}
    found = {c["check"]: c["ok"] for c in lengths.checks(runs)}
    assert found == {"buckets: short p99 >= 3x lower than one-bucket": True,
                     "buckets: throughput >= 95% of one-bucket": True,
                     f"buckets+max-cost: long p99 below buckets' (cost capped at "
                     f"{lengths.CAP})": True}
    runs["buckets+max-cost"] = made_up_run(95.0, 850.0, 9.0)
    runs["buckets+dedicated"] = made_up_run(120.0, 800.0, 9.0)
    found = {c["check"]: c["ok"] for c in lengths.checks(runs)}
    assert not found[f"buckets+max-cost: long p99 below buckets' (cost capped at "
                     f"{lengths.CAP})"]
    assert not found["buckets+dedicated: short p99 >= 3x lower than one-bucket"]
    assert not found["buckets+dedicated: throughput >= 95% of one-bucket"]
    assert lengths.checks({"buckets+max-cost": runs["buckets+max-cost"]}) == []
