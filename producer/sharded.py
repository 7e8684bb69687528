"""ShardedProducer: submits to a sharded queue (docs/scaling.md, "Sharded queues").

One Producer per shard (scheduler_core/shards.py), all on one connection pool; each keeps
its own inbox and listener, so a handle behaves exactly as with one queue. The shard count
is read from the queue's policy once, when the producer is made.
"""

from __future__ import annotations

import itertools
import threading
import time
import zlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import redis

from producer.sync import Handle, Producer
from scheduler_core.admin import shard_count
from scheduler_core.connection import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_REDIS_URL,
    close_node_clients,
    connect,
)
from scheduler_core.errors import InvalidRequest
from scheduler_core.keys import QueueKeys, validate_queue_name
from scheduler_core.policy import Priority
from scheduler_core.shards import check_placement, shard_name
from scheduler_core.wire import Result, decode_result

# least_depth: the shards' depths are read at most this often; between reads, the
# requests this producer placed are added to the last read.
DEPTH_REFRESH_S = 0.05


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
        count = shard_count(self._redis, queue)
        self.producers = [Producer(queue=shard_name(queue, i), client=self._redis,
                                   **producer_args) for i in range(count)]
        self._turn = itertools.count()
        self._lock = threading.Lock()
        self._depths = [0] * count
        self._depths_at = float("-inf")

    @property
    def shards(self) -> int:
        return len(self.producers)

    # -- placement ------------------------------------------------------------------
    def _shard_for(self, count: int, key: str | None) -> Producer:
        if key is not None:  # str or not, Producer's validation names it
            return self.producers[zlib.crc32(str(key).encode()) % self.shards]
        if self.shards == 1:
            return self.producers[0]
        if self.placement == "round_robin":
            return self.producers[next(self._turn) % self.shards]
        with self._lock:
            now = time.monotonic()
            if now - self._depths_at >= DEPTH_REFRESH_S:
                self._depths = self._read_depths()
                self._depths_at = now
            index = min(range(self.shards), key=lambda i: (self._depths[i], i))
            self._depths[index] += count
        return self.producers[index]

    def _read_depths(self) -> list[int]:
        pipe = self._redis.pipeline(transaction=False)
        for producer in self.producers:
            for key in producer.keys.pending_all:
                pipe.zcard(key)
        counts = pipe.execute()
        return [sum(counts[i * 3:i * 3 + 3]) for i in range(self.shards)]

    # -- Producer's API -------------------------------------------------------------
    def submit(self, payload: Any, priority: Priority | int | str = Priority.NORMAL,
               deadline_ms: float | None = None, idempotency_key: str | None = None,
               cost: int = 1) -> Handle:
        producer = self._shard_for(1, idempotency_key)
        return producer.submit(payload, priority, deadline_ms, idempotency_key, cost)

    def submit_many(self, payloads: Iterable[Any], priority: Priority | int | str =
                    Priority.NORMAL, deadline_ms: float | None = None,
                    idempotency_keys: list[str | None] | None = None,
                    cost: int | Sequence[int] = 1) -> list[Handle]:
        payloads = list(payloads)
        if not idempotency_keys or self.shards == 1 or \
                all(k is None for k in idempotency_keys):
            producer = self._shard_for(len(payloads), None)
            return producer.submit_many(payloads, priority, deadline_ms, idempotency_keys,
                                        cost)
        if len(idempotency_keys) != len(payloads):
            raise InvalidRequest("idempotency_keys", f"{len(idempotency_keys)} keys for "
                                 f"{len(payloads)} payloads")
        # Each keyed request to its key's shard (a repeat must find the first); one call
        # per shard, each atomic. A repeat of the whole call after an error is safe: the
        # keys answer the requests already accepted with their first ids.
        groups: dict[int, list[int]] = {}
        for i, key in enumerate(idempotency_keys):
            shard = zlib.crc32(str(key).encode()) % self.shards if key is not None else -1
            groups.setdefault(shard, []).append(i)
        costs = list(cost) if isinstance(cost, Sequence) else None
        handles: list[Handle | None] = [None] * len(payloads)
        for shard, indexes in groups.items():
            producer = self.producers[shard] if shard >= 0 else \
                self._shard_for(len(indexes), None)
            got = producer.submit_many(
                [payloads[i] for i in indexes], priority, deadline_ms,
                [idempotency_keys[i] for i in indexes],
                [costs[i] for i in indexes] if costs is not None else cost)
            for i, handle in zip(indexes, got, strict=True):
                handles[i] = handle
        return [h for h in handles if h is not None]

    as_completed = staticmethod(Producer.as_completed)

    def fetch(self, request_id: str) -> Result | None:
        """The stored result of any request of this queue, from whichever shard has it
        (one pipelined GET per shard)."""
        pipe = self._redis.pipeline(transaction=False)
        for producer in self.producers:
            pipe.get(QueueKeys(producer.config.queue).result(request_id))
        for raw in pipe.execute():
            if raw is not None:
                return decode_result(raw)
        return None

    def close(self) -> None:
        for producer in self.producers:
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
