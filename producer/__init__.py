"""Enqueue inference requests from any Python process (web apps, scripts, bulk jobs).

    from producer import Producer, Priority
    with Producer("redis://127.0.0.1:6379/0", queue="default") as p:
        print(p.submit({"x": 1}, priority=Priority.HIGH).result(timeout=5.0))

Depends on scheduler_core only; needs neither torch nor the consumer.
"""

from producer.aio import AsyncHandle, AsyncProducer
from producer.sharded import AsyncShardedProducer, ShardedProducer
from producer.sync import Handle, Producer
from scheduler_core.errors import (
    DeadlineExceeded,
    InvalidRequest,
    QueueFull,
    RequestCancelled,
    RequestFailed,
    RequestLost,
    ShardRetired,
    TenantLimit,
)
from scheduler_core.policy import Priority
from scheduler_core.wire import Restart, Result

__all__ = [
    "AsyncHandle",
    "AsyncProducer",
    "AsyncShardedProducer",
    "DeadlineExceeded",
    "Handle",
    "InvalidRequest",
    "Priority",
    "Producer",
    "QueueFull",
    "RequestCancelled",
    "RequestFailed",
    "RequestLost",
    "Restart",
    "Result",
    "ShardRetired",
    "ShardedProducer",
    "TenantLimit",
]
