"""Smaller promises of docs/producer.md and docs/guarantees.md, each on a real Redis: QueueFull
without a retry hint when nothing completed, `unix://` URLs, idempotency keys expiring
after idempotency_ttl_s, the 10,000-request cap of submit_many, dead-letter retry/purge
beyond the script's 1,000 ids per call, pruning of hour-silent consumers, and an enqueue
resent while its request runs."""

from __future__ import annotations

import asyncio
import json
import logging
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers.failure_support import CountingProducer, executions, serve
from helpers.processes import RedisServer
from helpers.support import configure, queue_pattern, snapshot, wait_for

from batchgate.cli import main as cli
from producer import AsyncProducer, InvalidRequest, Producer, QueueFull
from scheduler_core.connection import Backoff, Outage
from scheduler_core.deadletter import MAX_IDS_PER_CALL
from scheduler_core.keys import QueueKeys
from scheduler_core.ops.stats import queue_stats
from scheduler_core.scripts import NewRequest, Scripts, enqueue_call, enqueue_reply
from scheduler_core.wire import encode_error, encode_request


def redis_now_us(client) -> int:
    seconds, micros = client.time()
    return seconds * 1_000_000 + micros


def test_queue_full_without_recent_completions_has_no_retry_hint(shared_redis, queue):
    configure(shared_redis.url, queue, max_queue_size=3)  # no consumer: nothing completes
    client = shared_redis.client()
    with Producer(shared_redis.url, queue) as p:
        p.submit_many([{"i": i} for i in range(3)])
        before = snapshot(client, queue_pattern(queue))
        for call in (lambda: p.submit({"i": 3}), lambda: p.submit_many([{"i": 4}] * 2)):
            with pytest.raises(QueueFull) as info:
                call()
            exc = info.value
            assert exc.retry_after_s is None
            assert (exc.depth, exc.limit) == (3, 3)
            assert "max_queue_size 3" in str(exc) and "retry after" not in str(exc)
        assert snapshot(client, queue_pattern(queue)) == before  # nothing written


def test_unix_socket_url_round_trip(queue, inprocess_consumer):
    # A short path: Redis shows at most 77 characters of a client's address (CLIENT LIST),
    # and pytest-xdist's per-worker tmp_path is longer than that.
    folder = tempfile.TemporaryDirectory(prefix="bg-")
    socket = Path(folder.name) / "redis.sock"
    server = RedisServer("--unixsocket", str(socket), "--unixsocketperm", "700")
    try:
        url = f"unix://{socket}?db=0"
        inprocess_consumer("consumer.models:noop", redis_url=url, queue=queue)
        with Producer(url, queue) as p:
            assert p.submit({"over": "unix"}).result(timeout=15) == {"over": "unix"}

        async def round_trip() -> object:
            async with AsyncProducer(url, queue) as p:
                return await (await p.submit({"async": "unix"})).result(timeout=15)

        assert asyncio.run(round_trip()) == {"async": "unix"}
        stats = CliRunner().invoke(cli, ["stats", "--redis-url", url, "--queue", queue,
                                         "--json"])
        assert stats.exit_code == 0, stats.output
        assert json.loads(stats.output)["processed"] == 2
        # The consumer (still connected) came through the socket, not over TCP.
        admin = server.client()
        others = [c for c in admin.client_list() if int(c["id"]) != admin.client_id()]
        assert others and all(c["addr"].startswith(str(socket)) for c in others), others
    finally:
        server.close()
        folder.cleanup()


def test_idempotency_keys_expire_after_idempotency_ttl_s(shared_redis, queue):
    client, keys = shared_redis.client(), QueueKeys(queue)
    configure(shared_redis.url, queue)
    with Producer(shared_redis.url, queue, idempotency_ttl_s=1) as p:
        first = p.submit({"n": 1}, idempotency_key="order-1")
        again = p.submit({"n": 2}, idempotency_key="order-1")
        assert again.id == first.id and client.hlen(keys.jobs) == 1  # nothing written
        assert 0 < client.pttl(keys.idempotency("order-1")) <= 1000
        wait_for(lambda: not client.exists(keys.idempotency("order-1")), 10,
                 "the key to expire")
        later = p.submit({"n": 3}, idempotency_key="order-1")
    assert later.id != first.id and client.hlen(keys.jobs) == 2  # a new request


