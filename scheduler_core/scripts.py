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
                   keys.marker]
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
        raise QueueFull(keys.queue, depth, limit, adding)
    if status == -2:
        raise InvalidRequest("id", f"request id {_text(reply[1])!r} already exists")
    if status == -3:
        raise InvalidRequest(_text(reply[1]), "rejected by the enqueue script")
    return [_text(x) for x in reply[3:]]


def pop_keys(keys: QueueKeys) -> list[str]:
    return [keys.policy, *keys.pending_all, keys.jobs, keys.meta, keys.owner, keys.inflight,
            keys.batches, keys.seq, keys.marker, keys.consumers, keys.stats,
            keys.wait_samples]


def complete_keys(keys: QueueKeys, items: list[tuple[str, str]]) -> list[str]:
    """`items` are (request id, producer) pairs, in the order their results are passed."""
    script_keys = [keys.inflight, keys.batches, keys.owner, keys.jobs, keys.meta, keys.stats,
                   keys.e2e_samples, keys.dead, keys.dead_reason]
    for request_id, producer in items:
        script_keys += [keys.result(request_id), keys.inbox(producer)]
    return script_keys


def requeue_keys(keys: QueueKeys) -> list[str]:
    return [keys.inflight, keys.batches, keys.owner, keys.meta, *keys.pending_all,
            keys.marker, keys.stats]


def cancel_keys(keys: QueueKeys, request_id: str, producer: str) -> list[str]:
    return [*keys.pending_all, keys.jobs, keys.meta, keys.owner, keys.stats,
            keys.result(request_id), keys.inbox(producer)]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
