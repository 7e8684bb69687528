"""The queue registry, the per-queue snapshot (scheduler_core.ops.snapshot) and `batchgate top`,
against a real Redis with real consumers."""

from __future__ import annotations

import asyncio
import io
import os
import re
import subprocess
import time

import orjson
import pytest
from click.testing import CliRunner
from helpers.processes import BATCHGATE
from helpers.support import wait_for

from batchgate.cli import main as cli
from producer import AsyncProducer, Producer
from scheduler_core import registry
from scheduler_core.keys import QueueKeys
from scheduler_core.ops.snapshot import Rates, queue_snapshot
from scheduler_core.registry import known_queues, register_queue


def test_consumers_producers_and_policy_set_register_their_queue(redis_server, queue,
                                                                 inprocess_consumer):
    client = redis_server.client()
    assert known_queues(client) == []
    inprocess_consumer("consumer.models:noop", redis_url=redis_server.url, queue=queue + "-c")
    assert known_queues(client) == [queue + "-c"]  # at start, before its first heartbeat

    with Producer(redis_server.url, queue + "-p") as producer:
        producer.submit(1)
        producer.submit(2)

    async def submit_async() -> None:
        async with AsyncProducer(redis_server.url, queue + "-a") as producer:
            await producer.submit(1)
    asyncio.run(submit_async())

    out = CliRunner().invoke(cli, ["policy", "set", "--redis-url", redis_server.url,
                                   "--queue", queue + "-s", "--max-batch-size", "8"])
    assert out.exit_code == 0, out.output
    assert known_queues(client) == sorted(queue + s for s in ("-a", "-c", "-p", "-s"))
    # Each queue's own mark, under its tag: when it was last seen (ms).
    seen = [int(client.get(QueueKeys(queue + s).seen)) for s in ("-a", "-c", "-p", "-s")]
    assert all(abs(ms / 1000 - time.time()) < 60 for ms in seen)


def test_a_queue_with_no_keys_left_drops_out_after_stale_s_and_one_with_keys_stays(
        redis_server, queue, monkeypatch):
    client = redis_server.client()
    with Producer(redis_server.url, queue) as producer:
        producer.submit(1)  # keys stay: a pending request
    register_queue(client, queue + "-gone")  # no keys at all
    old = int((time.time() - registry.STALE_S - 60) * 1000)
    for name in (queue, queue + "-gone"):
        client.set(QueueKeys(name).seen, old)
    # Keys that merely end like a mark (an idempotency key under a queue's tag): not queues.
    client.set(QueueKeys(queue).idempotency("x}:seen"), "r1")
    client.set("{bg:not a valid name}:seen", old)
    assert known_queues(client, prune=False) == [queue, queue + "-gone"]
    assert known_queues(client) == [queue]
    assert int(client.get(QueueKeys(queue).seen)) > old  # marked seen again: not checked again
    assert client.get(QueueKeys(queue + "-gone").seen) is None
    # Recent and without keys (registered, nothing submitted yet): kept.
    register_queue(client, queue + "-new")
    assert known_queues(client) == [queue, queue + "-new"]


def test_snapshot_of_a_busy_queue(redis_server, queue, inprocess_consumer):
    client = redis_server.client()
    inprocess_consumer("consumer.models:synthetic", redis_url=redis_server.url, queue=queue,
                       model_args={"base_ms": 40}, max_batch_size=8, device="cpu")
    rates = Rates()
    first = rates.update(queue_snapshot(client, queue))
    assert first["rates"] is None  # rates need two snapshots
    with Producer(redis_server.url, queue) as producer:
        handles = [producer.submit({"i": i}) for i in range(60)]
        handles.append(producer.submit({"fail": True}))
        busy = queue_snapshot(client, queue)
        assert sum(busy["depth"].values()) + busy["in_flight_requests"] > 0
        for handle in handles[:-1]:
            handle.result(timeout=30)
    wait_for(lambda: queue_snapshot(client, queue)["recent_failures"], 10,
             "the failure to be published by the lease thread")
    snap = rates.update(queue_snapshot(client, queue))
    assert snap["completed"] == 61 and snap["processed"] == 60 and snap["failed"] == 1
    assert snap["rates"]["completed_per_s"] > 0
    assert snap["rates"]["arrived_per_s"] > 0
    assert snap["queue_wait_ms"]["p50"] is not None and snap["end_to_end_ms"]["p99"] >= \
        snap["end_to_end_ms"]["p50"]
    sizes = {int(k): v for k, v in snap["batch_sizes"].items()}
    assert sum(size * n for size, n in sizes.items()) == 61 and max(sizes) <= 8
    [consumer] = snap["consumers"]
    assert consumer["device"] == "cpu" and consumer["host"] and consumer["pid"].isdigit()
    assert consumer["heartbeat_age_s"] < 5
    wait_for(lambda: queue_snapshot(client, queue)["consumers"][0]["batches"] == sum(
        sizes.values()), 10, "the consumer's batch count in its info hash")
    [failure] = snap["recent_failures"]
    assert failure["type"] == "ValueError" and failure["id"] == handles[-1].id
    assert snap["dead"] == {"total": 0, "shown": []}
    assert snap["policy"]["max_batch_size"] == 8


