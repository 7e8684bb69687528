"""One consumer process serving every shard of a sharded queue (docs/scaling.md).

Each shard is a complete queue with its own Worker (consumer/worker.py: its lease
thread, sweep, derived delay, due times), all sharing one model, one connection pool and
one stop event; this loop decides which shard each batch comes from:

Under the priority strategy (fifo and dynamic do not serve levels apart: their peek only
says which shards hold requests, popped in turn):

1. peek: the oldest HIGH request of every shard (ZRANGE pending:0 0 0) and whether it
   holds anything at all (one pipelined round trip): an empty shard is not popped;
2. pop the shards that hold HIGH first, oldest HIGH first; then the others, round-robin;
   the first pop that yields a batch is run. While a shard seen holding HIGH yields no
   batch (its HIGH expired meanwhile, say), no other shard is popped: the loop peeks again;
3. nothing due anywhere: block until any shard's marker wakes us or the earliest due time
   of a shard passes.

So a consumer never runs a NORMAL or LOW batch from one shard while another shard held a
HIGH request at its peek. A HIGH request arriving on shard B after the peek and before
the pop of shard A is not seen: it waits for that batch of A (its model time), or for
another consumer. Overlap (prefetching the next batch) is off here: a prefetched batch
would be chosen before the model's run, without the peek.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import replace
from typing import Any

import redis

from consumer.batch import Batch, Idle
from consumer.config import ConsumerConfig
from consumer.due_timer import DueTimer
from consumer.loader import BatchModel
from consumer.worker import IDLE_BLOCK_S, Worker, check_eviction_policy
from scheduler_core.admin import ensure_policy
from scheduler_core.connection import Backoff, Outage, connect, dedicated
from scheduler_core.policy import Policy, Strategy, describe_policy
from scheduler_core.scripts import ScriptPipeline
from scheduler_core.shards import shard_name

log = logging.getLogger("batchgate.consumer")


class ShardedConsumer:
    """The loop of a consumer of a queue whose policy has `shards` > 1. Same surface as
    Worker where consumer/api.py uses it (prepare, run, stop, stopping, policy, delay)."""

    def __init__(self, model: BatchModel, config: ConsumerConfig,
                 client: redis.Redis | None = None, *, tracer: Any = None,
                 observer: Any = None):
        self.config = config
        self.redis = client or connect(config.redis_url)
        self.stopping = threading.Event()
        self.outage = Outage(f"consumer {config.name}")  # shared by every shard's loops
        self.shards: list[Worker] = []
        self.policy: Policy | None = None
        self.model, self.tracer, self.observer = model, tracer, observer
        self._next = 0  # round-robin start among shards without HIGH
        self._due_timer: DueTimer | None = None
        self._wakers: _Wakers | None = None

    @property
    def shards_changed(self) -> bool:
        return any(shard.shards_changed for shard in self.shards)

    @property
    def delay(self) -> Any:  # consumer/metrics.py reads the derived delay of shard 0
        return self.shards[0].delay

    # -- lifecycle ------------------------------------------------------------------
    def prepare(self) -> Policy:
        """Settle the logical queue's policy (which every shard's mirrors), then one
        Worker per shard."""
        self.policy = ensure_policy(self.redis, self.config.queue, self.config.policy)
        check_eviction_policy(self.redis)
        self.shards = []
        for index in range(self.policy.shards):
            config = replace(self.config, queue=shard_name(self.config.queue, index),
                             overlap=False, policy=self.config.policy if index == 0 else {})
            shard = Worker(self.model, config, client=self.redis, tracer=self.tracer,
                           observer=self.observer)
            shard.stopping = self.stopping
            if self.shards:
                shard.info = self.shards[0].info  # one heartbeat entry's details for all
            shard.outage = self.outage
            shard.pop_after_complete = False
            shard.prepare()
            self.shards.append(shard)
        return self.policy

    def stop(self) -> None:
        self.stopping.set()

    def run(self) -> None:
        if self.policy is None:
            self.prepare()
        with contextlib.ExitStack() as stack:
            for shard in self.shards:
                stack.enter_context(shard.services())
            if _is_cluster(self.redis):
                self._wakers = stack.enter_context(_Wakers(self.redis, self.shards,
                                                           self.stopping))
            log.info("consumer %s serving queue %r over %d shards with %s", self.config.name,
                     self.config.queue, len(self.shards),
                     describe_policy(self.policy, self.shards[0].delay.delay_ms))
            backoff = Backoff(outage=self.outage)
            try:
                while not self.stopping.is_set():
                    try:
                        for shard in self.shards:
                            shard._sweep_if_due()
                        picked = self._pick()
                        if isinstance(picked, tuple):
                            shard, batch = picked
                            shard._process(batch)  # popped: run even if a stop arrived
                        elif picked is not None:
                            self._idle(picked)
                        backoff.succeeded()
                    except redis.RedisError as exc:
                        # As Worker.run: wait it out; an abandoned batch keeps no lease,
                        # so a sweep re-queues it.
                        for shard in self.shards:
                            shard._current = None
                        backoff.sleep_after(exc)
            finally:
                self.stopping.set()
                if self._due_timer is not None:
                    self._due_timer.close()

    # -- choosing the shard -----------------------------------------------------------
    def _peek(self, priority: bool) -> tuple[list[float | None], list[bool]]:
        """One pipelined round trip: per shard, the arrival (µs) of its oldest HIGH
        request (None: none, or not asked for), and whether it holds anything to pop."""
        pipe = self.redis.pipeline(transaction=False)
        for shard in self.shards:
            keys = shard.keys
            pipe.zrange(keys.pending_high, 0, 0, withscores=True)
            for key in (keys.pending_normal, keys.pending_low, keys.delayed):
                pipe.zcard(key)
        replies = pipe.execute()
        high, busy = [], []
        for i in range(len(self.shards)):
            first, *counts = replies[i * 4:i * 4 + 4]
            high.append(first[0][1] if first and priority else None)
            busy.append(bool(first) or any(counts))
        return high, busy

    def _order(self, high: list[float | None]) -> tuple[list[int], int]:
        """Shards to pop in order, and how many of the first hold HIGH."""
        with_high = sorted((at, i) for i, at in enumerate(high) if at is not None)
        count = len(self.shards)
        rest = [(self._next + k) % count for k in range(count)]
        first = [i for _, i in with_high]
        return first + [i for i in rest if high[i] is None], len(first)

    def _pick(self) -> tuple[Worker, Batch] | Idle | None:
        """A popped batch and its shard; else Idle until the earliest due time of a shard
        (None: pop again at once). Shards holding nothing are not popped."""
        policy = self.shards[0].policy  # followed by shard 0's lease thread
        # fifo, dynamic: levels are not served apart, within a shard or across
        high, busy = self._peek(policy is not None and policy.strategy is Strategy.PRIORITY)
        order, with_high = self._order(high)
        due: list[float] = []
        for position, index in enumerate(order):
            if with_high and position == with_high and not self.config.only_bucket:
                # A shard seen with HIGH gave no batch: peek again first. (A dedicated
                # consumer's pop leaves other buckets' HIGH requests: it goes on.)
                return None
            if not busy[index]:
                continue
            shard = self.shards[index]
            step = shard._pop()
            if isinstance(step, Batch):
                if position >= with_high:
                    self._next = (index + 1) % len(self.shards)
                return shard, step
            if not isinstance(step, Idle):
                return None  # expired requests or restored a policy: pop again
            if step.due_in_ms is not None:
                due.append(step.due_in_ms)
        return Idle(min(due)) if due else Idle()

    # -- waiting --------------------------------------------------------------------
    def _idle(self, idle: Idle) -> None:
        """Block until an arrival on any shard or the earliest due time. On one Redis,
        one BZPOPMIN over every shard's marker and shard 0's wake key (its due timer,
        as Worker._idle); on a cluster, where one BZPOPMIN takes keys of one slot
        only, a thread per shard blocks on its marker (_Wakers)."""
        wait_s = IDLE_BLOCK_S if idle.due_in_ms is None else \
            min(IDLE_BLOCK_S, idle.due_in_ms / 1000)
        if self._wakers is not None:
            self._wakers.wait(wait_s)
            return
        first = self.shards[0]
        wake_key = first.keys.wake(self.config.name)
        if self._due_timer is None:
            self._due_timer = DueTimer(lambda: first._self_wake(wake_key))
        if idle.due_in_ms is not None and wait_s < IDLE_BLOCK_S:
            self._due_timer.set(time.monotonic() + wait_s)
        pipe = ScriptPipeline(self.redis)
        pipe.command("bzpopmin", [*(s.wake_marker for s in self.shards), wake_key],
                     IDLE_BLOCK_S)
        try:
            pipe.execute()
        finally:
            self._due_timer.cancel()


class _Wakers:
    """Cluster only: one thread per shard blocks on that shard's marker (on a client of
    its own) while the loop is idle, and wakes the loop."""

    def __init__(self, client: Any, shards: list[Worker], stopping: threading.Event):
        self._idle = threading.Event()
        self._woken = threading.Event()
        self._stopping = stopping
        self._clients = [dedicated(client) for _ in shards]
        self._threads = [threading.Thread(target=self._watch, args=(own, s.wake_marker),
                                          name=f"waker-{s.config.queue}", daemon=True)
                         for own, s in zip(self._clients, shards, strict=True)]

    def __enter__(self) -> _Wakers:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopping.set()
        self._idle.set()
        for thread in self._threads:
            thread.join(timeout=2 * IDLE_BLOCK_S)
        for own in self._clients:
            with contextlib.suppress(redis.RedisError):
                own.close()

    def wait(self, timeout: float) -> None:
        self._idle.set()
        try:
            self._woken.wait(timeout)
        finally:
            self._idle.clear()
            self._woken.clear()

    def _watch(self, client: Any, marker: str) -> None:
        while not self._stopping.is_set():
            if not self._idle.wait(IDLE_BLOCK_S) or self._stopping.is_set():
                continue
            try:
                if client.bzpopmin([marker], IDLE_BLOCK_S):
                    self._woken.set()
            except redis.RedisError:
                time.sleep(IDLE_BLOCK_S)  # the loop's own calls report the outage


def _is_cluster(client: Any) -> bool:
    return isinstance(client, redis.RedisCluster)