def test_submit_many_takes_up_to_10000_requests_in_one_call(redis_server, queue):
    client, keys = redis_server.client(), QueueKeys(queue)
    with Producer(redis_server.url, queue) as p:
        with pytest.raises(InvalidRequest) as info:
            p.submit_many([0] * 10_001)
        assert info.value.field == "payloads" and "10000" in str(info.value)
        assert snapshot(client, queue_pattern(queue)) == {}
        handles = p.submit_many([0] * 10_000, priority="low")
    assert len({h.id for h in handles}) == 10_000
    assert client.zcard(keys.pending(2)) == client.hlen(keys.jobs) == 10_000


def dead_letters(client, queue: str, prefix: str, n: int) -> list[str]:
    """n dead-lettered requests written as pop_batch.lua and complete.lua leave them."""
    keys, ids = QueueKeys(queue), [f"{prefix}{i}" for i in range(n)]
    pipe = client.pipeline(transaction=False)
    for i, rid in enumerate(ids):
        pipe.hset(keys.jobs, rid, f"1:{1000 + i}:0:3:0:|".encode() + encode_request({"i": i}))
        pipe.zadd(keys.dead, {rid: 1000 + i})
        pipe.hset(keys.dead_reason, rid, encode_error(rid, "DeadLettered", "gave up"))
    pipe.execute()
    return ids


def test_dead_letter_retry_and_purge_work_through_more_than_1000_ids(redis_server, queue):
    client, keys, runner = redis_server.client(), QueueKeys(queue), CliRunner()
    base = ["--redis-url", redis_server.url, "--queue", queue]
    n = 2 * MAX_IDS_PER_CALL + 100  # three calls of the script
    assert MAX_IDS_PER_CALL == 1000
    dead_letters(client, queue, "r", n)
    done = runner.invoke(cli, ["dead-letter", "retry", *base, "--all"])
    assert done.exit_code == 0 and f"retried {n}, skipped 0" in done.output, done.output
    assert client.zcard(keys.dead) == 0 and client.zcard(keys.pending(1)) == n

    doomed = dead_letters(client, queue, "p", n)
    named = doomed[:MAX_IDS_PER_CALL + 200] + ["unknown-id"]
    done = runner.invoke(cli, ["dead-letter", "purge", *base, *named])
    assert done.exit_code == 0, done.output
    assert f"purged {MAX_IDS_PER_CALL + 200}, skipped 1" in done.output
    done = runner.invoke(cli, ["dead-letter", "purge", *base, "--all"])
    assert f"purged {n - MAX_IDS_PER_CALL - 200}, skipped 0" in done.output, done.output
    assert client.zcard(keys.dead) == client.hlen(keys.dead_reason) == 0
    assert not any(client.hexists(keys.jobs, rid) for rid in doomed[::97])


def test_consumers_silent_for_an_hour_are_pruned(shared_redis, queue, inprocess_consumer):
    client, keys = shared_redis.client(), QueueKeys(queue)
    now = redis_now_us(client)
    client.zadd(keys.consumers, {"gone-host:1:old": now - 3601 * 1_000_000,
                                 "quiet-host:2:young": now - 3500 * 1_000_000})
    consumer = inprocess_consumer("consumer.models:noop", redis_url=shared_redis.url,
                                  queue=queue)
    # The consumer's first sweep prunes the set: only entries silent for over an hour.
    # Its own entry comes with its first heartbeat, which a loaded host may run later.
    wait_for(lambda: client.zscore(keys.consumers, "gone-host:1:old") is None
             and client.zcard(keys.consumers) == 2, 15,
             "the hour-old entry to be pruned and the consumer's own to appear")
    names = {m.decode() for m in client.zrange(keys.consumers, 0, -1)}
    assert "quiet-host:2:young" in names and len(names) == 2
    assert not consumer.stopping.is_set()
    assert queue_stats(client, queue).consumers_alive == 1


