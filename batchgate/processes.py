"""Child processes of the demo and the benchmark: started in a session of their own (so
Ctrl-C reaches only the parent, which stops them), output to a log file, ready once a
marker line appears in that log; killed with the parent whatever kills it
(scheduler_core/lifetime.py)."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from scheduler_core.errors import BatchgateError
from scheduler_core.lifetime import spawn

STOP_TIMEOUT_S = 15.0


def batchgate_argv() -> list[str]:
    """The `batchgate` installed next to this Python, else the same CLI via `-m`."""
    script = shutil.which("batchgate", path=os.path.dirname(sys.executable))
    return [script] if script else [sys.executable, "-m", "batchgate.cli"]


class ChildProcess:
    def __init__(self, argv: list[str], log_path: Path, ready_marker: bytes,
                 env: dict[str, str] | None = None):
        self.argv, self.log_path, self.ready_marker = argv, log_path, ready_marker
        with log_path.open("ab") as out:  # the child keeps its own copy of the descriptor
            self.proc = spawn(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                              start_new_session=True)

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise BatchgateError(f"{shlex.join(self.argv)} exited with "
                                 f"{self.proc.returncode}:\n{self.output()}")
        return self.ready_marker in self.log_path.read_bytes()

    def output(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def cpu_s(self) -> float:
        """User + system CPU seconds used so far (Linux /proc; 0 elsewhere)."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            return 0.0

    def terminate(self) -> None:
        """Ask for a graceful stop (the child finishes what it holds)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def reap(self, timeout: float = STOP_TIMEOUT_S) -> None:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()


def wait_all_ready(children: list[ChildProcess], timeout: float) -> None:
    """Wait until every child is ready; on failure or timeout kill them all and raise."""
    deadline = time.monotonic() + timeout
    try:
        while not all(child.ready() for child in children):
            if time.monotonic() > deadline:
                raise BatchgateError(f"not ready after {timeout:.0f}s: "
                                     f"{shlex.join(children[0].argv)}\n{children[0].output()}")
            time.sleep(0.05)
    except BaseException:
        for child in children:
            child.kill()
        raise
