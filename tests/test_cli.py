"""The `batchgate` command as operators use it: consumer lifecycle (SIGTERM), policy
conflicts, model arguments and environment variables (real `batchgate consumer`
processes); `submit`, `result`, `policy`, `stats --json` (through click's CliRunner, a
consumer in the test process serving them)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from importlib.metadata import version

from helpers.cli import Ran, batchgate
from helpers.failure_support import HERE
from helpers.support import RecordingModel, configure, queue_pattern, snapshot, wait_for

from producer import Producer
from scheduler_core.admin import read_policy
from scheduler_core.cost_model import CostModel, write_cost_model
from scheduler_core.keys import QueueKeys
from scheduler_core.ops.stats import queue_stats

# -- consumer lifecycle ----------------------------------------------------------------


def test_sigterm_finishes_the_batch_in_hand_then_exits_0(shared_redis, queue,
                                                         start_consumer, tmp_path):
    model = RecordingModel(tmp_path)
    proc = model.start(start_consumer, shared_redis.url, queue, "--strategy", "fifo",
                       "--max-batch-size", "4")
    client = shared_redis.client()
    with Producer(shared_redis.url, queue) as p:
        handles = p.submit_many([{"i": 0, "sleep_ms": 800}, {"i": 1}])
        wait_for(lambda: model.batches(), what="the batch to start")
        proc.signal(signal.SIGTERM)
        assert proc.proc.wait(15) == 0, proc.output()
        # The batch in hand was completed before the exit, not left to the lease sweep.
        assert [h.result(timeout=1) for h in handles] == [{"i": 0, "sleep_ms": 800}, {"i": 1}]
        left = p.submit({"after": "exit"})  # nobody takes work after the stop
    stats = queue_stats(client, queue)
    assert stats.processed == 2 and stats.requeued == 0 and stats.in_flight_requests == 0
    assert stats.depth["normal"] == 1 and client.hexists(QueueKeys(queue).jobs, left.id)
    assert stats.consumers_alive == 0  # it deregistered itself


def test_sigterm_under_load_strands_no_batch(shared_redis, queue, start_consumer):
    """Stopped while it churns through a backlog (the next batch rides with each
    completion), the consumer leaves nothing in flight: every request is answered or
    still waiting for the next consumer, none held by a dead lease."""
    total = 3000
    configure(shared_redis.url, queue, strategy="fifo")
    client = shared_redis.client()
    with Producer(shared_redis.url, queue) as p:
        p.submit_many([{"i": i} for i in range(total)])
    proc = start_consumer(shared_redis.url, queue, "--model", "consumer.models:noop")
    wait_for(lambda: queue_stats(client, queue).processed >= 100, what="some progress")
    proc.signal(signal.SIGTERM)
    assert proc.proc.wait(15) == 0, proc.output()
    stats = queue_stats(client, queue)
    assert stats.in_flight_requests == 0 and stats.in_flight_batches == 0
    assert stats.processed + stats.depth["normal"] == total and stats.requeued == 0


def test_idle_consumer_stops_on_sigterm_and_sigint(shared_redis, queue, start_consumer):
    procs = {sig: start_consumer(shared_redis.url, queue, "--model", "consumer.models:noop",
                                 ready=False) for sig in (signal.SIGTERM, signal.SIGINT)}
    for sig, proc in procs.items():
        proc.wait_ready()
        proc.signal(sig)
    for proc in procs.values():
        assert proc.proc.wait(15) == 0, proc.output()
    assert queue_stats(shared_redis.client(), queue).consumers_alive == 0


def test_user_model_is_imported_from_the_working_directory(shared_redis, queue,
                                                           start_consumer, tmp_path):
    model = RecordingModel(tmp_path)  # tmp_path/bg_recorder.py, not on sys.path otherwise
    model.start(start_consumer, shared_redis.url, queue)
    with Producer(shared_redis.url, queue) as p:
        assert p.submit({"mine": 1}).result(timeout=10) == {"mine": 1}
    assert model.payloads() == [{"mine": 1}]


def test_unknown_model_fails_with_a_clear_message(shared_redis, queue, start_consumer):
    proc = start_consumer(shared_redis.url, queue, "--model", "no_such_module_xyz:model",
                          ready=False)
    assert proc.proc.wait(30) != 0
    assert "no_such_module_xyz" in proc.output()


def test_conflicting_policy_flags_are_refused(shared_redis, queue, start_consumer):
    start_consumer(shared_redis.url, queue, "--model", "consumer.models:noop", "--strategy",
                   "dynamic", "--max-batch-size", "16")
    conflicts = [(["--strategy", "fifo"], "strategy=dynamic (asked fifo)"),
                 (["--max-batch-size", "8"], "max_batch_size=16 (asked 8)")]
    procs = [start_consumer(shared_redis.url, queue, "--model", "consumer.models:noop",
                            *flags, ready=False) for flags, _ in conflicts]
    for proc, (_, says) in zip(procs, conflicts, strict=True):
        assert proc.proc.wait(30) != 0
        out = proc.output()
        assert "ready on queue" not in out
        # The field, the stored and the asked value, and the queue.
        assert f"queue {queue!r} already runs with {says}" in out, out
    # The stored policy is untouched, and a consumer that asks nothing adopts it.
    policy = read_policy(shared_redis.client(), queue)
    assert policy.strategy.value == "dynamic" and policy.max_batch_size == 16
    adopters = [start_consumer(shared_redis.url, queue, "--model", "consumer.models:noop",
                               *flags, ready=False) for flags in ([], ["--strategy", "dynamic"])]
    for proc in adopters:
        proc.wait_ready()
    # "ready" is printed before a consumer's first heartbeat: wait for the three to beat.
    wait_for(lambda: queue_stats(shared_redis.client(), queue).consumers_alive == 3,
             what="three consumers alive")


# -- submit ----------------------------------------------------------------------------


def test_submit_wait_prints_the_result(shared_redis, queue, inprocess_consumer):
    inprocess_consumer("consumer.models:noop", redis_url=shared_redis.url, queue=queue)
    done = batchgate("submit", "--redis-url", shared_redis.url, "--queue", queue,
                     "--priority", "high", "--wait", '{"a": [1, 2, {"b": null}]}')
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"a": [1, 2, {"b": None}]}


def test_submit_prints_the_id_to_fetch_later(shared_redis, queue, inprocess_consumer):
    done = batchgate("submit", "--redis-url", shared_redis.url, "--queue", queue,
                     "--priority", "low", '"hello"')
    assert done.returncode == 0, done.stderr
    request_id = done.stdout.strip()
    inprocess_consumer("consumer.models:noop", redis_url=shared_redis.url, queue=queue)
    with Producer(shared_redis.url, queue) as p:
        stored = wait_for(lambda: p.fetch(request_id), what="the result")
    assert stored.ok and stored.value == "hello"


def test_submit_rejects_bad_input_and_writes_nothing(shared_redis, queue):
    client = shared_redis.client()
    for args in (["not json"], ["--priority", "urgent", "{}"], ["--deadline-ms", "-1", "{}"]):
        done = batchgate("submit", "--redis-url", shared_redis.url, "--queue", queue, *args)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert done.stderr.strip()
    done = batchgate("submit", "--redis-url", shared_redis.url, "--queue", "bad name", "{}")
    assert done.returncode == 2 and "queue" in done.stderr
    assert snapshot(client, queue_pattern(queue)) == {}


def test_submit_wait_reports_a_deadline_or_a_timeout(shared_redis, queue):
    done = batchgate("submit", "--redis-url", shared_redis.url, "--queue", queue,
                     "--deadline-ms", "100", "--wait", "{}")
    assert done.returncode == 1
    assert "DeadlineExceeded" in done.stderr
    done = batchgate("submit", "--redis-url", shared_redis.url, "--queue", queue,
                     "--wait", "--timeout", "0.3", "{}")
    assert done.returncode == 1 and "stays queued" in done.stderr
    assert queue_stats(shared_redis.client(), queue).depth["normal"] == 1


# -- stats -----------------------------------------------------------------------------


def stats_json(url: str, queue: str) -> dict:
    done = batchgate("stats", "--redis-url", url, "--queue", queue, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_stats_json(shared_redis, queue, inprocess_consumer):
    with Producer(shared_redis.url, queue) as p:
        p.submit_many([{"h": i} for i in range(2)], priority="high")
        p.submit_many([{"l": i} for i in range(3)], priority="low")
        waiting = stats_json(shared_redis.url, queue)
        assert waiting["queue"] == queue
        assert waiting["depth"] == {"high": 2, "normal": 0, "low": 3}
        assert waiting["oldest_wait_ms"] >= 0
        assert waiting["consumers_alive"] == 0 and waiting["processed"] == 0
        assert waiting["policy"] is None  # no consumer has configured the queue yet

        inprocess_consumer("consumer.models:noop", redis_url=shared_redis.url, queue=queue,
                           strategy="priority", max_batch_size=8)
        handles = p.submit_many([{"n": i} for i in range(8)])
        for h in handles:
            h.result(timeout=10)
        wait_for(lambda: queue_stats(shared_redis.client(), queue).processed == 13,
                 what="all 13 processed")
    stats = stats_json(shared_redis.url, queue)
    assert stats["depth"] == {"high": 0, "normal": 0, "low": 0}
    assert stats["oldest_wait_ms"] is None
    assert stats["in_flight_requests"] == 0 and stats["in_flight_batches"] == 0
    assert stats["consumers_alive"] == 1
    assert stats["policy"]["strategy"] == "priority"
    assert stats["policy"]["max_batch_size"] == 8  # numbers as JSON numbers
    assert stats["failed"] == 0 and stats["batches"] >= 3
    assert stats["mean_batch_size"] == 13 / stats["batches"]
    for name in ("queue_wait_ms", "end_to_end_ms"):
        latency = stats[name]
        assert latency["samples"] == 13
        assert 0 <= latency["p50"] <= latency["p99"]
    assert stats["model_ms"]["samples"] == stats["batches"]  # one per batch
    assert 0 <= stats["model_ms"]["p50"] <= stats["model_ms"]["p99"]


STATS_JSON_FIELDS = {  # `stats --json` is for scripts: these stay as they are
    "queue", "policy", "depth", "in_flight_requests", "in_flight_batches", "oldest_wait_ms",
    "consumers_alive", "processed", "failed", "requeued", "cancelled", "expired",
    "dead_letters", "batches", "mean_batch_size", "queue_wait_ms", "end_to_end_ms",
    "model_ms", "delayed", "past_deadline", "arrival_rate_rps", "max_queue_delay_ms_in_use",
    "arrival_window_s", "slo_p99_ms", "cost_model", "recommended_consumers", "retried",
    "retrying", "tenants", "preempted", "preempted_steps", "tenant_fairness",
    "tenant_counters"}


def test_stats_prints_an_aligned_table_with_units(shared_redis, queue, start_consumer):
    start_consumer(shared_redis.url, queue, "--model", "consumer.models:synthetic",
                   "--model-arg", "base_ms=3", "--strategy", "priority",
                   "--max-batch-size", "8")
    with Producer(shared_redis.url, queue) as p:
        assert all(h.result(timeout=30) for h in p.submit_many([{"n": i} for i in range(20)]))
    # As `batchgate profile --store` leaves it (a consumer's refit may replace it later).
    write_cost_model(shared_redis.client(), QueueKeys(queue),
                     CostModel(2100, 400, 0.98, 120, "profile"))
    done = batchgate("stats", "--redis-url", shared_redis.url, "--queue", queue,
                     "--slo-p99-ms", "250")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert max(len(line) for line in lines) <= 100, done.stdout
    rows = {line[:17].strip(): line[17:] for line in lines if line[:17].strip()}
    # One label column, every value starting in the same column.
    latency = ["latency", "queue wait", "end to end", "model per batch"]
    assert all(line[16] == " " and line[17] != " " for line in lines
               if line[:17].strip() not in ("", *latency)), done.stdout
    assert len({len(rows[label]) for label in latency}) == 1  # right-aligned columns
    assert rows["policy"] == "strategy=priority max_batch_size=8 max_queue_delay_ms=50"
    assert rows["delay in use"] == "50 ms"
    assert rows["consumers alive"] == "1"
    assert rows["answered"].startswith("20 processed, 0 failed")
    assert rows["arrival rate"].endswith("req/s (last 10 s)")
    assert re.fullmatch(r"\s+\d+\.\d ms\s+\d+\.\d ms\s+20", rows["end to end"]), done.stdout
    assert re.fullmatch(r"t\(b\) = \d+\.\d\d ms \+ 0\.\d{3} ms × b \((profile|live), "
                        r"[\d,]+ batches, r² [\d.]+, updated \d+ s ago\)",
                        rows["cost model"]), done.stdout
    assert re.fullmatch(r"\d+ consumers? \(SLO 250 ms at \d+\.\d req/s\)",
                        rows["recommended"]), done.stdout
    # For people: no Python reprs, no None, no float noise, no epoch microseconds.
    for raw in ("None", "{", "Policy(", "Strategy.", "updated_us"):
        assert raw not in done.stdout, raw
    assert not re.search(r"\d\.\d{4,}|\d{13,}", done.stdout), done.stdout
    machine = stats_json(shared_redis.url, queue)
    assert set(machine) == STATS_JSON_FIELDS  # --json keeps the machine form


def test_the_start_up_line_names_the_policy_in_the_clis_words(shared_redis, queue,
                                                              start_consumer):
    proc = start_consumer(shared_redis.url, queue, "--model", "consumer.models:noop",
                          "--strategy", "priority", "--max-batch-size", "8",
                          "--max-queue-delay-ms", "auto", "--slo-p99-ms", "100")
    wait_for(lambda: "serving queue" in proc.output(), 15, "the start-up line")
    line = next(x for x in proc.output().splitlines() if "serving queue" in x)
    assert re.search(r"with strategy=priority max_batch_size=8 max_queue_delay_ms=auto "
                     r"\(→ \d+(\.\d)? ms, SLO 100 ms\)$", line), line
    assert "Policy(" not in proc.output() and "<Strategy" not in proc.output()


# -- models: --device, --model-arg, env vars, torch threads ---------------------------


def test_device_works_with_every_built_in_model(shared_redis, queue, start_consumer):
    """docs/configuration.md's and docs/deploy.md's `--device cpu` command lines, with the default
    model and the other built-ins."""
    start_consumer(shared_redis.url, queue, "--device", "cpu")  # consumer.models:synthetic
    start_consumer(shared_redis.url, queue, "--model", "consumer.models:noop",
                   "--device", "cpu")
    with Producer(shared_redis.url, queue) as p:
        assert p.submit({"x": 1}).result(timeout=10) == {"x": 1}


def test_an_argument_the_model_does_not_take_names_the_flag_typed(shared_redis, queue,
                                                                  start_consumer):
    cases = [(["--device", "cpu"], "--device", "device"),
             (["--model-arg", "colour=1"], "--model-arg", "colour")]
    for args, flag, name in cases:
        proc = start_consumer(shared_redis.url, queue, "--model", "failure_models:Echo",
                              *args, cwd=str(HERE), ready=False)
        assert proc.proc.wait(30) == 2, proc.output()
        out = proc.output()
        assert f"{flag}: failure_models:Echo takes no argument {name}" in out, out
        assert "log, sleep_ms" in out  # what it does take
        assert "model_arg" not in out and "Traceback" not in out


def test_consumer_flags_are_read_from_their_environment_variables(shared_redis, queue,
                                                                  start_consumer):
    env = {"BATCHGATE_MODEL": "failure_models:ThreadsReport", "BATCHGATE_TORCH_THREADS": "1",
           "BATCHGATE_STRATEGY": "fifo", "BATCHGATE_MAX_BATCH_SIZE": "3",
           "BATCHGATE_CONSUMER_NAME": f"env-{queue}"}
    proc = start_consumer(shared_redis.url, queue, cwd=str(HERE), env=env)
    assert "(torch threads: 1)" in proc.output()
    with Producer(shared_redis.url, queue) as p:
        assert p.submit("x").result(timeout=30) == {"torch_threads": 1, "omp": "1"}
    policy = read_policy(shared_redis.client(), queue)
    assert (policy.strategy.value, policy.max_batch_size) == ("fifo", 3)
    assert f"env-{queue}" in proc.output()


def test_torch_threads_flag_caps_torch_in_the_consumer(shared_redis, queue, start_consumer):
    start_consumer(shared_redis.url, queue, "--model", "failure_models:ThreadsReport",
                   "--torch-threads", "2", cwd=str(HERE))
    with Producer(shared_redis.url, queue) as p:
        assert p.submit("x").result(timeout=30)["torch_threads"] == 2
    bad = batchgate("consumer", "--redis-url", shared_redis.url, "--torch-threads", "0")
    assert bad.returncode == 2 and "torch_threads: 0 is outside [1, 1024]" in bad.stderr


# -- policy ----------------------------------------------------------------------------


def policy_cli(url: str, queue: str, *args: str) -> Ran:
    return batchgate("policy", *args, "--redis-url", url, "--queue", queue)


def test_policy_set_applies_the_new_strategys_batch_size_and_show_prints_numbers(
        shared_redis, queue):
    url = shared_redis.url
    configure(url, queue, strategy="dynamic", max_batch_size=64, max_queue_delay_ms=20)
    to_fifo = policy_cli(url, queue, "set", "--strategy", "fifo")
    assert to_fifo.returncode == 0, to_fifo.stderr
    assert json.loads(to_fifo.stdout)["max_batch_size"] == 1  # fifo's default (docs)
    assert "max_batch_size: 64 -> 1" in to_fifo.stderr
    back = json.loads(policy_cli(url, queue, "set", "--strategy", "priority").stdout)
    assert back["max_batch_size"] == 32 and back["max_queue_delay_ms"] == 20  # others kept
    chosen = json.loads(policy_cli(url, queue, "set", "--strategy", "fifo",
                                   "--max-batch-size", "4").stdout)
    assert chosen["max_batch_size"] == 4
    same = json.loads(policy_cli(url, queue, "set", "--aging-ms", "0").stdout)
    assert same["max_batch_size"] == 4  # no strategy change: nothing reset
    shown = policy_cli(url, queue, "show")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout) == {
        "strategy": "fifo", "max_batch_size": 4, "max_queue_delay_ms": 20, "aging_ms": 0,
        "max_queue_size": 0, "max_attempts": 3, "result_ttl_s": 600, "max_cost": 0,
        "over_cost": "reject", "max_batch_cost": 0, "cost_mode": "sum", "cost_buckets": "",
        "slo_p99_ms": 0, "delay_mode": "fixed", "timeout_high_ms": 0, "timeout_normal_ms": 0,
        "timeout_low_ms": 0, "allow_timeout_override": 1, "on_timeout": "reject",
        "shards": 1, "retry_on": "", "retry_max": 1, "retry_backoff_ms": 1000,
        "retry_backoff_max_ms": 60000, "retry_jitter": 0, "tenant_quotas": "",
        "fairness": "none"}
    stats_policy = stats_json(url, queue)["policy"]
    assert stats_policy == json.loads(shown.stdout)  # the same JSON in both places


# -- result ----------------------------------------------------------------------------


def result_cli(url: str, queue: str, *args: str) -> Ran:
    return batchgate("result", "--redis-url", url, "--queue", queue, *args)


def test_result_prints_a_stored_result_with_documented_exit_codes(shared_redis, queue,
                                                                  inprocess_consumer):
    url = shared_redis.url
    with Producer(url, queue) as p:
        ok = p.submit({"v": [1, "é"]}, store_result=True)
        failing = p.submit({"fail": True}, store_result=True)
        queued = result_cli(url, queue, ok.id)
        assert queued.returncode == 3 and "queued" in queued.stderr
        waited_out = result_cli(url, queue, ok.id, "--wait", "--timeout", "0.3")
        assert waited_out.returncode == 3 and "within 0.3s" in waited_out.stderr
        inprocess_consumer("consumer.models:synthetic", redis_url=url, queue=queue)
        waited = result_cli(url, queue, ok.id, "--wait", "--timeout", "20")
        assert waited.returncode == 0, waited.stderr
        assert json.loads(waited.stdout) == {"v": [1, "é"]}
        failed = result_cli(url, queue, failing.id, "--wait", "--timeout", "20")
        assert failed.returncode == 1 and "ValueError" in failed.stderr
        as_json = result_cli(url, queue, failing.id, "--json")
        assert as_json.returncode == 1
        body = json.loads(as_json.stdout)
        assert (body["id"], body["status"], body["error"]["type"]) == (failing.id, "failed",
                                                                        "ValueError")
        assert json.loads(result_cli(url, queue, ok.id, "--json").stdout) == {
            "id": ok.id, "status": "done", "result": {"v": [1, "é"]}}
    for unknown in ("0" * 32, "not-an-id"):  # a typo does not wait for --timeout
        missing = result_cli(url, queue, unknown, "--wait", "--timeout", "30")
        assert missing.returncode == 3 and "no request" in missing.stderr
    bad = result_cli(url, queue, ok.id, "--timeout", "-1")
    assert bad.returncode == 2 and "--timeout" in bad.stderr


# -- the product: version, a missing extra, the benchmark that left the package ----------


def without(module: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`batchgate ARGS` in a Python where `module` cannot be imported (as where its extra
    is not installed: `import module` raises ModuleNotFoundError)."""
    code = (f"import sys; sys.modules[{module!r}] = None; sys.argv[0] = 'batchgate'; "
            "from batchgate.cli import main; main()")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True,
                          text=True, timeout=timeout)


