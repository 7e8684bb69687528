"""Every process a batchgate command starts dies with it, whatever kills the command
(SIGKILL included): on Linux each child asks the kernel for a parent-death signal
(prctl PR_SET_PDEATHSIG, SIGKILL). Elsewhere the children are not tied to the parent.

- `spawn(argv, ...)`: subprocess.Popen for a child that dies with this process.
- `die_with_parent(pid)`: called in a child (before exec, or first thing in a Python child
  started by a library, e.g. uvicorn's workers): SIGKILL when process `pid` dies, and at
  once if it is already gone.
- `mark_parent()` / `die_with_marked_parent()`: the same for Python children that a
  library starts (multiprocessing): the parent names itself in PARENT_ENV, the child reads
  it.

The kernel sends the signal when the *thread* that forked the child exits, not the
process: so a child is forked on the main thread (alive as long as the process), or, from
any other thread, on a thread kept for that until the process exits.

SIGKILL, not SIGTERM: a parent that was killed cannot wait for a graceful stop, and a child
that hangs would ignore SIGTERM; what such a child held is recovered as after any crash.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

PR_SET_PDEATHSIG = 1
PARENT_ENV = "BATCHGATE_PARENT_PID"


def _load_prctl() -> Callable[[int, int], int] | None:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None


# Looked up once, in the parent: dlopen/dlsym between fork and exec could deadlock.
_PRCTL = _load_prctl()
_forker: ThreadPoolExecutor | None = None
_forker_lock = threading.Lock()


def die_with_parent(parent: int) -> None:
    """In a child: get SIGKILL when process `parent` dies (Linux; nothing elsewhere). If
    it died before this call (the child was re-parented already), die now."""
    if _PRCTL is None:
        return
    _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died between the fork and the prctl
        os.kill(os.getpid(), signal.SIGKILL)


def preexec() -> Callable[[], None]:
    """A subprocess preexec_fn tying the child to this process. Fork on the main thread
    (or use `spawn`): the signal comes when the forking thread exits."""
    parent = os.getpid()
    return lambda: die_with_parent(parent)


def spawn(argv: list[str], **popen_kwargs: Any) -> subprocess.Popen[bytes]:
    """subprocess.Popen(argv, **popen_kwargs) for a child that dies with this process."""
    def popen() -> subprocess.Popen[bytes]:
        return subprocess.Popen(argv, preexec_fn=preexec(), **popen_kwargs)

    if threading.current_thread() is threading.main_thread():
        return popen()
    global _forker
    with _forker_lock:
        if _forker is None:  # its one thread lives until the process exits
            _forker = ThreadPoolExecutor(1, thread_name_prefix="batchgate-fork")
    return _forker.submit(popen).result()


def mark_parent() -> None:
    """Before a library starts Python children from the main thread: name this process
    as the parent they die with (they call die_with_marked_parent)."""
    os.environ[PARENT_ENV] = str(os.getpid())


def die_with_marked_parent() -> None:
    """In a Python child started after mark_parent(): die with that parent. Nothing in
    the marked process itself, in a process that is not its child, or without a mark.
    The mark is removed here, so that this child's own children do not inherit it."""
    marked = os.environ.get(PARENT_ENV, "")
    if not marked.isdigit() or int(marked) == os.getpid():
        return
    del os.environ[PARENT_ENV]
    parent = int(marked)
    if os.getppid() != parent and _exists(parent):
        return  # a further descendant (or a stray mark): not tied to that process
    die_with_parent(parent)  # which dies now if the parent already did


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's, but there
        pass
    return True