def test_a_consumer_that_stops_leaves_no_info_behind(redis_server, queue, start_consumer):
    client = redis_server.client()
    consumer = start_consumer(redis_server.url, queue, "--model", "consumer.models:noop")
    wait_for(lambda: [c for c in queue_snapshot(client, queue)["consumers"] if c["host"]], 10,
             "the consumer's info hash")
    name = queue_snapshot(client, queue)["consumers"][0]["name"]
    assert client.pttl(QueueKeys(queue).consumer_info(name)) > 0  # lapses if it crashes
    assert consumer.stop() == 0
    assert queue_snapshot(client, queue)["consumers"] == []
    assert not client.exists(QueueKeys(queue).consumer_info(name))


def test_top_shows_a_busy_queue_and_exits(redis_server, queue, inprocess_consumer):
    inprocess_consumer("consumer.models:synthetic", redis_url=redis_server.url, queue=queue,
                       model_args={"base_ms": 200}, max_batch_size=2)
    with Producer(redis_server.url, queue) as producer:
        for i in range(200):  # 20 s of work: still busy however slowly top starts
            producer.submit({"i": i}, priority="low")
        out = subprocess.run([BATCHGATE, "top", "--redis-url", redis_server.url,
                              "--iterations", "2", "--interval", "0.5"],
                             capture_output=True, text=True, timeout=60,
                             env={**os.environ, "COLUMNS": "120"})
    assert out.returncode == 0, out.stderr
    frames = out.stdout.split("waiting h/n/l")
    assert len(frames) == 3, out.stdout  # two refreshes
    first, second = frames[1], frames[2]
    rows = [next(line for line in frame.splitlines() if line.startswith(queue + " "))
            for frame in (first, second)]  # the queue's figures row, in each
    # waiting h/n/l, in flight, arrived/s, done/s, ...: the first refresh has no rates yet.
    low = [int(row.split()[1].split("/")[2]) for row in rows]
    assert low[0] > 0 and low[1] <= low[0], rows
    assert rows[0].split()[3] == "-" and re.fullmatch(r"\d+\.\d", rows[1].split()[3]), rows
    assert re.search(rf"{queue}\s+priority\s+2\s+50 ms\s+1 [▁-█ ]+ 2", second), second
    assert "batches/s" in second and "heartbeat" in second
    # --queue filters; an unknown queue shows empty figures rather than failing.
    out = CliRunner().invoke(cli, ["top", "--redis-url", redis_server.url, "--once",
                                   "--queue", queue + "-other"])
    assert out.exit_code == 0 and queue + "-other" in out.output
    assert f"{queue} " not in out.output.replace(queue + "-other", "")
    bad = CliRunner().invoke(cli, ["top", "--redis-url", redis_server.url, "--once",
                                   "--queue", "bad name"])
    assert bad.exit_code == 2 and "queue" in bad.output


@pytest.mark.parametrize(("signal_name", "inherited"), [
    ("SIGINT", "default"), ("SIGTERM", "default"),
    # A parent that ignores SIGINT (a script's background job; an RQ worker in the same
    # process) passes SIG_IGN on to its children: top still stops on Ctrl-C.
    ("SIGINT", "ignored")])
