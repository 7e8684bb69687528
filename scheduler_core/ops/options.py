"""Click options shared by every `batchgate` subcommand that talks to a queue."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import click

from scheduler_core.connection import DEFAULT_REDIS_URL
from scheduler_core.policy import AUTO, CHOICES, LIMITS, MAX_COST_BUCKETS, Strategy, is_auto


class FloatRange(click.FloatRange):
    """click.FloatRange without NaN, which compares false with both bounds and so passed
    through as a timeout, an interval or a duration."""

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        number = super().convert(value, param, ctx)
        if math.isnan(number):
            self.fail(f"{value!r} is not a number in the range {self._describe_range()}.",
                      param, ctx)
        return number


def env_option(*decls: str, envvar: str, help: str, **kwargs: Any) -> Callable[[Any], Any]:
    """click.option read from `envvar` too, with the variable named in its help (the
    docs' tables list the same names; tests/test_docs.py keeps them in step)."""
    return click.option(*decls, envvar=envvar, help=f"{help} Env: {envvar}.", **kwargs)


redis_url_option = env_option(
    "--redis-url", envvar="BATCHGATE_REDIS_URL", default=DEFAULT_REDIS_URL, show_default=True,
    help="Redis to use (redis://, rediss:// for TLS, unix://); Redis 7.0 or newer.")
queue_option = env_option(
    "--queue", envvar="BATCHGATE_QUEUE", default="default", show_default=True,
    help="Queue name (1-128 of A-Z a-z 0-9 _ . : -).")


def wait_replicas_options(acknowledged: str, ranged: bool = True) -> Callable[[Any], Any]:
    """--wait-replicas and --wait-timeout-ms (Redis WAIT after each write), for a command
    whose writes are `acknowledged` (what its help says happens to them). Without
    `ranged`, the command's own settings check the ranges (0-64, 1-60000)."""
    def decorate(func: Any) -> Any:
        func = env_option(
            "--wait-replicas", envvar="BATCHGATE_WAIT_REPLICAS",
            type=click.IntRange(0, 64) if ranged else int, default=0, show_default=True,
            help=f"{acknowledged} only once this many replicas have them (Redis WAIT, on "
                 "the connection that wrote them), so that a failover cannot lose them. "
                 "0 = as soon as the primary has them." + ("" if ranged else " 0-64."))(func)
        return env_option(
            "--wait-timeout-ms", envvar="BATCHGATE_WAIT_TIMEOUT_MS",
            type=click.IntRange(1, 60_000) if ranged else int, default=1000,
            show_default=True,
            help="ms: how long each WAIT of --wait-replicas waits before the write is "
                 "sent again." + ("" if ranged else " 1-60000."))(func)
    return decorate


def _range(name: str) -> str:
    low, high = LIMITS[name]
    return f"{low}-{high}"


class DelayType(click.ParamType):
    """--max-queue-delay-ms: whole milliseconds, or `auto`."""

    name = "MS|auto"

    def convert(self, value: Any, param: Any, ctx: Any) -> int | str:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if is_auto(value):
            return AUTO
        try:
            return int(str(value).strip())
        except ValueError:
            self.fail(f"{value!r} is neither a whole number of ms nor 'auto'", param, ctx)


# (flag, help) of each policy knob; unset ones stay None (= keep stored/default).
POLICY_KNOBS: list[tuple[str, dict[str, Any], str]] = [
    ("--strategy", {"type": click.Choice([s.value for s in Strategy])},
     "Scheduling strategy [default: priority]."),
    ("--max-batch-size", {"type": int},
     f"Most requests per batch, {_range('max_batch_size')} [default: 32; fifo: 1]."),
    ("--max-queue-delay-ms", {"type": DelayType()},
     f"dynamic/priority: longest a partial batch waits, ms, {_range('max_queue_delay_ms')}, "
     "or 'auto': derived from the measured arrival rate and the cost model to hold "
     "--slo-p99-ms [default: 50]."),
    ("--aging-ms", {"type": int},
     f"priority: wait that promotes a request one level, ms, {_range('aging_ms')}; 0 = off "
     "[default: 5000]."),
    ("--max-queue-size", {"type": int},
     f"Pending requests before enqueue fails with QueueFull, {_range('max_queue_size')}; "
     "0 = unbounded [default: 0]."),
    ("--max-attempts", {"type": int},
     f"Deliveries before a request is dead-lettered, {_range('max_attempts')} [default: 3]."),
    ("--result-ttl-s", {"type": int},
     f"Seconds results stay fetchable by id, {_range('result_ttl_s')} [default: 600]."),
    ("--max-cost", {"type": int},
     f"Largest cost of one request, {_range('max_cost')}; 0 = no cap [default: 0]."),
    ("--over-cost", {"type": click.Choice(CHOICES["over_cost"])},
     "A request above --max-cost: reject it at enqueue, or truncate its cost to the cap "
     "(the model is told) [default: reject]."),
    ("--max-batch-cost", {"type": int},
     f"Cost budget of one batch (see --cost-mode), {_range('max_batch_cost')}; 0 = none; a "
     "single request above it runs alone [default: 0]."),
    ("--cost-mode", {"type": click.Choice(CHOICES["cost_mode"])},
     "A batch's cost: sum of its costs, or padded = batch size x largest cost "
     "[default: sum]."),
    ("--cost-buckets", {"type": str},
     f"Cost boundaries, e.g. 32,1024 (at most {MAX_COST_BUCKETS}): a batch holds one bucket "
     "only; '' = one bucket [default: '']."),
    ("--slo-p99-ms", {"type": int},
     f"P99 latency target, ms, {_range('slo_p99_ms')}, that --max-queue-delay-ms auto holds "
     "(required with it); 0 = none [default: 0]."),
    ("--timeout-high-ms", {"type": int},
     f"Default deadline of a HIGH request, ms after enqueue, {_range('timeout_high_ms')}; "
     "0 = none [default: 0]."),
    ("--timeout-normal-ms", {"type": int},
     f"Default deadline of a NORMAL request, ms, {_range('timeout_normal_ms')}; 0 = none "
     "[default: 0]."),
    ("--timeout-low-ms", {"type": int},
     f"Default deadline of a LOW request, ms, {_range('timeout_low_ms')}; 0 = none "
     "[default: 0]."),
    ("--allow-timeout-override", {"type": int},
     "1: a request's own deadline_ms replaces its level's default timeout; 0: the default "
     "applies where the level has one [default: 1]."),
    ("--on-timeout", {"type": click.Choice(CHOICES["on_timeout"])},
     "A request still waiting at its deadline: reject (DeadlineExceeded) or delay (it runs "
     "only when nothing else waits) [default: reject]."),
    ("--tenant-quotas", {"type": str},
     "Per-tenant quotas, 'TENANT:QUOTA=N,...;...' with '*' for every named tenant without "
     "its own; quotas max_waiting, rps, burst, cps, cost_burst, and under --fairness "
     "weight and max_in_flight (docs/tenants.md); '' = none [default: '']."),
    ("--fairness", {"type": click.Choice(CHOICES["fairness"])},
     "Share each priority level between tenants: none (arrival order), requests or cost "
     "(weighted service kept balanced, docs/tenants.md) [default: none]."),
    ("--shards", {"type": int},
     f"Physical queues (shards) the queue is spread over, {_range('shards')}; each has its "
     "own cluster slot; ordering is strict within a shard only (docs/scaling.md) "
     "[default: 1]."),
    ("--retry-on", {"type": str},
     "Exception class names (the model's exception or a base class), comma-separated, "
     "e.g. TimeoutError,ConnectionError, or '*' = any: a request whose run raises one runs "
     "again, up to --retry-max runs; '' = none [default: '']."),
    ("--retry-max", {"type": int},
     f"Most runs of a request whose model raises a --retry-on exception, "
     f"{_range('retry_max')}; 1 = no retry. Each run counts as a delivery: a request is "
     "dead-lettered after the larger of --max-attempts and this [default: 1]."),
    ("--retry-backoff-ms", {"type": int},
     f"Wait before the 2nd run, ms, {_range('retry_backoff_ms')}; doubled for each further "
     "run [default: 1000]."),
    ("--retry-backoff-max-ms", {"type": int},
     f"Longest wait between runs, ms, {_range('retry_backoff_max_ms')} [default: 60000]."),
    ("--retry-jitter", {"type": int},
     "1: each wait is drawn uniformly from [half, all] of the backoff; 0: exact "
     "[default: 0]."),
]


def policy_options(func: Any = None, *, env: bool = False) -> Any:
    """--strategy and the policy knobs. With `env`, each is also read from
    BATCHGATE_<FLAG> (the consumer's; `policy set` takes flags only, so that a consumer
    host's environment cannot change a queue's policy by accident)."""
    def decorate(target: Any) -> Any:
        for flag, kwargs, text in reversed(POLICY_KNOBS):
            if env:
                var = "BATCHGATE_" + flag[2:].replace("-", "_").upper()
                target = env_option(flag, envvar=var, help=text, **kwargs)(target)
            else:
                target = click.option(flag, help=text, **kwargs)(target)
        return target
    return decorate(func) if func is not None else decorate


def policy_values(kwargs: dict[str, Any]) -> dict[str, Any]:
    names = ["strategy", *LIMITS, *CHOICES, "cost_buckets", "retry_on", "tenant_quotas"]
    return {name: kwargs.pop(name, None) for name in names}
