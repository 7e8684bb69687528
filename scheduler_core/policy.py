"""Queue policy: the scheduling rules one queue's consumers all apply.

The rules themselves run atomically in `lua/pop_batch.lua`; this module holds their
parameters, their defaults and their limits. A policy is stored with its queue in Redis
(hash `{bg:<queue>}:policy`), so every consumer of a queue, on any host, applies the same.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, fields
from typing import Any

from scheduler_core.errors import InvalidPolicy, InvalidRequest


class Priority(enum.IntEnum):
    """Request classes (docs/scheduling.md); lower is served first."""

    HIGH = 0  # online users: never wait for a batch to fill
    NORMAL = 1  # batch analysis: wait up to max_queue_delay_ms to fill a batch
    LOW = 2  # offline work: runs when nothing else waits

    @classmethod
    def parse(cls, value: Priority | int | str, field: str = "priority") -> Priority:
        if isinstance(value, Priority):
            return value
        if isinstance(value, str) and not isinstance(value, bool):
            try:
                return cls[value.strip().upper()]
            except KeyError:
                pass
        elif isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 2:
            return cls(value)
        raise InvalidRequest(field, f"unknown priority {value!r}; use high, normal or low (0-2)")


class Strategy(str, enum.Enum):
    FIFO = "fifo"  # arrival order across priorities, never waits
    DYNAMIC = "dynamic"  # arrival order, batch released when full or when the oldest is due
    PRIORITY = "priority"  # HIGH at once, NORMAL by the dynamic rule, LOW when idle, aging

    def __str__(self) -> str:  # "fifo", as users type it (not "Strategy.FIFO")
        return self.value


class OnTimeout(str, enum.Enum):
    """What happens to a request still waiting at its deadline (docs/scheduling.md)."""

    REJECT = "reject"  # it leaves the queue; its result is DeadlineExceeded
    DELAY = "delay"  # it stays queued and runs only when nothing else waits

    def __str__(self) -> str:
        return self.value


# (minimum, maximum) of each integer field; 0 means "off" where the field allows it.
LIMITS: dict[str, tuple[int, int]] = {
    "max_batch_size": (1, 4096),
    "max_queue_delay_ms": (0, 600_000),
    "aging_ms": (0, 86_400_000),
    "max_queue_size": (0, 1_000_000_000),
    "max_attempts": (1, 100),
    "result_ttl_s": (1, 30 * 86_400),
    # Default deadline of a request of each level, ms from its enqueue (like Triton's
    # default_timeout_microseconds); 0 = none. The bound is deadline_ms's.
    "timeout_high_ms": (0, 86_400_000),
    "timeout_normal_ms": (0, 86_400_000),
    "timeout_low_ms": (0, 86_400_000),
    "allow_timeout_override": (0, 1),  # 1: a request's own deadline_ms replaces the default
}

TEXT_FIELDS = ("strategy", "on_timeout")  # the fields that are not integers
DEFAULT_MAX_BATCH_SIZE = 32
DEFAULT_FIFO_BATCH_SIZE = 1  # fifo is strictly one by one unless asked otherwise


@dataclass(frozen=True)
class Policy:
    """Scheduling rules of one queue. Times in milliseconds unless the name says `_s`."""

    strategy: Strategy = Strategy.PRIORITY
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    max_queue_delay_ms: int = 50
    aging_ms: int = 5_000  # priority only: a request waiting this long moves up one level
    max_queue_size: int = 0  # pending requests, all priorities; 0 = unbounded
    max_attempts: int = 3  # deliveries before a request is dead-lettered
    result_ttl_s: int = 600  # how long results stay fetchable by id
    timeout_high_ms: int = 0  # default deadline per level (ms after enqueue); 0 = none
    timeout_normal_ms: int = 0
    timeout_low_ms: int = 0
    allow_timeout_override: int = 1  # 1: a request's own deadline_ms replaces its default
    on_timeout: OnTimeout = OnTimeout.REJECT  # reject (DeadlineExceeded) or delay

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "strategy", Strategy(self.strategy))
        except ValueError:
            raise InvalidPolicy(
                "strategy", f"unknown strategy {self.strategy!r}; use fifo, dynamic or priority"
            ) from None
        try:
            object.__setattr__(self, "on_timeout", OnTimeout(self.on_timeout))
        except ValueError:
            raise InvalidPolicy(
                "on_timeout", f"unknown on_timeout {self.on_timeout!r}; use reject or delay"
            ) from None
        for name, (low, high) in LIMITS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidPolicy(name, f"must be an integer, got {value!r}")
            if not low <= value <= high:
                raise InvalidPolicy(name, f"{value} is outside [{low}, {high}]")

    @classmethod
    def build(cls, strategy: Strategy | str | None = None, **overrides: int | None) -> Policy:
        """A policy from optional values: None means the default (fifo's batch size is 1)."""
        try:
            strat = Strategy(strategy) if strategy is not None else cls.strategy
        except ValueError:
            cls(strategy=strategy)  # type: ignore[arg-type] # InvalidPolicy naming the field
            raise
        values = {k: v for k, v in overrides.items() if v is not None}
        if strat is Strategy.FIFO:
            values.setdefault("max_batch_size", DEFAULT_FIFO_BATCH_SIZE)
        return cls(strategy=strat, **values)

    def to_dict(self) -> dict[str, Any]:
        """As JSON values: numbers as numbers (to_redis has strings, as Redis stores them)."""
        return {**asdict(self), "strategy": self.strategy.value,
                "on_timeout": self.on_timeout.value}

    def to_redis(self) -> dict[str, str]:
        data = asdict(self)
        data["strategy"], data["on_timeout"] = self.strategy.value, self.on_timeout.value
        return {k: str(v) for k, v in data.items()}

    def timeout_ms(self, priority: int) -> int:
        """The default deadline of a request submitted at `priority` (0 = none)."""
        return (self.timeout_high_ms, self.timeout_normal_ms, self.timeout_low_ms)[priority]

    def deadline_ms(self, priority: int, requested_ms: int) -> int:
        """The deadline enqueue.lua gives a request (0 = none): its own deadline_ms where
        it has one and the policy allows it to override the level's default, else the
        default (a level without one keeps the request's own)."""
        default = self.timeout_ms(priority)
        if default and (not requested_ms or not self.allow_timeout_override):
            return default
        return requested_ms

    @classmethod
    def from_redis(cls, raw: dict[bytes | str, bytes | str]) -> Policy:
        data = {_text(k): _text(v) for k, v in raw.items()}
        known = {f.name for f in fields(cls)}
        values: dict[str, object] = {}
        for name in known & data.keys():
            values[name] = data[name] if name in TEXT_FIELDS else int(data[name])
        return cls(**values)  # type: ignore[arg-type]

    def differences(self, requested: dict[str, object]) -> dict[str, tuple[object, object]]:
        """Fields where `requested` (explicitly given values) differs from this policy."""
        diff = {}
        for name, want in requested.items():
            have = getattr(self, name)
            if name == "strategy":
                want = Strategy(want)
            elif name == "on_timeout" and want is not None:
                want = OnTimeout(want)
            if want is not None and have != want:
                diff[name] = (have, want)
        return diff


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
