"""consumer/overlap.py's timing of a fetch ahead, in process (the real consumers' overlap
is tested end to end in test_failures.py)."""

from __future__ import annotations

import threading
import time

from consumer.batch import POP_NOW
from consumer.overlap import Overlap


def overlap_recording(calls: list[float]) -> Overlap:
    def fetch():
        calls.append(time.monotonic())
        return POP_NOW

    return Overlap(fetch, lambda job: None, threading.Event())


def test_a_size_not_run_yet_is_fetched_by_the_nearest_sizes_time_not_at_once():
    calls: list[float] = []
    overlap = overlap_recording(calls)
    try:
        overlap.ran(4, 2.0)  # a batch of 4 took 2 s; 8 has not run
        armed = time.monotonic()
        overlap.prefetch(8)
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
        overlap.prefetch(8)
        deadline = time.monotonic() + 5
        while not calls and time.monotonic() < deadline:
            time.sleep(0.005)
        assert calls and calls[0] - armed < 1.0
        overlap.take()
    finally:
        overlap.close()
