"""`batchgate simulate`: the simulated queue serves requests as the rules and the cost model
say (small traces whose every latency is known), and the command's output and errors."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from batchgate.cli import main
from batchgate.simulate import (
    DEFAULT_FETCH,
    DEFAULT_FINISH,
    DEFAULT_TRANSPORT_MS,
    CostModel,
    PathTime,
    SimConfig,
    _Level,
    jitter_ratios,
    parse_mix,
    path_offsets,
    poisson_arrivals,
    read_model_samples,
    read_trace,
    simulate,
)
from batchgate.workload import Workload
from scheduler_core.errors import InvalidRequest
from scheduler_core.policy import Policy, Strategy

NO_PATH = PathTime(0, 0)


def run(strategy: Strategy, times_ms: list[float], prios: list[int], cost: str = "10",
        consumers: int = 1, **policy: int):
    config = SimConfig(Policy(strategy=strategy, **policy), CostModel.parse(cost), consumers,
                       overhead_ms=0, transport_ms=0, fetch=NO_PATH, finish=NO_PATH,
                       react_ms=0)
    return simulate(config, [t / 1000 for t in times_ms], prios)


def test_fifo_serves_each_request_in_its_model_time_while_it_keeps_up():
    result = run(Strategy.FIFO, [10.0 * k for k in range(100)], [1] * 100, cost="5")
    assert result.latency_ms["all"] == {"p50": 5.0, "p95": 5.0, "p99": 5.0, "max": 5.0}
    assert result.mean_batch == 1 and result.batch_histogram == {1: 100}
    assert result.utilisation == pytest.approx(500 / 995, abs=1e-4)  # 100 x 5 ms over 995 ms


def test_a_partial_dynamic_batch_leaves_when_its_oldest_has_waited_the_delay():
    result = run(Strategy.DYNAMIC, [0, 10, 20], [1, 0, 2], cost="5+1*b", max_batch_size=32,
                 max_queue_delay_ms=50)
    # popped at 50 ms, t(3) = 8 ms: results at 58 ms
    assert [result.latency_ms[p]["max"] for p in ("normal", "high", "low")] == [58, 48, 38]
    assert result.batch_histogram == {3: 1}


def test_a_full_batch_leaves_at_once_and_busy_consumers_queue_the_rest():
    # 96 requests at t=0 (Redis scores them 1 µs apart), batches of 32, two consumers.
    result = run(Strategy.DYNAMIC, [0.0] * 96, [1] * 96, cost="10", consumers=2,
                 max_batch_size=32, max_queue_delay_ms=1000)
    assert result.batch_histogram == {32: 3}
    assert result.latency_ms["all"]["p50"] == pytest.approx(10.0, abs=0.1)
    assert result.latency_ms["all"]["max"] == pytest.approx(20.0, abs=0.1)  # waited for one


def test_priority_serves_high_first_normal_by_its_window_low_when_nothing_else_waits():
    result = run(Strategy.PRIORITY, [0, 1, 2, 3], [2, 1, 0, 2], cost="10", max_batch_size=8,
                 max_queue_delay_ms=50, aging_ms=0)
    ms = {p: result.latency_ms[p]["max"] for p in ("high", "normal", "low")}
    # LOW at 0 runs at once (nothing else waits), until 10 ms; then HIGH (until 20 ms);
    # NORMAL is due at 51 ms (until 61 ms) and the second LOW waits behind it (until 71 ms).
    assert ms == {"high": 18.0, "normal": 60.0, "low": 68.0}
    assert result.latency_ms["low"]["p50"] == 10.0


@pytest.mark.parametrize(("react_ms", "low_ms"), [(0, 59), (0.2, 109.3)])
def test_the_next_consumer_decides_react_ms_after_a_pop(react_ms, low_ms):
    # A HIGH at 0 ms runs alone (0-10 ms), so the first consumer knows its model time and
    # fetches ahead only at its model's end (lead 0). NORMAL at 20 ms is due at 70; LOW at
    # 21 waits behind it; another NORMAL comes at 70.1. The first consumer pops the NORMAL
    # at 70. Deciding at the same instant, the second finds NORMAL empty and runs the LOW
    # (done at 80 ms). Deciding 0.2 ms later, it finds the new NORMAL: the LOW waits for
    # that one's window and runs 0.2 ms after it is popped at 120.1 ms.
    config = SimConfig(Policy(strategy=Strategy.PRIORITY, max_batch_size=8,
                              max_queue_delay_ms=50, aging_ms=0),
                       CostModel.parse("10"), 2, overhead_ms=0, transport_ms=0,
                       fetch=NO_PATH, finish=NO_PATH, lead_ms=0, react_ms=react_ms)
    result = simulate(config, [0.0, 0.020, 0.021, 0.0701], [0, 1, 2, 1])
    assert result.latency_ms["low"]["max"] == pytest.approx(low_ms, abs=0.01)
    assert result.latency_ms["normal"]["max"] == pytest.approx(60, abs=0.01)


def test_a_bad_react_is_refused_naming_the_field():
    with pytest.raises(InvalidRequest) as err:
        SimConfig(react_ms=-1)
    assert err.value.field == "react_ms"


def test_aging_lifts_low_out_of_a_steady_normal_load():
    """LOW waits while NORMAL keeps the only consumer busy, until aging_ms lifts it. (It
    arrives after the first batch, which the consumer fetches ahead of at once: no model
    time known yet.)"""
    normal = [float(k) for k in range(0, 3000)]  # one NORMAL per ms, t(b) = 1 ms per item
    times, prios = [10.5, *normal], [2, *[1] * len(normal)]
    order = sorted(range(len(times)), key=lambda k: times[k])
    result = run(Strategy.PRIORITY, [times[k] for k in order], [prios[k] for k in order],
                 cost="0+1.05*b", max_batch_size=4, max_queue_delay_ms=5, aging_ms=500)
    assert 500 <= result.latency_ms["low"]["max"] < 520  # served once it reaches NORMAL
    without = run(Strategy.PRIORITY, [times[k] for k in order], [prios[k] for k in order],
                  cost="0+1.05*b", max_batch_size=4, max_queue_delay_ms=5, aging_ms=0)
    assert without.latency_ms["low"]["max"] > 2000


def test_the_workload_is_the_benchmarks():
    times, prios, _ = Workload("poisson", rate=300, duration_s=3, seed=4).arrivals()
    assert poisson_arrivals(300, 3, seed=4) == (times, prios)
    assert poisson_arrivals(300, 3, (0, 1, 0), seed=4)[1] == [1] * len(times)


def test_cost_model_and_mix_parse_or_name_the_field():
    assert CostModel.parse("5 + 0.5*b") == CostModel(5.0, 0.5)
    assert CostModel.parse("0.5b") == CostModel(0.0, 0.5)
    assert CostModel.parse("12") == CostModel(12.0, 0.0)
    assert parse_mix("high=1, low=3") == (1.0, 0.0, 3.0)
    for bad in ("5+b*0.5", "-1+2*b", "", "5+0.5*x"):
        with pytest.raises(InvalidRequest) as info:
            CostModel.parse(bad)
        assert info.value.field == "cost_ms"
    for bad in ("urgent=1", "high=-1", "high=0,normal=0", "high"):
        with pytest.raises(InvalidRequest) as info:
            parse_mix(bad)
        assert info.value.field == "mix"
    with pytest.raises(InvalidRequest, match=r"\[1, 4096\]"):
        SimConfig(consumers=0)


def test_trace_file(tmp_path: Path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"t": 0.2, "priority": "low"}\n\n{"t": 0.1}\n{"t": 0, "priority": 0}\n')
    assert read_trace(trace) == ([0.0, 0.1, 0.2], [0, 1, 2])
    trace.write_text('{"t": 0.1}\n{"t": -1}\n')
    with pytest.raises(InvalidRequest, match=r"trace.jsonl:2: \"t\""):
        read_trace(trace)
    trace.write_text('{"t": 1, "priority": "urgent"}\n')
    with pytest.raises(InvalidRequest, match="trace line 1"):
        read_trace(trace)


def test_command_prints_the_documented_json(tmp_path: Path):
    result = CliRunner().invoke(main, ["simulate", "--strategy", "dynamic", "--rate", "400",
                                       "--duration-s", "2", "--consumers", "1", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert {"throughput_rps", "mean_batch", "utilisation", "latency_ms"} <= out.keys()
    assert set(out["latency_ms"]) == {"all", "high", "normal", "low"}
    for summary in out["latency_ms"].values():
        assert set(summary) == {"p50", "p95", "p99", "max"}
        assert 50 <= summary["p99"] <= 100  # the 50 ms window plus t(b)
    assert sum(out["batch_histogram"].values()) == out["batches"]
    assert out["throughput_rps"] == pytest.approx(400, rel=0.1)
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"t": 0, "priority": "high"}\n')
    text = CliRunner().invoke(main, ["simulate", "--trace", str(trace), "--cost-ms", "7"])
    assert text.exit_code == 0, text.output
    # fetch(1) + t(1) + finish(1) + transport, the defaults: a lone request is fetched cold
    alone = DEFAULT_FETCH.us(1) / 1000 + 7 + DEFAULT_FINISH.us(1) / 1000 + DEFAULT_TRANSPORT_MS
    assert "high" in text.output and f"{alone:.2f}" in text.output


def test_command_names_the_bad_option():
    result = CliRunner().invoke(main, ["simulate", "--cost-ms", "fast"])
    assert result.exit_code == 2 and "cost_ms" in result.output
    result = CliRunner().invoke(main, ["simulate", "--max-batch-size", "0"])
    assert result.exit_code == 2 and "max_batch_size" in result.output
    result = CliRunner().invoke(main, ["simulate", "--transport-ms", "-1"])
    assert result.exit_code == 2 and "transport_ms" in result.output
    for flag in ("--fetch-ms", "--finish-ms"):
        for bad in ("slow", "1+2*c", "-1"):
            result = CliRunner().invoke(main, ["simulate", flag, bad])
            assert result.exit_code == 2 and flag[2:].replace("-", "_") in result.output


# -- the path around the model, and a model time that varies ---------------------------
def path_run(times_ms: list[float], strategy: Strategy = Strategy.FIFO, **policy: int):
    config = SimConfig(Policy(strategy=strategy, **policy), CostModel.parse("10"), 1,
                       overhead_ms=0.25, transport_ms=0.5, fetch=PathTime.parse("1+0.5*b", "f"),
                       finish=PathTime.parse("2+0.25*b", "f"))
    return simulate(config, [t / 1000 for t in times_ms], [1] * len(times_ms))


def test_a_lone_request_pays_fetch_model_finish_and_transport():
    result = path_run([0.0])
    assert result.latency_ms["all"]["max"] == 1.5 + 10 + 2.25 + 0.5


def test_a_batch_fetched_ahead_skips_the_fetch_and_finishes_beside_the_next():
    # One request at 0 (a batch of 1: the consumer is busy until 13.75 ms: fetch, model,
    # finish), then 64 at 1 ms: the first 32 are fetched cold with 32 left waiting, so
    # the second 32 were fetched ahead (overhead only) and the first finished beside them.
    result = path_run([0.0] + [1.0] * 64, Strategy.DYNAMIC, max_batch_size=32,
                      max_queue_delay_ms=0)
    free = 1.5 + 10 + 2.25
    end = free + (1 + 0.5 * 32) + 10
    first = end + (2 + 0.25 * 32) + 0.5 - 1
    second = end + 0.25 + 10 + (2 + 0.25 * 32) + 0.5 - 1
    assert result.batch_histogram == {1: 1, 32: 2}
    assert result.latency_ms["all"]["p50"] == pytest.approx(first, abs=0.1)
    assert result.latency_ms["all"]["max"] == pytest.approx(second, abs=0.1)


@pytest.mark.parametrize(("lead_ms", "low_ms", "high_ms"), [(3, 29, 22), (0, 39, 18)])
def test_a_consumer_fetching_ahead_decides_lead_ms_before_its_model_ends(lead_ms, low_ms,
                                                                         high_ms):
    # HIGH at 0 runs 0-10 ms; LOW (1 ms) and HIGH (2 ms) wait. At 10 the HIGH runs with
    # the LOW left waiting, so the consumer fetches ahead: 3 ms before that model ends it
    # finds only the LOW and takes it, and the HIGH arriving at 18 ms waits for it (done
    # at 40). Deciding at the end (lead 0), it takes that HIGH first and the LOW last.
    config = SimConfig(Policy(strategy=Strategy.PRIORITY, max_batch_size=1),
                       CostModel.parse("10"), 1, overhead_ms=0, transport_ms=0,
                       fetch=NO_PATH, finish=NO_PATH, lead_ms=lead_ms)
    result = simulate(config, [0.0, 0.001, 0.002, 0.018], [0, 2, 0, 0])
    assert result.latency_ms["low"]["max"] == pytest.approx(low_ms, abs=0.01)
    assert result.latency_ms["high"]["max"] == pytest.approx(high_ms, abs=0.01)


def test_a_bad_lead_is_refused_naming_the_field():
    with pytest.raises(InvalidRequest) as err:
        SimConfig(lead_ms=-2)
    assert err.value.field == "lead_ms"


def test_without_a_backlog_the_consumer_finishes_before_it_pops_again():
    # The second request arrives while the first one's results are being written: it waits
    # for the consumer, then is fetched cold.
    result = path_run([0.0, 12.0])
    free = 1.5 + 10 + 2.25  # first: fetched, run, finished on the consumer
    assert result.latency_ms["all"]["max"] == pytest.approx(free - 12 + 1.5 + 10 + 2.25 + 0.5,
                                                            abs=0.01)


def test_jitter_ratios_are_each_sample_over_the_samples_own_line(tmp_path: Path):
    samples = tmp_path / "samples.txt"
    samples.write_text("1:6000\n2:7000\n\n4:9000\n1:12000\n")  # line 6 + 1*b ms, one 2x slow
    read = read_model_samples(samples)
    assert read == [(1, 6.0), (2, 7.0), (4, 9.0), (1, 12.0)]
    ratios = jitter_ratios(read)
    assert len(ratios) == 4 and max(ratios) > 1.3 and min(ratios) < 1
    assert jitter_ratios([(8, 10.0), (8, 20.0)]) == pytest.approx((2 / 3, 4 / 3))
    # a line whose intercept fits below 0 is clamped as the live refit clamps it: every
    # sample keeps a ratio, none huge
    clamped = jitter_ratios([(1, 0.5), (10, 100.0), (20, 210.0)])
    assert len(clamped) == 3 and max(clamped) < 2
    samples.write_text("1:6000\nfast\n")
    with pytest.raises(InvalidRequest, match="samples.txt:2") as info:
        read_model_samples(samples)
    assert info.value.field == "cost_jitter"
    with pytest.raises(InvalidRequest) as info:
        jitter_ratios([(1, 5.0)])
    assert info.value.field == "cost_jitter"
    with pytest.raises(InvalidRequest) as info:
        SimConfig(jitter=(1.0, 0.0))
    assert info.value.field == "cost_jitter"


def test_jitter_is_seeded_widens_p99_and_keeps_throughput():
    times, prios = poisson_arrivals(300, 20, seed=2)
    policy = Policy.build("dynamic", max_batch_size=32, max_queue_delay_ms=20)
    ratios = (0.8, 0.9, 1.0, 1.0, 1.1, 1.2, 3.0)  # one batch in seven stalls at 3x

    def sim(jitter: tuple[float, ...], seed: int = 1):
        return simulate(SimConfig(policy, CostModel(5, 0.5), 2, jitter=jitter,
                                  jitter_seed=seed), times, prios)

    exact, shaken = sim(()), sim(ratios)
    assert sim(ratios).latency_ms == shaken.latency_ms  # the same seed, the same answer
    assert sim(ratios, seed=2).latency_ms != shaken.latency_ms
    assert shaken.latency_ms["all"]["p99"] > exact.latency_ms["all"]["p99"] * 1.1
    assert shaken.throughput_rps == pytest.approx(exact.throughput_rps, rel=0.02)
    assert sim((1.0,)).latency_ms == exact.latency_ms  # a ratio of 1 changes nothing


def test_the_paths_spread_offsets_each_result_and_keeps_the_mean():
    # Lone requests, 5 ms model, a 2 ms constant path: one in ten is seen 9 ms late, the
    # others 1 ms early (mean offset 0): p50 drops by 1 ms and p99 rises by 9.
    offsets = path_offsets([1.0] * 9 + [11.0])
    assert offsets == pytest.approx((-1,) * 9 + (9,))
    config = SimConfig(Policy(strategy=Strategy.FIFO), CostModel.parse("5"), 1,
                       overhead_ms=0, transport_ms=2, fetch=NO_PATH, finish=NO_PATH,
                       path_spread=offsets)
    times = [k * 0.05 for k in range(2000)]
    spread = simulate(config, times, [1] * len(times))
    plain = simulate(replace(config, path_spread=()), times, [1] * len(times))
    assert plain.latency_ms["all"]["p99"] == 7
    assert spread.latency_ms["all"]["p50"] == 6 and spread.latency_ms["all"]["p99"] == 16
    assert spread.throughput_rps == pytest.approx(plain.throughput_rps, rel=0.01)
    assert simulate(config, times, [1] * len(times)).latency_ms == spread.latency_ms
    with pytest.raises(InvalidRequest) as info:
        SimConfig(path_spread=(1.0, 70_000.0))
    assert info.value.field == "path_spread"
    with pytest.raises(InvalidRequest) as info:
        path_offsets([3.0])
    assert info.value.field == "path_spread"


def test_the_command_takes_the_path_and_a_jitter_file(tmp_path: Path):
    samples = tmp_path / "samples.txt"
    samples.write_text("".join(f"{b}:{round((5 + 0.5 * b) * 1000 * r)}\n"
                               for b in (1, 8, 32) for r in (0.9, 1.0, 1.1, 2.5)))
    args = ["simulate", "--strategy", "dynamic", "--rate", "300", "--duration-s", "5",
            "--json"]
    plain = json.loads(CliRunner().invoke(main, args).output)
    shaken = CliRunner().invoke(main, args + ["--cost-jitter", str(samples)])
    assert shaken.exit_code == 0, shaken.output
    assert json.loads(shaken.output)["latency_ms"]["all"]["p99"] > \
        plain["latency_ms"]["all"]["p99"]
    free = CliRunner().invoke(main, args + ["--fetch-ms", "0", "--finish-ms", "0",
                                            "--transport-ms", "0"])
    assert json.loads(free.output)["latency_ms"]["all"]["p50"] < \
        plain["latency_ms"]["all"]["p50"]
    text = CliRunner().invoke(main, args[:-1] + ["--cost-jitter", str(samples)]).output
    assert "x a measured ratio (12 samples)" in text and "fetch 0.45+0.05*b ms" in text
    path = tmp_path / "path.txt"
    path.write_text("2.0\n2.0\n\n2.5\n30\n")
    spread = CliRunner().invoke(main, args + ["--path-samples", str(path)])
    assert spread.exit_code == 0, spread.output
    assert json.loads(spread.output)["latency_ms"]["all"]["p99"] > \
        plain["latency_ms"]["all"]["p99"]
    text = CliRunner().invoke(main, args[:-1] + ["--path-samples", str(path)]).output
    assert "path spread from 4 samples" in text
    path.write_text("2.0\nslow\n")
    bad = CliRunner().invoke(main, args + ["--path-samples", str(path)])
    assert bad.exit_code == 2 and "path_spread" in bad.output and "path.txt:2" in bad.output
    samples.write_text("32\n")
    bad = CliRunner().invoke(main, args + ["--cost-jitter", str(samples)])
    assert bad.exit_code == 2 and "cost_jitter" in bad.output


def test_the_simulators_level_behaves_as_a_list():
    """_Level (O(1) pops from the head) against a plain list, on random edits as decide
    and apply make them."""
    rng = random.Random(3)
    level, model = _Level(), []
    for step in range(20_000):
        op = rng.random()
        if op < 0.6 or not model:
            item = (step, rng.random())
            level.append(item)
            model.append(item)
        elif op < 0.7:
            n = rng.randint(1, min(len(model), 10))
            del level[:n]
            del model[:n]
        elif op < 0.85:
            k = rng.randrange(len(model))
            del level[k]
            del model[k]
        else:
            k, item = rng.randint(0, len(model)), (step, -1.0)
            level.insert(k, item)
            model.insert(k, item)
        assert len(level) == len(model)
        if step % 97 == 0:
            assert list(level) == model and level[:5] == model[:5]
            assert level[len(model) // 2:len(model) // 2 + 3] == \
                model[len(model) // 2:len(model) // 2 + 3]


def test_simcheck_simulates_the_benchmarks_sleep_model_runs():
    """bench/simcheck.py pairs each sleep-model run of a results.json with the
    simulation of the same requests, and skips what it cannot simulate."""
    pytest.importorskip("hdrh")
    from bench.run import spec_dict
    from bench.simcheck import compare, render
    from bench.spec import RunSpec

    workload = Workload("poisson", rate=200, duration_s=2, seed=3, model="synthetic")
    measured = {"throughput_rps": 200.0, "batch_mean": 8.0, "overloaded": False,
                "busy_fraction": 0.5, "model_samples": ["4:7100", "8:9000", "8:12000"],
                "latency_ms": {c: {"p50": 40.0, "p99": 60.0}
                               for c in ("all", "high", "normal", "low")}}
    runs = [{"label": system, "spec": spec_dict(RunSpec("grid", system, model, workload, 2)),
             "summary": measured}
            for system, model in (("batchgate", "synthetic"), ("rq", "synthetic"),
                                  ("batchgate", "noop"))]
    rows = compare({"runs": runs})
    assert [r["system"] for r in rows] == ["batchgate"]
    # the run's own model samples feed the jitter, seeded as the workload
    ratios = jitter_ratios([(4, 7.1), (8, 9.0), (8, 12.0)])
    expected = simulate(SimConfig(Policy.build("dynamic", aging_ms=1000), CostModel(5, 0.5),
                                  2, jitter=ratios, jitter_seed=3), *workload.schedule())
    assert rows[0]["jitter_samples"] == 3
    assert rows[0]["all_p99"] == (60.0, expected.latency_ms["all"]["p99"])
    assert rows[0]["mean_batch"] == (8.0, expected.mean_batch)
    assert "λ=200" in render(rows) and "runs under 90% busy" in render(rows)
    exact = compare({"runs": runs}, jitter=False)
    assert exact[0]["jitter_samples"] == 0
    # a calibration's spread at the nearest rate offsets each result as simulate's would
    offsets = (-1.0,) * 9 + (9.0,)
    spread = compare({"runs": runs}, spreads={20: (0.0,), 150: offsets})
    expected = simulate(SimConfig(Policy.build("dynamic", aging_ms=1000), CostModel(5, 0.5),
                                  2, jitter=ratios, jitter_seed=3, path_spread=offsets),
                        *workload.schedule())
    assert spread[0]["all_p99"] == (60.0, expected.latency_ms["all"]["p99"])



def test_simcheck_fits_the_path_to_several_calibration_files(tmp_path: Path, monkeypatch,
                                                            capsys):
    from bench import simcheck

    def cal(name: str, batch: float, rate: float, path: list[float]) -> Path:
        stages = {"submit_to_enqueue": {"mean": 0.4}, "pop_to_model": {"mean": 0.5 + batch / 10},
                  "model_to_seen": {"mean": 1.0}}
        run = {"spec": {"system": "batchgate", "workload": {"rate": rate}}, "summary": {
            "batch_mean": batch, "overloaded": False, "stages_ms": stages,
            "generator_lag_ms": {"mean": 0.1}, "path_samples_ms": path}}
        file = tmp_path / name
        file.write_bytes(json.dumps({"runs": [run]}).encode())
        return file

    light, heavy = cal("light.json", 1, 20, [2.0, 3.0, 7.0]), cal("heavy.json", 31, 900, [4, 6])
    grid = tmp_path / "grid.json"
    grid.write_text('{"runs": []}')
    monkeypatch.setattr("sys.argv", ["simcheck", str(grid), "--path-from", str(light),
                                     str(heavy)])
    simcheck.main()
    out = capsys.readouterr().out
    assert (f"path fitted to {light}, {heavy}: --transport-ms 0.5 --fetch-ms 0.5+0.1*b "
            "--finish-ms 1+0*b;") in out
    assert "spread from the path samples at λ 20 (3), 900 (2)" in out


def test_simcheck_takes_the_median_ratio_of_a_point_over_several_runs():
    """Several results.json (other seeds): each point's median predicted/measured ratio,
    and how many of its runs met the targets on their own."""
    from bench.simcheck import across, render_across

    def row(seed: int, p99_predicted: float, busy: float = 0.5) -> dict[str, Any]:
        return {"system": "batchgate", "strategy": "priority", "kind": "poisson",
                "rate": 900.0, "seed": seed, "overloaded": False, "busy": busy,
                "all_p50": (50.0, 50.0), "throughput_rps": (900.0, 900.0),
                "mean_batch": (8.0, 8.0), "all_p99": (200.0, p99_predicted)}

    rows = [row(1, 160.0), row(2, 200.0), row(3, 220.0), row(4, 100.0, busy=0.95)]
    [point] = across(rows)  # the run at 95% busy is not held to the targets
    assert (point["runs"], point["met"]) == (3, 2)
    assert point["median_ratio"]["all_p99"] == pytest.approx(1.0)
    assert point["median_within"] is True
    assert "2 of 3" in render_across([point])


def test_simcheck_fits_the_path_to_a_calibration_runs_stage_means():
    """--path-from: transport is the median of the kept-up batchgate runs' intended
    arrival→enqueue means; fetch and finish are the least-squares line of their stage
    means over mean batch size; the spread is each run's path samples about that run's
    own mean, kept per arrival rate (overloaded and other systems' runs left out); a
    run is simulated with the spread of the nearest rate."""
    from bench.simcheck import fit_path, nearest

    def run(system: str, batch: float, fetch: float, finish: float, transport: float,
            overloaded: bool = False, path: tuple[float, ...] = (), rate: float = 20
            ) -> dict[str, Any]:
        stages = {"submit_to_enqueue": {"mean": transport - 0.1},
                  "pop_to_model": {"mean": fetch}, "model_to_seen": {"mean": finish}}
        return {"spec": {"system": system, "workload": {"rate": rate}}, "summary": {
            "batch_mean": batch, "overloaded": overloaded, "stages_ms": stages,
            "generator_lag_ms": {"mean": 0.1}, "path_samples_ms": list(path)}}

    runs = [run("batchgate", 1, 0.31, 0.47, 0.5, path=(1, 1, 4)),
            run("batchgate", 11, 0.41, 0.67, 0.2, path=(10, 12), rate=900),
            run("batchgate", 31, 0.61, 1.07, 0.3), run("batchgate", 31, 9, 9, 9, True, (99, 1)),
            run("rq", 1, 5, 5, 5, path=(50, 1))]
    transport, fetch, finish, spread = fit_path({"runs": runs})
    assert transport == 0.3
    assert spread == {20: (-1, -1, 2), 900: (-1, 1)}
    assert nearest(spread, 100) == (-1, -1, 2) and nearest(spread, 500) == (-1, 1)
    assert nearest({}, 100) == ()
    assert (fetch.base_ms, fetch.per_item_ms) == (0.3, 0.01)
    assert (finish.base_ms, finish.per_item_ms) == (0.45, 0.02)
    with pytest.raises(SystemExit, match="two batch sizes"):
        fit_path({"runs": runs[:1]})


# -- requests of different cost ------------------------------------------------------------
def test_a_padded_model_costs_size_times_the_largest_and_the_sum_model_the_sum():
    """Two requests of cost 2 and 10 arrive together, one batch: padded t = 1 + 0.5 x 2 x 10,
    sum t = 1 + 0.5 x 12; padding waste (10 - 2) / (10 + 10)."""
    for mode, model_ms in (("padded", 11.0), ("sum", 7.0)):
        config = SimConfig(Policy(strategy=Strategy.DYNAMIC, max_batch_size=2,
                                  cost_mode=mode),
                           CostModel.parse("1+0.5*c"), 1, overhead_ms=0, transport_ms=0,
                           fetch=NO_PATH, finish=NO_PATH)
        result = simulate(config, [0.0, 0.0], [1, 1], [2, 10])  # arrivals 0 and 1 µs
        assert result.batch_histogram == {2: 1}
        assert result.latency_ms["all"]["max"] == pytest.approx(model_ms + 0.001)
        assert result.padding_waste == pytest.approx(8 / 20)
        assert set(result.latency_by_cost) == {2, 10}


def test_cost_buckets_keep_short_requests_out_of_long_batches():
    """The documented scenario (docs/scheduling.md), shorter: buckets leave no padding and
    lower the short requests' p99; max_cost caps the long ones (truncate) or refuses them."""
    times, prios = poisson_arrivals(430, 10, (0, 1, 0), seed=3)
    from batchgate.simulate import draw_costs
    costs = draw_costs(len(times), [(16, 80), (256, 20)], seed=3)

    def sim(**policy):
        config = SimConfig(Policy(strategy=Strategy.DYNAMIC, max_batch_size=32,
                                  max_queue_delay_ms=20, cost_mode="padded", **policy),
                           CostModel.parse("5+0.01*c"), 2)
        return simulate(config, times, prios, costs)

    one, buckets = sim(), sim(cost_buckets="32")
    assert one.padding_waste > 0.5 and buckets.padding_waste == 0
    assert buckets.latency_by_cost[16]["p99"] < one.latency_by_cost[16]["p99"]
    assert buckets.throughput_rps >= 0.95 * one.throughput_rps
    capped = sim(max_cost=128, over_cost="truncate")
    assert capped.truncated == costs.count(256) and capped.rejected == 0
    assert capped.latency_by_cost[256]["p99"] < one.latency_by_cost[256]["p99"]
    refused = sim(max_cost=128)
    assert refused.rejected == costs.count(256) and refused.requests == costs.count(16)
    assert set(refused.latency_by_cost) == {16}


def test_the_command_takes_a_cost_mix_and_the_cost_settings():
    runner = CliRunner()
    done = runner.invoke(main, ["simulate", "--rate", "200", "--duration-s", "2",
                                "--cost-mix", "16:80,256:20", "--cost-ms", "2+0.01*c",
                                "--cost-mode", "padded", "--cost-buckets", "32",
                                "--max-batch-cost", "4096", "--json"])
    assert done.exit_code == 0, done.output
    out = json.loads(done.output)
    assert set(out["latency_by_cost_ms"]) == {"16", "256"} and out["padding_waste"] == 0
    text = runner.invoke(main, ["simulate", "--rate", "200", "--duration-s", "2",
                                "--cost-mix", "16:80,256:20"])
    assert "padding waste" in text.output and "cost 256" in text.output
    for args, field in ((["--cost-mix", "16"], "cost_mix"), (["--cost-mix", "0:5"], "cost_mix"),
                        (["--cost-ms", "5+c*x"], "cost_ms"),
                        (["--cost-buckets", "9,3"], "cost_buckets")):
        bad = runner.invoke(main, ["simulate", "--duration-s", "1", *args])
        assert bad.exit_code != 0 and field in bad.output, (args, bad.output)


def test_consumers_preferring_the_short_bucket_trade_long_latency_for_short():
    """docs/scheduling.md's measurement: near saturation, consumers preferring the short
    bucket lower the short requests' p99 and raise the long ones'."""
    from batchgate.simulate import draw_costs
    times, prios = poisson_arrivals(700, 20, (0, 1, 0), seed=1)
    costs = draw_costs(len(times), [(16, 90), (2048, 10)], seed=1)

    def sim(prefs):
        policy = Policy(strategy=Strategy.DYNAMIC, max_batch_size=32, max_queue_delay_ms=20,
                        cost_mode="padded", cost_buckets="32")
        return simulate(SimConfig(policy, CostModel.parse("5+0.01*c"), 2,
                                  prefer_buckets=prefs), times, prios, costs)

    shared, short_first = sim(()), sim((1, 1))
    assert short_first.latency_by_cost[16]["p99"] < shared.latency_by_cost[16]["p99"]
    assert short_first.latency_by_cost[2048]["p99"] > shared.latency_by_cost[2048]["p99"]
    for bad in ((1,), (1, 9), (1, True)):
        with pytest.raises(InvalidRequest) as err:
            SimConfig(Policy(), CostModel(5), 2, prefer_buckets=bad)
        assert err.value.field == "prefer_buckets"


def test_a_cost_model_without_costs_counts_each_request_as_one():
    """--cost-ms "A+B*c" with no cost mix: every request costs 1, so c = b."""
    result = run(Strategy.DYNAMIC, [0.0, 0.0, 0.0], [1, 1, 1], cost="2+1*c",
                 max_batch_size=3)
    assert result.batch_histogram == {3: 1}
    assert result.latency_ms["all"]["max"] == pytest.approx(2 + 3 + 0.002)  # 3rd: 2 µs in


def test_a_trace_carries_costs_and_max_cost_refuses_the_ones_above(tmp_path: Path):
    from batchgate.simulate import read_trace_costs
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"t": 0, "cost": 4}\n{"t": 0.001, "cost": 300}\n{"t": 0.002}\n')
    times, prios, costs = read_trace_costs(trace)
    assert costs == [4, 300, 1] and read_trace(trace) == (times, prios)
    (tmp_path / "plain.jsonl").write_text('{"t": 0}\n')
    assert read_trace_costs(tmp_path / "plain.jsonl")[2] is None
    done = CliRunner().invoke(main, ["simulate", "--trace", str(trace), "--max-cost", "100",
                                     "--json"])
    assert done.exit_code == 0, done.output
    out = json.loads(done.output)
    assert (out["rejected"], out["requests"], set(out["latency_by_cost_ms"])) == (1, 2,
                                                                                 {"1", "4"})
    (tmp_path / "bad.jsonl").write_text('{"t": 0, "cost": 0}\n')
    bad = CliRunner().invoke(main, ["simulate", "--trace", str(tmp_path / "bad.jsonl")])
    assert bad.exit_code != 0 and "cost" in bad.output
