"""Retries of the exceptions a model raises (policy retry_on, retry_max, retry_backoff_ms,
retry_backoff_max_ms, retry_jitter; docs/failure-modes.md, "Retries"): against a real
Redis, with the in-process consumer, and one real `batchgate consumer` killed with
SIGKILL between two runs."""

from __future__ import annotations

import signal
import threading
import time
from collections import defaultdict

import orjson
import pytest
from click.testing import CliRunner
from helpers.failure_support import CountingProducer, executions, start, wait_for
from prometheus_client import CollectorRegistry

from batchgate.cli import main as cli
from producer import Producer
from scheduler_core.admin import read_policy
from scheduler_core.deadletter import list_dead
from scheduler_core.errors import (
    DeadlineExceeded,
    InvalidPolicy,
    RequestCancelled,
    RequestFailed,
)
from scheduler_core.keys import QueueKeys
from scheduler_core.ops.stats import queue_stats
from scheduler_core.policy import Policy

IDLE_BLOCK_S = 1.0  # consumer/worker.py: an idle consumer pops at least this often
# A consumer reads the stored policy every min(lease_ms / 3, 1 s) (consumer/lease.py).
POLICY_FOLLOW_S = 1.0
SLACK_S = 5.0  # a loaded test machine's scheduling, on top of the configured delays


class Scripted:
    """A model whose run n of a payload {"i": i, ...} raises `errors[i][n - 1]` (an
    exception instance) while there is one, else echoes; it records each run's time."""

    def __init__(self, errors: dict[int, list[BaseException]] | None = None,
                 forever: BaseException | None = None):
        self.errors = errors or {}
        self.forever = forever
        self.runs: dict[int, list[float]] = defaultdict(list)
        self.lock = threading.Lock()

    def __call__(self, payloads):
        out = []
        for p in payloads:
            with self.lock:
                self.runs[p["i"]].append(time.monotonic())
                n = len(self.runs[p["i"]])
            if p.get("forever") and self.forever is not None:
                raise type(self.forever)(f"{self.forever} (run {n})")
            script = self.errors.get(p["i"], [])
            if n <= len(script):
                raise script[n - 1]
            out.append({"i": p["i"], "run": n})
        return out


def consumer_for(inprocess_consumer, server, queue, model, **policy):
    settings = {"strategy": "fifo", "retry_backoff_ms": 50, **policy}
    return inprocess_consumer(model, redis_url=server.url, queue=queue, **settings)


def retry_listed(client, queue):
    """Wait until one request waits out its backoff in the retry set."""
    wait_for(lambda: client.zcard(QueueKeys(queue).retry) == 1, what="a retry listed")


def policy_set(server, queue, *flags):
    done = CliRunner().invoke(cli, ["policy", "set", "--redis-url", server.url, "--queue",
                                    queue, *flags])
    assert done.exit_code == 0, done.output


def metric(registry, outcome):
    return registry.get_sample_value("batchgate_consumer_requests_total",
                                     {"queue": registry.queue, "outcome": outcome}) or 0


def test_fails_twice_then_succeeds_answers_once_with_the_result(shared_redis, queue,
                                                                inprocess_consumer):
    model = Scripted({0: [TimeoutError("slow"), ConnectionError("reset")]})
    registry = CollectorRegistry()
    registry.queue = queue
    consumer_for(inprocess_consumer, shared_redis, queue, model, metrics_registry=registry,
                 retry_on="TimeoutError,ConnectionError", retry_max=3)
    with CountingProducer(shared_redis.url, queue) as p:
        handle = p.submit({"i": 0})
        assert handle.result(timeout=15) == {"i": 0, "run": 3}
        assert p.delivered_once([handle])
    s = queue_stats(shared_redis.client(), queue)
    assert (s.processed, s.failed, s.retried, s.retrying, s.dead_letters) == (1, 0, 2, 0, 0)
    assert (metric(registry, "retry"), metric(registry, "ok")) == (2, 1)


def test_a_base_class_in_retry_on_matches_its_subclasses(shared_redis, queue,
                                                          inprocess_consumer):
    """ConnectionResetError is an OSError: retry_on=OSError retries it."""
    model = Scripted({0: [ConnectionResetError("reset")]})
    consumer_for(inprocess_consumer, shared_redis, queue, model, retry_on="OSError",
                 retry_max=2)
    with Producer(shared_redis.url, queue) as p:
        assert p.submit({"i": 0}).result(timeout=15) == {"i": 0, "run": 2}


