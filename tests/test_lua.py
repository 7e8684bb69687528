"""The Lua scripts' shared conventions: one order of the queue's keys, and the policy
limits from their one source (scheduler_core.policy.LIMITS) in every script that
enforces them."""

from __future__ import annotations

import asyncio
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio
from redis.commands.core import Script

from scheduler_core.keys import (
    BUCKET_MARKERS,
    BUCKET_SETS,
    FAIR_COUNTERS,
    FAIR_SETS,
    SHARED_KEYS,
    QueueKeys,
)
from scheduler_core.policy import LIMITS
from scheduler_core.scripts import (
    SCRIPT_NAMES,
    AsyncReloadingScript,
    ReloadingScript,
    Scripts,
    SentScript,
    cancel_keys,
    complete_keys,
    configure_keys,
    dead_letter_keys,
    enqueue_call,
    extend_lease_keys,
    pop_keys,
    render,
    requeue_keys,
    stream_keys,
)

LUA = Path(__file__).resolve().parent.parent / "scheduler_core" / "lua"
QUEUE_SCRIPTS = [name for name in SCRIPT_NAMES if "/" not in name]
NAMED_KEY = re.compile(r"^local (\w+) = KEYS\[(\d+)\]\s*(?:--.*)?$", re.MULTILINE)
NAMED_TABLE = re.compile(r"^local (\w+) = \{((?:KEYS\[\d+\],? ?)+)\}\s*$", re.MULTILINE)


@pytest.mark.parametrize("name", QUEUE_SCRIPTS)
def test_script_names_the_shared_keys_in_the_one_order(name):
    header, body = (LUA / f"{name}.lua").read_text().split("]]", 1)
    assert f"KEYS[1..{len(SHARED_KEYS)}] the queue's shared keys" in header
    named = NAMED_KEY.findall(body)
    assert named, "the script names its keys at the top of its body"
    for local, index in named:
        i = int(index)
        assert i > len(SHARED_KEYS) or local == SHARED_KEYS[i - 1], (local, i)
        assert re.search(rf"^KEYS\[{i}\] ", header, re.MULTILINE), f"header lacks KEYS[{i}]"
    # The per-bucket keys, as one table each: all of them, in order, and one header line.
    tables = {"bucket_markers": BUCKET_MARKERS, "bucket_sets": BUCKET_SETS,
              "fair_sets": FAIR_SETS, "fair_counters": FAIR_COUNTERS}
    for local, indexes in NAMED_TABLE.findall(body):
        numbers = [int(i) for i in re.findall(r"KEYS\[(\d+)\]", indexes)]
        assert [SHARED_KEYS[i - 1] for i in numbers] == list(tables[local]), (local, numbers)
        assert f"KEYS[{numbers[0]}..{numbers[-1]}] " in header, "header lacks the markers"
        named += [(SHARED_KEYS[i - 1], str(i)) for i in numbers]
    # Shared keys are used by name only; KEYS[<number>] elsewhere is a per-call key.
    numbered = [int(i) for i in re.findall(r"KEYS\[(\d+)\]", body)]
    shared = sorted(int(i) for _, i in named if int(i) <= len(SHARED_KEYS))
    assert sorted(i for i in numbered if i <= len(SHARED_KEYS)) == shared


def test_every_keys_builder_starts_with_the_shared_keys():
    q = QueueKeys("order")
    shared = [q.bucket_marker(BUCKET_MARKERS.index(name) + 1) if name in BUCKET_MARKERS
              else q.bucket_set(BUCKET_SETS.index(name) + 1) if name in BUCKET_SETS
              else q.fair_set(FAIR_SETS.index(name)) if name in FAIR_SETS
              else q.fair_counters(FAIR_COUNTERS.index(name)) if name in FAIR_COUNTERS
              else getattr(q, name) for name in SHARED_KEYS]
    assert list(q.shared) == shared and len(shared) == 43
    for keys in (pop_keys(q), requeue_keys(q), extend_lease_keys(q), configure_keys(q)):
        assert keys == shared
    assert enqueue_call(q, "p", [], 60)[0] == shared
    assert complete_keys(q, [("a", "p")]) == [*shared, q.result("a"), q.inbox("p")]
    assert cancel_keys(q, "a", "p") == [*shared, q.result("a"), q.inbox("p")]
    assert dead_letter_keys(q, ["a", "b"]) == [*shared, q.result("a"), q.result("b")]
    assert stream_keys(q, ["a", "a"]) == [*shared, q.stream("a"), q.stream("a")]


# -- policy limits: one source ------------------------------------------------------------
NARROWED = {field: (low + 1, high - 1) if high - low >= 2 else (low, high)  # 0/1 flags stay
            for field, (low, high) in LIMITS.items()}
POP_READS = ("max_batch_size", "max_queue_delay_ms", "aging_ms", "max_attempts")


