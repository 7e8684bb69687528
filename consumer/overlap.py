"""Overlap the scheduler's own work with the model while a queue has a backlog.

Between two batches a consumer encodes the results, completes the batch, pops the next
one and decodes its payloads, while the model idles. While more requests wait
(pop_batch's `remaining` > 0), and the model's last run for the batch size outlasted a
fetch (`Prefetcher.lead_s`), two helper threads take that work off the model's path
(measured in docs/benchmarks.md, "Why the consumer works the way it does"):

- Prefetcher: shortly before the running batch is expected to end (less twice the recent
  time a fetch takes and 0.5 ms), pops the next batch and decodes it, so the model starts
  it as soon as it is free. The end expected is the longest of the last RECENT_RUNS run
  times of a batch of the same shape: its size and its cost as the policy's cost_mode
  counts it (Σcost, or size × the largest cost), so that a long generation is not timed
  by a short one of the same size. For a shape not run yet, the time of the costliest
  shape run below it, scaled up by the ratio of the costs (an over-estimate under a
  linear model), else that of the cheapest shape above it. Each errs late rather than
  early: a fetch that lands late costs the model a fetch time, one that lands early holds
  the requests it popped for the rest of the running batch, while another consumer may
  be free. For the same reason it is timed to the end, not the start: a HIGH request
  arriving after the pop waits for the batch popped. Popped at most a fetch time early,
  a HIGH request waits no longer than it would behind a batch popped at the model's end:
  t(max_batch) + t(1) at worst.
- Completer: encodes the finished batch's results and runs complete.lua while the model
  runs the next batch. At most two batches queue for it, so a slow Redis holds the model
  back rather than letting results pile up in memory; it is flushed before the consumer
  exits, so a stop never drops computed results.

A model faster than a fetch (a no-op, a tiny one) has nothing to hide a fetch behind;
there the consumer sends the next pop before the model runs and reads its reply after
encoding the results (`SentFetch`), while the Completer runs the completion: Redis pops
and completes while the consumer's Python works, with no second thread decoding. Only
while every recent run of the batch's shape was faster than a fetch: the batch popped so
waits for no more than that run and its encoding.

`Overlap` owns them: the consumer loop asks it whether a batch overlaps, and hands it the
fetch timing, the completions, the pop sent ahead and the take of the batch fetched.

A consumer killed (SIGKILL, OOM, a crashing payload) loses what it holds as before, now up
to five batches: the running one, one fetched ahead or sent for (its requests were charged
the delivery attempt) and up to three whose results were not written yet (one being
written, two waiting for the Completer while Redis is slower than the model). Their
leases lapse and they run again (at-least-once, as always). A batch holding a
re-delivered request - the one that may be crashing consumers - runs without overlap, so
a poison payload's crashes do not charge its neighbours in the queue an attempt each
time.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from consumer.batch import POP_NOW, Batch, Finished, Next
from consumer.due_timer import DueTimer

log = logging.getLogger("batchgate.consumer")

# Added to twice the recent fetch time when timing a prefetch (the simulator models the
# same lead: scheduler_core/ops/simulation.py, PREFETCH_MARGIN_US).
FETCH_MARGIN_S = 0.0005

# Overlap.plan's answers
MODEL, COMPLETION, ALONE = "model", "completion", "alone"

# A batch's shape: (its size, its cost units as the policy's cost_mode counts them).
Shape = tuple[int, int]
# Shapes whose model times are kept: without costs a shape per batch size; with costs of
# many values, a bound on the memory and on the scan for a shape not run yet.
MAX_SHAPES = 256
RECENT_RUNS = 4  # model times kept per shape; a fetch ahead is timed by their longest


@dataclass(frozen=True)
class SentFetch:
    """A pop sent to Redis, not read yet: `ready()` says whether its reply has arrived,
    `receive()` reads, parses and decodes it."""
    ready: Callable[[], bool]
    receive: Callable[[], Next]


class Overlap:
    """Decides, batch by batch, whether the next fetch and this batch's completion run
    beside the model, and runs them there (one Prefetcher, one Completer, or a pop sent
    ahead)."""

    def __init__(self, fetch: Callable[[], Next], finish: Callable[[Finished], object],
                 stopping: threading.Event, send: Callable[[], SentFetch] | None = None):
        self._prefetcher = Prefetcher(fetch)
        self._completer = Completer(finish)
        self._stopping = stopping
        self._send = send
        self._sent: tuple[float, SentFetch] | None = None  # (when sent, the pop)
        # the recent model times per shape (batch size, cost units); the newest
        # MAX_SHAPES shapes are kept, in the order last run
        self._recent: dict[Shape, deque[float]] = {}

    def plan(self, batch: Batch, shape: Shape) -> str:
        """How `batch`, whose requests the model runs as a batch of `shape`, overlaps:
        MODEL (fetch ahead, complete beside the model), COMPLETION (the model is faster
        than a fetch: nothing hides the fetch, so the next pop is sent before the model
        and read after the encoding, the completion runs beside them, and Redis works
        while the consumer's Python does) or ALONE.

        Only while a backlog waits and no stop was asked; not for a re-delivered request:
        it may crash the process, which would take a batch fetched ahead (and charge its
        requests an attempt) or results not written yet with it. The model counts as
        faster than a fetch if its quickest recent run of the shape was: a run slowed by
        the fetch's own thread (the GIL) must not keep the consumer fetching ahead.
        """
        if batch.remaining <= 0 or self._stopping.is_set() \
                or any(item.attempts != 1 for item in batch.items):
            return ALONE
        if not self._recent or self._expected_s(shape, min) >= self._prefetcher.lead_s:
            return MODEL
        return COMPLETION

    def prefetch(self, shape: Shape) -> None:
        """Arm the next fetch to land as the model is expected to finish a batch of
        `shape`: by the longest of its recent runs, late rather than early."""
        self._prefetcher.arm(time.monotonic() +
                             max(0.0, self._expected_s(shape, max) - self._prefetcher.lead_s))

    def _expected_s(self, shape: Shape, pick: Callable[[deque[float]], float]) -> float:
        """The model's time for `shape`, `pick` of its recent runs (module docstring; a
        fetch armed at 0 would pop a whole model time early). 0 before any batch ran."""
        recent = self._recent
        if shape in recent:
            return pick(recent[shape])
        if not recent:
            return 0.0
        units = shape[1]
        below = [s for s in recent if s[1] <= units]
        if below:
            ref = max(below, key=lambda s: (s[1], s[0]))
            return pick(recent[ref]) * units / max(ref[1], 1)
        return pick(recent[min(recent, key=lambda s: (s[1], s[0]))])

    def ran(self, shape: Shape, model_s: float) -> None:
        recent = self._recent
        times = recent.pop(shape, None) or deque(maxlen=RECENT_RUNS)  # re-inserted last
        times.append(model_s)
        recent[shape] = times
        if len(recent) > MAX_SHAPES:
            del recent[next(iter(recent))]

    def send_fetch(self, shape: Shape) -> None:
        """Send the next pop now, before the model runs a batch of `shape` (COMPLETION),
        if every recent run of it was faster than a fetch: the batch popped then waits at
        most about a fetch time (and the encoding) for the model. take() reads it."""
        if self._send is not None and self._expected_s(shape, max) < self._prefetcher.lead_s:
            self._sent = (time.perf_counter(), self._send())

    def fetch_here(self) -> Next:
        """Fetch on the consumer's own thread (no fetch ahead was armed), timed like a
        fetch ahead: whether to fetch ahead goes by the recent fetch time, which only
        fetches made ahead would otherwise measure, so one slow fetch ahead could turn
        fetching ahead off for good."""
        return self._prefetcher.fetch_timed()

    def complete(self, job: Finished) -> None:
        self._completer.submit(job)

    def _receive(self) -> Next:
        """Read the pop sent ahead. Its time since sending is the fetch's when the reply
        had not arrived yet; otherwise only a bound (the consumer worked meanwhile),
        which may lower the recent fetch time but not raise it."""
        assert self._sent is not None
        sent_at, sent = self._sent
        self._sent = None
        waited = not sent.ready()
        outcome = sent.receive()
        if isinstance(outcome, Batch):
            self._prefetcher.record(time.perf_counter() - sent_at, exact=waited)
        return outcome

    def take(self) -> Next:
        """The next step fetched ahead, fetched now if its time has not come (called off
        if a stop was asked), or the pop sent ahead; POP_NOW if neither."""
        if self._sent is not None:
            return self._receive()
        got = self._prefetcher.take(fetch_now=not self._stopping.is_set())
        if got is None:
            return POP_NOW
        ok, value = got
        if not ok:
            raise value
        return value

    def salvage(self) -> Next:
        """After an error: a batch already fetched ahead or sent for (it holds our
        requests), else POP_NOW; a fetch not started yet is called off."""
        if self._sent is not None:
            with contextlib.suppress(Exception):  # a broken connection: its lease lapses
                if isinstance(got := self._receive(), Batch):
                    return got
            return POP_NOW
        got = self._prefetcher.take(fetch_now=False)
        if got is not None and got[0] and isinstance(got[1], Batch):
            return got[1]
        return POP_NOW

    def fetched(self) -> Batch | None:
        """The batch fetched ahead, waiting for the model (the lease thread renews it,
        or gives it back when the model hangs)."""
        return self._prefetcher.ready()

    def completing(self) -> list[Batch]:
        """Batches whose results are being written (the lease thread renews them)."""
        return self._completer.batches()

    def close(self) -> None:
        """Write every computed result, then stop both threads."""
        self._completer.close()
        self._prefetcher.close()


class Prefetcher:
    """One fetch at a time, run on a helper thread at a set time (or at once on take())."""

    def __init__(self, fetch: Callable[[], Next]):
        self._fetch = fetch
        self._cond = threading.Condition()
        self._state = "idle"  # idle -> armed -> fetching -> done -> (taken) idle
        self._result: tuple[bool, Next | BaseException] | None = None
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

    def take(self, fetch_now: bool = True) -> tuple[bool, Next | BaseException] | None:
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

    def ready(self) -> Batch | None:
        """The fetched batch waiting to be taken, if any."""
        result = self._result
        return result[1] if result is not None and isinstance(result[1], Batch) else None

    def close(self) -> None:
        self._timer.close()

    def fetch_timed(self) -> Next:
        """Fetch on the caller's thread; a fetch that brought a batch counts towards the
        recent fetch time."""
        started = time.perf_counter()
        outcome = self._fetch()
        if isinstance(outcome, Batch):
            self.record(time.perf_counter() - started)
        return outcome

    def record(self, took: float, exact: bool = True) -> None:
        """A fetch took `took`, from its start to its decoded batch (`exact`), or at most
        that (a pop sent ahead whose reply was waiting: the caller worked meanwhile)."""
        with self._cond:
            if exact or (self._fetch_s and took < self._fetch_s):
                self._timed(took)

    def _timed(self, took: float) -> None:
        self._fetch_s = took if not self._fetch_s else 0.8 * self._fetch_s + 0.2 * took

    def _run(self) -> None:
        with self._cond:
            self._state = "fetching"
        started = time.perf_counter()
        result: tuple[bool, Next | BaseException]
        try:
            result = (True, self._fetch())
        except BaseException as exc:  # handed to the consumer loop, which handles it
            result = (False, exc)
        took = time.perf_counter() - started
        with self._cond:
            self._timed(took)
            self._result, self._state = result, "done"
            self._cond.notify_all()


class Completer:
    """Runs `finish(job)` for each submitted job, in order, on a helper thread."""

    def __init__(self, finish: Callable[[Finished], object]):
        self._finish = finish
        self._jobs: queue.Queue[Finished | None] = queue.Queue(maxsize=2)
        self._open: list[Finished] = []  # jobs submitted and not finished
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="batchgate-complete",
                                        daemon=True)
        self._thread.start()

    def submit(self, job: Finished) -> None:
        with self._lock:
            self._open.append(job)
        self._jobs.put(job)

    def batches(self) -> list[Batch]:
        """Batches whose results are not written yet."""
        with self._lock:
            return [job.batch for job in self._open]

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
