"""`--batching continuous`: requests join and leave a running batch at every step.

The model is step-wise (consumer/stepwise.py). Between two steps the loop pops from the
queue with pop_batch.lua as a static consumer does (HIGH first, aging, deadlines, cost
buckets), whenever a slot is free: a popped batch (a "group") may be larger than the free
slots, so its members wait here, leased, and join as slots free, in pop order; nothing
more is popped while any waits. At most max_batch_size sequences run at once, and, with
a max_batch_cost, the running sequences' costs sum to at most that budget (a sequence
alone may exceed it).

Each finished sequence is answered at once through complete.lua with its group's batch id
(a batch can be completed a part at a time): fenced, so a group whose lease lapsed is
refused and its re-run elsewhere answers instead; the batch leaves the in-flight set with
its last member. The lease thread renews every open group's lease each tick. Streaming
goes through each group's StreamWriter (one stream_append.lua call per group per step),
fenced the same way: a group whose lease is found lost stops running at once.

A stop (SIGTERM) pops nothing more and finishes the sequences in hand, as a static
consumer finishes its batch.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import redis

from consumer.batch import (
    POP_NOW,
    Answers,
    Batch,
    Cost,
    Finished,
    Idle,
    Item,
    Next,
    PopNow,
    describe_error,
    expired_answer,
)
from consumer.lease import Held
from consumer.stepwise import checked_steps, is_step_model
from consumer.streaming import StreamWriter
from scheduler_core.connection import Backoff
from scheduler_core.errors import InvalidRequest
from scheduler_core.scripts import SentScript, preempt_keys
from scheduler_core.wire import Outcome

log = logging.getLogger("batchgate.consumer")

LOW = 2  # a request popped at this level or below (3: delayed past its deadline) yields
# After a pop between steps found nothing due, the next waits this long: a pop every step
# (a millisecond or less) would cost the consumer and Redis about as much CPU as a small
# model's steps; a request arriving meanwhile joins at most this much later.
IDLE_POP_GAP_S = 0.002


@dataclass(eq=False)
class Group:
    """One popped batch whose members run as separate sequences."""
    batch: Batch
    open: int  # members not yet answered
    writer: StreamWriter | None
    joined: list[Item] = field(default_factory=list)  # members the model took (tracing)
    first_step_ns: int = 0  # wall clock of its first member's first step (tracing)
    failed: int = 0  # members answered with the model's error (tracing)
    answered: Answers = field(default_factory=dict)  # for the observer, once all are in
    unsent: Answers = field(default_factory=dict)  # answered, not yet written
    ran: int = 0  # members the model ran
    lost: bool = False  # its lease lapsed: its members were dropped


@dataclass(eq=False)
class Member:
    group: Group
    item: Item
    payload: Any
    row: int  # its index in the group's StreamWriter
    handle: Any = None
    steps: int = 0  # steps it ran here (wasted if it is preempted)


def check_step_model(model: Any) -> None:
    """Refuse a model that cannot run step by step, naming the flag."""
    if not is_step_model(model):
        raise InvalidRequest("batching", "continuous batching needs a step-wise model "
                                         "(steps = True with add, step, remove and "
                                         "running: docs/models.md); this model runs whole "
                                         "batches only: use --batching static")


class ContinuousLoop:
    """The loop of a `--batching continuous` consumer; runs inside its Worker's services."""

    def __init__(self, worker: Any):
        self.worker = worker
        self.model = worker.model
        self.groups: dict[str, Group] = {}
        self.waiting: deque[Member] = deque()  # popped, not yet running
        self.running: dict[Any, Member] = {}  # handle -> member
        self.step_marker: Batch | None = None  # what the lease thread's hang clock watches
        self.steps = 0
        self.pending: tuple[SentScript, float] | None = None  # the pop sent between steps
        self.quiet_until = 0.0  # monotonic time before which no pop is sent between steps
        self.preempted = 0  # sequences given back to the queue for HIGH work
        self.wasted_steps = 0  # the steps those had run (recomputed later)

    def held(self) -> Held:
        return Held(current=lambda: None, in_model=lambda: self.step_marker,
                    completing=lambda: [g.batch for g in list(self.groups.values())])

    def about(self) -> dict[str, str]:
        """For the consumer's info hash (dashboards): open batch ids, running sequences."""
        return {"batch": ",".join(list(self.groups)[:16]), "batch_size": str(len(self.running)),
                "steps": str(self.steps), "preempted": str(self.preempted),
                "wasted_steps": str(self.wasted_steps)}

    # -- the loop ---------------------------------------------------------------------
    def run(self) -> None:
        w = self.worker
        backoff = Backoff(outage=w.outage)
        upcoming: Next = POP_NOW  # what the last pop (or idle wait) said
        # The pop between steps: sent before a step, read once its reply is in (after
        # that step, or a later one): Redis pops while the model runs, and no step waits
        # for it. Read before anything else waits (nothing running, a stop).
        # A batch popped before a stop arrived is run, not stranded until its lease lapses.
        while not w.stopping.is_set() or self.running or self.waiting \
                or isinstance(upcoming, Batch) or self.pending is not None:
            try:
                w._sweep_if_due()
                if self.pending is not None and (not self.running or self.pending[0].ready()):
                    upcoming = self._read_pending()
                if isinstance(upcoming, Batch):  # popped by the idle wait
                    self._join(upcoming)
                    upcoming = POP_NOW
                elif not self.running and self._may_pop() and isinstance(upcoming, PopNow):
                    upcoming = self._joined(w._pop())
                self._admit()
                if self.running and w.config.preempt and self._preempt():
                    # The HIGH work is popped now and joins this very step.
                    if self.pending is not None:
                        upcoming = self._read_pending()
                    if self._may_pop():
                        upcoming = self._joined(w._pop())
                    self._admit()
                if self.running:
                    if self._may_pop_between_steps():
                        self.pending = (SentScript(w.redis, *w._pop_call()), time.monotonic())
                    self._step()
                elif not self.waiting and not w.stopping.is_set() \
                        and isinstance(upcoming, Idle):
                    upcoming = w._idle(upcoming)  # blocks until work may be due, then pops
                backoff.succeeded()
            except redis.RedisError as exc:
                upcoming = POP_NOW
                # Its batch, if Redis popped one, is run; lost with the connection, it is
                # re-queued when its lease lapses.
                with contextlib.suppress(redis.RedisError):
                    if self.pending is not None:
                        upcoming = self._read_pending()
                backoff.sleep_after(exc)

    def _read_pending(self) -> Next:
        """The reply of the pop sent between steps; its batch joins."""
        sent, sent_s = self.pending
        self.pending = None
        step = self._joined(self.worker._parse(sent.reply()), sent_s)
        if isinstance(step, Idle):
            self.quiet_until = time.monotonic() + IDLE_POP_GAP_S
        return step

    def _may_pop(self) -> bool:
        """A free slot, nobody popped waiting here for one, no pop in flight, no stop
        asked, and no request running alone."""
        return not self.worker.stopping.is_set() and not self.waiting and self._free() > 0 \
            and self.pending is None and not self._alone()

    def _may_pop_between_steps(self) -> bool:
        """_may_pop, and the last pop between steps found work, or was IDLE_POP_GAP_S ago."""
        return self._may_pop() and self.quiet_until <= time.monotonic()

    def _alone(self) -> bool:
        """A request delivered before (its consumer crashed or hung: it may be the cause)
        runs alone, as pop_batch.lua isolates it in a batch of its own: in a shared step a
        poison request would take its step-mates down with it."""
        return any(m.item.attempts > 1 for m in self.running.values())

    def _joined(self, step: Next, sent_s: float | None = None) -> Next:
        """A popped batch joins (PopNow: pop again when a slot is free); Idle is kept."""
        if not isinstance(step, Batch):
            return step
        if sent_s is not None:  # its deadlines count from when the pop was sent
            step.received_s = sent_s
        self._join(step)
        return POP_NOW

    def _free(self) -> int:
        size = self.worker.policy.max_batch_size if self.worker.policy else 1
        return size - len(self.running)

    def _join(self, batch: Batch) -> None:
        w = self.worker
        w.requests_done += len(batch.items)
        w.batches_done += 1
        early, runnable = w._prepare(batch)
        group = Group(batch, len(runnable), None)
        if runnable:
            self.groups[batch.id] = group
            if w._model_streams:
                group.writer = w._stream_writer(batch, [item for item, _ in runnable])
                group.writer.start()
            self.waiting.extend(Member(group, item, payload, row)
                                for row, (item, payload) in enumerate(runnable))
        if early:
            group.open += len(early)
            if not runnable:
                self.groups[batch.id] = group
            for rid, answer in early.items():
                self._answer(group, rid, answer)
            self._flush()

    def _admit(self) -> None:
        """Members waiting here join the running batch while slots (and the token budget)
        allow; past their deadline they are answered instead."""
        w = self.worker
        budget = w.policy.max_batch_cost if w.policy else 0
        cost = sum(m.item.cost for m in self.running.values())
        reject_late = w.policy is None or w.policy.on_timeout == "reject"
        while self.waiting and self._free() > 0 and not self._alone():
            member = self.waiting[0]
            if budget and self.running and cost + member.item.cost > budget:
                break
            if member.item.attempts > 1 and self.running:
                break  # delivered before: it runs alone, once the others are done
            self.waiting.popleft()
            group, item = member.group, member.item
            if group.lost:
                continue
            if reject_late and item in group.batch.past_deadline():
                self._answer(group, item.id, expired_answer(item))
                continue
            try:
                member.handle = self.model.add(member.payload, Cost(item.cost, item.requested)
                                               if w._model_takes_costs else None)
                hash(member.handle)
            except Exception as exc:  # this request's failure, not the batch's
                self._answer(group, item.id, w._encode(item.id, False, (
                    type(exc).__name__, describe_error(exc))))
                continue
            self.running[member.handle] = member
            group.joined.append(item)
            cost += item.cost
        self._flush()

    def _step(self) -> None:
        w = self.worker
        self.step_marker = Batch("step", 0, [])  # a fresh one: the hang clock restarts
        size, started = len(self.running), time.perf_counter()
        if w.tracer is not None:
            now_ns = time.time_ns()
            for member in self.running.values():
                member.group.first_step_ns = member.group.first_step_ns or now_ns
        try:
            steps = checked_steps(self.model.step())
        except Exception as exc:  # every running sequence fails; the loop goes on
            message = describe_error(exc)
            log.warning("model step raised: %s: %s", type(exc).__name__, message)
            for handle, member in list(self.running.items()):
                member.group.failed += 1
                self._drop(handle)
                self._answer(member.group, member.item.id, w._encode(
                    member.item.id, False, (type(exc).__name__, message)))
            self._flush()
            return
        finally:
            self.step_marker = None
        self.steps += 1
        # A step is the model's call here: its size and time are what the consumer's
        # batch size and model time histograms show (a popped group's lifetime is not).
        on_step = getattr(w.observer, "on_step", None)
        if on_step is not None:
            on_step(size, int((time.perf_counter() - started) * 1e6))
        parts: dict[Group, dict[int, Any]] = {}
        for handle, part, result in steps:
            member = self.running.get(handle)
            if member is None:
                continue
            member.steps += 1
            if part is not None and member.group.writer is not None:
                parts.setdefault(member.group, {})[member.row] = part
            if result is not None:
                del self.running[handle]
                member.group.ran += 1
                self._answer(member.group, member.item.id,
                             w._encode(member.item.id, True, result))
        for group, rows in parts.items():
            if group.writer is not None and not group.writer.stale:
                group.writer.emit(rows)
            if group.writer is not None and group.writer.stale:
                self._lose(group)
        self._flush()

    def _preempt(self) -> bool:
        """--preempt: HIGH requests wait and every slot runs: give running LOW sequences
        (the latest admitted first: the least work lost) back to the queue, one per HIGH
        request waiting; they keep their arrival time and are recomputed later, and their
        streams get a restart marker. Whether any was given back (the caller pops the
        HIGH work at once)."""
        w = self.worker
        if self._free() > 0 or self.waiting:
            return False
        low = [m for m in self.running.values() if m.item.level >= LOW]
        if not low:
            return False
        high = int(w.redis.zcard(w.keys.pending(0)))
        if not high:
            return False
        given = False
        self._flush()  # answers first: the give-back may close their batch
        victims: dict[Group, list[Member]] = {}
        for member in low[-high:]:
            victims.setdefault(member.group, []).append(member)
        for group, members in victims.items():
            if group.lost:
                continue
            if group.writer is not None:
                group.writer.restart([m.item for m in members])
            ids = [m.item.id for m in members]
            reply = w.scripts.preempt(keys=preempt_keys(w.keys), args=[
                group.batch.id, len(ids), *ids, *(m.steps for m in members)])
            if int(reply[0]) == -1:
                self._lose(group)
                continue
            for m in members:
                self._drop(m.handle)
                self.wasted_steps += m.steps
            self.preempted += len(members)
            given = True
            group.open -= len(members)
            log.info("batch %s: %d LOW sequences given back to the queue for HIGH work",
                     group.batch.id, len(members))
            if group.open == 0:
                self._close(group)
        return given

    # -- answers ----------------------------------------------------------------------
    def _answer(self, group: Group, request_id: str, answer: tuple[Outcome, bytes]) -> None:
        group.answered[request_id] = group.unsent[request_id] = answer
        group.open -= 1

    def _flush(self) -> None:
        """Write the answers given since the last flush: one complete.lua call per group."""
        w = self.worker
        for group in list(self.groups.values()):
            if not group.unsent or group.lost:
                continue
            job = Finished(group.batch, dict(group.unsent), last=False)
            w._finish(job)  # raises (Redis refused it): kept, offered at the next flush
            group.unsent = {}
            if job.refused:
                self._lose(group)
            elif group.open == 0:
                self._close(group)

    def _close(self, group: Group) -> None:
        del self.groups[group.batch.id]
        w = self.worker
        if w.observer is not None:  # waits and outcomes; the steps were observed each
            w.observer.on_batch(group.batch, 0, 0, group.answered)
        if w.tracer is not None and group.first_step_ns:
            self._trace(group)

    def _trace(self, group: Group) -> None:
        """The group's spans, as a static batch's (consumer/tracing.py): each traced
        request's queue wait; the batch span from the pop to its last answer; the model
        span from its first step to its last answer, the steps shared with the running
        batch."""
        w = self.worker
        try:
            span = w.tracer.model_ran(group.batch, group.joined,
                                      w.policy.strategy.value if w.policy else "",
                                      group.first_step_ns, time.time_ns(), group.failed)
            w.tracer.completed(span)
        except Exception:  # tracing must never stop the consumer
            log.exception("tracing failed")

    def _lose(self, group: Group) -> None:
        """The group's lease lapsed (another consumer re-runs it): stop its sequences."""
        if group.lost:
            return
        group.lost = True
        self.groups.pop(group.batch.id, None)
        for handle, member in list(self.running.items()):
            if member.group is group:
                self._drop(handle)
        log.warning("batch %s: lease lost; its %d unanswered requests are dropped here "
                    "(another consumer re-runs them)", group.batch.id, group.open)

    def _drop(self, handle: Any) -> None:
        del self.running[handle]
        try:
            self.model.remove(handle)
        except Exception:  # the model's bookkeeping; the sequence is answered elsewhere
            log.exception("model.remove failed")


