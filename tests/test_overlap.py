"""consumer/overlap.py's timing of a fetch ahead, in process (the real consumers' overlap
is tested end to end in test_failures.py)."""

from __future__ import annotations

import threading
import time

from consumer.batch import POP_NOW, Batch, Item
from consumer.overlap import COMPLETION, MAX_SHAPES, MODEL, Overlap
from scheduler_core.wire import Outcome


def overlap_recording(calls: list[float]) -> Overlap:
    def fetch():
        calls.append(time.monotonic())
        return POP_NOW

    return Overlap(fetch, lambda job: None, threading.Event())


def test_a_size_not_run_yet_is_fetched_by_a_smaller_sizes_time_not_at_once():
    calls: list[float] = []
    overlap = overlap_recording(calls)
    try:
        overlap.ran((4, 4), 2.0)  # a batch of 4 took 2 s; 8 has not run
        armed = time.monotonic()
        overlap.prefetch((8, 8))
        time.sleep(0.2)
        assert calls == []  # armed for ~2 s less the lead, not fired at once
        overlap.take()  # the model ended early: fetched now
        assert len(calls) == 1 and calls[0] - armed >= 0.2
    finally:
        overlap.close()


def test_before_any_batch_ran_the_fetch_ahead_is_armed_at_once():
    calls: list[float] = []
    overlap = overlap_recording(calls)
    try:
        armed = time.monotonic()
        overlap.prefetch((8, 8))
        deadline = time.monotonic() + 5
        while not calls and time.monotonic() < deadline:
            time.sleep(0.005)
        assert calls and calls[0] - armed < 1.0
        overlap.take()
    finally:
        overlap.close()


def test_a_costly_batch_is_timed_by_its_cost_not_by_a_cheap_batch_of_its_size():
    """A generation of 256 tokens after one of 16, both batches of 1: the fetch ahead is
    not armed by the short one's time, which would pop the next batch (and hold its
    requests) for most of the long one."""
    calls: list[float] = []
    overlap = overlap_recording(calls)
    try:
        overlap.ran((1, 16), 0.01)
        assert overlap._expected_s((1, 256), max) >= 0.01 * 16  # scaled up: late, never early
        assert overlap._expected_s((1, 16), max) == 0.01
        overlap.ran((1, 256), 0.5)
        assert overlap._expected_s((1, 256), max) == 0.5  # each shape by its own times
        assert overlap._expected_s((1, 16), max) == 0.01
        assert overlap._expected_s((2, 32), max) == 0.02  # the costliest below, scaled up
        armed = time.monotonic()
        overlap.prefetch((1, 256))
        time.sleep(0.3)
        assert calls == []  # not fired after the short one's 10 ms
        overlap.take()
        assert len(calls) == 1 and calls[0] - armed >= 0.3
    finally:
        overlap.close()


def test_the_newest_shapes_are_kept():
    overlap = overlap_recording([])
    try:
        for units in range(1, MAX_SHAPES + 2):
            overlap.ran((1, units), units / 1000)
        overlap.ran((1, 2), 0.5)  # run again: kept as the newest
        overlap.ran((1, 10_000), 1.0)
        assert len(overlap._recent) == MAX_SHAPES
        assert (1, 1) not in overlap._recent and (1, 3) not in overlap._recent
        assert overlap._expected_s((1, 2), max) == 0.5
    finally:
        overlap.close()


def test_a_shape_is_timed_by_its_longest_recent_run():
    """A fetch ahead errs late: one timed by a quick run of a shape whose times vary would
    pop the next batch early and hold its requests."""
    overlap = overlap_recording([])
    try:
        for seconds in (0.2, 0.1, 0.12, 0.11):
            overlap.ran((1, 256), seconds)
        assert overlap._expected_s((1, 256), max) == 0.2
        # Whether to fetch ahead at all goes by the quickest: one slow run (the GIL held
        # by the fetch's own thread, say) does not make a fast model slower than a fetch.
        assert overlap._expected_s((1, 256), min) == 0.1
        overlap.ran((1, 256), 0.1)  # the 0.2 s run is RECENT_RUNS runs old now
        assert overlap._expected_s((1, 256), max) == 0.12
    finally:
        overlap.close()


def test_the_consumers_own_fetches_are_timed_so_one_slow_fetch_ahead_is_not_final():
    """One slow fetch ahead (a GC pause, a busy Redis) makes the recent fetch time longer
    than the model, so the consumer stops fetching ahead and pops on its own thread. Those
    pops are timed too: once they are quick again, fetching ahead resumes."""
    item = Item(id="r", envelope=b"", arrival_us=0, attempts=1, producer="p", state=Outcome.RUN,
                level=1)
    batch = Batch(id="b", popped_us=0, items=[item], remaining=10)
    slow = [True]

    def fetch():
        if slow[0]:
            time.sleep(0.05)
        return batch

    overlap = Overlap(fetch, lambda job: None, threading.Event())
    try:
        overlap.ran((1, 1), 0.01)  # the model takes 10 ms
        assert overlap.plan(batch, (1, 1)) == MODEL
        overlap.prefetch((1, 1))
        assert overlap.take() is batch  # that fetch ahead took 50 ms
        assert overlap.plan(batch, (1, 1)) == COMPLETION  # slower than the model
        slow[0] = False
        for _ in range(30):
            assert overlap.fetch_here() is batch
        assert overlap.plan(batch, (1, 1)) == MODEL
    finally:
        overlap.close()
