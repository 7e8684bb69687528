"""Fixtures: private redis-server processes on free ports, and consumer processes started
exactly as the CLI starts them. Nothing here touches a Redis the tests did not start."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

BATCHGATE = shutil.which("batchgate", path=os.path.dirname(sys.executable)) or shutil.which(
    "batchgate")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A private redis-server: start, stop (SIGKILL or SHUTDOWN), restart on the same port."""

    def __init__(self, *extra: str):
        if not shutil.which("redis-server"):
            pytest.skip("redis-server is not on PATH (apt-get install redis-server)")
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="bg-redis-")
        self.extra = list(extra)
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", self.dir, "--save", "", "--appendonly", "no",
                "--maxmemory-policy", "noeviction", *self.extra]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server did not start: {args}") from None
                time.sleep(0.02)
            finally:
                client.close()

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def restart(self) -> None:
        self.kill()
        self.start()

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port)

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def shared_redis() -> Iterator[RedisServer]:
    """One private server for tests that only need isolation by queue name."""
    server = RedisServer()
    yield server
    server.close()


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A server of this test's own, for tests that kill, restart or inspect all keys."""
    server = RedisServer()
    yield server
    server.close()


@pytest.fixture
def queue() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


class LoggedProcess:
    """A child process in its own session, its output captured in a temporary log."""

    def __init__(self, args: list[str], prefix: str, cwd: str | Path | None = None,
                 env: dict[str, str] | None = None):
        self.args = args
        self.log = Path(tempfile.mkstemp(prefix=prefix, suffix=".log")[1])
        self._log_file = self.log.open("wb")
        self.proc = subprocess.Popen(args, stdout=self._log_file, stderr=subprocess.STDOUT,
                                     cwd=cwd, env={**os.environ, **(env or {})},
                                     start_new_session=True)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self, timeout: float = 15.0) -> int:
        self.signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()
        self.log.unlink(missing_ok=True)


class ConsumerProcess(LoggedProcess):
    """`batchgate consumer ...` as a real child process."""

    def __init__(self, redis_url: str, queue: str, *args: str, cwd: str | None = None,
                 env: dict[str, str] | None = None):
        assert BATCHGATE, "the batchgate command is not installed (pip install -e .)"
        super().__init__([BATCHGATE, "consumer", "--redis-url", redis_url, "--queue", queue,
                          *args], "bg-consumer-", cwd, env)

    def wait_ready(self, timeout: float = 30.0) -> ConsumerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if b"ready on queue" in self.log.read_bytes():
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"consumer exited {self.proc.returncode}:\n{self.output()}")
            time.sleep(0.02)
        raise RuntimeError(f"consumer not ready after {timeout}s:\n{self.output()}")


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
