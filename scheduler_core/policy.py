"""Queue policy: the scheduling rules one queue's consumers all apply.

The rules themselves run atomically in `lua/pop_batch.lua`; this module holds their
parameters, their defaults and their limits. A policy is stored with its queue in Redis
(hash `{bg:<queue>}:policy`), so every consumer of a queue, on any host, applies the same.
"""

from __future__ import annotations

import bisect
import enum
import functools
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from scheduler_core.errors import InvalidPolicy, InvalidRequest
from scheduler_core.wire import DEFAULT_TENANT, TENANT_NAME


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


# (minimum, maximum) of each integer field; 0 means "off" where the field allows it.
LIMITS: dict[str, tuple[int, int]] = {
    "max_batch_size": (1, 4096),
    "max_queue_delay_ms": (0, 600_000),
    "aging_ms": (0, 86_400_000),
    "max_queue_size": (0, 1_000_000_000),
    "max_attempts": (1, 100),
    "result_ttl_s": (1, 30 * 86_400),
    "max_cost": (0, 1_000_000_000),  # 0 = no cap
    "max_batch_cost": (0, 1_000_000_000),  # 0 = no budget per batch
    "slo_p99_ms": (0, 600_000),
    # Default deadline of a request of each level, ms from its enqueue (like Triton's
    # default_timeout_microseconds); 0 = none. The bound is deadline_ms's.
    "timeout_high_ms": (0, 86_400_000),
    "timeout_normal_ms": (0, 86_400_000),
    "timeout_low_ms": (0, 86_400_000),
    "allow_timeout_override": (0, 1),  # 1: a request's own deadline_ms replaces the default
    # Physical queues one logical queue is spread over (docs/scaling.md, "Sharded queues").
    "shards": (1, 64),
    # Retries of the exceptions named by retry_on (docs/failure-modes.md, "Retries"): the
    # most runs of a request (1 = no retry; each run counts as a delivery, so pop_batch
    # dead-letters after max(max_attempts, retry_max) of them), and the backoff before
    # run n+1: retry_backoff_ms x 2^(n-1), capped at retry_backoff_max_ms; retry_jitter 1
    # draws it uniformly from [half, all] of that.
    "retry_max": (1, 100),
    "retry_backoff_ms": (0, 3_600_000),
    "retry_backoff_max_ms": (0, 86_400_000),
    "retry_jitter": (0, 1),
}


# How max_queue_delay_ms is chosen: "fixed" (the stored value) or "auto" (each consumer
# derives it about once a second from the measured arrival rate and the cost model, aiming
# at the largest batches whose predicted P99 stays under slo_p99_ms; scheduler_core/
# auto_delay.py). Stored as the policy field `delay_mode`; users write
# `--max-queue-delay-ms auto`.
DELAY_MODES = ("fixed", "auto")
AUTO = "auto"


def is_auto(value: object) -> bool:
    """Whether a given max_queue_delay_ms asks for delay_mode auto: the string "auto" in
    any case, spaces around ignored. The one place that reads the word (the flag's type,
    Policy.build and differences, `policy set`, `simulate`)."""
    return isinstance(value, str) and value.strip().lower() == AUTO


def delay_fields(delay: int | str) -> dict[str, int | str]:
    """The policy fields a given max_queue_delay_ms sets: "auto" sets delay_mode auto and
    leaves the fixed delay as stored (kept for a switch back); a number sets delay_mode
    fixed with that delay."""
    if is_auto(delay):
        return {"delay_mode": AUTO}
    return {"delay_mode": "fixed", "max_queue_delay_ms": delay}