def test_top_exits_cleanly_on_ctrl_c(redis_server, queue, signal_name, inherited):
    import signal

    client = redis_server.client()
    register_queue(client, queue)
    before = len(client.client_list())
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) \
        if inherited == "ignored" else None
    proc = subprocess.Popen([BATCHGATE, "top", "--redis-url", redis_server.url,
                             "--interval", "0.2"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=ignore)
    # Running (a busy host may take seconds to start it): its connection is open.
    wait_for(lambda: len(client.client_list()) > before, 60, "top to connect to Redis")
    time.sleep(0.5)
    proc.send_signal(getattr(signal, signal_name))
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "Traceback" not in err and queue in out


def test_rates_are_counted_over_the_window():
    def snap(t: float, completed: int, depth: int, batches: int) -> dict:
        return {"queue": "q", "time_s": t, "completed": completed, "batches": batches,
                "depth": {"high": 0, "normal": depth, "low": 0}, "in_flight_requests": 0,
                "dead_letters": 0, "consumers": [{"name": "c", "batches": batches}]}
    rates = Rates(window_s=5.0)
    assert rates.update(snap(100.0, 0, 0, 0))["rates"] is None
    rates.update(snap(102.0, 10, 5, 2))
    # At t=106 the sample of t=100 is 6 s old, t=102 only 4: rates over 106-100 = 6 s.
    got = rates.update(snap(106.0, 40, 2, 8))
    assert got["rates"]["completed_per_s"] == 40 / 6
    assert got["rates"]["arrived_per_s"] == (40 + 2) / 6  # answered + still waiting
    assert got["consumers"][0]["batches_per_s"] == 8 / 6
    # At t=108: t=102 is now the newest sample at least 5 s old.
    got = rates.update(snap(108.0, 50, 0, 10))
    assert got["rates"]["interval_s"] == 6.0 and got["rates"]["completed_per_s"] == 40 / 6


def test_a_user_confined_to_its_queue_registers_it(redis_server, queue, start_consumer):
    from test_security import acl_rule

    admin = redis_server.client()
    rule = acl_rule(f"~{{bg:{queue}}}:*")  # the documented one-queue rule: no other key
    admin.execute_command("ACL", "SETUSER", "no-registry", "reset", *rule)
    url = f"redis://no-registry:s3cret-pw@127.0.0.1:{redis_server.port}/0"
    consumer = start_consumer(url, queue, "--model", "consumer.models:synthetic",
                              "--model-arg", "base_ms=1")
    with Producer(url, queue) as producer:
        assert producer.submit({"i": 1}).result(timeout=15) == {"i": 1}
        with pytest.raises(Exception, match="synthetic failure"):
            producer.submit({"fail": True}).result(timeout=15)
    assert known_queues(admin) == [queue]  # its mark is one of its own keys
    # The consumer's own figures are still published (its info hash, its failures).
    wait_for(lambda: queue_snapshot(admin, queue)["recent_failures"], 10, "the failure")
    assert queue_snapshot(admin, queue)["consumers"][0]["host"]
    assert consumer.proc.poll() is None and "Traceback" not in consumer.output()


def test_a_lean_snapshot_skips_the_lists(redis_server, queue):
    """What an exporter polling often asks for: the figures without the listings."""
    client = redis_server.client()
    with Producer(redis_server.url, queue) as producer:
        producer.submit(1)
    client.lpush(QueueKeys(queue).failures, b'{"id": "x"}')
    full, lean = queue_snapshot(client, queue), queue_snapshot(client, queue, 0, 0)
    assert full["recent_failures"] == [{"id": "x"}] and lean["recent_failures"] == []
    assert lean["dead"] == {"total": 0, "shown": []} and lean["depth"] == full["depth"]
    # An adaptive delay (max_queue_delay_ms=auto) shows where the queue's stats hold one.
    assert full["adaptive_delay"] == {}
    client.hset(QueueKeys(queue).stats, "adaptive_delay_us", 1234)
    assert queue_snapshot(client, queue)["adaptive_delay"] == {"adaptive_delay_us": 1234}


def test_top_fits_100_by_40_with_5_queues_busy_first(redis_server, start_consumer):
    """Five queues, four of them served, one idle, one with a failure: top's frame fits
    a 100 x 40 terminal, busy queues first; in a shorter one the consumers are cut with a
    line saying how many more."""
    from rich.console import Console

    from batchgate.top import render

    client = redis_server.client()
    names = ["a-idle", "b-waiting", "c-served", "d-served", "e-embeddings"]
    register_queue(client, names[0])
    for name in names[2:]:
        start_consumer(redis_server.url, name, "--model", "consumer.models:synthetic",
                       "--model-arg", "base_ms=5", "--max-batch-size", "4")
    start_consumer(redis_server.url, names[2], "--model", "consumer.models:noop")
    with Producer(redis_server.url, names[1]) as producer:
        producer.submit_many([{"i": i} for i in range(5)])  # nobody serves it: it waits
    for name in names[2:]:
        with Producer(redis_server.url, name) as producer:
            assert all(h.result(timeout=30) for h in producer.submit_many(
                [{"i": i} for i in range(9)]))
    with Producer(redis_server.url, names[3]) as producer, \
            pytest.raises(Exception, match="synthetic failure"):
        producer.submit({"fail": True}).result(timeout=30)
    wait_for(lambda: queue_snapshot(client, names[3])["recent_failures"], 10, "the failure")
    rates = Rates()
    snaps = [rates.update(queue_snapshot(client, name)) for name in names]

    def frame(height: int | None) -> list[str]:
        console = Console(width=100, height=40, record=True, file=io.StringIO())
        console.print(render([dict(s) for s in snaps], height))
        return console.export_text().splitlines()

    lines = frame(40)
    assert len(lines) <= 40 and max(len(line) for line in lines) <= 100, "\n".join(lines)
    # Requests wait on b-waiting only: it comes first, then the idle ones by name.
    assert [line.split()[0] for line in lines[1:6]] == [names[1], names[0], *names[2:]]
    assert any(line.split()[:2] == ["queue", "consumer"] for line in lines)
    assert any("synthetic failure" in line for line in lines), "\n".join(lines)
    short = frame(18)
    assert len(short) <= 18, "\n".join(short)
    assert re.search(r"\.\.\. and \d+ more consumers", "\n".join(short)), "\n".join(short)


def test_the_auto_delay_in_use_reads_the_same_in_stats_top_dashboard_and_exporter(
        redis_server, queue):
    """Under max_queue_delay_ms=auto, the delay the consumers derived (63 ms here, as a
    consumer publishes it in {bg:q}:stats about once a second), not the stored fixed one
    (50 ms), with its target: worded by one function in `stats`, `top` and the dashboard,
    and a gauge with a delay_mode label in the exporter."""
    from fastapi.testclient import TestClient
    from prometheus_client import generate_latest
    from rich.console import Console

    from batchgate.dashboard.app import create_app
    from batchgate.exporter import ExporterConfig, build_registry
    from batchgate.top import render
    from scheduler_core.auto_delay import STATS_AT_US, STATS_DELAY_US

    client = redis_server.client()
    done = CliRunner().invoke(cli, ["policy", "set", "--redis-url", redis_server.url,
                                    "--queue", queue, "--max-queue-delay-ms", "auto",
                                    "--slo-p99-ms", "100"])
    assert done.exit_code == 0, done.output

    def publish() -> None:  # what a live consumer's DelayKeeper writes
        now_s, now_us = client.time()
        client.hset(QueueKeys(queue).stats, mapping={
            STATS_DELAY_US: 63_000, STATS_AT_US: now_s * 1_000_000 + now_us})

    wording = "auto → 63 ms, SLO 100 ms"
    publish()
    stats = CliRunner().invoke(cli, ["stats", "--redis-url", redis_server.url, "--queue",
                                     queue])
    assert f"delay in use     {wording}\n" in stats.output, stats.output
    assert "max_queue_delay_ms=auto (→ 63 ms, SLO 100 ms)" in stats.output

    publish()
    console = Console(width=100, record=True, file=io.StringIO())
    console.print(render([Rates().update(queue_snapshot(client, queue))]))
    assert wording in console.export_text(), console.export_text()

    publish()
    with TestClient(create_app(client, only=[queue])) as page:
        html = page.get("/").text
    served = orjson.loads(re.search(r'<script id="snapshot" type="application/json">'
                                    r"(.*?)</script>", html).group(1))
    [snap] = served["queues"]
    assert snap["delay_text"] == wording
    assert "max_queue_delay_ms=auto (→ 63 ms, SLO 100 ms)" in snap["policy_text"]

    publish()
    metrics = generate_latest(build_registry(client, ExporterConfig((queue,)))).decode()
    assert (f'batchgate_queue_max_queue_delay_seconds_in_use{{delay_mode="auto",'
            f'queue="{queue}"}} 0.063') in metrics, metrics
    # No consumer derived one lately: said so, not a stale or a made-up figure.
    client.hset(QueueKeys(queue).stats, STATS_AT_US, 0)
    stats = CliRunner().invoke(cli, ["stats", "--redis-url", redis_server.url, "--queue",
                                     queue])
    assert "delay in use     auto → not derived yet (no live consumer), SLO 100 ms" in \
        stats.output, stats.output
    metrics = generate_latest(build_registry(client, ExporterConfig((queue,)))).decode()
    assert "batchgate_queue_max_queue_delay_seconds_in_use{" not in metrics
