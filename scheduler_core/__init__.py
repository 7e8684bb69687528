"""The protocol batchgate's producer and consumer share: key schema, wire format, policy,
the strategy rules and the Lua scripts.

`producer` and `consumer` both build on this package and never on each other. The
operator tooling (stats, snapshots, the simulator and planner, click options) is the
subpackage `scheduler_core.ops`, which this package never imports.
"""

from scheduler_core.errors import (
    BatchgateError,
    DeadlineExceeded,
    InvalidRequest,
    PolicyConflict,
    QueueFull,
    RequestCancelled,
    RequestFailed,
    TenantLimit,
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
    "TenantLimit",
]

__version__ = "0.1.0"