# A request's cost (Producer.submit(cost=...)): an integer in the user's own unit.
MAX_REQUEST_COST = 1_000_000_000
# The policy's string settings and the values each may take (configure.lua checks them too).
CHOICES: dict[str, tuple[str, ...]] = {
    "over_cost": ("reject", "truncate"),  # a request above max_cost: refused, or capped
    "cost_mode": ("sum", "padded"),  # a batch's cost: sum of costs, or size x largest
    "delay_mode": DELAY_MODES,
    # a request still waiting at its deadline: DeadlineExceeded, or kept to run only
    # when nothing else waits (docs/scheduling.md, "Deadlines")
    "on_timeout": ("reject", "delay"),
    # fair share between tenants inside each level (docs/tenants.md): none (arrival
    # order), by requests served, or by cost served (lua/_fair.lua)
    "fairness": ("none", "requests", "cost"),
}
# The values a consumer (its flags, Consumer's keywords) or `policy set` may give;
# delay_mode follows max_queue_delay_ms ("auto" or a number).
KNOBS = ("strategy", *LIMITS, *(name for name in CHOICES if name != "delay_mode"),
         "cost_buckets", "retry_on", "tenant_quotas")
_DIGITS = re.compile(r"[0-9]{1,10}")
# retry_on: exception class names (a model's exception or any of its bases), or "*".
_CLASS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
RETRY_ANY = "*"
MAX_RETRY_ON = 256  # bytes: configure.lua keeps a string field of at most this
MAX_COST_BUCKETS = 4  # boundaries in cost_buckets: at most 5 buckets

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
    # Costs (docs/scheduling.md, "Requests of different cost"), in the requests' own unit.
    max_cost: int = 0  # a request's largest cost; 0 = no cap
    over_cost: str = "reject"  # above max_cost: "reject" at enqueue, or "truncate" to it
    max_batch_cost: int = 0  # a batch's budget under cost_mode; 0 = none
    cost_mode: str = "sum"  # "sum" of costs, or "padded": batch size x largest cost
    cost_buckets: str = ""  # "32,1024": a batch holds costs <= 32, <= 1024 or > 1024 only
    # P99 latency target (ms) of max_queue_delay_ms=auto; 0 = none (required with auto).
    slo_p99_ms: int = 0
    # "auto": consumers derive the delay (max_queue_delay_ms is then kept, unused, for a
    # switch back to "fixed").
    delay_mode: str = "fixed"
    timeout_high_ms: int = 0  # default deadline per level (ms after enqueue); 0 = none
    timeout_normal_ms: int = 0
    timeout_low_ms: int = 0
    allow_timeout_override: int = 1  # 1: a request's own deadline_ms replaces its default
    on_timeout: str = "reject"  # reject (DeadlineExceeded) or delay
    shards: int = 1  # physical queues (scheduler_core/shards.py); 1 = today's single queue
    # Retries (LIMITS above): exception class names that are retried, "*" = any; "" = none.
    retry_on: str = ""
    retry_max: int = 1
    retry_backoff_ms: int = 1_000
    retry_backoff_max_ms: int = 60_000
    retry_jitter: int = 0
    # Per-tenant quotas, "*:rps=5;acme:max_waiting=100,rps=50" (format_tenant_quotas,
    # docs/tenants.md); "" = none.
    tenant_quotas: str = ""
    # Fair share between tenants inside each level: "none", "requests" or "cost"
    # (docs/tenants.md); weights and max_in_flight are in tenant_quotas.
    fairness: str = "none"

    def batch_cost(self, costs: Sequence[int]) -> int:
        """A batch's cost as cost_mode counts it: Σcost, or padded, its size × its largest
        cost (what a padded tensor computes). Requests without a cost count 1 each."""
        if not costs:
            return 0
        return len(costs) * max(costs) if self.cost_mode == "padded" else sum(costs)

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "strategy", Strategy(self.strategy))
        except ValueError:
            raise InvalidPolicy(
                "strategy", f"unknown strategy {self.strategy!r}; use fifo, dynamic or priority"
            ) from None
        for name, (low, high) in LIMITS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidPolicy(name, f"must be an integer, got {value!r}")
            if not low <= value <= high:
                raise InvalidPolicy(name, f"{value} is outside [{low}, {high}]")
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise InvalidPolicy(name, f"{getattr(self, name)!r}: use {' or '.join(allowed)}")
        object.__setattr__(self, "cost_buckets", format_buckets(self.cost_buckets))
        object.__setattr__(self, "retry_on", format_retry_on(self.retry_on))
        object.__setattr__(self, "tenant_quotas", format_tenant_quotas(self.tenant_quotas))
        if self.fairness == "none" and "max_in_flight=" in self.tenant_quotas:
            raise InvalidPolicy("tenant_quotas", "max_in_flight needs fairness=requests or "
                                                 "cost (the pop passes over a tenant at its "
                                                 "limit through the fair index)")
        if self.delay_mode == AUTO and self.slo_p99_ms < 1:
            high = LIMITS["slo_p99_ms"][1]
            raise InvalidPolicy("slo_p99_ms", "max_queue_delay_ms=auto needs a P99 target: "
                                f"give slo_p99_ms, 1-{high} ms")

    @property
    def auto_delay(self) -> bool:
        return self.delay_mode == AUTO

    @functools.cached_property
    def quotas(self) -> dict[str, dict[str, int]]:
        """tenant_quotas as {tenant: {quota: value}} ('*': every named tenant without an
        entry of its own)."""
        return parse_tenant_quotas(self.tenant_quotas)

    @property
    def bucket_bounds(self) -> tuple[int, ...]:
        """cost_buckets as integers: bucket i holds costs <= bounds[i], the last the rest."""
        return tuple(int(b) for b in self.cost_buckets.split(",")) if self.cost_buckets else ()

    def bucket_of(self, cost: int) -> int:
        """The bucket (0-based) a request of this cost belongs to."""
        return bisect.bisect_left(self.bucket_bounds, cost)

    @classmethod
    def build(cls, strategy: Strategy | str | None = None,
              **overrides: int | str | None) -> Policy:
        """A policy from optional values: None means the default (fifo's batch size is 1).
        max_queue_delay_ms="auto" means delay_mode="auto" (the stored fixed delay is kept);
        a number means delay_mode="fixed"."""
        try:
            strat = Strategy(strategy) if strategy is not None else cls.strategy
        except ValueError:
            cls(strategy=strategy)  # type: ignore[arg-type] # InvalidPolicy naming the field
            raise
        values = {k: v for k, v in overrides.items() if v is not None}
        delay = values.get("max_queue_delay_ms")
        if delay is not None and (is_auto(delay) or "delay_mode" not in values):
            values.update(delay_fields(values.pop("max_queue_delay_ms")))
        if strat is Strategy.FIFO:
            values.setdefault("max_batch_size", DEFAULT_FIFO_BATCH_SIZE)
        return cls(strategy=strat, **values)

    def changed(self, **changes: Any) -> Policy:
        """This policy with `changes` (given values only; None = keep), as every policy
        change applies them (`policy set`, `plan --apply`, the dashboard): a new strategy
        without max_batch_size gets that strategy's default batch size;
        max_queue_delay_ms="auto" switches delay_mode to auto (the stored fixed delay is
        kept), a number switches it to fixed."""
        values = {k: v for k, v in changes.items() if v is not None}
        merged = self.to_dict()
        if "strategy" in values and "max_batch_size" not in values:
            try:
                strategy = Strategy(values["strategy"])
            except (TypeError, ValueError):
                strategy = None  # Policy.build refuses it, naming the field
            if strategy is not self.strategy:
                del merged["max_batch_size"]  # Policy.build supplies the strategy's default
        if "max_queue_delay_ms" in values:  # "auto" keeps the stored fixed delay
            values = {**delay_fields(values.pop("max_queue_delay_ms")), **values}
        merged.update(values)
        return Policy.build(**merged)

    def to_dict(self) -> dict[str, Any]:
        """As JSON values: numbers as numbers (to_redis has strings, as Redis stores them)."""
        return {**asdict(self), "strategy": self.strategy.value}

    def to_redis(self) -> dict[str, str]:
        data = asdict(self)
        data["strategy"] = self.strategy.value
        return {k: str(v) for k, v in data.items()}

    def retries(self, error_types: Sequence[str]) -> bool:
        """Whether a model's exception is retried: `error_types` are its class's name and
        its bases' (type(exc).__mro__), matched against retry_on."""
        names = self.retry_on.split(",") if self.retry_on else []
        return self.retry_max > 1 and (RETRY_ANY in names or any(t in names
                                                                  for t in error_types))

    def retry_backoff(self, run: int, draw: float = 1.0) -> int:
        """ms to wait before run `run` + 1 (`run`: the run that failed, 1-based):
        retry_backoff_ms x 2^(run-1), capped at retry_backoff_max_ms; under retry_jitter
        scaled by 0.5 + draw / 2 (`draw` uniform in [0, 1])."""
        ms = min(self.retry_backoff_ms * 2 ** min(max(run - 1, 0), 40),
                 self.retry_backoff_max_ms)
        return int(ms * (0.5 + draw / 2)) if self.retry_jitter else int(ms)

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
            values[name] = int(data[name]) if name in LIMITS else data[name]
        return cls(**values)  # type: ignore[arg-type]

    def differences(self, requested: dict[str, object]) -> dict[str, tuple[object, object]]:
        """Fields where `requested` (explicitly given values) differs from this policy."""
        diff = {}
        for name, want in requested.items():
            have = getattr(self, name)
            if name == "strategy":
                want = Strategy(want)
            elif name == "cost_buckets" and want is not None:
                want = format_buckets(want)
            elif name == "retry_on" and want is not None:
                want = format_retry_on(want)
            elif name == "tenant_quotas" and want is not None:
                want = format_tenant_quotas(want)
            elif name == "max_queue_delay_ms" and want is not None:
                # "auto" asks for delay_mode auto; a number, for that fixed delay
                if is_auto(want):
                    have, want = self.delay_mode, AUTO
                elif self.auto_delay:
                    have = AUTO
            if want is not None and have != want:
                diff[name] = (have, want)
        return diff


