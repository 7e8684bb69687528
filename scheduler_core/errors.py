"""Exceptions shared by producers, consumers and the CLI."""

from __future__ import annotations


class BatchgateError(Exception):
    """Base class of every batchgate error."""


class InvalidRequest(BatchgateError, ValueError):
    """Bad input, rejected before anything is written. `field` names the culprit."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


class InvalidPolicy(InvalidRequest):
    """A policy value outside its documented range."""


class ShardRetired(InvalidRequest):
    """The queue is a shard that `batchgate policy set --shards` dropped: nothing was
    written. A ShardedProducer re-reads the shard count and places the requests again."""

    def __init__(self, queue: str):
        self.queue = queue
        super().__init__("shards", f"queue {queue!r} is a shard that `policy set --shards` "
                                   "dropped; submit to the logical queue's current shards")


class PolicyConflict(BatchgateError):
    """A consumer asked for rules that differ from the ones stored with the queue."""


class QueueFull(BatchgateError):
    """`max_queue_size` would be exceeded; nothing was written."""

    def __init__(self, queue: str, depth: int, limit: int, adding: int,
                 retry_after_s: float | None = None):
        self.queue = queue
        self.depth = depth
        self.limit = limit
        self.retry_after_s = retry_after_s
        hint = f"; retry after ~{retry_after_s:.2f}s" if retry_after_s is not None else ""
        super().__init__(
            f"queue {queue!r} is full: depth {depth} + {adding} new > max_queue_size {limit}{hint}"
        )


class TenantLimit(QueueFull):
    """A named tenant's quota in the queue's policy (tenant_quotas, docs/tenants.md) would
    be exceeded; nothing was written. `limit_name` names the quota (max_waiting, rps,
    cps, burst, cost_burst), `value` (and QueueFull's `limit`) is its setting;
    `retry_after_s`: when enough of a rate quota's tokens are back (None for max_waiting,
    or a call larger than the burst)."""

    def __init__(self, queue: str, tenant: str, limit: str, value: int,
                 retry_after_s: float | None = None):
        BatchgateError.__init__(self, f"tenant {tenant!r} of queue {queue!r} is over its "
                                      f"{limit} of {value}" +
                                (f"; retry after ~{retry_after_s:.3f}s"
                                 if retry_after_s is not None else ""))
        self.queue, self.tenant, self.limit_name, self.value = queue, tenant, limit, value
        self.depth, self.limit = 0, value
        self.retry_after_s = retry_after_s


class RequestFailed(BatchgateError):
    """The request was run (or given up on) and did not produce a result."""

    def __init__(self, request_id: str, message: str, error_type: str = "RequestFailed"):
        self.request_id = request_id
        self.error_type = error_type
        super().__init__(f"request {request_id} failed: {error_type}: {message}")


class DeadlineExceeded(RequestFailed):
    """The request's `deadline_ms` passed before a consumer ran it; it was not run."""


class RequestCancelled(RequestFailed):
    """The request was cancelled by its producer before it ran."""


class RequestLost(RequestFailed):
    """Redis no longer knows the request: it is not waiting, not in flight, has no result
    and is not dead-lettered. Redis lost it (restarted without persistence, flushed, a
    failover to a replica that lacked it), or its result expired (`result_ttl_s`) before it
    was collected. Nothing will answer it: submit it again if it should run."""


class NotReplicated(BatchgateError):
    """`wait_replicas` was asked for and fewer replicas confirmed the write in time: the
    primary has it, but a failover now could lose it. A resend of the same call is safe."""

    def __init__(self, wanted: int, acked: int, timeout_ms: int, replies: list | None = None):
        self.wanted, self.acked = wanted, acked
        self.replies = replies or []  # the replies of the calls (they did run)
        super().__init__(f"{acked} of {wanted} replicas confirmed the write within "
                         f"{timeout_ms} ms (WAIT); it is not acknowledged")
