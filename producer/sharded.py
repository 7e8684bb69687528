"""ShardedProducer: submits to a sharded queue (docs/scaling.md, "Sharded queues").

One Producer per shard (scheduler_core/shards.py), all on one connection pool; each keeps
its own inbox and listener, so a handle behaves exactly as with one queue. The shard count
is read from the queue's policy when the producer is made, then again at most every
SHARDS_REFRESH_S on the submit path, and at once when a shard refuses a submit because
`policy set --shards` dropped it (ShardRetired): the submit is then placed again.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import zlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import redis
import redis.asyncio

from producer.aio import AsyncHandle, AsyncProducer
from producer.sync import Handle, Producer
from scheduler_core.connection import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_REDIS_URL,
    aclose_node_clients,
    close_node_clients,
    connect,
    connect_async,
)
from scheduler_core.errors import InvalidRequest, ShardRetired
from scheduler_core.keys import QueueKeys, validate_queue_name
from scheduler_core.policy import Priority
from scheduler_core.shards import check_placement, shard_count, shard_count_async, shard_name
from scheduler_core.wire import Result, decode_result

# least_depth: the shards' depths are read at most this often; between reads, the
# requests this producer placed are added to the last read.
DEPTH_REFRESH_S = 0.05
# How stale a producer's shard count may be before a submit re-reads it (one HGET).
SHARDS_REFRESH_S = 2.0


class Placer:
    """Which shard each submit goes to; shared by ShardedProducer and
    AsyncShardedProducer, which read the depths (least_depth) when `stale()` says so."""

    def __init__(self, shards: int, placement: str):
        self.shards = shards
        self.placement = placement
        self._turn = itertools.count()
        self._lock = threading.Lock()
        self._depths = [0] * shards
        self._depths_at = float("-inf")

    def keyed(self, key: object) -> int:
        return zlib.crc32(str(key).encode()) % self.shards

    def stale(self, key: object) -> bool:
        return key is None and self.shards > 1 and self.placement == "least_depth" and \
            time.monotonic() - self._depths_at >= DEPTH_REFRESH_S

    def read(self, depths: list[int]) -> None:
        with self._lock:
            self._depths, self._depths_at = depths, time.monotonic()

    def pick(self, count: int, key: object) -> int:
        if key is not None:  # str or not, Producer's validation names it
            return self.keyed(key)
        if self.shards == 1:
            return 0
        if self.placement == "round_robin":
            return next(self._turn) % self.shards
        with self._lock:
            index = min(range(self.shards), key=lambda i: (self._depths[i], i))
            self._depths[index] += count
        return index

    def groups(self, keys: list[str | None]) -> dict[int, list[int]]:
        """Indexes of submit_many's requests per shard of their key (-1: no key)."""
        out: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            out.setdefault(self.keyed(key) if key is not None else -1, []).append(i)
        return out


def reshaped(queue: str, count: int, producers: list[Any], retired: list[Any],
             make: Any) -> tuple[list[Any], list[Any]]:
    """(the producers of shards 0..count-1, those of dropped shards): a shard's existing
    producer is kept (its handles, its inbox), one is made for each new shard."""
    old = {p.keys.queue: p for p in [*producers, *retired]}
    names = [shard_name(queue, i) for i in range(count)]
    kept = [old.pop(name, None) or make(name) for name in names]
    return kept, list(old.values())


def depth_reads(pipe: Any, producers: Sequence[Any]) -> None:
    for producer in producers:
        for key in producer.keys.pending_all:
            pipe.zcard(key)


def depths_of(counts: list[int], shards: int) -> list[int]:
    return [sum(counts[i * 3:i * 3 + 3]) for i in range(shards)]


def needs_split(payload_count: int, keys: list[str | None] | None, shards: int) -> bool:
    if not keys or shards == 1 or all(k is None for k in keys):
        return False
    if len(keys) != payload_count:
        raise InvalidRequest("idempotency_keys", f"{len(keys)} keys for {payload_count} "
                                                 "payloads")
    return True