def _policy_args(limits: dict[str, tuple[int, int]], **given: int) -> list[str]:
    values = {f: (low + high) // 2 for f, (low, high) in limits.items()} | given
    return ["strategy", "priority", *(x for f, v in values.items() for x in (f, str(v)))]


@pytest.mark.parametrize("limits", [LIMITS, NARROWED], ids=["LIMITS", "narrowed"])
def test_scripts_enforce_the_policy_limits_they_are_rendered_from(shared_redis, queue,
                                                                  limits):
    """configure refuses each bound +-1 and stores the bounds; pop_batch refuses a stored
    policy outside the limits and writes nothing; complete takes at most the largest
    max_batch_size results. Rendered with narrowed limits, the same scripts follow those:
    no script keeps its own copy of the numbers."""
    r, q = shared_redis.client(), QueueKeys(queue)
    configure, pop_batch, complete = (r.register_script(render(name, limits))
                                      for name in ("configure", "pop_batch", "complete"))
    for field, (low, high) in limits.items():
        for value in (low - 1, low, high, high + 1):
            reply = configure(keys=configure_keys(q),
                              args=["replace", *_policy_args(limits, **{field: value})])
            if low <= value <= high:
                assert reply[0] == 1 and r.hget(q.policy, field) == str(value).encode()
            else:
                assert reply == [-3, field.encode()], (field, value)

    assert configure(keys=configure_keys(q), args=["replace", *_policy_args(limits)])[0] == 1
    stored = r.hgetall(q.policy)
    for field in POP_READS:
        low, high = limits[field]
        for value in (low - 1, low, high, high + 1):
            r.hset(q.policy, field, value)
            reply = pop_batch(keys=pop_keys(q), args=["c", 1000])
            if low <= value <= high:
                assert reply == [0, -1], (field, value)  # read, and nothing waits
            else:
                assert reply == [-3, b"policy"], (field, value)
            r.delete(q.consumers)
        r.hset(q.policy, mapping=stored)
    r.hset(q.policy, "strategy", "lifo")
    assert pop_batch(keys=pop_keys(q), args=["c", 1000]) == [-3, b"policy"]
    assert not r.exists(q.consumers)

    high = limits["max_batch_size"][1]
    for n, expected in ((high, [-1]), (high + 1, [-3, b"n"])):  # -1: batch 1 not in flight
        ids = [f"r{i}" for i in range(n)]
        args = ["1", 60, n, *(x for rid in ids for x in (rid, "ok", b"{}"))]
        assert complete(keys=complete_keys(q, [(rid, "p") for rid in ids]),
                        args=args) == expected, n


@pytest.mark.parametrize("name", SCRIPT_NAMES)
def test_a_script_inlines_only_the_helpers_it_uses(name):
    """Each `local function` costs a closure on every call: none is left unused."""
    code = re.sub(r"--\[\[.*?\]\]|--[^\n]*", "", render(name), flags=re.DOTALL)
    for helper in re.findall(r"^local function (\w+)", code, re.MULTILINE):
        assert len(re.findall(rf"\b{helper}\b", code)) > 1, f"{helper} is never called"
    assert "@include" not in code and "@render" not in code


class ForgetsAfterLoad(redis.Redis):
    """A server that restarts (empty) right after a script was loaded, as one can between
    redis-py's load on NOSCRIPT and the call it re-sends after a broken connection."""
    restarts = 1

    def script_load(self, script: Any) -> Any:
        sha = super().script_load(script)
        if self.restarts:
            self.restarts -= 1
            self.script_flush()
        return sha


class AsyncForgetsAfterLoad(redis.asyncio.Redis):
    restarts = 1

    async def script_load(self, script: Any) -> Any:
        sha = await super().script_load(script)
        if self.restarts:
            self.restarts -= 1
            await self.script_flush()
        return sha


def test_a_script_that_meets_noscript_after_its_load_is_loaded_again(redis_server):
    client = ForgetsAfterLoad(port=redis_server.port)
    with pytest.raises(redis.exceptions.NoScriptError):  # redis-py's own loads only once
        Script(client, "return 7")()
    client.restarts = 1
    assert ReloadingScript(client, "return 8")() == 8
    assert Scripts(ForgetsAfterLoad(port=redis_server.port)).enqueue.__class__ is ReloadingScript

    async def run() -> Any:
        aclient = AsyncForgetsAfterLoad(port=redis_server.port)
        try:
            assert isinstance(Scripts(aclient).enqueue, AsyncReloadingScript)
            return await AsyncReloadingScript(aclient, "return 9")()
        finally:
            await aclient.aclose()
    assert asyncio.run(run()) == 9



def test_a_sent_script_runs_before_its_reply_is_read(redis_server):
    """SentScript: Redis runs the call as soon as it is sent (the caller reads the reply
    later); a NOSCRIPT (the cache flushed) loads the script and calls again; a server lost
    before the read raises, and the client's pool then serves sound connections."""
    client = redis_server.client()
    script = ReloadingScript(client, "redis.call('SET', KEYS[1], ARGV[1]) return ARGV[1]")
    client.script_load(script.script)
    sent = SentScript(client, script, ["k"], ["1"])
    deadline = time.monotonic() + 5
    while client.get("k") is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert client.get("k") == b"1"  # ran, not read yet
    assert sent.ready()
    assert sent.reply() == b"1"

    client.script_flush()
    assert SentScript(client, script, ["k"], ["2"]).reply() == b"2"
    assert client.get("k") == b"2"

    redis_server.proc.send_signal(signal.SIGSTOP)  # the call is sent, never run
    lost = SentScript(client, script, ["k"], ["3"])
    assert not lost.ready()
    redis_server.kill()
    with pytest.raises(redis.ConnectionError):
        lost.reply()
    redis_server.start()
    assert client.set("k", "4") and client.get("k") == b"4"
