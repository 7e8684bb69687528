"""Throw-away Redis Cluster and Sentinel sets, for the tests and the failover benchmark.

    with EmbeddedCluster() as cluster:      # 3 primaries + 3 replicas
        cluster.url                          # redis+cluster://127.0.0.1:P1,.../
    with EmbeddedSentinel() as sentinel:    # 1 primary, 2 replicas, 3 sentinels
        sentinel.url                         # redis+sentinel://127.0.0.1:S1,.../mymaster

Every server runs the `redis-server` on PATH on loopback, in one temporary directory,
without persistence, and is killed (and the directory removed) on close. A cluster node
also listens on its port + 10000 (the cluster bus), so cluster ports stay below 55536.
"""

from __future__ import annotations

import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from batchgate.embedded import RedisServerNotFound, _wait_for_ping
from scheduler_core.errors import BatchgateError
from scheduler_core.lifetime import spawn

BUS_OFFSET = 10_000
START_TIMEOUT_S = 30.0


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int, bus: bool = False) -> list[int]:
    """`count` free loopback ports below 55536 (and, with `bus`, port + 10000 free too)."""
    ports: list[int] = []
    rng = random.Random()
    while len(ports) < count:
        port = rng.randrange(20_000, 45_000)
        if port in ports or (bus and port + BUS_OFFSET in ports):
            continue
        if _bindable(port) and (not bus or _bindable(port + BUS_OFFSET)):
            ports.append(port)
    return ports


class _Servers:
    """redis-server processes in one temporary directory."""

    def __init__(self, prefix: str):
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise RedisServerNotFound("no 'redis-server' on PATH (apt-get install redis-server)")
        self.dir = Path(tempfile.mkdtemp(prefix=prefix))
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.args: dict[int, list[str]] = {}

    def spawn(self, port: int, *extra: str, sentinel_conf: str | None = None) -> None:
        workdir = self.dir / str(port)
        workdir.mkdir(exist_ok=True)
        if sentinel_conf is not None:
            conf = workdir / "sentinel.conf"
            conf.write_text(sentinel_conf)
            args = [self.binary or "redis-server", str(conf), "--sentinel", "--port", str(port),
                    "--bind", "127.0.0.1", "--dir", str(workdir)]
        else:
            args = [self.binary or "redis-server", "--port", str(port), "--bind", "127.0.0.1",
                    "--dir", str(workdir), "--save", "", "--appendonly", "no",
                    "--maxmemory-policy", "noeviction", "--repl-diskless-sync-delay", "0", *extra]
        self.args[port] = args
        self._launch(port)

    def _launch(self, port: int) -> None:
        log = (self.dir / str(port) / "server.log").open("ab")
        self.procs[port] = spawn(self.args[port], stdout=log, stderr=log,
                                 cwd=self.dir / str(port))
        log.close()
        if not _wait_for_ping(self.procs[port], port, START_TIMEOUT_S):
            raise BatchgateError(f"redis-server on port {port} did not start; log in "
                                 f"{self.dir / str(port)}")

    def kill(self, port: int) -> None:
        """SIGKILL the server on `port` (the failover's trigger)."""
        proc = self.procs.get(port)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def restart(self, port: int) -> None:
        self.kill(port)
        self._launch(port)

    def start_again(self, port: int) -> None:
        """Start a killed server again with its arguments (a cluster node keeps its
        identity in nodes.conf, and rejoins as a replica of whoever took its slots)."""
        self._launch(port)

    def replicas_of(self, port: int) -> list[int]:
        """Ports of the replicas attached to the server on `port`."""
        info = self.client(port).info("replication")
        return [int(v["port"]) for k, v in info.items()
                if k.startswith("slave") and isinstance(v, dict)]

    def pause(self, port: int) -> None:
        """SIGSTOP: the server stops answering and replicating (a lagging replica)."""
        self.procs[port].send_signal(signal.SIGSTOP)

    def resume(self, port: int) -> None:
        self.procs[port].send_signal(signal.SIGCONT)

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)

    def close(self) -> None:
        for port in list(self.procs):
            self.kill(port)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EmbeddedCluster(_Servers):
    """A Redis Cluster of `primaries` primaries with `replicas` replicas each, made with
    `redis-cli --cluster create`."""

    def __init__(self, primaries: int = 3, replicas: int = 1, node_timeout_ms: int = 2000):
        super().__init__("batchgate-cluster-")
        try:
            self.ports = free_ports(primaries * (1 + replicas), bus=True)
            for port in self.ports:
                self.spawn(port, "--cluster-enabled", "yes", "--cluster-config-file",
                           "nodes.conf", "--cluster-node-timeout", str(node_timeout_ms))
            cli = shutil.which("redis-cli") or "redis-cli"
            subprocess.run([cli, "--cluster", "create",
                            *(f"127.0.0.1:{p}" for p in self.ports),
                            "--cluster-replicas", str(replicas), "--cluster-yes"],
                           check=True, capture_output=True, timeout=60)
            self.wait_ok()
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports[:3]) + "/"

    def wait_ok(self, timeout: float = START_TIMEOUT_S) -> None:
        """Until every live node reports cluster_state:ok and all slots are served."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = []
            for port, proc in self.procs.items():
                if proc.poll() is not None:
                    continue
                try:
                    info = self.client(port).cluster("info")
                except redis.RedisError:
                    states.append(False)
                    continue
                text = info if isinstance(info, dict) else {}
                states.append(str(text.get("cluster_state")) == "ok"
                              and int(text.get("cluster_slots_ok", 0)) == 16384)
            if states and all(states) and self._replicas_online():
                return
            time.sleep(0.1)
        raise BatchgateError(f"cluster not ok after {timeout}s; logs in {self.dir}")

    def _replicas_online(self) -> bool:
        """Every live replica has finished its sync (a WAIT counts only those)."""
        for port, proc in self.procs.items():
            if proc.poll() is not None:
                continue
            try:
                info = self.client(port).info("replication")
            except redis.RedisError:
                return False
            if info.get("role") == "master":
                links = [v for k, v in info.items() if k.startswith("slave")
                         and isinstance(v, dict)]
                if any(link.get("state") != "online" for link in links):
                    return False
            elif info.get("master_link_status") != "up":
                return False
        return True

    def primary_of(self, key: str) -> int:
        """The port of the primary serving `key`'s slot now."""
        for port, proc in self.procs.items():
            if proc.poll() is not None:
                continue
            try:
                slot = self.client(port).cluster("keyslot", key)
                for start, end, primary, *_ in self.client(port).cluster("slots") or []:
                    if start <= int(slot) <= end:
                        return int(primary[1])
            except redis.RedisError:
                continue
        raise BatchgateError(f"no live node knows the primary of {key!r}")


