"""Loads the Lua scripts and builds their KEYS/ARGV; parses their replies.

Each script is one file in `lua/` whose header documents KEYS, ARGV, return value and
error codes. `-- @include NAME` inlines the helpers of a shared file that the script uses;
`-- @render policy` (in `_policy.lua`) becomes the policy's STRATEGIES and LIMITS, rendered
from scheduler_core/policy.py, their one source. Every queue script receives the queue's shared
keys first, as KEYS[1..43] in the order of keys.SHARED_KEYS, then its per-call keys; the
`*_keys` builders below are the one place that builds each script's KEYS list.

Scripts are called through `Scripts`, which registers them as redis-py's Script objects:
EVALSHA, falling back to loading the script on NOSCRIPT, for sync and asyncio clients
alike.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Collection
from dataclasses import dataclass
from importlib import resources
from typing import Any

import redis
from redis.commands.core import AsyncScript, Script
from redis.exceptions import NoScriptError

from scheduler_core.connection import (
    refresh_topology,
    refresh_topology_async,
    slot_owner,
    slot_owner_async,
)
from scheduler_core.errors import (
    InvalidRequest,
    NotReplicated,
    QueueFull,
    ShardRetired,
    TenantLimit,
)
from scheduler_core.keys import QueueKeys, bulk_lease_key
from scheduler_core.policy import (
    CHOICES,
    LIMITS,
    MAX_COST_BUCKETS,
    MAX_REQUEST_COST,
    MAX_TENANT_QUOTAS,
    TENANT_QUOTAS,
    Strategy,
)
from scheduler_core.wire import DEFAULT_TENANT

# Queue scripts, then the bulk job's lease (lua/bulk/, not queue keys). `Scripts` names
# each by its path with '/' as '_': scripts.bulk_lease_renew.
SCRIPT_NAMES = ("enqueue", "pop_batch", "complete", "extend_lease", "requeue_expired",
                "configure", "cancel", "dead_letter", "expire_due", "stream_append", "preempt",
                "bulk/lease_renew",
                "bulk/lease_release")
_INCLUDE = re.compile(r"^-- @include (\S+)[ \t]*\n", re.MULTILINE)
_RENDER_POLICY = re.compile(r"^-- @render policy[ \t]*$", re.MULTILINE)
_COMMENT = re.compile(r"--\[\[.*?\]\]|--[^\n]*", re.DOTALL)  # no '--' in the strings
_DEFINES = re.compile(r"^local (?:function (\w+)|([\w, ]+?) =)", re.MULTILINE)


def render(name: str, limits: dict[str, tuple[int, int]] = LIMITS) -> str:
    """The source of script `name` with its includes inlined and the policy rendered
    from `limits` (tests pass other limits to show the scripts follow them).

    Only the helpers the script uses (directly or through other helpers) are inlined: a
    script runs its whole chunk on every call, and each `local function` it defines costs
    a closure per call. An include file is a sequence of definitions separated by blank
    lines, each with its comment."""
    lua = resources.files("scheduler_core") / "lua"
    text = (lua / f"{name}.lua").read_text()
    blocks = [block for include in _INCLUDE.findall(text)
              for block in re.split(r"\n\s*\n", _RENDER_POLICY.sub(
                  lambda _: _policy_lua(limits), (lua / include).read_text()))]
    body = _INCLUDE.sub("", text)
    kept = _used(blocks, body)
    helpers = "".join(block.strip("\n") + "\n\n" for block in blocks if block in kept)
    first = _INCLUDE.search(text)
    return body if first is None else \
        text[:first.start()] + helpers + body[first.start():].lstrip("\n")


def _used(blocks: list[str], body: str) -> set[str]:
    """The blocks defining a name that `body` or another used block refers to."""
    names = {block: [n.strip() for m in _DEFINES.findall(block) for n in "".join(m).split(",")]
             for block in blocks}
    used: set[str] = set()
    text = _COMMENT.sub("", body)
    while True:
        found = {block for block in blocks if block not in used and any(
            re.search(rf"\b{re.escape(n)}\b", text) for n in names[block])}
        if not found:
            return used
        used |= found
        text += "".join(_COMMENT.sub("", block) for block in found)


@functools.cache
def source(name: str) -> str:
    return render(name)


def _policy_lua(limits: dict[str, tuple[int, int]]) -> str:
    """STRATEGIES, LIMITS (configure iterates them), CHOICES (delay_mode, over_cost,
    cost_mode, on_timeout) and policy_range: the same ranges as code, so that pop_batch,
    which runs per batch, builds no table of them."""
    strategies = ", ".join(f"{s.value} = true" for s in Strategy)
    bounds = [(field, int(low), int(high)) for field, (low, high) in limits.items()]
    ranges = ", ".join(f"{field} = {{{low}, {high}}}" for field, low, high in bounds)
    cases = "".join(f"  if field == '{field}' then return {low}, {high} end\n"
                    for field, low, high in bounds)
    choices = ", ".join(f"{field} = {{" + ", ".join(f"{v} = true" for v in values) + "}"
                        for field, values in CHOICES.items())
    return (f"local STRATEGIES = {{{strategies}}}\n\nlocal LIMITS = {{{ranges}}}\n\n"
            f"local CHOICES = {{{choices}}}\n\n"
            f"local MAX_COST_BUCKETS, MAX_REQUEST_COST = {MAX_COST_BUCKETS}, {MAX_REQUEST_COST}\n\n"
            f"local function policy_range(field)\n{cases}  return nil\nend\n\n"
            f"{_tenant_quotas_lua()}")


def _tenant_quotas_lua() -> str:
    """TENANT_QUOTAS (each quota's largest value; all take 0 = none), MAX_TENANT_QUOTAS
    and DEFAULT_TENANT, for configure's check of tenant_quotas (lua/_tenants.lua)."""
    assert all(low == 0 for low, _ in TENANT_QUOTAS.values())
    highs = ", ".join(f"{name} = {high}" for name, (_, high) in TENANT_QUOTAS.items())
    return (f"local TENANT_QUOTAS = {{{highs}}}\n"
            f"local MAX_TENANT_QUOTAS, DEFAULT_TENANT = {MAX_TENANT_QUOTAS}, '{DEFAULT_TENANT}'")


# redis-py's Script loads the script on NOSCRIPT and calls again, once. When redis-py
# re-sends a call whose connection broke, the re-sent call can reach a server that was
# restarted or promoted after that load: NOSCRIPT again. NOSCRIPT means nothing ran there,
# so loading and calling again is safe.
NOSCRIPT_ATTEMPTS = 3


class ReloadingScript(Script):
    def __call__(self, keys: Any = None, args: Any = None, client: Any = None) -> Any:
        for _ in range(NOSCRIPT_ATTEMPTS - 1):
            with contextlib.suppress(NoScriptError):
                return super().__call__(keys, args, client)
        return super().__call__(keys, args, client)


class AsyncReloadingScript(AsyncScript):
    async def __call__(self, keys: Any = None, args: Any = None,  # type: ignore[override]
                       client: Any = None) -> Any:
        for _ in range(NOSCRIPT_ATTEMPTS - 1):
            with contextlib.suppress(NoScriptError):
                return await super().__call__(keys, args, client)
        return await super().__call__(keys, args, client)


class Scripts:
    """The registered scripts of one redis client (sync or asyncio): the one way batchgate
    calls a script, `scripts.pop_batch(keys=pop_keys(queue_keys), args=[...])`."""

    enqueue: Any
    pop_batch: Any
    complete: Any
    extend_lease: Any
    requeue_expired: Any
    configure: Any
    cancel: Any
    dead_letter: Any
    expire_due: Any
    stream_append: Any
    preempt: Any
    bulk_lease_renew: Any
    bulk_lease_release: Any

    def __init__(self, client: Any):
        self.client = client
        reloading = {Script: ReloadingScript, AsyncScript: AsyncReloadingScript}
        for name in SCRIPT_NAMES:
            script = client.register_script(source(name))
            if type(script) in reloading:  # redis-py's (a client's own kind is kept as is)
                script = reloading[type(script)](client, script.script)
            setattr(self, name.replace("/", "_"), script)

    def preload(self, *names: str) -> None:
        """SCRIPT LOAD these now (a sync client), so that a script's first call, on a
        request's time, is not a NOSCRIPT, a load and a second call."""
        for name in names:
            self.client.script_load(getattr(self, name).script)


class SentScript:
    """One script call sent now, its reply read later on the connection held meanwhile:
    Redis runs the script while the caller's thread works on, with no helper thread (a
    sync client; on a cluster, sent to the primary serving the first key's slot)."""

    def __init__(self, client: Any, script: Any, keys: list[str], args: list[Any]):
        self.client, self.call = client, (script, keys, args)
        self.target = slot_owner(client, keys[0])
        self.conn: Any = self.target.connection_pool.get_connection()
        try:
            self.conn.send_command("EVALSHA", script.sha, len(keys), *keys, *args)
        except BaseException:
            self._release(broken=True)
            raise

    def ready(self) -> bool:
        """Whether the reply has arrived (a broken connection counts: reply() raises)."""
        try:
            return self.conn is None or bool(self.conn.can_read(timeout=0))
        except (redis.RedisError, OSError):
            return True

    def reply(self) -> Any:
        """The script's reply, or its error raised. After NOSCRIPT (the script cache was
        flushed: nothing ran) the script is loaded and called again."""
        try:
            reply = self.target.parse_response(self.conn, "EVALSHA")
        except NoScriptError:
            self._release()
            script, keys, args = self.call
            return script(keys=keys, args=args, client=self.target)
        except redis.ResponseError as exc:  # a whole error reply: the connection is sound
            self._release()
            refresh_topology(self.client, exc)
            raise
        except BaseException:
            self._release(broken=True)
            raise
        self._release()
        return reply

    def _release(self, broken: bool = False) -> None:
        if self.conn is None:
            return
        if broken:  # a reply may be half read: never hand the connection on as it is
            self.conn.disconnect()
        self.target.connection_pool.release(self.conn)
        self.conn = None


class ScriptPipeline:
    """Script calls (and plain commands) sent in one round trip.

    redis-py's own pipelines check SCRIPT EXISTS before every execute, an extra round
    trip on the consumer's hot path (and a cluster pipeline refuses EVALSHA); this sends
    EVALSHA directly and re-runs only a call that got NOSCRIPT (Redis restarted, failed
    over or flushed its script cache) once the script is loaded.

    With `replicas` > 0 the pipeline ends with `INCR {bg:<queue>}:acks` and `WAIT replicas
    wait_timeout_ms` on the same connection, and `execute` raises NotReplicated (carrying
    the replies) unless that many replicas confirmed every write up to the INCR. WAIT
    waits for the connection's own last write; the INCR makes that write come after
    the scripts' effects, and after those of an earlier copy of a resent call that landed
    through another connection (a resend writes nothing), so one confirmed WAIT covers
    them all. On a cluster the pipeline then goes to the primary serving the first key's
    slot (all keys of a queue share it); a resend after a failover is the caller's
    (every script is safe to resend). `pinned` sends it there without WAIT: a pipeline
    with a keyless command that must read that server (TIME).
    """

    def __init__(self, client: Any, replicas: int = 0, wait_timeout_ms: int = 0,
                 pinned: bool = False):
        self.client = client
        self.replicas, self.wait_timeout_ms = replicas, wait_timeout_ms
        self.pinned = pinned
        self._ops: list[tuple[Any, ...]] = []
        self._calls: list[tuple[Any, list[str], list[Any]] | None] = []
        self.target: Any = client

    def script(self, script: Any, keys: list[str], args: list[Any]) -> None:
        self._ops.append(("EVALSHA", script.sha, len(keys), *keys, *args))
        self._calls.append((script, keys, args))

    def command(self, name: str, *args: Any) -> None:
        self._ops.append((name, *args))
        self._calls.append(None)

    def _first_key(self) -> str:
        for op, call in zip(self._ops, self._calls, strict=True):
            if call is not None:
                return call[1][0]
            return _first_key(op[1:])
        return ""

    def _build(self, target: Any) -> Any:
        pipe = target.pipeline(transaction=False)
        for op in self._ops:
            if op[0] == "EVALSHA":
                pipe.execute_command(*op)
            else:
                getattr(pipe, op[0])(*op[1:])
        if self.replicas:
            pipe.incr(acks_key(self._first_key()))
            pipe.execute_command("WAIT", self.replicas, self.wait_timeout_ms)
        return pipe

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        """The replies in order. An error reply is raised (the first), or with
        raise_on_error=False left in its place."""
        if not self._ops:
            return []
        if self.replicas or self.pinned:
            self.target = slot_owner(self.client, self._first_key())
        try:
            replies = self._build(self.target).execute(raise_on_error=False)
        except redis.RedisError as exc:
            refresh_topology(self.client, exc)
            raise
        acked = replies.pop() if self.replicas else None
        if self.replicas:
            replies.pop()  # the INCR
        missing = self._missing(replies)
        if missing:
            again = ScriptPipeline(self.target, self.replicas, self.wait_timeout_ms)
            for script in self._scripts_of(missing):
                self.target.script_load(script.script)
            for i in missing:
                again.script(*self._calls[i])  # type: ignore[misc]
            for i, reply in zip(missing, again.execute(raise_on_error=False), strict=True):
                replies[i] = reply
            acked = self.replicas  # the re-run's own WAIT confirmed everything
        for reply in [*replies, acked]:
            if isinstance(reply, redis.RedisError):
                refresh_topology(self.client, reply)
        return self._check(replies, acked, raise_on_error)

    def _missing(self, replies: list[Any]) -> list[int]:
        return [i for i, (reply, call) in enumerate(zip(replies, self._calls, strict=True))
                if isinstance(reply, NoScriptError) and call is not None]

    def _scripts_of(self, indexes: list[int]) -> list[Any]:
        return list({id(c[0]): c[0] for i in indexes if (c := self._calls[i])}.values())

    def _check(self, replies: list[Any], acked: Any, raise_on_error: bool) -> list[Any]:
        if raise_on_error:
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
        if self.replicas:
            if isinstance(acked, Exception):
                raise acked
            if int(acked) < self.replicas:
                raise NotReplicated(self.replicas, int(acked), self.wait_timeout_ms, replies)
        return replies


class AsyncScriptPipeline(ScriptPipeline):
    """ScriptPipeline for asyncio clients: `await pipe.execute()`."""

    async def execute(self, raise_on_error: bool = True) -> list[Any]:  # type: ignore[override]
        if not self._ops:
            return []
        if self.replicas or self.pinned:
            self.target = await slot_owner_async(self.client, self._first_key())
        try:
            replies = await self._build(self.target).execute(raise_on_error=False)
        except redis.RedisError as exc:
            await refresh_topology_async(self.client, exc)
            raise
        acked = replies.pop() if self.replicas else None
        if self.replicas:
            replies.pop()  # the INCR
        missing = self._missing(replies)
        if missing:
            again = AsyncScriptPipeline(self.target, self.replicas, self.wait_timeout_ms)
            for script in self._scripts_of(missing):
                await self.target.script_load(script.script)
            for i in missing:
                again.script(*self._calls[i])  # type: ignore[misc]
            for i, reply in zip(missing, await again.execute(raise_on_error=False),
                                strict=True):
                replies[i] = reply
            acked = self.replicas
        for reply in [*replies, acked]:
            if isinstance(reply, redis.RedisError):
                await refresh_topology_async(self.client, reply)
        return self._check(replies, acked, raise_on_error)


def acks_key(key: str) -> str:
    """`{bg:<queue>}:acks` of the queue that `key` belongs to (its hash tag)."""
    end = key.find("}")
    return (key[:end + 1] if key.startswith("{") and end > 0 else key) + ":acks"


def _first_key(args: tuple[Any, ...]) -> str:
    first = args[0] if args else ""
    return first[0] if isinstance(first, list | tuple) else str(first)


@dataclass(frozen=True)
class NewRequest:
    id: str
    priority: int
    deadline_ms: int
    envelope: bytes
    idempotency_key: str | None = None
    cost: int = 1  # in the user's unit, 1..MAX_REQUEST_COST (validated at the edge)
    # Store the result by id too (result:<id>, fetch); it always goes to the inbox. A
    # request with an idempotency key is always stored: a resubmission under the key,
    # from any producer, answers with it.
    store_result: bool = False


def enqueue_call(keys: QueueKeys, producer: str, requests: list[NewRequest],
                 idempotency_ttl_s: int, trial: bool = False) -> tuple[list[str], list[Any]]:
    """enqueue.lua's KEYS and ARGV. `trial`: a coalesced call whose refusal the producer
    answers by sending each submission again alone: a tenant quota's refusal of it is
    not counted (the re-sent ones are)."""
    script_keys = list(keys.shared)
    args: list[Any] = [producer, len(requests), idempotency_ttl_s]
    for r in requests:
        args += [r.id, r.priority, r.deadline_ms, r.envelope, 1 if r.idempotency_key else 0,
                 r.cost, 1 if r.store_result or r.idempotency_key else 0]
        if r.idempotency_key:
            script_keys.append(keys.idempotency(r.idempotency_key))
    if trial:
        args.append("trial")
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
    if status == -4:  # a cost above the queue's max_cost (over_cost=reject)
        index, cost, limit = (int(x) for x in reply[2:5])
        raise InvalidRequest("cost", f"{cost} is over the queue's max_cost of {limit} "
                                     f"(request {index} of the call; nothing was enqueued)")
    if status == -5:
        raise ShardRetired(keys.queue)
    if status == -6:  # a named tenant's quota (docs/tenants.md)
        wait_ms = int(reply[4])
        raise TenantLimit(keys.queue, _text(reply[1]), _text(reply[2]), int(reply[3]),
                          wait_ms / 1000 if wait_ms > 0 else None)
    n = (len(reply) - 3) // 2  # the ids, then the deadline each request got
    return [_text(x) for x in reply[3:3 + n]]


def enqueue_deadlines(reply: list[Any]) -> list[int]:
    """The deadline (ms after enqueue, 0 = none) each request of an accepted enqueue got:
    its own, or its level's default timeout (Policy.deadline_ms)."""
    n = (len(reply) - 3) // 2
    return [int(x) for x in reply[3 + n:]]


def retry_after(reply: list[Any], depth: int, limit: int, adding: int) -> float | None:
    """QueueFull's hint: seconds until the recent service rate has made room for the
    rejected requests (depth + adding - limit, at least 1); None when no recent rate."""
    rate = int(reply[4]) / 1000 if len(reply) > 4 else 0.0
    if rate <= 0:
        return None
    return max(1, depth + adding - limit) / rate


def shared_keys(keys: QueueKeys) -> list[str]:
    """The KEYS of a script that takes no per-call keys: the queue's shared keys."""
    return list(keys.shared)


pop_keys = requeue_keys = extend_lease_keys = configure_keys = preempt_keys = shared_keys


def complete_keys(keys: QueueKeys, items: list[tuple[str, str]],
                  retried: Collection[str] = ()) -> list[str]:
    """`items` are (request id, producer) pairs, in the order their results are passed;
    a request in `retried` (outcome 'retry') has its failed runs' list in place of its
    result key."""
    script_keys = list(keys.shared)
    for request_id, producer in items:
        first = keys.attempts(request_id) if request_id in retried else \
            keys.result(request_id)
        script_keys += [first, keys.inbox(producer)]
    return script_keys


def cancel_keys(keys: QueueKeys, request_id: str, producer: str) -> list[str]:
    return [*keys.shared, keys.result(request_id), keys.inbox(producer)]


def expire_keys(keys: QueueKeys, items: list[tuple[str, str]]) -> list[str]:
    """expire_due.lua's KEYS: `items` are (request id, producer) pairs, in ARGV's order."""
    return complete_keys(keys, items)


def stream_keys(keys: QueueKeys, request_ids: list[str]) -> list[str]:
    """stream_append.lua's KEYS: one stream key per entry, in ARGV's order."""
    return [*keys.shared, *(keys.stream(rid) for rid in request_ids)]


def dead_letter_keys(keys: QueueKeys, request_ids: list[str]) -> list[str]:
    return [*keys.shared, *(keys.result(rid) for rid in request_ids)]


def bulk_lease_keys(job_id: str) -> list[str]:
    """KEYS of bulk/lease_renew and bulk/lease_release."""
    return [bulk_lease_key(job_id)]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