class ShardedProducer:
    """Places each submit on one shard of `queue`: `placement` "round_robin" (each call
    the next shard) or "least_depth" (the shard with the fewest waiting requests). A
    request with an idempotency key goes to the shard its key hashes to, so that a
    repeat finds the first. submit_many places all its requests on one shard (the call
    stays atomic), except keyed ones: each goes to its key's shard, one atomic call per
    shard. Other arguments are Producer's."""

    def __init__(self, redis_url: str = DEFAULT_REDIS_URL, queue: str = "default", *,
                 placement: str = "round_robin", client: redis.Redis | None = None,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS, **producer_args: Any):
        self.placement = check_placement(placement)
        self.queue = validate_queue_name(queue)
        self._redis = client or connect(redis_url, max_connections)
        self._owns_client = client is None
        self._args = producer_args
        self._resizing = threading.Lock()
        self.producers: list[Producer] = []
        self._retired: list[Producer] = []  # of dropped shards: their handles still resolve
        self._resize(shard_count(self._redis, queue))

    @property
    def shards(self) -> int:
        return len(self.producers)

    def connect(self) -> ShardedProducer:
        """Producer.connect() for every shard's producer; returns this producer."""
        for producer in self.producers:
            producer.connect()
        return self

    def refresh(self, force: bool = False) -> int:
        """Re-read the shard count (if SHARDS_REFRESH_S has passed, or `force`); the
        count now placed on."""
        if force or time.monotonic() >= self._refresh_at:
            try:
                self._resize(shard_count(self._redis, self.queue))
            except redis.RedisError:
                if force:
                    raise
                # the submit itself meets the outage (and Producer's handling of it)
                self._refresh_at = time.monotonic() + SHARDS_REFRESH_S
        return self.shards

    def _resize(self, count: int) -> None:
        with self._resizing:
            self._refresh_at = time.monotonic() + SHARDS_REFRESH_S
            if count == len(self.producers):
                return
            self.producers, self._retired = reshaped(
                self.queue, count, self.producers, self._retired,
                lambda name: Producer(queue=name, client=self._redis, **self._args))
            self._placer = Placer(count, self.placement)

    # -- placement ------------------------------------------------------------------
    def _shard_for(self, count: int, key: object) -> Producer:
        self.refresh()
        producers, placer = self.producers, self._placer
        if placer.stale(key):
            pipe = self._redis.pipeline(transaction=False)
            depth_reads(pipe, producers)
            placer.read(depths_of(pipe.execute(), len(producers)))
        return producers[placer.pick(count, key)]

    # -- Producer's API -------------------------------------------------------------
    def submit(self, payload: Any, priority: Priority | int | str = Priority.NORMAL,
               deadline_ms: float | None = None, idempotency_key: str | None = None,
               cost: int = 1, store_result: bool = False, tenant: str | None = None
               ) -> Handle:
        try:
            return self._shard_for(1, idempotency_key).submit(
                payload, priority, deadline_ms, idempotency_key, cost, store_result, tenant=tenant)
        except ShardRetired:  # nothing was written: place it on a shard of the new count
            self.refresh(force=True)
            return self._shard_for(1, idempotency_key).submit(
                payload, priority, deadline_ms, idempotency_key, cost, store_result, tenant=tenant)

    def submit_many(self, payloads: Iterable[Any], priority: Priority | int | str =
                    Priority.NORMAL, deadline_ms: float | None = None,
                    idempotency_keys: list[str | None] | None = None,
                    cost: int | Sequence[int] = 1,
                    store_result: bool = False, tenant: str | None = None) -> list[Handle]:
        return self._place_many(list(payloads), priority, deadline_ms, idempotency_keys, cost,
                                store_result, retry=True, tenant=tenant)

    def _place_many(self, payloads: list[Any], priority: Priority | int | str,
                    deadline_ms: float | None, idempotency_keys: list[str | None] | None,
                    cost: int | Sequence[int], store_result: bool, retry: bool,
                    tenant: str | None = None) -> list[Handle]:
        """submit_many; with `retry`, requests a dropped shard refused (nothing written
        for them) are placed again once on the re-read shard count."""
        if not needs_split(len(payloads), idempotency_keys, self.shards):
            try:
                return self._shard_for(len(payloads), None).submit_many(
                    payloads, priority, deadline_ms, idempotency_keys, cost, store_result,
                    tenant=tenant)
            except ShardRetired:
                if not retry:
                    raise
                self.refresh(force=True)
                return self._place_many(payloads, priority, deadline_ms, idempotency_keys,
                                        cost, store_result, retry=False, tenant=tenant)
        assert idempotency_keys is not None
        # Each keyed request to its key's shard (a repeat must find the first); one call
        # per shard, each atomic. A repeat of the whole call after an error is safe: the
        # keys answer the requests already accepted with their first ids.
        costs = list(cost) if isinstance(cost, Sequence) else None
        handles: list[Handle | None] = [None] * len(payloads)
        refused: list[int] = []
        producers, placer = self.producers, self._placer
        for shard, indexes in placer.groups(idempotency_keys).items():
            producer = producers[shard] if shard >= 0 else \
                self._shard_for(len(indexes), None)
            try:
                got = producer.submit_many(
                    [payloads[i] for i in indexes], priority, deadline_ms,
                    [idempotency_keys[i] for i in indexes],
                    [costs[i] for i in indexes] if costs is not None else cost, store_result,
                    tenant=tenant)
            except ShardRetired:
                if not retry:
                    raise
                refused += indexes
                continue
            for i, handle in zip(indexes, got, strict=True):
                handles[i] = handle
        if refused:  # only those: the others' keys would hash elsewhere on the new count
            self.refresh(force=True)
            got = self._place_many(
                [payloads[i] for i in refused], priority, deadline_ms,
                [idempotency_keys[i] for i in refused],
                [costs[i] for i in refused] if costs is not None else cost, store_result,
                retry=False, tenant=tenant)
            for i, handle in zip(refused, got, strict=True):
                handles[i] = handle
        return [h for h in handles if h is not None]

    as_completed = staticmethod(Producer.as_completed)

    def fetch(self, request_id: str) -> Result | None:
        """The stored result of any request of this queue, from whichever shard has it
        (one pipelined GET per shard)."""
        pipe = self._redis.pipeline(transaction=False)
        for producer in [*self.producers, *self._retired]:
            pipe.get(QueueKeys(producer.config.queue).result(request_id))
        for raw in pipe.execute():
            if raw is not None:
                return decode_result(raw)
        return None

    def close(self) -> None:
        for producer in [*self.producers, *self._retired]:
            producer.close()
        if self._owns_client:
            close_node_clients(self._redis)
            self._redis.close()

    def __enter__(self) -> ShardedProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[Producer]:
        return iter(self.producers)


