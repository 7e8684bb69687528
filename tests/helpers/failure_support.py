"""Helpers of the failure, chaos and security tests: consumers running the misbehaving
models of failure_models.py, a producer that counts what its inbox delivered, and
execution logs."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from helpers.support import wait_for  # noqa: F401 - re-exported for the failure tests
from producer import Producer, Result

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


def executions(log_dir: Path) -> Counter[str]:
    """How many times each request (by its payload's "i") was run by any model process."""
    runs: Counter[str] = Counter()
    for path in log_dir.glob("*.log"):
        for line in path.read_text().splitlines():
            if line:
                runs[line] += 1
    return runs
