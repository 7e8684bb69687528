"""No process outlives the batchgate command that started it: each command that starts
children is SIGKILLed (as the OOM killer would) and, 3 s later, none of the processes it
had started (found by walking /proc before the kill) is running."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from helpers.processes import BATCHGATE, LoggedProcess, free_port
from helpers.servers import ServerProcess, gateway_args
from helpers.support import alive, wait_for

from scheduler_core.lifetime import PARENT_ENV, spawn

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(),
                                reason="Linux /proc (and its parent-death signal)")

GRACE_S = 3.0  # the bound: the children are gone this long after the kill


def descendants(root: int) -> dict[int, str]:
    """pid -> start time (clock ticks since boot) of every live descendant of `root`."""
    children: dict[int, list[int]] = {}
    started: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        pid = int(entry.name)
        children.setdefault(int(fields[1]), []).append(pid)
        started[pid] = fields[19]
    found: dict[int, str] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found[pid] = started[pid]
        todo += children.get(pid, [])
    return found


def running(pid: int, start_time: str) -> bool:
    """The same process (not a new one that got its pid) still runs, and is no zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[19] == start_time and fields[0] != "Z"


def sigkill_and_find_survivors(proc: LoggedProcess, expected: int) -> list[str]:
    """Wait until `proc` has at least `expected` descendants, SIGKILL it alone (not its
    process group), and return what is still running GRACE_S later (then killed, so that a
    failing run leaves nothing behind)."""
    wait_for(lambda: len(descendants(proc.proc.pid)) >= expected, timeout=90,
             what=f"{expected} children of {proc.args[:3]}")
    before = descendants(proc.proc.pid)
    proc.kill()
    time.sleep(GRACE_S)
    survivors = []
    for pid, start_time in before.items():
        if running(pid, start_time):
            survivors.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                             .decode(errors="replace")[:200])
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return survivors


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_sigkilled_gateway_leaves_no_worker_and_its_port_restarts(shared_redis, queue):
    """`gateway --workers 2`: two uvicorn workers and multiprocessing's resource tracker.
    After a SIGKILL of the gateway none runs, the port is closed, and a new gateway
    starts on it and serves."""
    port = free_port()
    gateway = ServerProcess(gateway_args(shared_redis.url, queue, port, "--workers", "2"),
                            port, ready_path="/healthz")
    try:
        survivors = sigkill_and_find_survivors(gateway, expected=3)
        assert survivors == [], f"still running {GRACE_S:g} s after the SIGKILL: {survivors}"
        assert not port_open(port), "the killed gateway's port still accepts connections"
        again = ServerProcess(gateway_args(shared_redis.url, queue, port, "--workers", "2"),
                              port, ready_path="/healthz")
        try:
            assert httpx.get(f"{again.url}/healthz", timeout=5).status_code == 200
            assert alive(again.proc.pid)
        finally:
            again.close()
    finally:
        gateway.close()


@pytest.mark.parametrize("command, expected", [
    # a supervisor and its two `batchgate consumer` replicas
    (["consumer", "--redis-url", "{redis}", "--queue", "{queue}", "--model",
      "consumer.models:noop", "--replicas", "2"], 2),
    # a private redis-server and two `batchgate consumer` children
    (["demo", "--duration", "60", "--consumers", "2"], 3),
    # the checkout's benchmark (python -m bench.run): a private redis-server and its workers
    (["-m", "bench.run", "--quick", "--out", "{out}"], 2),
], ids=["consumer-replicas", "demo", "bench"])
def test_sigkilled_command_leaves_none_of_its_children(shared_redis, queue, tmp_path,
                                                       command, expected):
    assert BATCHGATE
    argv = [arg.format(redis=shared_redis.url, queue=queue, out=tmp_path) for arg in command]
    program = [sys.executable] if argv[0] == "-m" else [BATCHGATE]
    proc = LoggedProcess([*program, *argv], "bg-parent-")
    try:
        assert sigkill_and_find_survivors(proc, expected=expected) == []
    finally:
        proc.close()


def test_the_parent_mark_ties_a_child_only_to_a_live_parent():
    """A Python child started with the mark of a parent that is already gone dies at
    once (the race between the start and the prctl); one that is not the marked
    process's child (a grandchild, a stray mark) is left alone, and its own children do
    not inherit the mark."""
    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid names no process now
    probe = f"import os, batchgate; print('alive', os.environ.get('{PARENT_ENV}'))"
    orphan = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            env={**os.environ, PARENT_ENV: str(gone.pid)}, timeout=60)
    assert orphan.returncode == -signal.SIGKILL and "alive" not in orphan.stdout
    grandchild = subprocess.run(["sh", "-c", f"{sys.executable} -c \"{probe}\""],
                                capture_output=True, text=True, timeout=60,
                                env={**os.environ, PARENT_ENV: str(os.getpid())})
    assert grandchild.returncode == 0 and grandchild.stdout.strip() == "alive None"


def test_a_child_spawned_from_a_thread_outlives_the_thread():
    """The kernel sends the parent-death signal when the *thread* that forked the child
    exits: spawn() from a short-lived thread forks on a thread that lives on."""
    children: list[subprocess.Popen[bytes]] = []
    thread = threading.Thread(target=lambda: children.append(spawn(["sleep", "60"])))
    thread.start()
    thread.join()
    try:
        time.sleep(0.5)
        assert children[0].poll() is None, "the child died with the thread that started it"
    finally:
        children[0].kill()
        children[0].wait()
