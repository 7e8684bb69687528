"""Fixtures shared by the tests. Helpers live in tests/helpers/."""

from __future__ import annotations

import signal
import uuid
from collections.abc import Iterator

import pytest
from helpers.processes import ConsumerProcess, RedisServer
from helpers.topology import TopologyServer

from consumer import Consumer
from consumer.sharded import ShardedConsumer
from consumer.worker import Worker


@pytest.fixture(scope="session")
def shared_redis() -> Iterator[RedisServer]:
    """One private server for tests that only need isolation by queue name."""
    server = RedisServer()
    yield server
    server.close()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[TopologyServer]:
    """A 6-node Redis Cluster (3 primaries, 3 replicas), started once for the session."""
    server = TopologyServer("cluster")
    yield server
    server.close()


@pytest.fixture(scope="session")
def redis_sentinel() -> Iterator[TopologyServer]:
    """1 primary, 2 replicas and 3 sentinels, started once for the session."""
    server = TopologyServer("sentinel")
    yield server
    server.close()


@pytest.fixture(params=["cluster", "sentinel"])
def topology(request) -> TopologyServer:
    """Each test using it runs on the cluster, then on the sentinel set."""
    return request.getfixturevalue(f"redis_{request.param}")


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A server of this test's own, for tests that kill, restart or inspect all keys."""
    server = RedisServer()
    yield server
    server.close()


@pytest.fixture
def queue() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def start_consumer() -> Iterator:
    """start_consumer(redis_url, queue, *cli_args) -> a ready ConsumerProcess."""
    started: list[ConsumerProcess] = []

    def start(redis_url: str, queue: str, *args: str, ready: bool = True,
              **kwargs: object) -> ConsumerProcess:
        proc = ConsumerProcess(redis_url, queue, *args, **kwargs)  # type: ignore[arg-type]
        started.append(proc)
        return proc.wait_ready() if ready else proc

    yield start
    for proc in started:
        proc.close()


@pytest.fixture
def inprocess_consumer() -> Iterator:
    """inprocess_consumer(model, redis_url=..., queue=..., **settings) -> a started
    Consumer: the real loop on a thread of the test process, built through the public
    API (`model` and `settings` as Consumer takes them). Stopped at teardown. For what
    does not depend on process boundaries; crashes, signals and the CLI need
    start_consumer."""
    started: list[Consumer] = []

    def start(model: object, **settings: object) -> Consumer:
        consumer = Consumer(model, **settings)  # type: ignore[arg-type]
        started.append(consumer)
        return consumer.start()

    yield start
    for consumer in started:
        consumer.stopping.set()
    for consumer in started:
        _wake(consumer)
        consumer.stop()


def _wake(consumer: Consumer) -> None:
    """End an idle consumer's block (up to IDLE_BLOCK_S, 1 s) now, through the wake key
    its own due timer pushes to (a sharded one on one Redis: shard 0's)."""
    loop = consumer.loop
    first = loop.shards[0] if isinstance(loop, ShardedConsumer) else loop
    if isinstance(first, Worker):
        first._self_wake(first.keys.wake(consumer.name))


@pytest.fixture(autouse=True)
def _sigint_restored() -> Iterator[None]:
    """An RQ worker run in this process sets SIGINT to SIG_IGN, which every child started
    later would inherit: give the next test the default back."""
    yield
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
