"""HTTP server processes for the web tests: the examples and `batchgate gateway`, started
as a user starts them, on a free port, and stopped with SIGTERM."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from helpers.processes import BATCHGATE, LoggedProcess, free_port

ROOT = Path(__file__).resolve().parents[2]


class ServerProcess(LoggedProcess):
    """A child process serving HTTP on 127.0.0.1:`port`; `url` is its base URL."""

    def __init__(self, args: list[str], port: int, env: dict[str, str] | None = None,
                 ready_path: str = "/", cwd: Path = ROOT):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        super().__init__(args, "bg-http-", cwd, env)
        try:
            self._wait_ready(ready_path)
        except BaseException:  # no caller holds it yet to close it
            self.close()
            raise

    def _wait_ready(self, path: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.output()}")
            with contextlib.suppress(httpx.TransportError):
                httpx.get(self.url + path, timeout=1.0)
                return
            time.sleep(0.05)
        raise RuntimeError(f"server not answering after {timeout}s:\n{self.output()}")


def gateway_args(redis_url: str, queue: str, port: int, *extra: str) -> list[str]:
    assert BATCHGATE, "the batchgate command is not installed (pip install -e .)"
    return [BATCHGATE, "gateway", "--redis-url", redis_url, "--queue", queue,
            "--port", str(port), "--no-access-log", *extra]


def gateway_factory() -> Iterator[Callable[..., ServerProcess]]:
    """For a fixture: start(redis_url, queue, *cli_args, env=None) -> a ServerProcess running
    `batchgate gateway`; all of them are killed when the fixture ends."""
    started: list[ServerProcess] = []

    def start(redis_url: str, queue: str, *extra: str,
              env: dict[str, str] | None = None) -> ServerProcess:
        port = free_port()
        server = ServerProcess(gateway_args(redis_url, queue, port, *extra), port, env=env,
                               ready_path="/healthz")
        started.append(server)
        return server

    yield start
    for server in started:
        server.close()
