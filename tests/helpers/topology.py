"""A Redis Cluster or Sentinel set seen as the tests see one server: `url` (the
redis+cluster:// or redis+sentinel:// form every command takes) and `client()` (redis-py's
cluster or sentinel client, as batchgate builds it)."""

from __future__ import annotations

import shutil
from typing import Any

import pytest

from bench.topology import EmbeddedCluster, EmbeddedSentinel
from scheduler_core.connection import connect


class TopologyServer:
    def __init__(self, kind: str):
        if not shutil.which("redis-server") or not shutil.which("redis-cli"):
            pytest.skip("redis-server and redis-cli are needed for a cluster/sentinel set")
        self.kind = kind
        self.servers: Any = EmbeddedCluster() if kind == "cluster" else EmbeddedSentinel()
        self.url: str = self.servers.url
        self._clients: list[Any] = []

    def client(self) -> Any:
        client = connect(self.url)
        self._clients.append(client)
        return client

    def close(self) -> None:
        for client in self._clients:
            client.close()
        self.servers.close()
