"""A Redis that hangs (SIGSTOP: connections stay open, nothing answers): a submit fails
within the client's command attempts, each one socket timeout, not after the freeze.
A fresh connection's handshake is not retried on its own under the command's retries."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import redis

from producer import AsyncProducer, Producer
from scheduler_core import connection

SOCKET_TIMEOUT_S = 1.0


def bound_s() -> float:
    """Each command attempt waits its socket timeout, then the backoff (capped at 1 s);
    half again for slack on a loaded machine (with the handshake retried too, 16 socket
    timeouts)."""
    attempts = 1 + connection.COMMAND_RETRIES
    return 1.5 * (attempts * SOCKET_TIMEOUT_S + (attempts - 1) * 1.0)


@pytest.fixture
def frozen(redis_server, monkeypatch):
    monkeypatch.setattr(connection, "SOCKET_TIMEOUT_S", SOCKET_TIMEOUT_S)
    yield redis_server
    os.kill(redis_server.proc.pid, signal.SIGCONT)


def fails_within(call, bound: float) -> float:
    started = time.monotonic()
    with pytest.raises((redis.TimeoutError, redis.ConnectionError)):
        call()
    took = time.monotonic() - started
    assert took < bound, f"the submit failed after {took:.1f} s (bound {bound:.1f} s)"
    return took


def test_sync_submit_to_a_hung_redis_fails_within_the_command_attempts(frozen, queue):
    live = Producer(frozen.url, queue)
    try:
        live.submit({"n": 1})
        os.kill(frozen.proc.pid, signal.SIGSTOP)
        fails_within(lambda: live.submit({"n": 2}), bound_s())  # on an open connection
        fresh = Producer(frozen.url, queue)  # its first connection meets the freeze
        try:
            fails_within(lambda: fresh.submit({"n": 3}), bound_s())
        finally:
            fresh.close()
    finally:
        os.kill(frozen.proc.pid, signal.SIGCONT)
        live.close()


async def async_fails_within(submit, bound: float) -> float:
    started = time.monotonic()
    with pytest.raises((redis.TimeoutError, redis.ConnectionError)):
        await submit
    took = time.monotonic() - started
    assert took < bound, f"the submit failed after {took:.1f} s (bound {bound:.1f} s)"
    return took


def test_async_submit_to_a_hung_redis_fails_within_the_command_attempts(frozen, queue):
    async def scenario() -> None:
        async with AsyncProducer(frozen.url, queue) as live:
            await live.submit({"n": 1})
            os.kill(frozen.proc.pid, signal.SIGSTOP)
            try:
                await async_fails_within(live.submit({"n": 2}), bound_s())
                async with AsyncProducer(frozen.url, queue) as fresh:
                    await async_fails_within(fresh.submit({"n": 3}), bound_s())
            finally:
                os.kill(frozen.proc.pid, signal.SIGCONT)

    asyncio.run(scenario())
