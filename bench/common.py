"""Pieces more than one benchmark uses: the workers' environment, CPU seconds of a
process tree and of a redis-server, readiness waits, and saving a figure."""

from __future__ import annotations

import os
import subprocess
import tarfile
import time
import urllib.request
from collections.abc import Callable
from io import BytesIO
from pathlib import Path
from typing import Any

import redis

# The repository root: `python -m bench.NAME` children find `bench` from there.
ROOT = Path(__file__).resolve().parents[1]
CHUNK = 10_000  # submit_many's limit per call
# A consumer that costs next to nothing per batch: the path, not the model, is measured.
NOOP_CONSUMER = ["--model", "consumer.models:noop", "--strategy", "dynamic",
                 "--max-batch-size", "256", "--max-queue-delay-ms", "1"]
DPI = 80


def worker_env() -> dict[str, str]:
    """The environment of a benchmark's child process: one BLAS thread (the host's cores
    are shared by everything) and the checkout on PYTHONPATH (so `-m bench.X` resolves
    from any working directory)."""
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def redis_cpu_s(client: redis.Redis) -> float:
    """CPU seconds (system + user) a redis-server has used so far."""
    info = client.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of a process and its children (Linux /proc)."""
    total = 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except (OSError, IndexError, ValueError):
        return total
    return total + sum(tree_cpu_s(int(child)) for child in children)


def http_healthy(base: str) -> bool:
    """GET base/healthz answers 200."""
    try:
        with urllib.request.urlopen(base + "/healthz", timeout=1) as answer:
            return answer.status == 200
    except OSError:
        return False


def wait_until(ready: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready after {timeout}s")
        time.sleep(0.05)


def save_figure(fig: Any, out: Path, name: str) -> str:
    """Write a matplotlib figure as out/name (PNG) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(out / name, dpi=DPI)
    plt.close(fig)
    try:  # a 64-colour palette keeps the PNGs small enough to commit
        from PIL import Image

        with Image.open(out / name) as img:
            small = img.convert("RGB").quantize(colors=64)
        small.save(out / name, optimize=True)
    except (ImportError, OSError):
        pass
    return name


def baseline_tree(ref: str, into: Path) -> Path:
    """producer/ and scheduler_core/ of git ref `ref` of this checkout, extracted in
    `into` (a baseline to measure this tree against)."""
    data = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "producer",
                           "scheduler_core"], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into