class AsyncShardedProducer:
    """ShardedProducer for asyncio: `async with AsyncShardedProducer(url, queue) as p:`.
    The shard count is read on entering (or on the first submit), then as
    ShardedProducer re-reads it; AsyncProducer's arguments otherwise."""

    def __init__(self, redis_url: str = DEFAULT_REDIS_URL, queue: str = "default", *,
                 placement: str = "round_robin", client: redis.asyncio.Redis | None = None,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS, **producer_args: Any):
        self.placement = check_placement(placement)
        self.queue = validate_queue_name(queue)
        self._redis = client or connect_async(redis_url, max_connections)
        self._owns_client = client is None
        self._args = producer_args
        self.producers: list[AsyncProducer] = []
        self._retired: list[AsyncProducer] = []
        self._placer: Placer | None = None
        self._refresh_at = float("-inf")
        self._opening = asyncio.Lock()

    @property
    def shards(self) -> int:
        return len(self.producers)

    async def open(self) -> AsyncShardedProducer:
        if self._placer is None:
            await self.refresh(force=True)
        return self

    async def connect(self) -> AsyncShardedProducer:
        """open(), then AsyncProducer.connect() for every shard's producer."""
        await self.open()
        for producer in self.producers:
            await producer.connect()
        return self

    async def refresh(self, force: bool = False) -> int:
        """As ShardedProducer.refresh."""
        if force or time.monotonic() >= self._refresh_at:
            async with self._opening:
                if force or time.monotonic() >= self._refresh_at:
                    try:
                        count = await shard_count_async(self._redis, self.queue)
                    except redis.RedisError:
                        if force or self._placer is None:
                            raise
                        count = self.shards  # as ShardedProducer.refresh
                    self._refresh_at = time.monotonic() + SHARDS_REFRESH_S
                    if count != len(self.producers):
                        self.producers, self._retired = reshaped(
                            self.queue, count, self.producers, self._retired,
                            lambda name: AsyncProducer(queue=name, client=self._redis,
                                                       **self._args))
                        self._placer = Placer(count, self.placement)
        return self.shards

    async def _shard_for(self, count: int, key: object) -> AsyncProducer:
        await self.refresh()
        producers, placer = self.producers, self._placer
        assert placer is not None
        if placer.stale(key):
            pipe = self._redis.pipeline(transaction=False)
            depth_reads(pipe, producers)
            placer.read(depths_of(await pipe.execute(), len(producers)))
        return producers[placer.pick(count, key)]

    async def submit(self, payload: Any, priority: Priority | int | str = Priority.NORMAL,
                     deadline_ms: float | None = None, idempotency_key: str | None = None,
                     cost: int = 1, store_result: bool = False,
                     tenant: str | None = None) -> AsyncHandle:
        try:
            producer = await self._shard_for(1, idempotency_key)
            return await producer.submit(payload, priority, deadline_ms, idempotency_key,
                                         cost, store_result, tenant=tenant)
        except ShardRetired:  # nothing was written: place it on a shard of the new count
            await self.refresh(force=True)
            producer = await self._shard_for(1, idempotency_key)
            return await producer.submit(payload, priority, deadline_ms, idempotency_key,
                                         cost, store_result, tenant=tenant)

    async def submit_many(self, payloads: Iterable[Any], priority: Priority | int | str =
                          Priority.NORMAL, deadline_ms: float | None = None,
                          idempotency_keys: list[str | None] | None = None,
                          cost: int | Sequence[int] = 1, store_result: bool = False,
                          tenant: str | None = None) -> list[AsyncHandle]:
        """As ShardedProducer.submit_many."""
        await self.open()
        return await self._place_many(list(payloads), priority, deadline_ms,
                                      idempotency_keys, cost, store_result, retry=True,
                                      tenant=tenant)

    async def _place_many(self, payloads: list[Any], priority: Priority | int | str,
                          deadline_ms: float | None,
                          idempotency_keys: list[str | None] | None,
                          cost: int | Sequence[int], store_result: bool,
                          retry: bool, tenant: str | None = None) -> list[AsyncHandle]:
        """As ShardedProducer._place_many."""
        if not needs_split(len(payloads), idempotency_keys, self.shards):
            try:
                producer = await self._shard_for(len(payloads), None)
                return await producer.submit_many(payloads, priority, deadline_ms,
                                                  idempotency_keys, cost, store_result,
                                                  tenant=tenant)
            except ShardRetired:
                if not retry:
                    raise
                await self.refresh(force=True)
                return await self._place_many(payloads, priority, deadline_ms,
                                              idempotency_keys, cost, store_result, False,
                                              tenant=tenant)
        assert idempotency_keys is not None and self._placer is not None
        costs = list(cost) if isinstance(cost, Sequence) else None
        handles: list[AsyncHandle | None] = [None] * len(payloads)
        refused: list[int] = []
        producers, placer = self.producers, self._placer
        for shard, indexes in placer.groups(idempotency_keys).items():
            producer = producers[shard] if shard >= 0 else \
                await self._shard_for(len(indexes), None)
            try:
                got = await producer.submit_many(
                    [payloads[i] for i in indexes], priority, deadline_ms,
                    [idempotency_keys[i] for i in indexes],
                    [costs[i] for i in indexes] if costs is not None else cost, store_result,
                    tenant=tenant)
            except ShardRetired:
                if not retry:
                    raise
                refused += indexes
                continue
            for i, handle in zip(indexes, got, strict=True):
                handles[i] = handle
        if refused:
            await self.refresh(force=True)
            got = await self._place_many(
                [payloads[i] for i in refused], priority, deadline_ms,
                [idempotency_keys[i] for i in refused],
                [costs[i] for i in refused] if costs is not None else cost, store_result,
                False, tenant=tenant)
            for i, handle in zip(refused, got, strict=True):
                handles[i] = handle
        return [h for h in handles if h is not None]

    async def fetch(self, request_id: str) -> Result | None:
        """As ShardedProducer.fetch."""
        await self.open()
        pipe = self._redis.pipeline(transaction=False)
        for producer in [*self.producers, *self._retired]:
            pipe.get(producer.keys.result(request_id))
        for raw in await pipe.execute():
            if raw is not None:
                return decode_result(raw)
        return None

    async def close(self) -> None:
        for producer in [*self.producers, *self._retired]:
            await producer.close()
        if self._owns_client:
            await aclose_node_clients(self._redis)
            await self._redis.aclose()

    async def __aenter__(self) -> AsyncShardedProducer:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
