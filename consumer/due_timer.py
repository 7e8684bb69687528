"""A call at a set time, from one long-lived thread: the idle consumer's due timer and
the prefetcher's clock (consumer/overlap.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class DueTimer:
    """Calls `fire()` once at a set time.monotonic(), from one long-lived thread.

    The consumer arms it each time it idles until a batch falls due; a thread started per
    wait (threading.Timer) would add its start-up to the due time of every dynamic batch
    (docs/benchmarks.md, "Why the consumer works the way it does").
    """

    def __init__(self, fire: Callable[[], None], name: str = "batchgate-due-timer"):
        self._fire = fire
        self._cond = threading.Condition()
        self._due: float | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def set(self, at: float) -> None:
        with self._cond:
            self._due = at
            self._cond.notify_all()

    def fire_now(self) -> None:
        """Fire at once if a call is pending; nothing if it has fired already."""
        with self._cond:
            if self._due is not None:
                self._due = 0.0
                self._cond.notify_all()

    def cancel(self) -> bool:
        """Call off the pending call: True if it will not happen, False if it has already
        started (or nothing was set)."""
        with self._cond:
            pending, self._due = self._due is not None, None
            return pending

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed:
                    if self._due is None:
                        self._cond.wait()
                        continue
                    delay = self._due - time.monotonic()
                    if delay <= 0:
                        break
                    self._cond.wait(delay)
                if self._closed:
                    return
                self._due = None
            self._fire()
