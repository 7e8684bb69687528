"""Redis refusing writes (docs/failure-modes.md): MISCONF (a snapshot could not be
written), READONLY (a replica, as after a failover), LOADING (a restart reading its
dataset), OOM (maxmemory under noeviction). A producer's submit raises Redis' error,
which names the cause, and writes nothing; a consumer waits with backoff, logs the outage
once, and serves again when Redis does. (A consumer under OOM: tests/test_failures.py.)"""

from __future__ import annotations

import shutil
import threading

import pytest
import redis
from helpers.processes import RedisServer
from helpers.support import configure, queue_pattern, snapshot, wait_for

from producer import Producer
from scheduler_core.keys import QueueKeys

NOOP = ["--model", "consumer.models:noop"]


@pytest.fixture
def servers():
    started: list[RedisServer] = []

    def start(*extra: str) -> RedisServer:
        started.append(RedisServer(*extra))
        return started[-1]

    yield start
    for server in started:
        server.close()


def refused_and_nothing_written(p: Producer, client: redis.Redis, error: type[Exception],
                                says: str) -> None:
    """submit and submit_many raise `error` naming the cause; the queue is unchanged."""
    before = snapshot(client, queue_pattern(p.keys.queue))
    with pytest.raises(error, match=says):
        p.submit({"refused": 1})
    with pytest.raises(error, match=says):
        p.submit_many([{"refused": i} for i in range(50)], priority="low")
    after = snapshot(client, queue_pattern(p.keys.queue))
    keys = QueueKeys(p.keys.queue)
    for key in (keys.jobs, *keys.pending_all, keys.clock):
        assert after.get(key.encode()) == before.get(key.encode()), key


def waits_out_the_refusal(consumer, says: str) -> None:
    wait_for(lambda: "Redis unavailable" in consumer.output(), 15, "the consumer to notice")
    assert says in consumer.output()
    assert consumer.proc.poll() is None, consumer.output()


def served_again(consumer, url: str, queue: str) -> None:
    with Producer(url, queue) as p:
        assert p.submit({"after": 1}).result(timeout=30) == {"after": 1}
    wait_for(lambda: "Redis is back" in consumer.output(), 15, "the consumer to log it")
    assert consumer.output().count("Redis unavailable") == 1  # once, not per attempt


def test_misconf_refused_then_served_again(servers, queue, start_consumer):
    server = servers()
    consumer = start_consumer(server.url, queue, *NOOP)
    client = server.client()
    with Producer(server.url, queue) as p:
        assert p.submit({"before": 1}).result(timeout=15) == {"before": 1}
        # A snapshot that cannot be written (its directory is gone), with a save point
        # configured: Redis stops accepting writes until told otherwise.
        shutil.rmtree(server.dir)
        client.config_set("save", "3600 1")
        client.bgsave()
        wait_for(lambda: client.info("persistence")["rdb_last_bgsave_status"] == "err",
                 what="the snapshot to fail")
        waits_out_the_refusal(consumer, "MISCONF")
        refused_and_nothing_written(p, client, redis.ResponseError, "^MISCONF .*persist")
        client.config_set("stop-writes-on-bgsave-error", "no")  # the operator's fix
    served_again(consumer, server.url, queue)


def test_readonly_replica_refused_then_served_after_promotion(servers, queue,
                                                              start_consumer):
    """The consumer's Redis becomes a replica (a failover elsewhere), then is promoted."""
    primary, server = servers(), servers()
    consumer = start_consumer(server.url, queue, *NOOP)
    configure(primary.url, queue)  # the data the replica takes over, policy included
    client = server.client()
    with Producer(server.url, queue) as p:
        assert p.submit({"before": 1}).result(timeout=15) == {"before": 1}
        client.replicaof("127.0.0.1", primary.port)
        wait_for(lambda: client.info("replication").get("master_link_status") == "up",
                 what="the replica to sync")
        waits_out_the_refusal(consumer, "read only replica")
        refused_and_nothing_written(p, client, redis.ReadOnlyError, "read only replica")
        assert not primary.client().exists(QueueKeys(queue).jobs)
        client.replicaof("NO", "ONE")
    served_again(consumer, server.url, queue)


def test_loading_after_a_restart_refused_then_served(servers, queue, start_consumer):
    """A restart of a Redis with a dataset to read: while it loads (slowed down to ~2 s
    here), it answers LOADING."""
    server = servers("--key-load-delay", "100", "--loading-process-events-interval-bytes",
                     "1024")
    consumer = start_consumer(server.url, queue, *NOOP)
    client = server.client()
    with Producer(server.url, queue) as p:
        assert p.submit({"before": 1}).result(timeout=15) == {"before": 1}
        for start in range(0, 20_000, 5_000):
            client.mset({f"filler:{i}": "x" for i in range(start, start + 5_000)})
        client.save()
        restart = threading.Thread(target=server.restart)
        restart.start()

        def loading() -> bool:
            try:
                return bool(server.client().info("persistence")["loading"])
            except redis.ConnectionError:
                return False

        try:
            wait_for(loading, 15, "Redis to be loading", interval=0.005)
            with pytest.raises(redis.BusyLoadingError, match="loading the dataset"):
                p.submit({"refused": 1})
        finally:
            restart.join()
        assert client.hlen(QueueKeys(queue).jobs) == 0  # nothing was written
        waits_out_the_refusal(consumer, "")
    served_again(consumer, server.url, queue)


def test_out_of_memory_refused_with_the_cause_and_nothing_written(servers, queue):
    server = servers()
    configure(server.url, queue)
    client = server.client()
    with Producer(server.url, queue) as p:
        p.submit({"before": 1})
        client.config_set("maxmemory", "1mb")  # below what is used: every write refused
        refused_and_nothing_written(p, client, redis.exceptions.OutOfMemoryError,
                                    "maxmemory")
        client.config_set("maxmemory", "0")
        handle = p.submit({"after": 1})
    assert client.hexists(QueueKeys(queue).jobs, handle.id)
