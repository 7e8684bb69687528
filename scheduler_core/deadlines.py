"""Deadlines the server enforces: take the requests past their deadline out of a queue.

`expire_due` runs `lua/expire_due.lua` in bounded chunks: each request still waiting past
its deadline is answered with DeadlineExceeded (its result stored and pushed to its
producer's inbox, as a cancel is), or, under on_timeout = delay, moved to the delayed set.
Anyone may call it at any time: a request is answered once, by whichever call finds it
due first. Consumers call it when pop_batch.lua answers {-4}, when their due timer
reaches the earliest deadline, and from their lease thread while the model runs;
producers at the deadlines of their own requests. Each learns the next deadline from the
reply and arms its timer for it: nobody polls.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

from scheduler_core.errors import InvalidRequest
from scheduler_core.keys import QueueKeys
from scheduler_core.scripts import Scripts, expire_keys, shared_keys
from scheduler_core.wire import DEADLINE, encode_error

EXPIRE_CHUNK = 200  # requests per script call (each call blocks Redis for its length)
MAX_ROUNDS = 10  # calls per sweep; a sweep that leaves some due says so (`more`)
EXPIRED_MESSAGE = "deadline passed before a consumer ran it"


def expired_envelope(request_id: str) -> bytes:
    """The result of a request that left the queue at its deadline."""
    return encode_error(request_id, DEADLINE, EXPIRED_MESSAGE)


@dataclass(frozen=True)
class Sweep:
    expired: int  # answered DeadlineExceeded by this sweep
    delayed: int  # moved to the delayed set (on_timeout = delay)
    next_in_s: float | None  # until the earliest deadline still waiting (Redis' clock)
    more: bool  # requests past their deadline remain (the sweep's bound was reached)


Call = tuple[list[str], list[Any]]


def _sweep(keys: QueueKeys, result_ttl_s: int, chunk: int, rounds: int
           ) -> Generator[Call, Any, Sweep]:
    """The calls of one sweep (sent by the sync or asyncio driver below)."""
    expired = delayed = 0
    next_us, now_us, more = -1, 0, False
    for _ in range(rounds):
        listed = yield shared_keys(keys), ["list", chunk]
        if int(listed[0]) < 0:
            raise InvalidRequest(_text(listed[1]), "rejected by expire_due.lua")
        now_us, next_us, moved = int(listed[0]), int(listed[1]), int(listed[2])
        delayed += moved
        ids = [_text(x) for x in listed[3:]]
        pairs = list(zip(ids[::2], ids[1::2], strict=True))
        more = moved >= chunk
        if pairs:
            args: list[Any] = ["expire", result_ttl_s, len(pairs)]
            for request_id, _ in pairs:
                args += [request_id, expired_envelope(request_id)]
            done = yield expire_keys(keys, pairs), args
            expired += int(done[0])
            next_us, more = int(done[1]), int(done[2]) > 0
        if not more:
            break
    next_in_s = max(0.0, (next_us - now_us) / 1e6) if next_us >= 0 else None
    return Sweep(expired, delayed, next_in_s, more)


def expire_due(scripts: Scripts, keys: QueueKeys, result_ttl_s: int = 600,
               chunk: int = EXPIRE_CHUNK, rounds: int = MAX_ROUNDS) -> Sweep:
    """Expire (or delay) up to chunk x rounds requests past their deadline; sync client.
    `result_ttl_s` is used only if the queue has no policy. A caller that will not be
    called again for these requests (a producer's timer) sweeps again while `more`."""
    steps = _sweep(keys, result_ttl_s, chunk, rounds)
    try:
        call = next(steps)
        while True:
            call = steps.send(scripts.expire_due(keys=call[0], args=call[1]))
    except StopIteration as done:
        return done.value


async def expire_due_async(scripts: Scripts, keys: QueueKeys, result_ttl_s: int = 600,
                           chunk: int = EXPIRE_CHUNK, rounds: int = MAX_ROUNDS) -> Sweep:
    """`expire_due` for an asyncio client's Scripts."""
    steps = _sweep(keys, result_ttl_s, chunk, rounds)
    try:
        call = next(steps)
        while True:
            call = steps.send(await scripts.expire_due(keys=call[0], args=call[1]))
    except StopIteration as done:
        return done.value


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
