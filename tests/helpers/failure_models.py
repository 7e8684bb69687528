"""Models that misbehave on purpose, for the failure tests, and one that reports on its
process. `batchgate consumer` imports them as a user's own module
(`--model failure_models:NAME`, cwd = this directory).

Every model appends one line per executed request to `<log>/<pid>.log` (when `log` is
given) *before* running it, so a test can count how often each request actually ran.
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any


class _Base:
    def __init__(self, log: str = "", sleep_ms: float = 0.0):
        self.log = log
        self.sleep_ms = float(sleep_ms)

    def record(self, payloads: list[Any]) -> None:
        if not self.log:
            return
        lines = "".join(f"{p.get('i') if isinstance(p, dict) else p}\n" for p in payloads)
        fd = os.open(os.path.join(self.log, f"{os.getpid()}.log"),
                     os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, lines.encode())
        finally:
            os.close(fd)

    def __call__(self, payloads: list[Any]) -> list[Any]:
        self.record(payloads)
        for p in payloads:
            self.check(p)
        self.work(payloads)
        return [self.answer(p) for p in payloads]

    def check(self, payload: Any) -> None:
        pass

    def work(self, payloads: list[Any]) -> None:
        if self.sleep_ms:
            time.sleep(self.sleep_ms / 1000)

    def answer(self, payload: Any) -> Any:
        return {"echo": payload, "pid": os.getpid()}


class Echo(_Base):
    """Echoes after sleeping `sleep_ms` per batch."""


class Busy(_Base):
    """Holds the CPU (and the GIL) in pure Python for `busy_ms` per batch."""

    def __init__(self, log: str = "", busy_ms: float = 1000.0):
        super().__init__(log)
        self.busy_ms = float(busy_ms)

    def work(self, payloads: list[Any]) -> None:
        end = time.perf_counter() + self.busy_ms / 1000
        n = 0
        while time.perf_counter() < end:
            n += 1


class Unprintable(Exception):
    """An exception with no message to give: str() of it raises."""

    def __str__(self) -> str:
        raise RuntimeError("this exception cannot be printed")


class Poison(_Base):
    """Raises for payloads with "raise": true (Unprintable for "unprintable": true); kills
    the whole process (os._exit) for payloads with "crash": true, unless the file `cured`
    exists; hangs (a call that never returns in a test's time) for "hang": true."""

    def __init__(self, log: str = "", sleep_ms: float = 0.0, cured: str = ""):
        super().__init__(log, sleep_ms)
        self.cured = cured

    def check(self, payload: Any) -> None:
        if not isinstance(payload, dict):
            return
        if payload.get("crash") and not (self.cured and os.path.exists(self.cured)):
            os._exit(17)
        if payload.get("raise"):
            raise ValueError(f"poison payload {payload.get('i')}")
        if payload.get("unprintable"):
            raise Unprintable()
        if payload.get("hang"):
            time.sleep(3600)


class Flaky(_Base):
    """Raises TimeoutError for a payload {"i": ..., "fail": k} on its first k runs, counted
    across every process by the run log (`log` is required)."""

    def check(self, payload: Any) -> None:
        if not isinstance(payload, dict) or not payload.get("fail"):
            return
        runs = 0
        for name in os.listdir(self.log):
            if name.endswith(".log"):
                with open(os.path.join(self.log, name)) as f:
                    runs += f.read().split().count(str(payload.get("i")))
        if runs <= int(payload["fail"]):
            raise TimeoutError(f"run {runs} of payload {payload.get('i')} timed out")


class Big(_Base):
    """Answers each payload {"size": n} with a string of n bytes."""

    def answer(self, payload: Any) -> Any:
        return "x" * int(payload.get("size", 0))


class GcReport(_Base):
    """Answers with the garbage collector's view of the consumer process."""

    def answer(self, payload: Any) -> Any:
        return {"frozen": gc.get_freeze_count(), "tracked": len(gc.get_objects())}


class ThreadsReport(_Base):
    """Answers with the CPU threads torch runs with in the consumer process."""

    def answer(self, payload: Any) -> Any:
        import torch

        return {"torch_threads": torch.get_num_threads(),
                "omp": os.environ.get("OMP_NUM_THREADS")}
