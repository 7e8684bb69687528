"""Consumer hosts on one machine: network namespaces joined to the host by veth pairs,
with delay, loss and partitions injected between them and Redis.

    with ConsumerHost() as host:              # needs root (ip netns)
        redis on host.host_ip                 # the host end of the veth pair
        host.argv(["batchgate", "consumer", "--redis-url", f"redis://{host.host_ip}:P/0"])
        host.netem(delay_ms=5)                # tc netem on both ends (RTT = 2 x 5 ms)
        host.drop(loss_pct=2)                 # 2% of the packets lost each way
        host.partition(); host.heal()         # the link down, then up again

`tc netem` needs the kernel's sch_netem; where it is missing (some VM kernels),
`netem()` raises NetemUnavailable and `DelayProxy` adds the delay in user space instead:
a TCP relay on the host end that holds every chunk for half the RTT in each direction.
`drop()` loses packets with netem where it can, else with iptables' `statistic` match
inside the namespace (netfilter is in kernels that lack netem).
Everything made here is removed by `close()` (namespaces, links, qdiscs, rules).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import subprocess
import threading
import time
from typing import Any

from scheduler_core.errors import BatchgateError


class NetemUnavailable(BatchgateError):
    """The kernel has no netem qdisc (sch_netem)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here; None when they can."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"bgprobe{os.getpid()}"
    made = _ip("netns", "add", name, check=False)
    if made.returncode != 0:
        return f"`ip netns add` is not permitted here: {made.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


class ConsumerHost:
    """One namespace with a veth pair: `host_ip` on the host's end, `ns_ip` inside."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000}{random.randrange(1000):03d}"
        self.name = f"bg{tag}"
        self.host_if, self.ns_if = f"bgh{tag}"[:15], f"bgn{tag}"[:15]
        subnet = random.randrange(1, 250)
        self.host_ip, self.ns_ip = f"10.213.{subnet}.1", f"10.213.{subnet}.2"
        try:
            _ip("netns", "add", self.name)
            _ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
            _ip("link", "set", self.ns_if, "netns", self.name)
            _ip("addr", "add", f"{self.host_ip}/30", "dev", self.host_if)
            _ip("link", "set", self.host_if, "up")
            self.run("ip", "addr", "add", f"{self.ns_ip}/30", "dev", self.ns_if)
            self.run("ip", "link", "set", self.ns_if, "up")
            self.run("ip", "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def argv(self, argv: list[str]) -> list[str]:
        """`argv` run inside the namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def run(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(list(argv)), capture_output=True, text=True,
                              check=True)

    def netem(self, delay_ms: float = 0.0, loss_pct: float = 0.0) -> None:
        """Delay (one way, each end: RTT = 2 x delay_ms) and loss on the link."""
        spec = ["netem", "delay", f"{delay_ms}ms", "loss", f"{loss_pct}%"]
        for prefix in ([], self.argv([])):
            dev = self.ns_if if prefix else self.host_if
            done = subprocess.run([*prefix, "tc", "qdisc", "replace", "dev", dev, "root",
                                   *spec], capture_output=True, text=True)
            if done.returncode != 0:
                if "unknown" in done.stderr.lower():
                    raise NetemUnavailable(f"tc netem is not available: {done.stderr.strip()}")
                raise BatchgateError(done.stderr.strip())

    def drop(self, loss_pct: float) -> str:
        """Lose loss_pct% of the packets in each direction; says how ("netem" or
        "iptables"). With netem this replaces a delay set by netem(): give both there."""
        if not 0 <= loss_pct <= 100:
            raise ValueError(f"loss_pct must be within 0-100, got {loss_pct}")
        try:
            self.netem(loss_pct=loss_pct)
            return "netem"
        except NetemUnavailable:
            pass
        if shutil.which("iptables") is None:
            raise NetemUnavailable("neither tc netem nor iptables is available to lose "
                                   "packets")
        for chain in ("INPUT", "OUTPUT"):  # every packet on the link crosses one of them
            self.run("iptables", "-F", chain)
            if loss_pct:
                self.run("iptables", "-A", chain, "-i" if chain == "INPUT" else "-o",
                         self.ns_if, "-m", "statistic", "--mode", "random",
                         "--probability", f"{loss_pct / 100:.6f}", "-j", "DROP")
        return "iptables"

    def partition(self) -> None:
        """Cut the consumer host off: its link goes down (nothing passes either way)."""
        _ip("link", "set", self.host_if, "down")

    def heal(self) -> None:
        _ip("link", "set", self.host_if, "up")

    def close(self) -> None:
        _ip("link", "del", self.host_if, check=False)  # its peer and qdiscs go with it
        _ip("netns", "del", self.name, check=False)

    def __enter__(self) -> ConsumerHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DelayProxy:
    """A TCP relay on (listen_host, listen_port) to (target_host, target_port) that
    delivers every chunk rtt_ms / 2 after it arrived, in each direction (order kept):
    latency without bandwidth limits, for kernels without netem."""

    def __init__(self, listen_host: str, target_host: str, target_port: int, rtt_ms: float):
        self.listen_host, self.target = listen_host, (target_host, target_port)
        self.delay_s = rtt_ms / 2000
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="delay-proxy")
        self._thread.start()
        if not self._ready.wait(10):
            raise BatchgateError("delay proxy did not start")

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._relay, self.listen_host, 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer),
                             return_exceptions=True)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    break
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()

        sender = asyncio.ensure_future(deliver())
        try:
            while data := await reader.read(65536):
                queue.put_nowait((time.monotonic() + self.delay_s, data))
        finally:
            queue.put_nowait((0.0, b""))
            with contextlib.suppress(Exception):
                await sender
            writer.close()

    def close(self) -> None:
        async def shutdown() -> None:
            self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def __enter__(self) -> DelayProxy:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