def format_buckets(value: object) -> str:
    """cost_buckets in its stored form, "32,1024" (strictly increasing boundaries, each
    within [1, MAX_REQUEST_COST], at most MAX_COST_BUCKETS), from that string, "" (none)
    or a sequence of integers; InvalidPolicy naming cost_buckets otherwise."""
    if isinstance(value, (list, tuple)):
        parts = list(value)
    elif isinstance(value, str):
        parts = [p.strip() for p in value.split(",")] if value.strip() else []
    else:
        raise InvalidPolicy("cost_buckets", f"must be a string like '32,1024', got {value!r}")
    bounds: list[int] = []
    for part in parts:
        if isinstance(part, bool) or not (isinstance(part, int) or
                                          (isinstance(part, str) and _DIGITS.fullmatch(part))):
            raise InvalidPolicy("cost_buckets", f"{part!r} is not a whole number")
        bound = int(part)
        if not 1 <= bound <= MAX_REQUEST_COST or (bounds and bound <= bounds[-1]):
            raise InvalidPolicy("cost_buckets", f"{value!r}: boundaries must increase, each "
                                                f"within [1, {MAX_REQUEST_COST}]")
        bounds.append(bound)
    if len(bounds) > MAX_COST_BUCKETS:
        raise InvalidPolicy("cost_buckets", f"{len(bounds)} boundaries, over the limit of "
                                            f"{MAX_COST_BUCKETS}")
    return ",".join(str(b) for b in bounds)


