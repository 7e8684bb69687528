"""Hardening of the producer side (docs/guarantees.md): requests Redis lost fail their
handles with RequestLost instead of being waited on forever, an idempotency key whose
request is gone is free again, and names with a trailing newline are refused. Real
redis-server processes; a consumer as a `batchgate consumer` process where the test reads
its output, in the test process (the Consumer API) otherwise."""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time

import orjson
import pytest
from helpers.processes import BATCHGATE
from helpers.support import configure, wait_for

from producer import AsyncProducer, Producer, RequestFailed, RequestLost
from producer.base import LOST_CHECK_AFTER_S, POLL_S
from producer.bulk.engine import BulkSpec, run_bulk
from producer.bulk.state import check_job_id
from scheduler_core import errors
from scheduler_core.errors import InvalidRequest
from scheduler_core.keys import QueueKeys
from scheduler_core.wire import LOST

# A handle is checked at its polls from LOST_CHECK_AFTER_S of age on; polls come at
# doubling ages (1, 2, 4 s ...), and the listener sweeps every POLL_S (its blocking pop
# waits up to POLL_S more). A loss at age a is seen by age 2 * max(a, LOST_CHECK_AFTER_S).
SLACK_S = 10.0


def lost_within(age_at_loss: float) -> float:
    return 2 * max(age_at_loss, LOST_CHECK_AFTER_S) + 2 * POLL_S + SLACK_S


def test_request_lost_is_exported_as_a_request_failure():
    assert errors.RequestLost is RequestLost
    assert issubclass(RequestLost, RequestFailed)


def test_handles_of_requests_lost_in_a_restart_fail_with_request_lost(redis_server, queue):
    """Redis restarted without persistence: 40 sync and 40 async handles waiting without
    a timeout each end with RequestLost, in the time the poll schedule allows."""
    with Producer(redis_server.url, queue) as sync_producer:
        sync_handles = sync_producer.submit_many([{"i": i} for i in range(40)])

        async def run_async() -> list[BaseException | object]:
            async with AsyncProducer(redis_server.url, queue) as producer:
                handles = await producer.submit_many([{"i": i} for i in range(40)])
                await asyncio.to_thread(redis_server.restart)
                return await asyncio.wait_for(
                    asyncio.gather(*(h.result() for h in handles), return_exceptions=True),
                    lost_within(1.0))

        async_outcomes = asyncio.run(run_async())
        assert all(isinstance(o, RequestLost) for o in async_outcomes), async_outcomes[:3]
        assert len(list(Producer.as_completed(sync_handles, timeout=lost_within(5.0)))) == 40
        for handle in sync_handles:
            with pytest.raises(RequestLost, match="Redis no longer knows it") as info:
                handle.result(timeout=0)
            assert info.value.error_type == LOST
            assert info.value.request_id == handle.id
        # Redis is back and empty: the producer goes on submitting.
        assert sync_producer.submit({"after": True}).id


def test_cancel_of_a_lost_request_says_lost(redis_server, queue):
    with Producer(redis_server.url, queue) as producer:
        handle = producer.submit("gone")
        redis_server.restart()
        assert handle.cancel() == "lost"
        with pytest.raises(RequestLost):
            handle.result(timeout=0)

        async def run_async() -> None:
            async with AsyncProducer(redis_server.url, queue) as aproducer:
                ahandle = await aproducer.submit("gone too")
                redis_server.client().flushall()
                assert await ahandle.cancel() == "lost"
                with pytest.raises(RequestLost):
                    await ahandle.result(timeout=0)
        asyncio.run(run_async())


def test_flushall_fails_waiting_and_running_requests_and_the_consumer_says_why(
        redis_server, queue, start_consumer):
    """FLUSHALL while one request runs and others wait: every handle ends with
    RequestLost, and the consumer's refused completion says the requests no longer exist
    rather than that another consumer answers them."""
    consumer = start_consumer(redis_server.url, queue, "--model", "consumer.models:synthetic",
                              "--model-arg", "base_ms=2000", "--strategy", "fifo",
                              "--lease-ms", "10000", "--no-overlap")
    keys = QueueKeys(queue)
    with Producer(redis_server.url, queue) as producer:
        handles = producer.submit_many([{"i": i} for i in range(5)])
        client = redis_server.client()
        wait_for(lambda: client.hlen(keys.owner), 10, "a request in flight")
        client.flushall()
        assert len(list(Producer.as_completed(handles, timeout=lost_within(1.0)))) == 5
        for handle in handles:
            with pytest.raises(RequestLost):
                handle.result(timeout=0)
        wait_for(lambda: "no longer exist" in consumer.output(), 15, "the consumer's log")
        assert "another consumer answers it" not in consumer.output()
        # The consumer stored its policy again and serves new requests.
        assert producer.submit("fresh").result(timeout=15) == "fresh"


def test_a_request_still_known_is_not_taken_for_lost(redis_server, queue, inprocess_consumer):
    """Requests that wait, run or finish for longer than the check's age are answered
    normally, never RequestLost."""
    inprocess_consumer("consumer.models:synthetic", redis_url=redis_server.url, queue=queue,
                       model_args={"base_ms": 1500}, strategy="fifo")
    with Producer(redis_server.url, queue) as producer:
        handles = producer.submit_many([{"i": i} for i in range(4)])  # ~6 s one by one
        assert [h.result(timeout=30) for h in handles] == [{"i": i} for i in range(4)]