def test_a_non_retryable_exception_fails_at_once(shared_redis, queue, inprocess_consumer):
    model = Scripted({0: [ValueError("bad input"), ValueError("never reached")]})
    consumer_for(inprocess_consumer, shared_redis, queue, model, retry_on="TimeoutError",
                 retry_max=3)
    with Producer(shared_redis.url, queue) as p, \
            pytest.raises(RequestFailed, match="bad input") as info:
        p.submit({"i": 0}).result(timeout=15)
    assert info.value.error_type == "ValueError"
    assert len(model.runs[0]) == 1
    s = queue_stats(shared_redis.client(), queue)
    assert (s.failed, s.retried, s.dead_letters) == (1, 0, 0)


def test_exhausted_retries_fail_with_the_last_error_and_dead_letter_each_attempt(
        shared_redis, queue, inprocess_consumer):
    model = Scripted(forever=TimeoutError("upstream timed out"))
    registry = CollectorRegistry()
    registry.queue = queue
    consumer_for(inprocess_consumer, shared_redis, queue, model, metrics_registry=registry,
                 retry_on="*", retry_max=3)
    with CountingProducer(shared_redis.url, queue) as p:
        handle = p.submit({"i": 0, "forever": True})
        with pytest.raises(RequestFailed, match=r"upstream timed out \(run 3\)") as info:
            handle.result(timeout=15)
        assert p.delivered_once([handle])
    assert info.value.error_type == "TimeoutError"
    assert len(model.runs[0]) == 3
    total, dead = list_dead(shared_redis.client(), queue)
    assert total == 1
    assert (dead[0].id, dead[0].error_type, dead[0].attempts) == (handle.id, "TimeoutError", 3)
    assert dead[0].runs == [{"attempt": n, "type": "TimeoutError",
                             "message": f"upstream timed out (run {n})"} for n in (1, 2, 3)]
    listed = CliRunner().invoke(cli, ["dead-letter", "list", "--redis-url", shared_redis.url,
                                      "--queue", queue])
    assert "    run 2: TimeoutError: upstream timed out (run 2)" in listed.output
    # Each run's error, in the consumer's failure list (written by its lease thread).
    failures_key = QueueKeys(queue).failures

    def attempts_listed():
        listed = [orjson.loads(x) for x in shared_redis.client().lrange(failures_key, 0, -1)]
        return sorted((f["attempt"], f["message"]) for f in listed if f["id"] == handle.id)
    assert wait_for(lambda: len(attempts_listed()) == 3, what="three failures listed")
    assert attempts_listed() == [(n, f"upstream timed out (run {n})") for n in (1, 2, 3)]
    assert (metric(registry, "retry"), metric(registry, "dead_letter")) == (2, 1)
    s = queue_stats(shared_redis.client(), queue)
    assert (s.processed, s.failed, s.retried) == (0, 1, 2)


def test_a_request_raising_forever_does_not_hold_up_its_batch_mates(
        shared_redis, queue, inprocess_consumer):
    model = Scripted(forever=RuntimeError("broken"))
    consumer_for(inprocess_consumer, shared_redis, queue, model, strategy="dynamic",
                 max_batch_size=8, max_queue_delay_ms=100, retry_on="*", retry_max=5,
                 retry_backoff_ms=20)
    with CountingProducer(shared_redis.url, queue) as p:
        handles = p.submit_many([{"i": i, "forever": i == 3} for i in range(8)])
        for i, h in enumerate(handles):
            if i == 3:
                with pytest.raises(RequestFailed, match="broken"):
                    h.result(timeout=15)
            else:
                assert h.result(timeout=15)["i"] == i
        assert p.delivered_once(handles)
    # Its first delivery bisects the batch of 8 (8, 4, 2, 1: 4 runs); each of the 4
    # retries runs it alone (5 runs in all: over max_attempts, 3, which bounds crashes);
    # its batch-mates ran within the first delivery only.
    assert len(model.runs[3]) == 4 + 4
    assert all(1 <= len(model.runs[i]) <= 4 for i in range(8) if i != 3)


