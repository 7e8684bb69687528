"""Start gate and orphan guard shared by the benchmark's worker processes.

A worker prints READY_LINE once it can work, then blocks until the benchmark pushes a token
to the run's go-list, so that all N workers start together, after a backlog (if any) is
fully enqueued. A worker whose parent (the benchmark) is gone exits by itself.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import redis


def guard_parent() -> None:
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=watch, daemon=True, name="bench-orphan-guard").start()


READY_LINE = b"batchgate bench worker ready"


def ready_then_wait(url: str, go_key: str) -> None:
    sys.stdout.write(READY_LINE.decode() + "\n")
    sys.stdout.flush()
    client = redis.Redis.from_url(url)
    while not client.blpop([go_key], timeout=1):
        pass
    client.close()
