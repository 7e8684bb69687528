"""Helpers of the failure, chaos and security tests: consumers running the misbehaving
models of failure_models.py, a producer that counts what its inbox delivered, and
execution logs."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from helpers import failure_models
from helpers.support import wait_for  # noqa: F401 - re-exported for the failure tests
from producer import Producer, Result
from scheduler_core.keys import QueueKeys

HERE = Path(__file__).resolve().parent


def model_args(name: str, **kwargs: Any) -> list[str]:
    """CLI arguments running failure_models.NAME(**kwargs)."""
    args = ["--model", f"failure_models:{name}"]
    for key, value in kwargs.items():
        args += ["--model-arg", f"{key}={value}"]
    return args


def start(start_consumer: Callable[..., Any], url: str, queue: str, model: str,
          *cli_args: str, ready: bool = True, env: dict[str, str] | None = None,
          **model_kwargs: Any) -> Any:
    """A `batchgate consumer` process running failure_models.MODEL."""
    return start_consumer(url, queue, *model_args(model, **model_kwargs), *cli_args,
                          cwd=str(HERE), ready=ready, env=env)


def batches_held(client: Any, queue: str, pid: int) -> list[str]:
    """The batches in flight held by the consumer process `pid`: `{bg:q}:batches` maps a
    batch id to "consumer|ids", and a consumer's default name is host:pid:random."""
    held = client.hgetall(QueueKeys(queue).batches)
    return [batch.decode() for batch, value in held.items()
            if value.split(b"|", 1)[0].split(b":")[1:2] == [str(pid).encode()]]


def wait_holding(client: Any, queue: str, pid: int, timeout: float) -> bool:
    """Whether the consumer `pid` came to hold a batch within `timeout` (polled often:
    a batch of a fast model is held for a few milliseconds)."""
    deadline = time.monotonic() + timeout
    while not batches_held(client, queue, pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def serve(inprocess_consumer: Callable[..., Any], url: str, queue: str, model: str,
          settings: dict[str, Any] | None = None, **model_kwargs: Any) -> Any:
    """A Consumer in this process running failure_models.MODEL(**model_kwargs), with
    `settings` as Consumer takes them (strategy=, lease_ms=, ...)."""
    kwargs = {k: str(v) if isinstance(v, Path) else v for k, v in model_kwargs.items()}
    return inprocess_consumer(getattr(failure_models, model)(**kwargs), redis_url=url,
                              queue=queue, **(settings or {}))


class CountingProducer(Producer):
    """A Producer that counts every result envelope its inbox delivered, per request id:
    exactly-once delivery means each count is exactly 1."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.deliveries: Counter[str] = Counter()
        self._count_lock = threading.Lock()
        super().__init__(*args, on_result=self._count, **kwargs)

    def _count(self, result: Result) -> None:
        with self._count_lock:
            self.deliveries[result.id] += 1

    def delivered_once(self, handles: Any, timeout: float = 15.0) -> bool:
        """Whether the inbox delivered each handle's result exactly once. A handle can end
        before its inbox delivery (the listener's poll of `result:<id>` found it first),
        so wait for every delivery to arrive, then for any duplicate to show."""
        ids = [h.id for h in handles]
        deadline = time.monotonic() + timeout
        while any(self.deliveries[i] == 0 for i in ids) and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.1)
        return all(self.deliveries[i] == 1 for i in ids)


def executions(log_dir: Path) -> Counter[str]:
    """How many times each request (by its payload's "i") was run by any model process."""
    runs: Counter[str] = Counter()
    for path in log_dir.glob("*.log"):
        for line in path.read_text().splitlines():
            if line:
                runs[line] += 1
    return runs
