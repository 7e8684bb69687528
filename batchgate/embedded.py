"""A private, throw-away Redis for `batchgate demo`, the benchmark and the tests.

    with embedded_redis() as url:
        ...  # redis://127.0.0.1:<free port>/0, gone when the block ends

It runs the `redis-server` found on PATH on a free loopback port, in a temporary
directory, with persistence off (`--save ""`, `--appendonly no`), and kills it on exit
(and dies with this process whatever kills it: scheduler_core/lifetime.py).
Nothing else is touched. `EmbeddedRedis` is the same server as an object that can also be
killed and restarted on its port (the tests' fault injection).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import redis

from scheduler_core.errors import BatchgateError
from scheduler_core.lifetime import spawn

START_TIMEOUT_S = 10.0
PORT_ATTEMPTS = 3  # a free port can be taken between choosing it and binding it


class RedisServerNotFound(BatchgateError):
    """There is no `redis-server` on PATH to start."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_ping(proc: subprocess.Popen[bytes], port: int, timeout: float) -> bool:
    """True once the server answers PING; False if it exited or never answered."""
    client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=1)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if client.ping():
                    return True
            except redis.ConnectionError:
                time.sleep(0.02)
        return False
    finally:
        client.close()


class EmbeddedRedis:
    """A private redis-server: start, kill (SIGKILL), restart on the same port, close."""

    def __init__(self, *extra: str, executable: str = "redis-server"):
        binary = shutil.which(executable)
        if binary is None:
            raise RedisServerNotFound(
                f"no {executable!r} on PATH, and the demo needs a Redis to run against. "
                "Install one (Debian/Ubuntu: `sudo apt-get install redis-server`; macOS: "
                "`brew install redis`), or point the demo at an existing server with "
                "`--redis-url redis://HOST:PORT/DB` (it only creates and removes its own "
                "`demo-...` queues there).")
        self.binary, self.extra = binary, list(extra)
        self.dir = tempfile.mkdtemp(prefix="batchgate-redis-")
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        try:
            for _ in range(PORT_ATTEMPTS):
                self.port = free_port()
                if self._launch():
                    return
            raise BatchgateError(f"{binary} did not start (tried {PORT_ATTEMPTS} ports)")
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port)

    def _launch(self) -> bool:
        self.proc = spawn(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir,
             "--save", "", "--appendonly", "no", "--maxmemory-policy", "noeviction",
             *self.extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if _wait_for_ping(self.proc, self.port, START_TIMEOUT_S):
            return True
        self.kill()
        return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()

    def start(self) -> None:
        """Start again on the same port after kill() (with no persistence, empty)."""
        if not self._launch():
            raise BatchgateError(f"redis-server did not start on port {self.port}")

    def restart(self) -> None:
        self.kill()
        self.start()

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


@contextmanager
def embedded_redis(executable: str = "redis-server") -> Iterator[str]:
    """Start a private redis-server; yield its URL; kill it and remove its directory."""
    server = EmbeddedRedis(executable=executable)
    try:
        yield server.url
    finally:
        server.close()
