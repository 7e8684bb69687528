"""Models that break the batch-model contract (one result per payload, in a list), for
tests/test_torch_runner.py. `batchgate consumer` imports them from this directory
(`--model contract_models:NAME`, cwd = this directory)."""

from __future__ import annotations

from typing import Any


class OneShort:
    """Returns one result too few."""

    def __call__(self, payloads: list[Any]) -> list[Any]:
        return list(payloads)[:-1]


class NotAList:
    """Returns None instead of a list of results."""

    def __call__(self, payloads: list[Any]) -> None:
        return None