def test_version_is_the_packages_one_version():
    import scheduler_core

    proc = batchgate("--version")
    assert proc.returncode == 0
    assert proc.stdout == f"batchgate, version {scheduler_core.__version__}\n"
    assert scheduler_core.__version__ == version("batchgate")  # the installed metadata's


def test_a_shipped_model_whose_extra_is_missing_names_it_and_exits_2(shared_redis, queue):
    proc = without("transformers", "consumer", "--redis-url", shared_redis.url, "--queue",
                   queue, "--model", "consumer.models:generator", timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "consumer.models:generator needs the `generate` extra" in proc.stderr
    assert "pip install 'batchgate[generate]'" in proc.stderr
    assert "pip install -e '.[generate]'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_user_model_importing_a_missing_module_names_it_and_exits_2(shared_redis, queue,
                                                                      start_consumer,
                                                                      tmp_path):
    (tmp_path / "needs_dep.py").write_text("import no_such_dep_xyz\n\n"
                                           "def model(batch):\n    return batch\n")
    proc = start_consumer(shared_redis.url, queue, "--model", "needs_dep:model",
                          ready=False, cwd=str(tmp_path))
    assert proc.proc.wait(60) == 2
    out = proc.output()
    assert "needs_dep:model imports no_such_dep_xyz, which is not installed" in out
    assert "Traceback" not in out


def test_bench_says_where_the_benchmark_went():
    proc = batchgate("bench", "--quick")
    assert proc.returncode == 2
    assert "python -m bench.run" in proc.stderr and "batchgate profile" in proc.stderr
    assert not re.search(r"^\s+bench\s", batchgate("--help").stdout, re.M)  # not listed


def test_nan_is_refused_by_every_seconds_option():
    """NaN compares false with both bounds of click's FloatRange: before, `gateway
    --request-timeout-s nan` started serving. Refused while parsing: nothing runs."""
    for args in (["gateway", "--request-timeout-s", "nan"],
                 ["exporter", "--scrape-timeout-s", "nan"], ["top", "--interval", "nan"],
                 ["dashboard", "--interval", "nan"], ["demo", "--duration", "nan"]):
        result = batchgate(*args, "--redis-url", "redis://127.0.0.1:1/0")
        assert result.returncode == 2, (args, result.stderr)
        assert args[1] in result.stderr and "not a number" in result.stderr, result.stderr