def format_retry_on(value: object) -> str:
    """retry_on in its stored form: "" (none), "*" (any exception) or class names
    separated by commas ("TimeoutError,ConnectionError"); InvalidPolicy naming retry_on
    otherwise."""
    if isinstance(value, (list, tuple)):
        parts = [str(p).strip() for p in value]
    elif isinstance(value, str):
        parts = [p.strip() for p in value.split(",")] if value.strip() else []
    else:
        raise InvalidPolicy("retry_on", f"must be a string like 'TimeoutError,OSError', "
                                        f"got {value!r}")
    names: list[str] = []
    for part in parts:
        if part != RETRY_ANY and not _CLASS_NAME.fullmatch(part):
            raise InvalidPolicy("retry_on", f"{part!r} is not an exception class name "
                                            "(letters, digits, '_', at most 64) or '*'")
        if part not in names:
            names.append(part)
    text = RETRY_ANY if RETRY_ANY in names else ",".join(names)
    if len(text) > MAX_RETRY_ON:
        raise InvalidPolicy("retry_on", f"{len(text)} characters, over the limit of "
                                        f"{MAX_RETRY_ON}")
    return text


# Per-tenant quotas (docs/tenants.md): each a whole number, 0 = none. rps/cps are token
# buckets (requests/s, cost/s) holding burst/cost_burst (default: one second's worth).
TENANT_QUOTAS: dict[str, tuple[int, int]] = {
    "max_waiting": (0, 1_000_000_000),  # the tenant's requests waiting at once
    "rps": (0, 1_000_000),
    "burst": (0, 1_000_000_000),
    "cps": (0, 1_000_000_000),
    "cost_burst": (0, 1_000_000_000_000),
    # Under fairness requests | cost (docs/tenants.md, "Fair share"): the tenant's share
    # (0 = 1), and its requests popped but not finished.
    "weight": (0, 1000),
    "max_in_flight": (0, 1_000_000_000),
}
DEFAULT_QUOTA = "*"  # the entry that applies to every named tenant without its own
MAX_TENANT_QUOTAS = 16_384  # characters of the stored form
_QUOTA_DIGITS = re.compile(r"[0-9]{1,13}")