class EmbeddedSentinel(_Servers):
    """One primary with `replicas` replicas, watched by `sentinels` sentinels (quorum 2)
    under the service name `service`."""

    def __init__(self, replicas: int = 2, sentinels: int = 3, service: str = "mymaster",
                 down_after_ms: int = 1000, failover_timeout_ms: int = 5000):
        super().__init__("batchgate-sentinel-")
        self.service = service
        try:
            ports = free_ports(1 + replicas + sentinels)
            self.primary_port = ports[0]
            self.replica_ports = ports[1:1 + replicas]
            self.sentinel_ports = ports[1 + replicas:]
            self.spawn(self.primary_port)
            for port in self.replica_ports:
                self.spawn(port, "--replicaof", "127.0.0.1", str(self.primary_port))
            quorum = min(2, sentinels)
            conf = (f"sentinel monitor {service} 127.0.0.1 {self.primary_port} {quorum}\n"
                    f"sentinel down-after-milliseconds {service} {down_after_ms}\n"
                    f"sentinel failover-timeout {service} {failover_timeout_ms}\n"
                    f"sentinel parallel-syncs {service} 1\n")
            for port in self.sentinel_ports:
                self.spawn(port, sentinel_conf=conf)
            self.wait_ok()
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        return ("redis+sentinel://" + ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
                + f"/{self.service}")

    def current_primary(self) -> int:
        for port in self.sentinel_ports:
            try:
                host_port = self.client(port).sentinel_get_master_addr_by_name(self.service)
            except redis.RedisError:
                continue
            if host_port:
                return int(host_port[1])
        raise BatchgateError("no sentinel names a primary")

    def wait_ok(self, timeout: float = START_TIMEOUT_S) -> None:
        """Until the replicas are in sync and every sentinel knows them and its peers."""
        deadline = time.monotonic() + timeout
        replicas, peers = len(self.replica_ports), len(self.sentinel_ports) - 1
        while time.monotonic() < deadline:
            try:
                ok = all(
                    int(m.get("num-slaves", 0)) >= replicas
                    and int(m.get("num-other-sentinels", 0)) >= peers
                    for m in (self.client(p).sentinel_master(self.service)
                              for p in self.sentinel_ports))
                info = self.client(self.primary_port).info("replication")
                links = [v for k, v in info.items() if k.startswith("slave")
                         and isinstance(v, dict)]
                ok = ok and sum(link.get("state") == "online" for link in links) >= replicas
            except redis.RedisError:
                ok = False
            if ok:
                return
            time.sleep(0.1)
        raise BatchgateError(f"sentinel set not ready after {timeout}s; logs in {self.dir}")