@pytest.mark.parametrize("jitter", [0, 1])
def test_backoff_is_respected(shared_redis, queue, inprocess_consumer, jitter):
    """Run n+1 starts no earlier than the backoff after run n ended: 300 ms, then 600 ms
    (doubled), capped at 700 ms; under jitter, at least half of each."""
    model = Scripted({0: [TimeoutError("a"), TimeoutError("b"), TimeoutError("c")]})
    consumer_for(inprocess_consumer, shared_redis, queue, model, retry_on="TimeoutError",
                 retry_max=4, retry_backoff_ms=300, retry_backoff_max_ms=700,
                 retry_jitter=jitter)
    with Producer(shared_redis.url, queue) as p:
        assert p.submit({"i": 0}).result(timeout=30) == {"i": 0, "run": 4}
    runs = model.runs[0]
    gaps = [b - a for a, b in zip(runs, runs[1:], strict=False)]
    backoffs = [0.3, 0.6, 0.7]
    low = 0.5 if jitter else 1.0
    for gap, backoff in zip(gaps, backoffs, strict=True):
        assert backoff * low <= gap <= backoff + IDLE_BLOCK_S + SLACK_S, gaps


def test_deadline_is_honoured_while_waiting_for_a_retry(shared_redis, queue,
                                                        inprocess_consumer):
    """The backoff (5 s) outlasts the deadline (1 s): DeadlineExceeded at the deadline,
    and the request never runs again."""
    model = Scripted({0: [TimeoutError("slow")] * 3})
    consumer_for(inprocess_consumer, shared_redis, queue, model, retry_on="TimeoutError",
                 retry_max=3, retry_backoff_ms=5_000)
    with Producer(shared_redis.url, queue) as p:
        sent = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            p.submit({"i": 0}, deadline_ms=1_000).result(timeout=15)
        assert time.monotonic() - sent < 1.0 + SLACK_S - 1  # well before the 5 s backoff
    time.sleep(0.5)
    assert len(model.runs[0]) == 1
    assert shared_redis.client().zcard(QueueKeys(queue).retry) == 0


def test_the_sweep_expires_a_retry_at_its_deadline_without_its_producer(
        shared_redis, queue, inprocess_consumer):
    """The producer that set the deadline is gone (no timer of its own): the consumers'
    pop moves the request back at its deadline and answers it DeadlineExceeded."""
    model = Scripted({0: [TimeoutError("slow")] * 3})
    consumer_for(inprocess_consumer, shared_redis, queue, model, retry_on="TimeoutError",
                 retry_max=3, retry_backoff_ms=60_000)
    client = shared_redis.client()
    with Producer(shared_redis.url, queue) as p:
        handle = p.submit({"i": 0}, deadline_ms=1_500, store_result=True)
        retry_listed(client, queue)
    result = wait_for(lambda: Producer(shared_redis.url, queue).fetch(handle.id),
                      timeout=1.5 + IDLE_BLOCK_S + SLACK_S, what="the deadline's answer")
    assert result.error_type == "DeadlineExceeded"
    assert len(model.runs[0]) == 1


def test_cancel_during_the_backoff(shared_redis, queue, inprocess_consumer):
    model = Scripted({0: [TimeoutError("slow")]})
    consumer_for(inprocess_consumer, shared_redis, queue, model, retry_on="TimeoutError",
                 retry_max=3, retry_backoff_ms=1_500)
    client = shared_redis.client()
    with Producer(shared_redis.url, queue) as p:
        handle = p.submit({"i": 0})
        retry_listed(client, queue)
        assert handle.cancel() == "cancelled"
        with pytest.raises(RequestCancelled):
            handle.result(timeout=5)
        time.sleep(1.5 + IDLE_BLOCK_S)  # past the backoff: it must not run again
    assert len(model.runs[0]) == 1
    assert client.zcard(QueueKeys(queue).retry) == 0
    assert client.hlen(QueueKeys(queue).jobs) == 0


