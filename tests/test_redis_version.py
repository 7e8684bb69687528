"""The Redis version check (scheduler_core/compat.py): batchgate needs Redis 7.0 (BLMPOP).
The parse and the comparison are checked on INFO replies written here, as old servers
send them; a real server (7.x on this machine) passes, once per client."""

from __future__ import annotations

import asyncio

import pytest
import redis

from scheduler_core.compat import (
    RedisVersionError,
    check_redis_version,
    describe_server,
    parse_redis_version,
    require_redis_version,
    require_redis_version_async,
)
from scheduler_core.connection import connect, connect_async


def info(version: str) -> bytes:
    return (f"# Server\r\nredis_version:{version}\r\nredis_git_sha1:00000000\r\n"
            "redis_mode:standalone\r\n").encode()


@pytest.mark.parametrize(("reply", "version"), [
    (info("6.2.14"), (6, 2, 14)),
    (info("7.0.15"), (7, 0, 15)),
    (info("7.2.4"), (7, 2, 4)),
    (info("8.0.0"), (8, 0, 0)),
    ({"redis_version": "6.0.20", "redis_mode": "standalone"}, (6, 0, 20)),  # redis-py's
    (b"# Server\r\nredis_mode:standalone\r\n", None),  # a proxy that hides it
])
def test_parse(reply, version) -> None:
    assert parse_redis_version(reply) == version


def test_older_than_7_0_is_refused_with_the_url_and_the_version() -> None:
    for old in ("6.2.14", "6.0.20", "5.0.7"):
        with pytest.raises(RedisVersionError) as info_:
            check_redis_version(parse_redis_version(info(old)), "redis://db:6379/0")
        assert str(info_.value) == f"batchgate needs Redis >= 7.0; redis://db:6379/0 runs {old}"
    for ok in ("7.0.0", "7.4.1", "8.0.2", None):
        check_redis_version(parse_redis_version(info(ok)) if ok else None, "x")


def test_server_is_named_without_credentials() -> None:
    assert describe_server(redis.Redis.from_url("rediss://user:secret@db:6380/2")) == \
        "rediss://db:6380/2"
    assert describe_server(redis.Redis.from_url("unix:///run/redis.sock")) == \
        "unix:///run/redis.sock"


def test_a_real_server_passes_once_per_client(shared_redis) -> None:
    client = connect(shared_redis.url)
    version = parse_redis_version(client.info("server"))
    assert version is not None and version >= (7, 0)
    require_redis_version(client)
    calls = []
    client.info = lambda *a: calls.append(a)  # cached: not asked again
    require_redis_version(client)
    assert calls == []
    client.close()

    async def check() -> None:
        aclient = connect_async(shared_redis.url)
        await require_redis_version_async(aclient)
        await aclient.aclose()
    asyncio.run(check())


def test_an_unreachable_server_is_a_connection_error_not_a_version_error() -> None:
    from helpers.processes import free_port

    with pytest.raises(redis.ConnectionError):
        require_redis_version(connect(f"redis://127.0.0.1:{free_port()}/0"))
