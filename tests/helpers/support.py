"""Helpers for the end-to-end tests: a user's own model module that records what it ran,
Redis-side evidence (snapshots, stats, queue-wait samples) and polling."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from helpers.processes import BATCHGATE  # noqa: F401 - re-exported
from scheduler_core.admin import ensure_policy
from scheduler_core.connection import connect
from scheduler_core.keys import QueueKeys

# The tests that run whole benchmarks or demos and keep the CPUs busy (several processes
# each, 10-40 s): pytest-xdist runs them one after another on one worker, beside the rest
# of the suite. A test whose time is paced arrivals or process start-up stays out: the
# group is the suite's longest serial path.
HEAVY = pytest.mark.xdist_group("heavy")

# A model module as a user would write one: imported by `batchgate consumer` from its
# working directory. It logs each batch to <out>/<pid>.jsonl *before* running it, then
# sleeps delay_ms (+ the largest "sleep_ms" of the batch's payloads) and echoes (with
# stamp=true: {"by": <pid>, "payload": ...}).
RECORDER_SOURCE = '''
import json
import os
import time


class Recorder:
    def __init__(self, out, delay_ms=0, stamp=False):
        self.path = os.path.join(out, "%d.jsonl" % os.getpid())
        self.delay_ms = delay_ms
        self.stamp = stamp

    def __call__(self, payloads):
        line = json.dumps({"pid": os.getpid(), "t": time.time(), "payloads": payloads})
        with open(self.path, "a") as f:
            f.write(line + "\\n")
        extra = [p.get("sleep_ms", 0) for p in payloads if isinstance(p, dict)]
        time.sleep((self.delay_ms + max(extra, default=0)) / 1000)
        if self.stamp:
            return [{"by": os.getpid(), "payload": p} for p in payloads]
        return payloads
'''


class RecordingModel:
    """The recorder module written into `root`: `batchgate consumer` runs it with
    cwd=root (start), a Consumer in this process loads the same file (serve)."""

    def __init__(self, root: Path):
        self.root = root
        self.out = root / "batches"
        self.out.mkdir(exist_ok=True)
        (root / "bg_recorder.py").write_text(RECORDER_SOURCE)

    def args(self, delay_ms: int = 0, stamp: bool = False) -> list[str]:
        return ["--model", "bg_recorder:Recorder", "--model-arg", f"out={self.out}",
                "--model-arg", f"delay_ms={delay_ms}",
                "--model-arg", f"stamp={'true' if stamp else 'false'}"]

    def start(self, start_consumer: Callable[..., Any], redis_url: str, queue: str,
              *cli_args: str, delay_ms: int = 0, stamp: bool = False, **kwargs: Any) -> Any:
        return start_consumer(redis_url, queue, *self.args(delay_ms, stamp), *cli_args,
                              cwd=str(self.root), **kwargs)

    def recorder(self, delay_ms: int = 0, stamp: bool = False) -> Any:
        """The same Recorder, loaded from the module file in this process."""
        spec = importlib.util.spec_from_file_location("bg_recorder", self.root / "bg_recorder.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.Recorder(str(self.out), delay_ms, stamp)

    def serve(self, inprocess_consumer: Callable[..., Any], redis_url: str, queue: str,
              delay_ms: int = 0, stamp: bool = False, **settings: Any) -> Any:
        """A Consumer in this process (the inprocess_consumer fixture) running the
        recorder; `settings` as Consumer takes them (strategy=, max_batch_size=, ...)."""
        return inprocess_consumer(self.recorder(delay_ms, stamp), redis_url=redis_url,
                                  queue=queue, **settings)

    def batches(self, pid: int | None = None) -> list[dict[str, Any]]:
        """Every batch run so far ({"pid", "t", "payloads"}), in the order each process
        ran them; processes merged by wall-clock time."""
        records = []
        for path in sorted(self.out.glob("*.jsonl")):
            if pid is not None and path.stem != str(pid):
                continue
            for line in path.read_text().splitlines(keepends=True):
                if line.endswith("\n"):  # skip a line still being written
                    records.append(json.loads(line))
        records.sort(key=lambda r: r["t"])
        return records

    def payloads(self) -> list[Any]:
        return [p for batch in self.batches() for p in batch["payloads"]]


def wait_for(predicate: Callable[[], Any], timeout: float = 15.0, what: str = "condition",
             interval: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def configure(url: str, queue: str, **policy: Any) -> None:
    """Store a queue's policy before any consumer runs (as `batchgate policy set` would)."""
    client = connect(url)  # any URL form: one server, a cluster, a sentinel set
    try:
        ensure_policy(client, queue, policy)
    finally:
        client.close()


def snapshot(client: redis.Redis, pattern: str = "*") -> dict[bytes, Any]:
    """Every key matching `pattern` with its value: a hash's fields and values (a large
    hash's DUMP follows its hash table's order, which a mere read may rehash), any other
    key's serialized value (DUMP)."""
    return {key: sorted(client.hgetall(key).items())
            if client.type(key) == b"hash" else client.dump(key)
            for key in client.scan_iter(match=pattern, count=1000)}


def queue_pattern(queue: str) -> str:
    return QueueKeys(queue).tag.replace("{", "\\{").replace("}", "\\}") + "*"


def wait_samples_ms(client: redis.Redis, queue: str) -> list[float]:
    """Redis-side queue waits (arrival to pop, by Redis' clock) of every request popped,
    oldest pop first."""
    raw = client.lrange(QueueKeys(queue).wait_samples, 0, -1)
    return [int(x) / 1000 for x in reversed(raw)]


STARTED = re.compile(r"consumer (\d+)(?: \([^)]*\))? started \(pid (\d+)\)")


def started(output: str) -> list[tuple[int, int]]:
    """(slot, pid) of every child start a supervisor logged, in order."""
    return [(int(slot), int(pid)) for slot, pid in STARTED.findall(output)]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not alive
        return f.read().split(") ")[-1][0] != "Z"