def test_a_policy_change_during_the_backoff_applies_to_the_next_run(
        shared_redis, queue, inprocess_consumer):
    """retry_on cleared while the request waits (a wait longer than the consumer takes
    to follow a policy change): its next failure is final, at once."""
    model = Scripted({0: [TimeoutError("first"), TimeoutError("second"),
                          TimeoutError("third")]})
    consumer_for(inprocess_consumer, shared_redis, queue, model, retry_on="TimeoutError",
                 retry_max=4, retry_backoff_ms=int(3 * POLICY_FOLLOW_S * 1000))
    client = shared_redis.client()
    with Producer(shared_redis.url, queue) as p:
        handle = p.submit({"i": 0})
        retry_listed(client, queue)
        policy_set(shared_redis, queue, "--retry-on", "")
        with pytest.raises(RequestFailed, match="second") as info:
            handle.result(timeout=15)
    assert info.value.error_type == "TimeoutError"
    assert len(model.runs[0]) == 2
    assert list_dead(client, queue)[0] == 0  # a plain failure: not retried, not dead


@pytest.mark.parametrize(("field", "value", "named"), [
    ("retry_on", "Timeout Error", "retry_on"),
    ("retry_on", "TimeoutError;OSError", "retry_on"),
    ("retry_on", "x" * 65, "retry_on"),
    ("retry_on", 3, "retry_on"),
    ("retry_max", 0, "retry_max"),
    ("retry_max", 101, "retry_max"),
    ("retry_backoff_ms", -1, "retry_backoff_ms"),
    ("retry_backoff_max_ms", 86_400_001, "retry_backoff_max_ms"),
    ("retry_jitter", 2, "retry_jitter"),
])
def test_bad_retry_settings_are_refused_naming_the_field(field, value, named):
    with pytest.raises(InvalidPolicy) as info:
        Policy.build(**{field: value})
    assert info.value.field == named


def test_policy_set_refuses_garbage_and_writes_nothing(shared_redis, queue):
    runner = CliRunner()
    ok = runner.invoke(cli, ["policy", "set", "--redis-url", shared_redis.url, "--queue",
                             queue, "--retry-on", " TimeoutError , OSError,TimeoutError",
                             "--retry-max", "3"])
    assert ok.exit_code == 0, ok.output
    stored = read_policy(shared_redis.client(), queue)
    assert (stored.retry_on, stored.retry_max) == ("TimeoutError,OSError", 3)
    for args, named in [(["--retry-on", "a b"], "retry_on"),
                        (["--retry-max", "101"], "retry_max"),
                        (["--retry-backoff-ms", "-5"], "retry_backoff_ms")]:
        bad = runner.invoke(cli, ["policy", "set", "--redis-url", shared_redis.url,
                                  "--queue", queue, *args])
        assert bad.exit_code != 0 and named in bad.output, bad.output
    assert read_policy(shared_redis.client(), queue) == stored


def test_backoff_grows_and_is_capped():
    policy = Policy.build(max_attempts=10, retry_max=10, retry_backoff_ms=100,
                          retry_backoff_max_ms=1_000)
    assert [policy.retry_backoff(n) for n in range(1, 7)] == [100, 200, 400, 800, 1000, 1000]
    jittered = Policy.build(retry_backoff_ms=100, retry_jitter=1)
    assert (jittered.retry_backoff(1, 0.0), jittered.retry_backoff(1, 1.0)) == (50, 100)


def test_sigkill_between_attempts_loses_nothing(redis_server, queue, start_consumer,
                                                tmp_path):
    """A `batchgate consumer` runs the request once (it raises), then is killed with
    SIGKILL while the request waits out its backoff: another consumer runs it again and
    its producer gets the result, once."""
    retry_flags = ["--strategy", "fifo", "--retry-on", "TimeoutError", "--retry-max", "3",
                   "--retry-backoff-ms", "2000"]
    first = start(start_consumer, redis_server.url, queue, "Flaky", *retry_flags,
                  log=tmp_path)
    client = redis_server.client()
    with CountingProducer(redis_server.url, queue) as p:
        handle = p.submit({"i": 7, "fail": 1})
        retry_listed(client, queue)
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(timeout=10)
        assert executions(tmp_path)["7"] == 1
        start(start_consumer, redis_server.url, queue, "Flaky", *retry_flags, log=tmp_path)
        assert handle.result(timeout=2 + 30)["echo"] == {"i": 7, "fail": 1}
        assert p.delivered_once([handle])
    assert executions(tmp_path)["7"] == 2
    s = queue_stats(client, queue)
    assert (s.processed, s.failed, s.retried, s.retrying) == (1, 0, 1, 0)


