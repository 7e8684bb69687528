"""Overlap the scheduler's own work with the model while a queue has a backlog.

Between two batches a consumer encodes the results, completes the batch, pops the next
one and decodes its payloads: 1-2 ms for a batch of 32, during which the model idles (5-10%
of a 20 ms batch). While more requests wait (pop_batch's `remaining` > 0), and the
model's last run for the batch size outlasted a fetch (`Prefetcher.lead_s`), two helper
threads take that work off the model's path:

- Prefetcher: shortly before the running batch is expected to end (its last run time for
  that size, less the recent time a fetch takes), pops the next batch and decodes it, so
  the model starts it as soon as it is free. Timed to the end, not the start: a batch
  popped early holds its requests, and a HIGH request arriving after that pop waits for
  it. Popped at most a fetch time early, a HIGH request waits no longer than it would
  behind a batch popped at the model's end (the seed's bound: t(max_batch) + t(1)).
- Completer: encodes the finished batch's results and runs complete.lua while the model
  runs the next batch. At most two batches queue for it, so a slow Redis holds the model
  back rather than letting results pile up in memory; it is flushed before the consumer
  exits, so a stop never drops computed results.

A consumer killed (SIGKILL, OOM, a crashing payload) loses what it holds as before, now up
to three batches: the running one, one fetched ahead (its requests were charged the
delivery attempt) and one whose results were not written yet. Their leases lapse and they
run again (at-least-once, as always). A batch holding a re-delivered request - the one
that may be crashing consumers - runs without overlap, so a poison payload's crashes do
not charge its neighbours in the queue an attempt each time.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from consumer.due_timer import DueTimer

log = logging.getLogger("batchgate.consumer")

FETCH_MARGIN_S = 0.0005  # added to twice the recent fetch time when timing a prefetch


class Prefetcher:
    """One fetch at a time, run on a helper thread at a set time (or at once on take())."""

    def __init__(self, fetch: Callable[[], Any]):
        self._fetch = fetch
        self._cond = threading.Condition()
        self._state = "idle"  # idle -> armed -> fetching -> done -> (taken) idle
        self._result: tuple[bool, Any] | None = None
        self._fetch_s = 0.0  # recent fetch time (EWMA)
        self._timer = DueTimer(self._run, name="batchgate-prefetch")

    @property
    def lead_s(self) -> float:
        """How long before the model's expected end to start fetching."""
        return 2 * self._fetch_s + FETCH_MARGIN_S

    def arm(self, at: float) -> None:
        """Fetch at time.monotonic() `at`."""
        with self._cond:
            if self._state != "idle":
                return
            self._state = "armed"
        self._timer.set(at)

    def take(self, fetch_now: bool = True) -> tuple[bool, Any] | None:
        """The fetched outcome as (ok, value or exception); None if nothing was armed, or
        (fetch_now=False) if the fetch had not started yet: then it is called off."""
        with self._cond:
            if self._state == "idle":
                return None
        if not fetch_now and self._timer.cancel():
            with self._cond:
                self._state = "idle"
            return None
        self._timer.fire_now()
        with self._cond:
            while self._state != "done":
                self._cond.wait()
            result, self._result, self._state = self._result, None, "idle"
            return result

    def ready(self) -> Any:
        """The fetched value waiting to be taken, if any (the lease thread renews it)."""
        result = self._result
        return result[1] if result is not None and result[0] else None

    def close(self) -> None:
        self._timer.close()

    def _run(self) -> None:
        with self._cond:
            self._state = "fetching"
        started = time.perf_counter()
        try:
            result: tuple[bool, Any] = (True, self._fetch())
        except BaseException as exc:  # handed to the consumer loop, which handles it
            result = (False, exc)
        took = time.perf_counter() - started
        with self._cond:
            self._fetch_s = took if not self._fetch_s else 0.8 * self._fetch_s + 0.2 * took
            self._result, self._state = result, "done"
            self._cond.notify_all()


class Completer:
    """Runs `finish(job)` for each submitted job, in order, on a helper thread."""

    def __init__(self, finish: Callable[[Any], None], batch_of: Callable[[Any], Any]):
        self._finish = finish
        self._batch_of = batch_of
        self._jobs: queue.Queue[Any] = queue.Queue(maxsize=2)
        self._open: list[Any] = []  # jobs submitted and not finished
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="batchgate-complete",
                                        daemon=True)
        self._thread.start()

    def submit(self, job: Any) -> None:
        with self._lock:
            self._open.append(job)
        self._jobs.put(job)

    def batches(self) -> list[Any]:
        """Batches whose results are not written yet (the lease thread renews them)."""
        with self._lock:
            return [self._batch_of(job) for job in self._open]

    def close(self) -> None:
        """Finish every submitted job, then stop."""
        self._jobs.put(None)
        self._thread.join()

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._finish(job)
            except Exception:  # never lose the thread: later batches still complete
                log.exception("completing a batch failed; its lease lapses and it re-runs")
            finally:
                with self._lock:
                    self._open.remove(job)
