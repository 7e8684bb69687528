"""Loads the Lua scripts and builds their KEYS/ARGV; parses their replies.

Each script is one file in `lua/` whose header documents KEYS, ARGV, return value and
error codes. `-- @include NAME` inlines a shared helper file. Scripts are registered with
redis-py's `register_script`, which runs EVALSHA and falls back to EVAL on NOSCRIPT, for
sync and asyncio clients alike.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from importlib import resources
from typing import Any

from redis.exceptions import NoScriptError

from scheduler_core.errors import InvalidRequest, QueueFull
from scheduler_core.keys import QueueKeys

SCRIPT_NAMES = ("enqueue", "pop_batch", "complete", "extend_lease", "requeue_expired",
                "configure", "cancel")
_INCLUDE = re.compile(r"^-- @include (\S+)\s*$", re.MULTILINE)


@functools.cache
def source(name: str) -> str:
    lua = resources.files("scheduler_core") / "lua"
    text = (lua / f"{name}.lua").read_text()
    return _INCLUDE.sub(lambda m: (lua / m.group(1)).read_text(), text)


class Scripts:
    """The registered scripts of one redis client (sync or asyncio)."""

    def __init__(self, client: Any):
        for name in SCRIPT_NAMES:
            setattr(self, name, client.register_script(source(name)))


class ScriptPipeline:
    """Script calls (and plain commands) sent in one round trip.

    redis-py's own pipelines check SCRIPT EXISTS before every execute, an extra round
    trip on the consumer's hot path; this sends EVALSHA directly and re-runs only a call
    that got NOSCRIPT (Redis restarted or flushed its script cache) through the Script
    object, which loads it.
    """

    def __init__(self, client: Any):
        self.pipe = client.pipeline(transaction=False)
        self._calls: list[tuple[Any, list[str], list[Any]] | None] = []

    def script(self, script: Any, keys: list[str], args: list[Any]) -> None:
        self.pipe.evalsha(script.sha, len(keys), *keys, *args)
        self._calls.append((script, keys, args))

    def command(self, name: str, *args: Any) -> None:
        getattr(self.pipe, name)(*args)
        self._calls.append(None)

    def execute(self) -> list[Any]:
        replies = self.pipe.execute(raise_on_error=False)
        for i, (reply, call) in enumerate(zip(replies, self._calls, strict=True)):
            if isinstance(reply, NoScriptError) and call is not None:
                script, keys, args = call
                replies[i] = script(keys=keys, args=args)
            elif isinstance(reply, Exception):
                raise reply
        return replies


@dataclass(frozen=True)
class NewRequest:
    id: str
    priority: int
    deadline_ms: int
    envelope: bytes
    idempotency_key: str | None = None


def enqueue_call(keys: QueueKeys, producer: str, requests: list[NewRequest],
                 idempotency_ttl_s: int) -> tuple[list[str], list[Any]]:
    script_keys = [keys.policy, *keys.pending_all, keys.jobs, keys.meta, keys.clock,
                   keys.marker, keys.stats]
    args: list[Any] = [producer, len(requests), idempotency_ttl_s]
    for r in requests:
        args += [r.id, r.priority, r.deadline_ms, r.envelope, 1 if r.idempotency_key else 0]
        if r.idempotency_key:
            script_keys.append(keys.idempotency(r.idempotency_key))
    return script_keys, args


def enqueue_reply(keys: QueueKeys, reply: list[Any]) -> list[str]:
    """The ids now holding each request; raises QueueFull or InvalidRequest."""
    status = int(reply[0])
    if status == -1:
        depth, limit, adding = (int(x) for x in reply[1:4])
        raise QueueFull(keys.queue, depth, limit, adding, retry_after(reply, depth, limit, adding))
    if status == -2:
        raise InvalidRequest("id", f"request id {_text(reply[1])!r} already exists")
    if status == -3:
        raise InvalidRequest(_text(reply[1]), "rejected by the enqueue script")
    return [_text(x) for x in reply[3:]]


def retry_after(reply: list[Any], depth: int, limit: int, adding: int) -> float | None:
    """QueueFull's hint: seconds until the recent service rate has made room for the
    rejected requests (depth + adding - limit, at least 1); None when no recent rate."""
    rate = int(reply[4]) / 1000 if len(reply) > 4 else 0.0
    if rate <= 0:
        return None
    return max(1, depth + adding - limit) / rate


def pop_keys(keys: QueueKeys) -> list[str]:
    return [keys.policy, *keys.pending_all, keys.jobs, keys.meta, keys.owner, keys.inflight,
            keys.batches, keys.seq, keys.marker, keys.consumers, keys.stats,
            keys.wait_samples, keys.dead, keys.dead_reason]


def complete_keys(keys: QueueKeys, items: list[tuple[str, str]]) -> list[str]:
    """`items` are (request id, producer) pairs, in the order their results are passed."""
    script_keys = [keys.inflight, keys.batches, keys.owner, keys.jobs, keys.meta, keys.stats,
                   keys.e2e_samples, keys.dead, keys.dead_reason, keys.model_samples]
    for request_id, producer in items:
        script_keys += [keys.result(request_id), keys.inbox(producer)]
    return script_keys


def requeue_keys(keys: QueueKeys) -> list[str]:
    return [keys.inflight, keys.batches, keys.owner, keys.meta, *keys.pending_all,
            keys.marker, keys.stats, keys.consumers]


def cancel_keys(keys: QueueKeys, request_id: str, producer: str) -> list[str]:
    return [*keys.pending_all, keys.jobs, keys.meta, keys.owner, keys.stats,
            keys.result(request_id), keys.inbox(producer), keys.policy]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