def test_retry_max_lowered_below_the_runs_made_dead_letters_at_the_next_pop(
        shared_redis, queue, inprocess_consumer):
    """3 runs made (max_attempts 3, retry_max 5), then retry_max set to 2 while it waits:
    its deliveries are used up; it is dead-lettered without a 4th run, and the message
    says retries count."""
    model = Scripted(forever=TimeoutError("slow"))
    consumer_for(inprocess_consumer, shared_redis, queue, model, retry_on="TimeoutError",
                 retry_max=5, retry_backoff_ms=300, retry_backoff_max_ms=3_000)
    client = shared_redis.client()
    with Producer(shared_redis.url, queue) as p:
        handle = p.submit({"i": 0, "forever": True})
        wait_for(lambda: len(model.runs[0]) == 3 and client.zcard(QueueKeys(queue).retry),
                 what="three runs, the fourth waiting")
        policy_set(shared_redis, queue, "--retry-max", "2")
        with pytest.raises(RequestFailed, match="retry_on exception") as info:
            handle.result(timeout=15)
    assert info.value.error_type == "DeadLettered"
    assert len(model.runs[0]) == 3


def test_zero_backoff_forever_ends_after_retry_max_runs(shared_redis, queue,
                                                       inprocess_consumer):
    model = Scripted(forever=RuntimeError("always"))
    consumer_for(inprocess_consumer, shared_redis, queue, model, retry_on="*",
                 retry_max=100, retry_backoff_ms=0)
    with Producer(shared_redis.url, queue) as p:
        with pytest.raises(RequestFailed, match=r"always \(run 100\)"):
            p.submit({"i": 0, "forever": True}).result(timeout=60)
        assert p.submit({"i": 1}).result(timeout=15) == {"i": 1, "run": 1}
    assert len(model.runs[0]) == 100
    s = queue_stats(shared_redis.client(), queue)
    assert (s.retried, s.dead_letters, s.retrying) == (99, 1, 0)


def test_a_dead_letter_retried_lists_only_its_new_runs(shared_redis, queue,
                                                      inprocess_consumer):
    model = Scripted(forever=TimeoutError("down"))
    consumer_for(inprocess_consumer, shared_redis, queue, model, retry_on="*", retry_max=3)
    client = shared_redis.client()
    with Producer(shared_redis.url, queue) as p:
        with pytest.raises(RequestFailed, match=r"\(run 3\)"):
            p.submit({"i": 0, "forever": True}, store_result=True).result(timeout=15)
        (request_id,) = [e.id for e in list_dead(client, queue)[1]]
        done = CliRunner().invoke(cli, ["dead-letter", "retry", "--redis-url",
                                        shared_redis.url, "--queue", queue, request_id])
        assert done.exit_code == 0, done.output
        wait_for(lambda: len(model.runs[0]) == 6 and list_dead(client, queue)[0] == 1,
                 what="dead-lettered again")
    (dead,) = list_dead(client, queue)[1]
    assert dead.id == request_id
    assert [(r["attempt"], r["message"]) for r in dead.runs] == [
        (n, f"down (run {n + 3})") for n in (1, 2, 3)]


def test_a_tenants_counters_come_back_to_zero_through_its_retries(shared_redis, queue,
                                                                   inprocess_consumer):
    """A retried request leaves in flight for the retry set and comes back to waiting:
    its tenant's waiting and in-flight gauges follow it, so they are 0 (removed) once it
    is answered, and max_waiting counts it right all along."""
    model = Scripted({0: [TimeoutError("slow"), TimeoutError("slow again")]})
    consumer_for(inprocess_consumer, shared_redis, queue, model, retry_on="TimeoutError",
                 retry_max=3, retry_backoff_ms=0)
    with Producer(shared_redis.url, queue) as p:
        assert p.submit({"i": 0}, tenant="acme").result(timeout=15) == {"i": 0, "run": 3}
    counters = shared_redis.client().hgetall(QueueKeys(queue).tenants)
    assert b"w:acme" not in counters and b"f:acme" not in counters, counters
    assert counters[b"s:acme"] == b"1"