def test_an_enqueue_resent_while_its_request_runs_is_not_added_again(
        redis_server, queue, inprocess_consumer, tmp_path):
    """What redis-py's retry does when an enqueue's reply was lost: it sends the same
    request (same id) again. While the request is in flight it is not queued again: it
    runs once and its result is delivered once."""
    url, client, keys = redis_server.url, redis_server.client(), QueueKeys(queue)
    serve(inprocess_consumer, url, queue, "Echo", {"strategy": "fifo"}, log=tmp_path,
          sleep_ms=800)
    with CountingProducer(url, queue) as p:
        handle = p.submit({"i": "once"})
        wait_for(lambda: executions(tmp_path), 15, "the request to start")
        assert client.hexists(keys.owner, handle.id)  # in flight
        # The same enqueue again: same id, producer, priority and envelope.
        request = NewRequest(handle.id, 1, 0, encode_request({"i": "once"}))
        script_keys, args = enqueue_call(keys, p.id, [request], 60)
        resent = Scripts(client).enqueue(keys=script_keys, args=args)
        assert int(resent[1]) == 0 and enqueue_reply(keys, resent) == [handle.id]
        assert sum(client.zcard(k) for k in keys.pending_all) == 0
        assert handle.result(timeout=15)["echo"] == {"i": "once"}
        wait_for(lambda: executions(tmp_path)["once"] == 1 and not client.hlen(keys.owner),
                 15, "the batch to complete")
    assert executions(tmp_path) == {"once": 1}
    assert p.deliveries[handle.id] == 1
    assert queue_stats(client, queue).processed == 1


def test_latency_sample_lists_stay_bounded(shared_redis, queue, inprocess_consumer):
    """The queue-wait, end-to-end and model-time samples `stats` reads are capped lists:
    at most 10,000 entries kept (plus at most 500 between trims), newest first."""
    client, keys = shared_redis.client(), QueueKeys(queue)
    kept, slack = 10_000, 500
    for key, filler in ((keys.wait_samples, b"7"), (keys.e2e_samples, b"7"),
                        (keys.model_samples, b"1:7")):
        client.lpush(key, *[filler] * (kept + slack))
    inprocess_consumer("consumer.models:noop", redis_url=shared_redis.url, queue=queue,
                       strategy="dynamic", max_batch_size=4, max_queue_delay_ms=100)
    with Producer(shared_redis.url, queue) as p:
        for h in p.submit_many([{"i": i} for i in range(4)]):
            h.result(timeout=15)
    wait_for(lambda: client.llen(keys.model_samples) <= kept, 15, "the last sample")
    for key, filler in ((keys.wait_samples, b"7"), (keys.e2e_samples, b"7"),
                        (keys.model_samples, b"1:7")):
        assert client.llen(key) == kept, key
        assert client.lindex(key, 0) != filler and client.lindex(key, -1) == filler, key
    stats = queue_stats(client, queue)
    assert stats.queue_wait_ms["samples"] == stats.end_to_end_ms["samples"] == kept


def test_loops_sharing_an_outage_log_it_once_when_it_starts_and_once_when_it_ends(caplog):
    """A consumer's main loop and its completions being retried share one Outage: the
    first loop to fail logs it, the last one through logs its end, and the next outage is
    logged again (docs/failure-modes.md: logged once when it starts, once when it ends)."""
    caplog.set_level(logging.WARNING, logger="batchgate")
    outage = Outage("consumer c")
    main_loop = Backoff(outage=outage)
    completing = Backoff(outage=outage, where=" (completing batch 7)")
    refused = ConnectionError("refused")
    for _ in range(2):
        caplog.clear()
        completing.failed(refused)
        main_loop.failed(refused)
        main_loop.failed(refused)
        main_loop.succeeded()
        assert caplog.messages == ["consumer c (completing batch 7): Redis unavailable "
                                   "(refused); retrying with backoff"]
        completing.succeeded()
        completing.succeeded()  # a loop that did not fail ends nothing
        assert len(caplog.messages) == 2
        assert caplog.messages[1].startswith("consumer c (completing batch 7): Redis is back")
        assert caplog.messages[1].endswith("(3 failed attempts)")