def parse_tenant_quotas(value: object) -> dict[str, dict[str, int]]:
    """tenant_quotas as {tenant: {quota: value}}, from its stored form
    ("*:rps=5;acme:max_waiting=100,rps=50"), a JSON object of the same, or a mapping;
    InvalidPolicy naming tenant_quotas (and the culprit) otherwise."""
    if isinstance(value, str) and value.strip().startswith("{"):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise InvalidPolicy("tenant_quotas", f"not valid JSON: {exc}") from None
    if isinstance(value, str):
        entries: dict[str, Any] = {}
        for part in filter(None, (p.strip() for p in value.split(";"))):
            tenant, sep, spec = part.rpartition(":")
            if not sep:
                raise InvalidPolicy("tenant_quotas", f"{part!r}: write tenant:quota=N,...")
            pairs = [kv.split("=", 1) for kv in filter(None, spec.split(","))]
            if any(len(kv) != 2 for kv in pairs):
                raise InvalidPolicy("tenant_quotas", f"{part!r}: write tenant:quota=N,...")
            entries[tenant.strip()] = {k.strip(): v.strip() for k, v in pairs}
        value = entries
    if not isinstance(value, Mapping):
        raise InvalidPolicy("tenant_quotas", f"must be a string like '*:rps=5;acme:"
                                             f"max_waiting=100', got {value!r}")
    quotas: dict[str, dict[str, int]] = {}
    for tenant, spec in value.items():
        where = f"tenant_quotas[{tenant!r}]"
        if tenant != DEFAULT_QUOTA and not (isinstance(tenant, str) and
                                            TENANT_NAME.fullmatch(tenant)):
            raise InvalidPolicy(where, "a tenant is 1-64 characters from letters, digits, "
                                       "'_', '.', ':' and '-', or '*' for the default")
        if tenant == DEFAULT_TENANT:
            raise InvalidPolicy(where, "requests without a tenant (the default tenant) have "
                                       f"no quota; '{DEFAULT_QUOTA}' is every named tenant "
                                       "without an entry of its own")
        if not isinstance(spec, Mapping):
            raise InvalidPolicy(where, f"must map quota names to numbers, got {spec!r}")
        entry = {}
        for name, raw in spec.items():
            if name not in TENANT_QUOTAS:
                raise InvalidPolicy(f"{where}.{name}", f"unknown; use {', '.join(TENANT_QUOTAS)}")
            low, high = TENANT_QUOTAS[name]
            if isinstance(raw, str) and _QUOTA_DIGITS.fullmatch(raw.strip()):
                raw = int(raw.strip())
            if isinstance(raw, bool) or not isinstance(raw, int) or not low <= raw <= high:
                raise InvalidPolicy(f"{where}.{name}",
                                    f"{raw!r} is not a whole number in [{low}, {high}]")
            entry[name] = raw
        quotas[tenant] = entry
    return quotas


