"""A private, throw-away Redis for `batchgate demo` (and anyone who wants one).

    with embedded_redis() as url:
        ...  # redis://127.0.0.1:<free port>/0, gone when the block ends

It runs the `redis-server` found on PATH on a free loopback port, in a temporary
directory, with persistence off (`--save ""`, `--appendonly no`), and kills it on exit.
Nothing else is touched.
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


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


@contextmanager
def embedded_redis(executable: str = "redis-server") -> Iterator[str]:
    """Start a private redis-server; yield its URL; kill it and remove its directory."""
    binary = shutil.which(executable)
    if binary is None:
        raise RedisServerNotFound(
            f"no {executable!r} on PATH, and the demo needs a Redis to run against. "
            "Install one (Debian/Ubuntu: `sudo apt-get install redis-server`; macOS: "
            "`brew install redis`), or point the demo at an existing server with "
            "`--redis-url redis://HOST:PORT/DB` (it only creates and removes its own "
            "`demo-...` queues there).")
    workdir = tempfile.mkdtemp(prefix="batchgate-redis-")
    proc: subprocess.Popen[bytes] | None = None
    try:
        for _ in range(PORT_ATTEMPTS):
            port = free_port()
            proc = subprocess.Popen(
                [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", workdir,
                 "--save", "", "--appendonly", "no", "--maxmemory-policy", "noeviction"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if _wait_for_ping(proc, port, START_TIMEOUT_S):
                break
            _stop(proc)
            proc = None
        if proc is None:
            raise BatchgateError(f"{binary} did not start (tried {PORT_ATTEMPTS} ports)")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        if proc is not None:
            _stop(proc)
        shutil.rmtree(workdir, ignore_errors=True)
