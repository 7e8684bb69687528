"""Shared core of batchgate: key schema, wire format, policy and the Lua scripts.

`producer` and `consumer` both build on this package and never on each other.
"""

from scheduler_core.errors import (
    BatchgateError,
    DeadlineExceeded,
    InvalidRequest,
    PolicyConflict,
    QueueFull,
    RequestCancelled,
    RequestFailed,
)
from scheduler_core.policy import Policy, Priority, Strategy

__all__ = [
    "BatchgateError",
    "DeadlineExceeded",
    "InvalidRequest",
    "Policy",
    "PolicyConflict",
    "Priority",
    "QueueFull",
    "RequestCancelled",
    "RequestFailed",
    "Strategy",
]

__version__ = "0.1.0"