def format_tenant_quotas(value: object) -> str:
    """tenant_quotas in its stored form: tenants sorted ('*' first), each
    "tenant:quota=N,..." with its quotas sorted, joined by ';'; entries without a quota
    dropped."""
    quotas = parse_tenant_quotas(value)
    text = ";".join(f"{t}:" + ",".join(f"{k}={v}" for k, v in sorted(q.items()))
                    for t, q in sorted(quotas.items(), key=lambda tq: (tq[0] != "*", tq[0]))
                    if q)
    if len(text) > MAX_TENANT_QUOTAS:
        raise InvalidPolicy("tenant_quotas", f"{len(text)} characters, over the limit of "
                                             f"{MAX_TENANT_QUOTAS}")
    return text


# -- for people: the policy in the CLI's own words ------------------------------------
def _ms(value: float) -> str:
    return f"{round(value, 1):g} ms"


def describe_delay(policy: Policy | Mapping[str, Any] | None,
                   in_use_ms: float | None = None) -> str:
    """The max_queue_delay_ms a queue's consumers apply, for people: "50 ms", or under
    max_queue_delay_ms=auto the one in use and the target, "auto → 63 ms, SLO 100 ms"
    (in_use_ms None: no consumer has derived one lately). `batchgate stats`, `top`, the
    dashboard and the consumer's start-up line all say it this way."""
    if policy is None:
        return "no policy yet"
    values = policy.to_dict() if isinstance(policy, Policy) else policy
    if values.get("delay_mode") != AUTO:
        return _ms(values["max_queue_delay_ms"])
    used = "not derived yet (no live consumer)" if in_use_ms is None else _ms(in_use_ms)
    return f"auto → {used}, SLO {_ms(values['slo_p99_ms'])}"


def describe_policy(policy: Policy | Mapping[str, Any] | None,
                    in_use_ms: float | None = None) -> str:
    """The policy as the flags that set it: strategy, max_batch_size and the delay
    always, every other knob where it differs from its default, e.g. "strategy=priority
    max_batch_size=8 max_queue_delay_ms=auto (→ 63 ms, SLO 100 ms) aging_ms=0"."""
    if policy is None:
        return "no policy yet"
    values = policy.to_dict() if isinstance(policy, Policy) else dict(policy)
    auto = values.get("delay_mode") == AUTO
    if auto:
        derived = "" if in_use_ms is None else f"→ {_ms(in_use_ms)}, "
        delay = f"auto ({derived}SLO {_ms(values['slo_p99_ms'])})"
    else:
        delay = str(values["max_queue_delay_ms"])
    words = [f"strategy={values['strategy']}", f"max_batch_size={values['max_batch_size']}",
             f"max_queue_delay_ms={delay}"]
    shown = {"strategy", "max_batch_size", "max_queue_delay_ms", "delay_mode"}
    if auto:
        shown.add("slo_p99_ms")
    for field in fields(Policy):
        value = values.get(field.name, field.default)
        if field.name not in shown and value != field.default:
            words.append(f"{field.name}={value}")
    return " ".join(words)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