def test_results_waiting_unread_in_the_inbox_are_not_taken_for_lost(redis_server, queue,
                                                                     inprocess_consumer):
    """Results not stored by id exist only in the inbox: while some wait there unread (a
    listener slower than the consumers), the handles past the lost check's age are not
    failed with RequestLost, they are answered."""
    inprocess_consumer("consumer.models:noop", redis_url=redis_server.url, queue=queue,
                       strategy="dynamic", max_batch_size=64)
    n = 1200

    def slow(_result) -> None:  # the listener delivers ~4 ms per result: ~5 s in all
        time.sleep(0.004)

    with Producer(redis_server.url, queue, on_result=slow) as producer:
        handles = producer.submit_many([{"i": i} for i in range(n)])
        outcomes = []
        for h in handles:
            try:
                outcomes.append(h.result(timeout=60))
            except RequestFailed as exc:
                outcomes.append(exc)
    assert outcomes == [{"i": i} for i in range(n)], \
        [o for o in outcomes if isinstance(o, Exception)][:3]


def test_a_bulk_job_submits_its_lost_requests_again(redis_server, queue, inprocess_consumer,
                                                   tmp_path, caplog):
    """The queue's keys vanish while a bulk job's window waits (no consumer yet): the lines'
    handles fail with RequestLost and the job submits them again, it does not record
    them as failed."""
    lines = 8
    (tmp_path / "in.jsonl").write_bytes(b"".join(orjson.dumps({"i": i}) + b"\n"
                                                 for i in range(1, lines + 1)))
    spec = BulkSpec(job_id=f"lost-{queue}", input=str(tmp_path / "in.jsonl"),
                    output=str(tmp_path / "out.jsonl"), redis_url=redis_server.url,
                    queue=queue, window=4, lease_s=5)
    client = redis_server.client()
    keys = QueueKeys(queue)
    outcome: list = []
    job = threading.Thread(target=lambda: outcome.append(run_bulk(spec)))
    job.start()
    try:
        wait_for(lambda: client.zcard(keys.pending_low) == 4, 15, "the window queued")
        client.delete(*client.scan_iter(match=keys.tag.replace("{", "\\{")
                                         .replace("}", "\\}") + "*"))
        # The job waits on its lines in order: the first is found gone and submitted
        # again; the producer finds the others lost meanwhile.
        wait_for(lambda: "no longer exist in Redis" in caplog.text, lost_within(1.0),
                 "the producer finding the requests lost")
        inprocess_consumer("consumer.models:noop", redis_url=redis_server.url, queue=queue)
    finally:
        job.join(60)
    final = outcome[0]
    assert (final.state, final.done, final.errors) == ("done", lines, 0)
    records = [orjson.loads(x) for x in (tmp_path / "out.jsonl").read_bytes().splitlines()]
    assert [r["result"]["i"] for r in records] == list(range(1, lines + 1))


def test_an_idempotency_key_whose_result_expired_runs_again(redis_server, queue,
                                                           inprocess_consumer):
    configure(redis_server.url, queue, result_ttl_s=1)
    inprocess_consumer("consumer.models:noop", redis_url=redis_server.url, queue=queue)
    client = redis_server.client()
    keys = QueueKeys(queue)
    with Producer(redis_server.url, queue) as producer:
        first = producer.submit({"n": 1}, idempotency_key="order-1")
        first.result(timeout=10)
        again = producer.submit({"n": 1}, idempotency_key="order-1")
        assert again.id == first.id  # the result is still there: found, not re-run
        wait_for(lambda: not client.exists(keys.result(first.id)), 10, "the result expiring")
        assert client.get(keys.idempotency("order-1")) == first.id.encode()  # key outlives it
        rerun = producer.submit({"n": 1}, idempotency_key="order-1")
        assert rerun.id != first.id
        rerun.result(timeout=10)  # it ran again, not TimeoutError
        assert client.get(keys.idempotency("order-1")) == rerun.id.encode()
        # A key naming a request Redis never had (or lost) is free as well.
        client.set(keys.idempotency("order-2"), "f" * 32)
        assert producer.submit(2, idempotency_key="order-2").id != "f" * 32


def test_names_with_a_trailing_newline_are_refused(shared_redis, queue):
    client = shared_redis.client()

    def written() -> list[bytes]:  # keys of these names (other tests share this Redis)
        return [k for pattern in ("*gw\n*", "*q\n*", f"*{queue}*")
                for k in client.scan_iter(match=pattern)]

    for name in ("gw\n", "q\n"):
        with pytest.raises(InvalidRequest) as info:
            QueueKeys(name)
        assert info.value.field == "queue"
        with pytest.raises(InvalidRequest):
            Producer(shared_redis.url, name)
    with Producer(shared_redis.url, queue) as producer:
        with pytest.raises(InvalidRequest) as info:
            producer.submit(1, idempotency_key="k1\n")
        assert info.value.field == "idempotency_key"
    assert written() == []  # nothing written
    with pytest.raises(InvalidRequest) as info:
        check_job_id("job\n")
    assert info.value.field == "job_id"
    submitted = subprocess.run([BATCHGATE, "submit", "--redis-url", shared_redis.url,
                                "--queue", "gw\n", "--no-wait", "1"], capture_output=True,
                               text=True, timeout=30)
    assert submitted.returncode == 2 and "queue" in submitted.stderr
    assert written() == []
