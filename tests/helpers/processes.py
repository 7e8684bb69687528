"""Real processes for the tests: private redis-servers, `batchgate consumer` and other
children with their output logged."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from batchgate.embedded import EmbeddedRedis, free_port
from scheduler_core.lifetime import spawn

__all__ = ["BATCHGATE", "ConsumerProcess", "LoggedProcess", "RedisServer", "free_port"]

BATCHGATE = shutil.which("batchgate", path=os.path.dirname(sys.executable)) or shutil.which(
    "batchgate")


class RedisServer(EmbeddedRedis):
    """A private redis-server of the test's own; skips the test where there is none."""

    def __init__(self, *extra: str):
        if not shutil.which("redis-server"):
            pytest.skip("redis-server is not on PATH (apt-get install redis-server)")
        super().__init__(*extra)


class LoggedProcess:
    """A child process in its own session, its output captured in a temporary log."""

    def __init__(self, args: list[str], prefix: str, cwd: str | Path | None = None,
                 env: dict[str, str] | None = None):
        self.args = args
        self.log = Path(tempfile.mkstemp(prefix=prefix, suffix=".log")[1])
        self._log_file = self.log.open("wb")
        # Tied to the test process (lifetime.spawn): a test run killed outright leaves no
        # consumer or gateway behind.
        self.proc = spawn(args, stdout=self._log_file, stderr=subprocess.STDOUT, cwd=cwd,
                          env={**os.environ, **(env or {})}, start_new_session=True)

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
        with contextlib.suppress(ProcessLookupError):  # its children too (gateway workers)
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._log_file.close()
        self.log.unlink(missing_ok=True)


class ConsumerProcess(LoggedProcess):
    """`batchgate consumer ...` as a real child process."""

    def __init__(self, redis_url: str, queue: str, *args: str, cwd: str | None = None,
                 env: dict[str, str] | None = None, wrap: list[str] | None = None):
        """`wrap` runs it through a prefix (e.g. `ip netns exec NAME`: another host)."""
        assert BATCHGATE, "the batchgate command is not installed (pip install -e .)"
        super().__init__([*(wrap or []), BATCHGATE, "consumer", "--redis-url", redis_url,
                          "--queue", queue, *args], "bg-consumer-", cwd, env)

    def wait_ready(self, timeout: float = 30.0) -> ConsumerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if b"ready on queue" in self.log.read_bytes():
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"consumer exited {self.proc.returncode}:\n{self.output()}")
            time.sleep(0.02)
        raise RuntimeError(f"consumer not ready after {timeout}s:\n{self.output()}")
